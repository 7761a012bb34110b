"""The small tensors no stage cost sees, counted where they live (issue #18): the wrapped
scalars autograd saves without the saved-tensor hooks (NOTE [ Saved wrapped scalars ] in
remat.capture.chain), kept from a stage's every forward to its backward, a checkpointed one
too; the loss and the gradient its backward is seeded with, held through the whole backward;
a CPU optimizer step's scalar. They replace the 1 KiB counted all step on the chain path, by
which ``remat.auto`` refused the budget that checkpointing every block of GPT-2 and Llama
measures (680656 B named against 679660 B measured; 514900 against 513888 B). The graph path counts the same terms per node
(:attr:`remat.capture.graph.GraphTrace.forward_kept_bytes`, ``small_scratch_bytes``,
``loss_bytes``) instead of its own 1 KiB, by which it refused HF ViT's every-block budget
(759844 B named against 759652 B measured)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from remat.auto import auto, predicted_step_peak_bytes, scalar_costs
from remat.capture.chain import capture, unhooked_saved
from remat.capture.graph import trace_graph
from remat.core.plan import ChainSegment, Plan
from remat.core.step import StepCosts, StepEvent, step_peak
from remat.execute.chain import apply
from remat.measure.events import allocated_bytes, step_peak_bytes
from remat.planners import BudgetTooSmallError


class TanhGELU(nn.Module):
    """GPT-2's GELU (transformers' NewGELUActivation): three Python numbers that autograd saves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.act, self.down = (
            nn.Linear(width, 4 * width),
            TanhGELU(),
            nn.Linear(4 * width, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


def _loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
    return m(b).square().mean()


def test_the_wrapped_scalars_autograd_saves_bypass_the_hooks() -> None:
    x = torch.randn(4, requires_grad=True)
    packed: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.untyped_storage()._cdata)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = TanhGELU()(x)
    found = unhooked_saved([y], dict.fromkeys(packed, 0), x.device)
    assert sorted(found.values()) == [8, 8, 8]  # 0.5, sqrt(2/pi), 0.044715: doubles
    assert not set(found) & set(packed)
    assert unhooked_saved([y], {}, torch.device("meta")) == {}  # another device's: not counted


def test_forward_kept_bytes_live_from_every_forward_to_the_backward() -> None:
    # stage 1 checkpointed: forward, forward, the loss, backward of 2, recompute 1, backward 1
    timeline = [
        StepEvent(False, 0, 100, 100),
        StepEvent(False, 1, 300, 300),
        StepEvent(False, -1, 300, 300),  # the chain's loss event
        StepEvent(True, 1, 350, 100),
        StepEvent(False, 0, 300, 300),
        StepEvent(True, 0, 320, 0),
    ]
    bare = StepCosts(persistent_bytes=0, grad_bytes=(0, 0))
    kept = dataclasses.replace(bare, forward_kept_bytes=(10, 20))
    assert step_peak(timeline, bare) == 350
    # during B of stage 2 both stages' scalars (30)
    assert step_peak(timeline, kept) == 380
    # a recomputation at the peak: stage 2's scalars are gone with its backward, stage 1's
    # first forward's (10) and the recomputation's copy (10) are there
    replayed = [*timeline[:4], StepEvent(False, 0, 400, 300), timeline[5]]
    assert step_peak(replayed, bare) == 400
    assert step_peak(replayed, kept) == 420
    with pytest.raises(ValueError, match="forward_kept_bytes"):
        StepCosts(persistent_bytes=0, grad_bytes=(0, 0), forward_kept_bytes=(1,))


def test_the_loss_and_its_seed_live_through_the_backward_and_the_loss_to_the_optimizer() -> None:
    timeline = [StepEvent(False, 0, 50, 50), StepEvent(True, 0, 60, 0)]
    costs = StepCosts(persistent_bytes=100, grad_bytes=(40,), optimizer_step_bytes=30)
    assert step_peak(timeline, costs) == 200  # the backward: 100 + 40 + 60
    loss = dataclasses.replace(costs, loss_bytes=4)
    assert step_peak(timeline, loss) == 208
    assert loss.optimizer_phase_bytes == costs.optimizer_phase_bytes + 4


def test_small_scratch_is_added_to_the_peaks_of_its_stage() -> None:
    timeline = [StepEvent(False, 0, 100, 100), StepEvent(False, -1, 100, 100)]
    timeline += [StepEvent(True, 0, 150, 0)]
    costs = StepCosts(persistent_bytes=0, grad_bytes=(0,))
    assert step_peak(timeline, dataclasses.replace(costs, op_scratch_bytes=((60, 0),))) == 160
    assert step_peak(timeline, dataclasses.replace(costs, op_scratch_bytes=((0, 30),))) == 180


@pytest.mark.slow
def test_a_kernels_small_workspace_is_counted_at_its_stage() -> None:
    # layer norm's CPU backward takes a few hundred bytes of workspace (512 B on the dev
    # machine: ViT's head) that no tensor tracker sees and the capture's overheads leave out
    # below 1 KiB (real and fake captures agree); the step's peak is in that backward
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.LayerNorm(32))
    x = torch.randn(130, 32)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b)[:, 0].square().mean()

    captured = capture(model, x, loss_fn=loss_fn)
    plan = Plan.none(captured.chain)

    def step() -> None:
        loss_fn(model, x).backward()
        model.zero_grad(set_to_none=True)

    measured = step_peak_bytes(step, model, None, x)
    predicted = predicted_step_peak_bytes(model, captured, plan)
    assert measured <= predicted <= measured + 4, (
        measured,
        predicted,
        captured.small_scratch_bytes,
    )


def test_on_cuda_the_loss_takes_an_allocator_block() -> None:
    # the CUDA caching allocator hands out multiples of 512 B: a 4-byte loss and its seed take
    # 1024 B through the backward (the scalars of Python numbers stay on the CPU there)
    assert allocated_bytes(4, torch.device("cuda")) == 512
    assert allocated_bytes(513, torch.device("cuda", 0)) == 1024
    assert allocated_bytes(4, torch.device("cpu")) == 4
    assert allocated_bytes(0, torch.device("cuda")) == 0


@pytest.mark.slow
def test_the_whole_step_is_predicted_to_the_byte_with_the_scalars() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(32) for _ in range(4)])
    x = torch.randn(16, 32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    captured = capture(model, x, loss_fn=_loss)
    assert captured.forward_kept_bytes == (24, 24, 24, 24)
    chain = captured.chain
    plans = [Plan.none(chain), Plan.every_stage(chain)]
    plans += [
        Plan.from_chain_segments([ChainSegment(i, i, i == k) for i in range(1, 5)])
        for k in (1, 2, 4)
    ]
    plans.append(
        Plan.from_chain_segments([ChainSegment(1, 2, True), ChainSegment(3, 3), ChainSegment(4, 4)])
    )
    for plan in plans:
        planned = apply(model, plan, stages=captured.stages)

        def step(planned: nn.Module = planned) -> None:
            _loss(planned, x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        measured = step_peak_bytes(step, planned, opt, x)
        predicted = predicted_step_peak_bytes(model, captured, plan, opt)
        # never under; over by at most the loss's 4 B (at the last stage's backward, where
        # the stage's measured backward already holds the seed)
        assert measured <= predicted <= measured + 4, (plan.describe(), measured, predicted)
    # every stage checkpointed: exact; without the scalars it was 100 B under
    every = Plan.every_stage(chain)
    planned = apply(model, every, stages=captured.stages)

    def every_step() -> None:
        _loss(planned, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured = step_peak_bytes(every_step, planned, opt, x)
    assert predicted_step_peak_bytes(model, captured, every, opt) == measured
    blind = dataclasses.replace(captured, forward_kept_bytes=())
    assert scalar_costs(blind)["forward_kept_bytes"] == ()
    assert predicted_step_peak_bytes(model, blind, every, opt) < measured


class NormBlock(Block):
    """:class:`Block` behind a layer norm (whose CPU backward takes a small workspace)."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class SkipNet(nn.Module):
    """Three :class:`NormBlock` and a skip from the stem to the head: not a chain, so
    ``remat.auto`` plans its module graph."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(NormBlock(width) for _ in range(3))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = s = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h + s)


@pytest.mark.slow
def test_the_graph_path_counts_the_scalars_where_they_live() -> None:
    # at the least budget auto names on the graph path, the step measures that budget to the
    # byte: no 1 KiB counted all step (which named 1 KiB more than any plan needs), and never
    # under (without the scalars, GPT-2's graph path at its least was 28 B under)
    torch.manual_seed(0)
    model = SkipNet()
    x = torch.randn(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    trace = trace_graph(model, x, _loss, level="module")
    names = [node.name for node in trace.graph.nodes]
    kept = dict(zip(names, trace.forward_kept_bytes, strict=True))
    assert {n: b for n, b in kept.items() if b} == {f"blocks.{i}.act": 24 for i in range(3)}
    assert trace.loss_bytes == 4
    scratch = dict(zip(names, trace.small_scratch_bytes, strict=True))
    assert all(scratch[f"blocks.{i}.norm"][1] > 0 for i in range(3))  # layer norm's backward

    def step_of(planned: nn.Module) -> Callable[[], None]:
        def step() -> None:
            _loss(planned, x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def grads_of(module: nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        _loss(module, x).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return grads

    with pytest.warns(UserWarning, match="not a chain"):
        with pytest.raises(BudgetTooSmallError) as info:
            auto(model, x, _loss, budget=1, optimizer=opt, loop="loss-only")
    least = info.value.minimum_bytes
    eager = step_peak_bytes(step_of(model), model, opt, x)
    for budget in (least, (least + eager) // 2):
        with pytest.warns(UserWarning, match="not a chain"):
            planned, summary = auto(model, x, _loss, budget=budget, optimizer=opt, loop="loss-only")
        assert summary.plan.segments
        measured = step_peak_bytes(step_of(planned), planned, opt, x)
        assert measured <= summary.predicted_peak_bytes <= budget, (budget, measured, summary)
        if budget == least:
            # the least plan (the graph descent's: planning.step_descent) recomputes block 0,
            # whose backward the simulator meets holding one gradient too many: the final sum
            # h + s hands its output gradient to two inputs (s and block 1's sum) as one tensor,
            # which a node's bwd_overhead_bytes cannot count below what the node holds itself
            # (Node.bwd_overhead_floor): 8,192 B (one 64 x 32 activation) over, never under
            assert measured <= summary.predicted_peak_bytes <= measured + 64 * 32 * 4
        for got, want in zip(grads_of(planned), grads_of(model), strict=True):
            torch.testing.assert_close(got, want)
