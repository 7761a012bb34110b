"""A checkpointed forward's own peak, predicted by the simulator and measured by the allocator.

A stage that runs without saving (inside a checkpoint, or recomputed as the input of an
inner checkpoint) frees its intermediates as it goes, but several of them can be live at
once: an MLP block's ``h = linear(x)`` and ``gelu(h)``. Its transient is not the storing
forward's peak minus its saved tensors (0 for such a block, whose every intermediate is
saved): capture measures it by running the stage without grad
(``Chain.fwd_none_overhead_bytes``) and the simulator uses it for ``F_none``. Before that,
the forward of the every-stage plan below was predicted at 327,684 B of activations and
measured at 806,656 B (GPT-2's checkpointed stage 3 likewise: 554,700 B vs 702,216 B).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import remat
from remat.auto import checkpoint_state_bytes
from remat.capture.chain import capture
from remat.core.chain import CHAIN_SCHEMA_VERSION
from remat.execute.chain import apply
from remat.graphs import Graph, lower_plan, run_schedule
from remat.measure.events import SCRATCH_MIN_BYTES, step_peak_bytes, unique_storage_bytes

D = 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)) for _ in range(4)]
    )


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


@pytest.mark.parametrize(
    "checkpoints",
    [None, [1, 2, 3, 4], [2]],
    ids=["none", "every", "two"],
)
def test_checkpointed_forward_peak_is_predicted(checkpoints: list[int] | None) -> None:
    model = _model()
    x = torch.randn(256, D)
    captured = capture(model, x, loss_fn=_loss)
    chain = captured.chain
    if checkpoints is None:
        plan = remat.Plan.none(chain)
    elif checkpoints == [1, 2, 3, 4]:
        plan = remat.Plan.every_stage(chain)
    else:
        plan = remat.Plan.from_checkpoints(chain, checkpoints)
    planned = apply(model, plan, stages=captured.stages)

    def forward() -> None:  # the forward alone: the loss is made and dropped
        _loss(planned, x)

    params = unique_storage_bytes(list(model.parameters()))
    # step_peak_bytes counts the parameters and the batch; the chain's input_bytes is the batch
    measured = step_peak_bytes(forward, model, None, x) - params
    # each checkpointed segment keeps the CPU RNG state from its forward to its backward
    segments = sum(seg.checkpoint for seg in plan.chain_segments(chain))
    predicted = remat.simulate(chain, plan).forward_peak_bytes
    predicted += segments * checkpoint_state_bytes()
    # the wrapped scalars of Python numbers (the mean's 12 B) are below SCRATCH_MIN_BYTES, left
    # out of the chain's overheads (remat.auto adds them to a whole step's prediction)
    assert predicted >= measured - SCRATCH_MIN_BYTES, (plan.describe(), predicted, measured)
    assert predicted <= 1.02 * measured, (plan.describe(), predicted, measured)


def test_captured_chain_keeps_the_forward_without_grad_in_its_json() -> None:
    chain = capture(_model(), torch.randn(256, D), loss_fn=_loss).chain
    # h and gelu(h) (256 x 256 float32 each) live at once without grad; with grad both are
    # saved, so the storing forward has no transient beyond them. The simulator counts the
    # output (256 x 64) live already at the transient's peak.
    assert chain.fwd_overhead_bytes[:3] == (0, 0, 0)
    assert chain.fwd_none_overhead_bytes[:3] == (2 * 256 * 4 * D * 4 - 256 * D * 4,) * 3
    text = chain.to_json()
    assert json.loads(text)["version"] == CHAIN_SCHEMA_VERSION == 2
    assert remat.Chain.from_json(text) == chain
    assert remat.Chain.from_json(text).fingerprint == chain.fingerprint
    graph = Graph.from_chain(chain)
    assert graph.to_chain() == dataclasses.replace(chain, stages_fingerprint="")
    plan = remat.Plan.every_stage(chain)
    assert run_schedule(graph, lower_plan(graph, plan)).timeline
    # a chain without it (made by hand, or written before) is written and read as version 1,
    # its forwards without grad taking fwd_overhead_bytes as before
    old = remat.Chain.homogeneous(3, out_bytes=8)
    data = json.loads(old.to_json())
    assert data["version"] == 1 and "fwd_none_overhead_bytes" not in data
    assert remat.Chain.from_json(old.to_json()).fwd_none_overhead_bytes == old.fwd_overhead_bytes
    with pytest.raises(ValueError, match="version 3"):
        remat.Chain.from_json(json.dumps({**data, "version": 3}))
