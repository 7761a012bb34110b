"""Two things users' models do that the captures did not see, found on Hugging Face models the
tests did not hold (DeBERTa-v2 and BLOOM, tiny configs):

* a tensor that requires grad, made before the blocks and handed to each of them (DeBERTa's
  relative-position embeddings): its gradient, which every block's backward adds to, lives
  from the last block's backward to the backward of the stage that made it; each stage
  measured alone holds only its own (NOTE [ The gradient of a carried tensor ] in
  remat.capture.chain). DeBERTa measured 4,096 B above its prediction at every plan, and over
  a budget set between the two;
* a tensor made before the blocks and handed to each that no block saves (Llama's causal
  mask, added to the attention scores): freed when the forward returns, unless a checkpoint
  keeps it as its segment's input; counted all step, it made every Hugging Face decoder's
  store-all step 8,964 B above what it measured, so a budget at the eager peak recomputed
  (NOTE [ Carried tensors no stage saves ]);
* a custom ``torch.autograd.Function`` (BLOOM's training GeLU): the module-graph capture sees
  torch calls, and ``Function.apply`` is not one, so what the Function saves was in no node.
  BLOOM's graph plan at its least ran 56,332 B over its budget. The graph capture refuses such
  a step now, naming the Function; ``remat.auto`` plans the chain (NOTE [ Tensors saved outside
  every call ] in remat.capture.graph)."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import pytest
import torch
from chain_steps import five_stage_plans, measured_step
from torch import nn

from remat.auto import predicted_step_peak_bytes
from remat.capture.chain import capture
from remat.capture.graph import trace_graph
from remat.capture.stages.families.blocks import KIND as GENERIC_KIND
from remat.core.errors import UnsupportedModelError
from remat.core.plan import Plan
from remat.measure.events import step_peak_bytes
from remat.planners import BudgetTooSmallError

auto = importlib.import_module("remat.auto").auto

WIDTH = 32


class _Block(nn.Module):
    """A pre-norm MLP block; its subclasses read a tensor made before the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = (
            nn.LayerNorm(WIDTH),
            nn.Linear(WIDTH, 64),
            nn.Linear(64, WIDTH),
        )


class RelBlock(_Block):
    """A block that reads the shared relative embedding ``rel`` (requires grad)."""

    def forward(self, x: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(torch.relu(self.up(h))) + torch.tanh(h @ rel)


class TinyDeberta(nn.Module):
    """DeBERTa's shape: a layer norm of a parameter made before the blocks, read by each."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(12, WIDTH)
        self.rel = nn.Parameter(0.1 * torch.randn(WIDTH, WIDTH))
        self.rel_norm = nn.LayerNorm(WIDTH)
        self.blocks = nn.ModuleList(RelBlock() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        rel = self.rel_norm(self.rel)
        for block in self.blocks:
            h = block(h, rel)
        return self.head(h[:, 0])


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _five_stages(make: type[nn.Module]) -> tuple[nn.Module, torch.Tensor, torch.optim.Adam, Any]:
    """``make()``, a batch, Adam, and its capture: before the blocks, three blocks, after them."""
    torch.manual_seed(0)
    model = make()
    x = torch.randn(8, 16, 12)
    captured = capture(model, x, loss_fn=_loss)
    assert captured.stages.kind == GENERIC_KIND and captured.chain.n == 5
    return model, x, torch.optim.Adam(model.parameters()), captured


def test_a_carried_tensors_gradient_is_counted_from_the_last_block_to_its_maker() -> None:
    model, x, opt, captured = _five_stages(TinyDeberta)
    rel_bytes = WIDTH * WIDTH * 4
    # made by the stage before the blocks (0), given a gradient last by the last block (3)
    assert captured.carried_grads == ((0, 3, rel_bytes),)

    plans = five_stage_plans(captured.chain, (2, 3))
    blind = dataclasses.replace(captured, carried_grads=())
    under = 0
    for plan in plans:
        measured = measured_step(model, plan, captured, x, opt, _loss)
        predicted = predicted_step_peak_bytes(model, captured, plan, opt)
        assert measured <= predicted <= measured + 4, (plan.describe(), measured, predicted)
        under = max(under, measured - predicted_step_peak_bytes(model, blind, plan, opt))
    # the fault: without the carried gradient the step was under-predicted by that buffer
    assert under == rel_bytes


def test_auto_keeps_a_budget_between_the_old_prediction_and_the_measurement() -> None:
    torch.manual_seed(0)
    model = TinyDeberta()
    x = torch.randn(8, 16, 12)
    reference = TinyDeberta()
    reference.load_state_dict(model.state_dict())
    _loss(reference, x).backward()
    captured = capture(model, x, loss_fn=_loss)
    opt = torch.optim.Adam(model.parameters())
    plan = Plan.every_stage(captured.chain)
    budget = predicted_step_peak_bytes(model, captured, plan, opt) - 1
    planned, summary = auto(model, x, loss_fn=_loss, budget=budget, optimizer=opt)

    def step() -> None:
        _loss(planned, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    _loss(planned, x).backward()
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7)
    opt.zero_grad(set_to_none=True)
    measured = step_peak_bytes(step, planned, opt, x)
    assert measured <= summary.predicted_peak_bytes <= budget


class TanhGelu(torch.autograd.Function):
    """BLOOM's training GeLU: a Function that saves its input and computes its own backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        slope = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
        return slope * grad


class GeluBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(TanhGelu.apply(self.up(x)))


class TinyBloom(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(12, WIDTH)
        self.blocks = nn.ModuleList(GeluBlock() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_the_graph_capture_refuses_a_custom_function_naming_it() -> None:
    torch.manual_seed(0)
    with pytest.raises(UnsupportedModelError, match="custom torch.autograd.Function TanhGelu"):
        trace_graph(TinyBloom(), torch.randn(8, 16, 12), loss_fn=_loss, level="module")


def test_below_the_chain_a_custom_function_is_refused_at_the_chains_least() -> None:
    torch.manual_seed(0)
    model = TinyBloom()
    x = torch.randn(8, 16, 12)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(BudgetTooSmallError, match="TanhGelu") as refused:
        auto(model, x, loss_fn=_loss, budget=1, optimizer=opt)
    least = refused.value.minimum_bytes
    # the minimum named is accepted, and the step stays within it with eager's gradients
    reference = TinyBloom()
    reference.load_state_dict(model.state_dict())
    _loss(reference, x).backward()
    planned, summary = auto(model, x, loss_fn=_loss, budget=least, optimizer=opt)
    _loss(planned, x).backward()
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7)
    opt.zero_grad(set_to_none=True)

    def step() -> None:
        _loss(planned, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    assert step_peak_bytes(step, planned, opt, x) <= least


class MaskBlock(_Block):
    """A block that adds the shared ``mask`` (no grad) and keeps no copy of it."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x)) + mask))


class TinyMasked(nn.Module):
    """A mask made before the blocks (no grad) that each block adds and none saves."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(12, WIDTH)
        self.blocks = nn.ModuleList(MaskBlock() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 256)  # a wide output: the step peaks in its backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        mask = torch.zeros(x.shape[0], x.shape[1], 64).masked_fill(x[..., :1] > 1.0, -1.0)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(h)


def test_a_carried_tensor_no_stage_saves_is_freed_with_the_forward() -> None:
    model, x, opt, captured = _five_stages(TinyMasked)
    mask_bytes = 8 * 16 * 64 * 4
    assert captured.forward_only_bytes == mask_bytes
    blind = dataclasses.replace(captured, forward_only_bytes=0)
    for plan in five_stage_plans(captured.chain, (2, 3)):
        measured = measured_step(model, plan, captured, x, opt, _loss)
        predicted = predicted_step_peak_bytes(model, captured, plan, opt)
        assert measured <= predicted <= measured + 4, (plan.describe(), measured, predicted)
        if plan.describe() == Plan.none(captured.chain).describe():
            # the fault: counted through the backward, the store-all step was over by the mask
            assert predicted_step_peak_bytes(model, blind, plan, opt) - predicted == mask_bytes
