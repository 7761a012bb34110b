"""A target the user's ``loss_fn`` reads from its closure lives all step, like the batch.

``loss_fn = lambda model, x: F.cross_entropy(model(x), y)``: ``y`` is allocated before the step
and held to its end. The loss saves it, so the chain capture counted it in the loss stage's
saved bytes (allocated at the loss, freed at its backward) and the graph capture with the
input; the conformance suite's measurement did not count it at all. On torchvision's LRASPP (a
2 x 64 x 64 int64 mask, 65,536 B) that made remat's least plan look 65,536 B above its
measured step. Both captures now count such a tensor with the input
(:attr:`remat.capture.chain.StageCost.external`), and a step is measured with the tensors it
reads from outside (``step_peak_bytes(..., inputs=(x, y))``).
"""

from __future__ import annotations

import torch
from torch import nn

from remat.auto import predicted_step_peak_bytes
from remat.capture.chain import capture
from remat.core.plan import ChainSegment, Plan
from remat.execute.chain import apply
from remat.measure.events import step_peak_bytes

N, W, C = 64, 256, 512


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(W, W), nn.Tanh()),
        nn.Sequential(nn.Linear(W, W), nn.Tanh()),
        nn.Sequential(nn.Linear(W, W), nn.Tanh()),
        nn.Linear(W, C * 4),
    )


def test_a_target_in_the_loss_fns_closure_is_counted_all_step_on_the_chain_path() -> None:
    model = _model()
    x = torch.randn(N, W)
    # a dense target as large as the output, which the loss's product saves
    y = torch.randn(N, C * 4)

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return (m(batch) * y).mean()

    captured = capture(model, x, loss_fn=loss_fn)
    assert captured.chain.input_bytes == x.nbytes + y.nbytes
    for plan in (
        Plan.none(),
        Plan.from_chain_segments((ChainSegment(1, 2, True), ChainSegment(3, 4, False))),
    ):
        planned = apply(model, plan, stages=captured.stages)

        def step(planned: nn.Module = planned) -> None:
            loss_fn(planned, x).backward()
            planned.zero_grad(set_to_none=True)

        measured = step_peak_bytes(step, planned, None, (x, y))
        predicted = predicted_step_peak_bytes(model, captured, plan.for_chain(captured.chain))
        assert measured <= predicted <= measured + 64, (plan, measured, predicted)


def test_a_closure_target_that_is_the_batch_is_counted_once() -> None:
    """Labels read from the closure that are the batch tensor itself (a causal LM's labels are
    its input_ids): the capture runs on a private copy of the batch, where they looked like a
    tensor of their own that the loss stage saved (512 B over on each Hugging Face decoder of
    the conformance suite); they are the batch, counted once."""
    model = _model()
    x = torch.randn(N, W)
    y = x  # the target is the batch

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return (m(batch)[:, :W] * y).mean()

    captured = capture(model, x, loss_fn=loss_fn)
    assert captured.chain.input_bytes == x.nbytes
    assert captured.external_bytes == 0
    assert captured.chain.saved_bytes[-1] < x.nbytes  # (the target is not among them)
    for plan in (Plan.none(), Plan.every_stage(captured.chain)):
        planned = apply(model, plan, stages=captured.stages)

        def step(planned: nn.Module = planned) -> None:
            loss_fn(planned, x).backward()
            planned.zero_grad(set_to_none=True)

        measured = step_peak_bytes(step, planned, None, x)
        predicted = predicted_step_peak_bytes(model, captured, plan.for_chain(captured.chain))
        assert measured <= predicted <= measured + 64, (plan, measured, predicted)
