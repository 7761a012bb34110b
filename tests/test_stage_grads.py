"""Which stage's backward makes a parameter's gradient is measured, not read off the modules
(NOTE [ The gradients a stage's backward makes ] in remat.capture.chain). A parameter on the
model itself that the code before its blocks reads (timm ViT's ``pos_embed`` and
``cls_token``) belongs to no stage's module; counted with the stage after the blocks, whose
backward runs first, its gradient was counted twice at the first stage's backward, and timm
ViT's whole step was predicted 8,448 B above what it measured at every plan. Compiled, its
every-block budget was refused on that prediction, though the plan at the least named met it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from chain_steps import five_stage_plans, measured_step
from torch import nn

from remat.auto import predicted_step_peak_bytes, stage_grad_bytes, step_costs
from remat.bench import conformance
from remat.capture.chain import capture
from remat.capture.stages.families.blocks import KIND as GENERIC_KIND
from remat.core.plan import Plan
from remat.execute.chain import apply
from remat.measure.profile import default_loss_fn
from remat.planners import BudgetTooSmallError
from remat.planning import plan_for_step


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = (
            nn.LayerNorm(width),
            nn.Linear(width, 64),
            nn.Linear(64, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyViT(nn.Module):
    """A class token and position embeddings as parameters of the model itself, read before the
    blocks; ``scale``, also the model's own, read before and after them."""

    def __init__(self, width: int = 32, tokens: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(12, width)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, tokens + 1, width))
        self.scale = nn.Parameter(torch.ones(width))
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) * self.scale
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]) * self.scale)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_parameter_read_before_the_blocks_is_counted_at_the_first_stage() -> None:
    torch.manual_seed(0)
    model = TinyViT()
    x = torch.randn(8, 16, 12)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    captured = capture(model, x, loss_fn=_loss)
    assert captured.stages.kind == GENERIC_KIND
    n = captured.chain.n
    assert n == 5  # before the blocks, three blocks, after them

    grads = stage_grad_bytes(captured.stages, captured.grad_made)
    before = _bytes(*model.embed.parameters(), model.cls_token, model.pos_embed)
    after = _bytes(*model.norm.parameters(), *model.head.parameters(), model.scale)
    # scale is read on both sides: counted after the blocks, whose backward makes it first
    assert grads[0] == before
    assert grads[-1] == after
    assert grads[1:-1] == [_bytes(*b.parameters()) for b in model.blocks]
    assert sum(grads) == _bytes(*model.parameters())
    # from the modules alone every parameter of the model's own is the last stage's
    owned = stage_grad_bytes(captured.stages)
    assert owned[0] == _bytes(*model.embed.parameters())
    assert owned[-1] == after + _bytes(model.cls_token, model.pos_embed)

    chain = captured.chain
    plans = five_stage_plans(chain, (1, 3))
    blind = dataclasses.replace(captured, grad_made=())
    for plan in plans:
        measured = measured_step(model, plan, captured, x, opt, _loss)
        predicted = predicted_step_peak_bytes(model, captured, plan, opt)
        assert measured <= predicted <= measured + 4, (plan.describe(), measured, predicted)
    # the fault: with the modules' attribution the whole step was over-predicted by the two
    # parameters' gradients, counted twice at the first stage's backward
    plan = Plan.none(chain)
    assert predicted_step_peak_bytes(model, blind, plan, opt) - predicted_step_peak_bytes(
        model, captured, plan, opt
    ) == _bytes(model.cls_token, model.pos_embed)


@pytest.mark.slow
def test_timm_vits_whole_step_is_predicted_to_the_byte_at_its_chains_least() -> None:
    loop = conformance.Loop(conformance.build("timm-vit"), "loss_fn")
    model = loop.module
    opt = conformance._optimizer(loop.built.model)
    captured = capture(model, loop.batch, loss_fn=loop.loss_fn)
    assert captured.stages.kind == GENERIC_KIND
    chain = captured.chain
    for plan in (Plan.none(chain), Plan.every_stage(chain)):
        planned = apply(model, plan, stages=captured.stages)
        measured = conformance._measure(loop, planned, opt)
        assert predicted_step_peak_bytes(model, captured, plan, opt) == measured, plan.describe()
    # the least the chain's refusal names is what its plan measures (8,448 B above before)
    costs = step_costs(captured, model, opt, loss_fn=default_loss_fn)
    with pytest.raises(BudgetTooSmallError) as refused:
        plan_for_step(chain, costs, 1, "optimal-time")
    least = refused.value.minimum_bytes
    plan = plan_for_step(chain, costs, least, "optimal-time")
    planned = apply(model, plan, stages=captured.stages)
    assert conformance._measure(loop, planned, opt) == least


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model_name": "deit_tiny_distilled_patch16_224"},  # a distillation token too
        {"model_name": "vit_small_patch16_224", "reg_tokens": 4},  # register tokens
    ],
    ids=["deit-distilled", "vit-registers"],
)
def test_timm_vits_with_more_tokens_of_their_own_are_predicted_to_the_byte(kwargs: dict) -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        **kwargs,
        pretrained=False,
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=3,
        num_heads=2,
        num_classes=10,
    )
    x = torch.randn(4, 3, 32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        out = m(b)
        return (out[0] if isinstance(out, tuple) else out).square().mean()

    captured = capture(model, x, loss_fn=loss)
    assert captured.stages.kind == GENERIC_KIND
    blind = dataclasses.replace(captured, grad_made=())
    for plan in (Plan.none(captured.chain), Plan.every_stage(captured.chain)):
        measured = measured_step(model, plan, captured, x, opt, loss)
        assert predicted_step_peak_bytes(model, captured, plan, opt) == measured, plan.describe()
        # before: the model's own tokens and position embeddings counted twice
        assert predicted_step_peak_bytes(model, blind, plan, opt) > measured
