"""A planned chain step measured, and the plans the chain tests try (not a test module)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat.core.chain import Chain
from remat.core.plan import ChainSegment, Plan
from remat.execute.chain import apply
from remat.measure.events import step_peak_bytes


def measured_step(
    model: nn.Module,
    plan: Plan,
    captured: Any,
    x: Any,
    opt: torch.optim.Optimizer,
    loss: Callable[[nn.Module, Any], torch.Tensor],
) -> int:
    """The measured peak of a training step (``loss``, its backward, ``opt``) of ``plan``
    applied to ``model`` with the captured stages."""
    planned = apply(model, plan, stages=captured.stages)

    def step() -> None:
        loss(planned, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step_peak_bytes(step, planned, opt, x)


def five_stage_plans(chain: Chain, single: tuple[int, ...]) -> list[Plan]:
    """Plans of a chain of 5 stages (before the blocks, three blocks, after them): none, every
    stage checkpointed, stage ``k`` alone checkpointed for each of ``single``, and the three
    blocks in one checkpointed segment."""
    n = chain.n
    plans = [Plan.none(chain), Plan.every_stage(chain)]
    plans += [
        Plan.from_chain_segments([ChainSegment(i, i, i == k) for i in range(1, n + 1)])
        for k in single
    ]
    plans.append(
        Plan.from_chain_segments([ChainSegment(1, 1), ChainSegment(2, 4, True), ChainSegment(5, 5)])
    )
    return plans
