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

import pytest
import torch
from torch import nn

import remat
from remat.capture.chain import capture
from remat.execute.chain import apply
from remat.measure.events import SCRATCH_MIN_BYTES, step_peak_bytes, unique_storage_bytes

D = 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)) for _ in range(4)]
    )


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


UNDER = pytest.mark.xfail(
    strict=True,
    reason="F_none's transient is derived from the storing forward: every-stage forward "
    "predicted 327,684 B, measured 806,656 B; (1-2) (3-4) 262,148 B vs 731,008 B",
)


@pytest.mark.parametrize(
    "checkpoints",
    [None, pytest.param([1, 2, 3, 4], marks=UNDER), pytest.param([2], marks=UNDER)],
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
    predicted = remat.simulate(chain, plan).forward_peak_bytes
    # the wrapped scalars of Python numbers (the mean's 12 B) are below SCRATCH_MIN_BYTES, left
    # out of the chain's overheads (remat.auto adds them to a whole step's prediction)
    assert predicted >= measured - SCRATCH_MIN_BYTES, (plan.describe(), predicted, measured)
    assert predicted <= 1.02 * measured, (plan.describe(), predicted, measured)
