"""The criterion a loop applies to the model's output when remat did not capture it (no
``loss_fn``): :data:`remat.core.step.CRITERIA` measured, and where :func:`step_peak` counts it.

Each criterion runs on an output that autograd reaches through a sink (as a model's output is
reached by the model's backward), the allocator's events counting its forward, its backward
and the output's gradient the sink receives.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from remat.core.step import (
    CRITERIA,
    CRITERION_PEAK_OUTPUTS,
    StepCosts,
    StepEvent,
    criterion_costs,
    step_peak,
)
from remat.measure.events import AllocatorWindow

ROWS, COLS = 256, 64
OUT_BYTES = ROWS * COLS * 4
SCALARS = 64
"""The loss and the wrapped scalars of Python numbers: 4 to 20 bytes measured, counted where
they live by :attr:`remat.core.step.StepCosts.loss_bytes` and ``op_scratch_bytes``."""

Criterion = Callable[[torch.Tensor], torch.Tensor]


def _criteria() -> dict[str, list[Criterion]]:
    """Per entry of CRITERIA, the criteria it names (targets made outside the measurement)."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, COLS, (ROWS,), generator=g)
    t = torch.randn(ROWS, COLS, generator=g)
    p = torch.rand(ROWS, COLS, generator=g)
    probs = p.softmax(-1)
    table: dict[str, list[Criterion]] = {
        "F.cross_entropy(out, y) (class indices, probabilities, label smoothing)": [
            lambda o: F.cross_entropy(o, y),
            lambda o: F.cross_entropy(o, probs),
            lambda o: F.cross_entropy(o, y, label_smoothing=0.1),
        ],
        "F.nll_loss(F.log_softmax(out, -1), y)": [lambda o: F.nll_loss(F.log_softmax(o, -1), y)],
        "F.kl_div(F.log_softmax(out, -1), p)": [
            lambda o: F.kl_div(F.log_softmax(o, -1), probs, reduction="batchmean")
        ],
        "F.mse_loss(out, t)": [lambda o: F.mse_loss(o, t)],
        "(out - t).pow(2).mean()": [lambda o: (o - t).pow(2).mean()],
        "out.pow(2).mean(), (out ** 2).mean(), (out * out).mean()": [
            lambda o: o.pow(2).mean(),
            lambda o: (o**2).mean(),
            lambda o: (o * o).mean(),
        ],
        "F.l1_loss(out, t), out.abs().mean()": [
            lambda o: F.l1_loss(o, t),
            lambda o: o.abs().mean(),
        ],
        "F.smooth_l1_loss(out, t), F.huber_loss(out, t)": [
            lambda o: F.smooth_l1_loss(o, t),
            lambda o: F.huber_loss(o, t),
        ],
        "F.binary_cross_entropy_with_logits(out, t)": [
            lambda o: F.binary_cross_entropy_with_logits(o, p)
        ],
        "F.binary_cross_entropy(out.sigmoid(), t)": [
            lambda o: F.binary_cross_entropy(o.sigmoid(), p)
        ],
        "out.sum(), out.mean(), out.norm()": [
            lambda o: o.sum(),
            lambda o: o.mean(),
            lambda o: o.norm(),
        ],
    }
    assert table.keys() == CRITERIA.keys()
    return table


class _Sink(torch.autograd.Function):
    """The model's side of the output: receives its gradient, records its bytes."""

    grad_bytes = 0

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> None:  # type: ignore[override]
        _Sink.grad_bytes = grad.untyped_storage().nbytes()


def _measure(criterion: Criterion) -> tuple[int, int]:
    """``(peak bytes beside the output, bytes of the output's gradient)``."""
    leaf = torch.randn(ROWS, COLS, requires_grad=True)
    out = _Sink.apply(leaf)
    with AllocatorWindow(torch.device("cpu")) as window:
        criterion(out).backward()
    assert window.peak_bytes is not None
    return window.peak_bytes, _Sink.grad_bytes


@pytest.mark.parametrize("name", list(CRITERIA))
def test_each_criterion_holds_at_most_its_entry(name: str) -> None:
    outputs = CRITERIA[name]
    peaks = []
    for criterion in _criteria()[name]:
        peak, grad = _measure(criterion)
        assert grad <= OUT_BYTES, name
        # beside the output-sized tensors: the loss and its wrapped scalars (a few dozen bytes,
        # StepCosts.loss_bytes, op_scratch_bytes), and label smoothing's per-row sums (one
        # float a row)
        assert peak <= outputs * OUT_BYTES + SCALARS + ROWS * 4, (name, peak / OUT_BYTES)
        assert peak <= CRITERION_PEAK_OUTPUTS * OUT_BYTES + SCALARS, name
        peaks.append(peak)
    # the entry is what the worst of its criteria holds, not more
    assert max(peaks) > (outputs - 1) * OUT_BYTES, (name, max(peaks) / OUT_BYTES)


def test_criterion_costs_is_the_bound_of_every_entry() -> None:
    assert CRITERION_PEAK_OUTPUTS == max(CRITERIA.values()) == 5
    assert criterion_costs("output-held", 1000) == (5000, 1000)
    assert criterion_costs("loss-only", 1000) == (6000, 1000)  # the output too, not held
    assert criterion_costs("output-held", 0) == (0, 0)


def test_step_peak_counts_the_criterion_at_the_loss_and_the_gradient_to_the_first_backward() -> (
    None
):
    # two stages, the last one checkpointed: forward 0, 1, the loss (index -1), stage 1
    # recomputed, then the backwards
    timeline = [
        StepEvent(False, 0, 40, 30),
        StepEvent(False, 1, 60, 50),
        StepEvent(False, -1, 52, 50),
        StepEvent(False, 1, 75, 70),
        StepEvent(True, 1, 90, 40),
        StepEvent(True, 0, 45, 0),
    ]
    plain = StepCosts(persistent_bytes=100, grad_bytes=(0, 0))
    assert step_peak(timeline, plain) == 100 + 90
    # the criterion at the loss: 50 live + 200
    crit = StepCosts(persistent_bytes=100, grad_bytes=(0, 0), criterion_peak_bytes=200)
    assert step_peak(timeline, crit) == 100 + 50 + 200
    # the output's gradient on the recomputation and the first backward, not after
    grad = StepCosts(persistent_bytes=100, grad_bytes=(0, 0), output_grad_bytes=30)
    assert step_peak(timeline, grad) == 100 + 90 + 30
    after = [*timeline[:-1], StepEvent(True, 0, 200, 0)]
    assert step_peak(after, grad) == 100 + 200
    # gradients already live (accumulation) are counted at the loss too
    live = StepCosts(
        persistent_bytes=100, grad_bytes=(7, 8), criterion_peak_bytes=200, grads_live=True
    )
    assert step_peak(timeline, live) == 100 + 15 + 50 + 200
