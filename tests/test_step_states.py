"""Checkpoint state (the RNG state each checkpointed segment keeps) in the whole-step model:
live from the segment's forward to its backward, not for every segment all step."""

from __future__ import annotations

import torch
from torch import nn

from remat.auto import checkpoint_state_bytes, predicted_step_peak_bytes
from remat.capture.chain import capture
from remat.core.plan import Plan
from remat.core.step import StepEvent, segment_state_bytes
from remat.execute.chain import apply
from remat.measure.events import SCRATCH_MIN_BYTES, step_peak_bytes


def test_segment_states_live_from_forward_to_backward() -> None:
    timeline = [
        StepEvent(False, 0, 0, 0),
        StepEvent(False, 1, 0, 0),
        StepEvent(False, 2, 0, 0),
        StepEvent(True, 2, 0, 0),
        StepEvent(False, 1, 0, 0),  # recomputation: no new state
        StepEvent(True, 1, 0, 0),
        StepEvent(True, 0, 0, 0),
    ]
    # segments starting at stages 0 and 1; the one at 1 holds a nested checkpoint (2 states)
    assert segment_state_bytes(timeline, [(0, 1), (1, 2)], 10) == [10, 30, 30, 30, 30, 30, 10]


def test_the_predicted_step_counts_only_the_states_still_held() -> None:
    # wide layers, a small batch: the gradients make the peak, at the end of the backward,
    # where one segment's RNG state is left, not all eight (they were counted all step)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])
    x = torch.randn(2, 128)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).square().mean()

    captured = capture(model, x, loss_fn=loss_fn)
    plan = Plan.every_stage(captured.chain)
    planned = apply(model, plan, stages=captured.stages)

    def step() -> None:
        loss_fn(planned, x).backward()
        planned.zero_grad(set_to_none=True)

    measured = step_peak_bytes(step, planned, None, x)
    predicted = predicted_step_peak_bytes(model, captured, plan)
    # auto budgets SCRATCH_MIN_BYTES beside the prediction for allocator-only scalars no capture
    # counts (here 4 B: measured 1063880 B, predicted 1063876 B); one state too many counted
    # would put the prediction 5 KiB above the measurement
    assert measured <= predicted + SCRATCH_MIN_BYTES, (measured, predicted)
    assert predicted <= measured + checkpoint_state_bytes() // 2, (measured, predicted)
