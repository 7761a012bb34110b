"""remat's promise tried the way a new user would, on models and loops the other tests do not use.

The promise (README): ``remat.auto(model, batch, budget=...)`` returns a model whose training
step's measured peak (the allocator's events, exact on the CPU) is within the budget, with the
unplanned model's gradients (same loss, same dropout masks, buffers updated once per step); a
budget too small is refused naming the minimum, and that minimum is then accepted.

Each scenario is tiny (seconds on a CPU) and asserts exact bytes and gradients. Found here and
fixed in the library:

* a buffer a forward updates (not batch norm: a moving average, a call counter) was updated
  again by every recomputation (counter 2 instead of 1 after one step; the average off by 0.029);
* gradient accumulation over microbatches, and a loop that never calls ``zero_grad`` (the
  README's quick start), hold every gradient from the forward on: the planned step ran at
  3,525,912 B under a 3,263,488 B budget (4 microbatches; the graph path 2,049,624 B under
  1,599,568 B);
* parameters unfrozen after planning get gradients the plan did not count: 3,887,640 B under a
  2,900,354 B budget;
* a criterion holding more than one output-sized tensor, without ``loss_fn`` (a squared error:
  3,573,496 B at the named minimum 3,314,420 B);
* spectral norm's power iteration started again from the updated vector in a recomputation
  (the weights' gradients 1.9e-4 off);
* ``torch.save(planned)`` failed on a local lambda and remat.auto's re-plan closure;
* the graph path refused spectral norm's forward (a property read in the power iteration did
  not match its trace);
* a model fed token ids with a padding mask (``h = block(h) * mask``), on the graph path: at
  its named minimum 4,295,052 B the step measured 4,766,072 B, because ``h`` holds the previous
  block's output past its last reader, where the forward peaks (``Node.held_until``);
* a ``loss_fn`` entering ``torch.autocast`` was captured in float32, and autocast's weight-cast
  cache kept a checkpointed segment's 16-bit weight copies through the forward;
* a sparse gradient (``nn.EmbeddingBag(sparse=True)``) crashed every entry point with torch's
  "Cannot access storage of SparseTensorImpl"; it is refused saying which module and what to do;
* a forward that makes its loss module (``nn.CrossEntropyLoss()``, as ALBERT's and BERT's do)
  showed torch's tracker warning "Module is None. Skipping PRE_BW hook." to the user;
* planning a timm ResNet-18-D printed HiGHS's debug line
  ("HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();") on stdout
  (tests/test_quiet.py).
"""

from __future__ import annotations

import copy
import importlib
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import Skip
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

import remat
from remat.auto import AutoSummary, auto
from remat.execute.chain import SignatureMismatchError
from remat.measure.events import step_peak_bytes
from remat.planners import BudgetTooSmallError

Step = Callable[[nn.Module], torch.Tensor]
"""One training forward and loss, ``step(model) -> loss``."""


# ---------------------------------------------------------------------- helpers
def _mlp(width: int = 128, layers: int = 8, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def _skip() -> Skip:
    torch.manual_seed(0)
    return Skip()


def _auto(model: nn.Module, batch: Any, **kw: Any) -> tuple[nn.Module, AutoSummary]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not a chain.*")
        return auto(model, batch, **kw)


def _minimum(build: Callable[[], nn.Module], batch: Any, **kw: Any) -> int:
    """The least budget remat accepts (named by the refusal of 1 byte)."""
    with pytest.raises(BudgetTooSmallError) as info:
        _auto(build(), batch, budget=1, **kw)
    return info.value.minimum_bytes


def _binding(build: Callable[[], nn.Module], batch: Any, **kw: Any) -> tuple[int, int]:
    """``(minimum, budget)``: a budget half-way between the minimum and the unplanned step."""
    least = _minimum(build, batch, **kw)
    _, unplanned = _auto(build(), batch, **kw)
    assert least < unplanned.unplanned_peak_bytes
    return least, (least + unplanned.unplanned_peak_bytes) // 2


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n.removeprefix("model."): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _assert_same_grads(got: nn.Module, want: nn.Module, rtol: float = 1e-5) -> None:
    a, b = _grads(got), _grads(want)
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=1e-6, msg=k)


def _peak(model: nn.Module, step: Step, inputs: Any, opt: Any = None) -> int:
    """The whole step's exact peak (after a warm-up step, which makes any re-plan)."""

    def run() -> None:
        torch.manual_seed(7)
        step(model).backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)

    return step_peak_bytes(run, model, opt, inputs)


def _has_checkpoint(plan: remat.Plan) -> bool:
    return any(True for _ in plan.walk())


# ---------------------------------------------------------------------- buffers
class Averaging(nn.Module):
    """A layer that keeps a moving average of its input and counts its training calls: buffers
    updated in the forward, in place, not batch norm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("avg", torch.zeros(width))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.avg.mul_(0.9).add_(0.1 * x.mean(0))
                self.calls += 1
        return torch.relu(self.lin(x))


class Reassigning(Averaging):
    """The same, updating by assigning a new tensor to the buffer's name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.avg = 0.9 * self.avg + 0.1 * x.detach().mean(0)
            self.calls = self.calls + 1
        return torch.relu(self.lin(x))


@pytest.mark.parametrize("layer", [Averaging, Reassigning])
def test_a_buffer_updated_in_forward_is_updated_once_per_step(layer: type) -> None:
    # before the fix: calls [2, 2, 1, 2, 2, 1] after one step, the average off by 0.029
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[layer(64) for _ in range(6)], nn.Linear(64, 10))

    x = torch.randn(128, 64)
    _, budget = _binding(build, x)
    model, reference = build(), build()
    planned, summary = _auto(model, x, budget=budget)
    assert _has_checkpoint(summary.plan)
    for _ in range(2):
        for m in (planned, reference):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            m(x).sum().backward()
    assert [int(m.calls) for m in model[:6]] == [2] * 6
    got, want = dict(model.named_buffers()), dict(reference.named_buffers())
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    _assert_same_grads(planned, reference)
    planned.zero_grad(set_to_none=True)
    assert _peak(planned, lambda m: m(x).sum(), x) <= budget


class WeightAverage(nn.Module):
    """A layer that keeps a moving average of its weight, updated in its forward (a buffer
    as large as the weight; in place, or by assigning a new tensor with ``reassign``)."""

    def __init__(self, width: int, reassign: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("avg", torch.zeros(width, width))
        self.reassign = reassign

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                if self.reassign:
                    self.avg = 0.9 * self.avg + 0.1 * self.lin.weight
                else:
                    self.avg.mul_(0.9).add_(0.1 * self.lin.weight)
        return F.gelu(self.lin(x))


@pytest.mark.parametrize("reassign", [False, True])
@pytest.mark.parametrize("at_minimum", [False, True])
def test_large_buffers_updated_in_forward_within_the_budget(
    reassign: bool, at_minimum: bool
) -> None:
    # the executor keeps, per checkpointed segment, a copy of the buffers its forward writes
    # (so that a recomputation starts where the forward did): uncounted, 8 blocks with a
    # weight-sized moving average measured 23,935,112 B at the named minimum 11,315,784 B.
    # Reassigned (a new tensor each step), the measurement itself was off: the profiler saw
    # no free of the old buffer, made before it started (remat.measure.events.step_peak_bytes)
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[WeightAverage(256, reassign) for _ in range(8)])

    x = torch.randn(512, 256)
    kw: dict[str, Any] = {"loop": "loss-only"}
    least, budget = _binding(build, x, optimizer=torch.optim.SGD(build().parameters()), **kw)
    budget = least if at_minimum else budget
    model, reference = build(), build()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    planned, summary = _auto(model, x, budget=budget, optimizer=opt, **kw)
    assert _has_checkpoint(summary.plan)
    measured = _peak(planned, lambda m: m(x).sum(), x, opt)
    assert measured <= summary.predicted_peak_bytes <= budget, (measured, summary.plan.describe())
    planned.zero_grad(set_to_none=True)
    for m in (planned, reference):
        m(x).sum().backward()
    _assert_same_grads(planned, reference)  # lr=0: the weights are the reference's


def test_a_buffer_updated_in_forward_on_the_graph_path() -> None:
    class SkipAveraging(Skip):
        def __init__(self) -> None:
            super().__init__(64)
            self.blocks = nn.ModuleList(Averaging(64) for _ in range(6))

    def build() -> SkipAveraging:
        torch.manual_seed(0)
        return SkipAveraging()

    x = torch.randn(128, 64)
    _, budget = _binding(build, x)
    model, reference = build(), build()
    planned, summary = _auto(model, x, budget=budget)
    assert summary.plan.segments  # something is recomputed
    planned(x).sum().backward()
    reference(x).sum().backward()
    assert [int(m.calls) for m in model.blocks] == [1] * 6
    for a, b in zip(model.blocks, reference.blocks, strict=True):
        torch.testing.assert_close(a.avg, b.avg, rtol=0, atol=0)
    _assert_same_grads(planned, reference)


def test_spectral_norm_gradients_under_recomputation() -> None:
    # before the fix: a recomputation started from the forward's updated u (buffers written
    # once, but read after the update): the weights' gradients 1.9e-4 off
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        layers = [nn.Sequential(spectral_norm(nn.Linear(64, 64)), nn.GELU()) for _ in range(6)]
        return nn.Sequential(*layers, nn.Linear(64, 10))

    x = torch.randn(128, 64)
    model, reference = build(), build()
    planned = remat.apply(model, remat.Plan.every_stage())
    for _ in range(2):  # the second step copies only the buffers the first saw written
        for m in (planned, reference):
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
        got, want = dict(model.named_buffers()), dict(reference.named_buffers())
        for k in want:  # the buffers are right (written once)
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
        _assert_same_grads(planned, reference)


def test_spectral_norm_on_the_graph_path() -> None:
    # before the fix: GraphExecutionError "torch call 4 of the forward is __get__ but the trace
    # has __get__" at the planned forward (a property's __get__, weight_mat.H in the power
    # iteration, is a new method-wrapper at each access: equal to the traced one, not identical)
    class SkipSpectral(Skip):
        def __init__(self) -> None:
            super().__init__(64)
            self.blocks = nn.ModuleList(
                nn.Sequential(spectral_norm(nn.Linear(64, 64)), nn.GELU()) for _ in range(6)
            )

    def build() -> SkipSpectral:
        torch.manual_seed(0)
        return SkipSpectral()

    x = torch.randn(128, 64)
    _, budget = _binding(build, x)
    model, reference = build(), build()
    planned, summary = _auto(model, x, budget=budget)
    assert summary.plan.segments  # something is recomputed
    planned(x).sum().backward()
    reference(x).sum().backward()
    got, want = dict(model.named_buffers()), dict(reference.named_buffers())
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    _assert_same_grads(planned, reference)
    planned.zero_grad(set_to_none=True)
    assert _peak(planned, lambda m: m(x).sum(), x) <= budget


# ---------------------------------------------------------------------- gradients held
K = 4


def _accumulate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    for k in range(K):
        F.cross_entropy(model(x[k::K]), y[k::K]).div(K).backward()


@pytest.mark.parametrize("path", ["chain", "graph"])
def test_gradient_accumulation_holds_the_budget(path: str) -> None:
    # before the fix: the chain step at 3,525,912 B under 3,263,488 B (the eager peak: no plan
    # was made for the gradients held through microbatches 2-4)
    build = _mlp if path == "chain" else _skip
    torch.manual_seed(1)
    x, y = torch.randn(512, 128), torch.randint(0, 10, (512,))
    micro = (x[0::K], y[0::K])

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        def run() -> None:
            _accumulate(model, x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return run

    eager = build()
    eager_opt = torch.optim.Adam(eager.parameters())
    eager_peak = step_peak_bytes(loop(eager, eager_opt), eager, eager_opt, x)
    least = _minimum(
        build, micro, loss_fn=loss_fn, optimizer=torch.optim.Adam(build().parameters())
    )
    budget = (least + eager_peak) // 2
    model = build()
    opt = torch.optim.Adam(model.parameters())
    planned, _ = _auto(model, micro, loss_fn=loss_fn, optimizer=opt, budget=budget)
    try:
        _accumulate(planned, x, y)
    except BudgetTooSmallError as err:  # honest: the held gradients need more
        assert path == "graph"
        assert "already held" in str(err) and err.minimum_bytes > budget
        budget = err.minimum_bytes  # ... and the minimum it names is accepted
        model = build()
        opt = torch.optim.Adam(model.parameters())
        planned, _ = _auto(model, micro, loss_fn=loss_fn, optimizer=opt, budget=budget)
        _accumulate(planned, x, y)
    # the accumulated gradients equal eager's
    reference = build()
    _accumulate(reference, x, y)
    _assert_same_grads(planned, reference)
    opt.zero_grad(set_to_none=True)
    measured = step_peak_bytes(loop(planned, opt), planned, opt, x)
    assert measured <= budget, (measured, budget, least, eager_peak)


def test_a_loop_without_zero_grad_holds_the_budget() -> None:
    # the README's quick start: planned(x).sum().backward() again and again, gradients summed;
    # before the fix 4,227,992 B under a 3,821,412 B budget
    x = torch.randn(512, 128)
    _, budget = _binding(_mlp, x)
    model = _mlp()
    planned, summary = _auto(model, x, budget=budget)
    assert summary.predicted_peak_bytes <= budget

    def run() -> None:
        planned(x).sum().backward()

    measured = step_peak_bytes(run, planned, None, x, warmup=2)
    assert measured <= budget, (measured, budget)
    reference = _mlp()
    for _ in range(4):  # warm-up 2 + measured 1 + this one
        reference(x).sum().backward()
    planned(x).sum().backward()
    _assert_same_grads(planned, reference)


@pytest.mark.parametrize("path", ["chain", "graph"])
def test_a_replan_for_the_gradients_held_reuses_the_step_captured_for_those_inputs(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each microbatch after the first of an accumulation holds every gradient: planned again
    # for that state, on the step already captured for the same inputs (NOTE [ A re-plan for
    # the gradients held ]); before, captured again (compiled: the stages and every one-graph
    # trial compiled again)
    build = _mlp if path == "chain" else _skip
    torch.manual_seed(1)
    x, y = torch.randn(512, 128), torch.randint(0, 10, (512,))
    small_x, small_y = x[:384], y[:384]  # a last, smaller batch

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    auto_module = importlib.import_module("remat.auto")
    name = "capture" if path == "chain" else "trace_graph"
    real, captures = getattr(auto_module, name), []

    def counted(*args: Any, **kwargs: Any) -> Any:
        loss = kwargs["loss_fn"] if "loss_fn" in kwargs else args[2]
        captures.append((tuple(args[1][0][0].shape), loss.__name__))
        return real(*args, **kwargs)

    budget = (_minimum(build, (x[0::K], y[0::K]), loss_fn=loss_fn) * 6) // 5
    model, reference = build(), build()
    planned, _ = _auto(model, (x[0::K], y[0::K]), loss_fn=loss_fn, budget=budget)
    monkeypatch.setattr(auto_module, name, counted)
    for inputs in [(x, y), (small_x, small_y)]:  # each: a plan, then one for the gradients held
        _accumulate(planned, *inputs)
        _accumulate(reference, *inputs)
        _assert_same_grads(planned, reference)
        planned.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    # each step captured once: the new inputs, and the planning inputs with the loss a re-plan
    # plans with (the output's sum: it holds back what the user's loss holds more); the graph
    # path re-plans every call on a trace of the call itself (before: 4 captures, the steps with
    # the gradients held captured again)
    assert sorted(captures) == [((96, 128), "call_loss"), ((128, 128), "call_loss")]
    assert len(planned._plans.cache) == 4  # 2 inputs x 2 states of the gradients
    measured = step_peak_bytes(lambda: _accumulate(planned, x, y), planned, None, x)
    assert measured <= budget, (measured, budget)


def test_a_deepcopy_of_the_planned_model_plans_for_its_own_gradients() -> None:
    # the copy's re-plan closes over the original model, whose gradients are not live
    x = torch.randn(512, 128)
    _, budget = _binding(_mlp, x[:128])
    planned, _ = _auto(_mlp(), x[:128], budget=budget)
    twin = copy.deepcopy(planned)
    assert not any(a is b for a, b in zip(twin.parameters(), planned.parameters(), strict=True))

    def run() -> None:
        for k in range(K):
            twin(x[k * 128 : (k + 1) * 128]).sum().backward()
        twin.zero_grad(set_to_none=True)

    measured = step_peak_bytes(run, twin, None, x)
    assert measured <= budget, (measured, budget)
    assert all(p.grad is None for p in planned.parameters())  # the original is untouched


def test_unfreezing_after_auto_replans_for_the_new_gradients() -> None:
    # before the fix: 3,887,640 B under a 2,900,354 B budget once the first six blocks train
    def frozen() -> nn.Sequential:
        model = _mlp()
        for p in model[:6].parameters():
            p.requires_grad_(False)
        return model

    x = torch.randn(512, 128)
    _, budget = _binding(frozen, x)
    # once the six blocks train, their gradients must fit too: a budget below what the
    # unfrozen model needs is refused at the re-plan, naming that minimum (with the frozen
    # prefix counted exactly, Chain.frozen_prefix, the half-way budget fell 5,360 B short)
    budget = max(budget, _minimum(_mlp, x))
    model = frozen()
    planned, summary = _auto(model, x, budget=budget)
    assert _has_checkpoint(summary.plan)  # the budget binds the frozen model too
    assert _peak(planned, lambda m: m(x).sum(), x) <= budget
    for p in model.parameters():
        p.requires_grad_(True)
    measured = _peak(planned, lambda m: m(x).sum(), x)
    assert measured <= budget, (measured, budget)
    reference = _mlp()
    reference(x).sum().backward()
    planned(x).sum().backward()
    _assert_same_grads(planned, reference)
    # and freezing again after that: fewer gradients, still within, still eager's
    planned.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    for m in (model, reference):
        for p in m[:4].parameters():
            p.requires_grad_(False)
    assert _peak(planned, lambda m: m(x).sum(), x) <= budget
    reference(x).sum().backward()
    planned(x).sum().backward()
    _assert_same_grads(planned, reference)


# ---------------------------------------------------------------------- precision, outputs
def test_autocast_bfloat16_around_the_step() -> None:
    x = torch.randn(512, 128)

    def step(m: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float().pow(2).mean()

    _, budget = _binding(_mlp, x)
    model = _mlp()
    planned, summary = _auto(model, x, budget=budget)
    assert _has_checkpoint(summary.plan)
    reference = _mlp()
    step(reference).backward()
    step(planned).backward()
    _assert_same_grads(planned, reference)
    planned.zero_grad(set_to_none=True)
    assert _peak(planned, step, x) <= budget  # planned in float32, run in bfloat16


@pytest.mark.parametrize("path", ["chain", "graph"])
def test_autocast_turned_on_after_planning_is_planned_again_in_bfloat16(path: str) -> None:
    # planned in float32, trained under autocast: the step keeps a bfloat16 copy of each weight
    # it reads for the backward. Where the weights outweigh the activations (16 x 512, 8
    # blocks) the float32 plan ran 17,366,024 B under a 16,875,528 B budget. Autocast on or
    # off is now part of the step state: the call is planned again in bfloat16, or refused
    # naming the minimum, which a budget then meets
    x = torch.randn(16, 512)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return _mlp(width=512) if path == "chain" else Skip(width=512)

    def step(m: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float().pow(2).mean()

    planned, summary = _auto(build(), x, budget="100%")
    assert summary.budget_bytes == summary.unplanned_peak_bytes
    assert _peak(planned, lambda m: m(x).float().pow(2).mean(), x) <= summary.budget_bytes
    with pytest.raises(BudgetTooSmallError, match="under autocast .cpu bfloat16") as refused:
        step(planned).backward()
    least = refused.value.minimum_bytes
    assert least > summary.budget_bytes  # (the weight copies: no plan of float32's budget)
    model, reference = build(), build()
    planned, _ = _auto(model, x, budget=least)
    step(reference).backward()
    step(planned).backward()
    _assert_same_grads(planned, reference)
    planned.zero_grad(set_to_none=True)
    measured = _peak(planned, step, x)
    assert measured <= least, (measured, least)
    plans = len(planned._plans.cache)
    assert _peak(planned, lambda m: m(x).float().pow(2).mean(), x) <= least  # float32 again
    assert len(planned._plans.cache) == plans == 2  # (each state's plan kept)


def test_a_loss_fn_that_enters_autocast_is_planned_in_bfloat16() -> None:
    # before: the stages were measured outside the loss_fn's autocast, in float32 (GPT-2 tiny:
    # 920,576 saved bytes a block instead of 592,896), so budgets the step meets in bfloat16
    # were refused (its least was 3,272,252 B where the plan measures 2,779,736)
    x = torch.randn(512, 128)

    def plain(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).float().pow(2).mean()

    def in_bf16(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return plain(m, b)

    outer = _mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference_chain = remat.capture_chain(outer, x, loss_fn=plain)
    chain = remat.capture_chain(_mlp(), x, loss_fn=in_bf16)
    assert chain.saved_bytes == reference_chain.saved_bytes
    assert chain.saved_bytes != remat.capture_chain(_mlp(), x, loss_fn=plain).saved_bytes

    least = _minimum(_mlp, x, loss_fn=in_bf16)
    assert least < _minimum(_mlp, x, loss_fn=plain)
    model, reference = _mlp(), _mlp()
    planned, summary = _auto(model, x, loss_fn=in_bf16, budget=least)
    assert _has_checkpoint(summary.plan)
    in_bf16(reference, x).backward()
    in_bf16(planned, x).backward()
    _assert_same_grads(planned, reference)
    planned.zero_grad(set_to_none=True)
    measured = _peak(planned, lambda m: in_bf16(m, x), x)
    assert measured <= least, (measured, least)


class Structured(nn.Module):
    """Returns a dict or a tuple (logits and features)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(6))
        self.head = nn.Linear(128, 512)

    def forward(self, x: torch.Tensor) -> Any:
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return {"logits": logits, "features": x} if self.kind == "dict" else (logits, x)


@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_a_dict_or_tuple_output_within_the_budget_and_at_the_minimum(kind: str) -> None:
    def build() -> Structured:
        torch.manual_seed(0)
        return Structured(kind)

    def logits(out: Any) -> torch.Tensor:
        return out["logits"] if kind == "dict" else out[0]

    torch.manual_seed(1)
    x, y = torch.randn(512, 128), torch.randint(0, 512, (512,))

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(logits(m(b[0])), b[1])

    opt_of = lambda m: torch.optim.Adam(m.parameters())  # noqa: E731
    least = _minimum(build, (x, y), loss_fn=loss_fn, optimizer=opt_of(build()))
    for budget in (least, least + 500_000):
        model, reference = build(), build()
        opt = opt_of(model)
        planned, _ = _auto(model, (x, y), loss_fn=loss_fn, optimizer=opt, budget=budget)
        loss_fn(reference, (x, y)).backward()
        loss_fn(planned, (x, y)).backward()
        _assert_same_grads(planned, reference)
        planned.zero_grad(set_to_none=True)
        measured = _peak(planned, lambda m: loss_fn(m, (x, y)), x, opt)
        assert measured <= budget, (measured, budget)


def test_weights_tied_between_two_layers() -> None:
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(6)])
        model[5][0].weight = model[0][0].weight
        return model

    x = torch.randn(512, 128)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).pow(2).mean()

    opt_of = lambda m: torch.optim.Adam(m.parameters())  # noqa: E731
    least = _minimum(build, x, loss_fn=loss_fn, optimizer=opt_of(build()))
    for budget in (least, least + 1_000_000):
        model, reference = build(), build()
        opt = opt_of(model)
        planned, summary = _auto(model, x, loss_fn=loss_fn, optimizer=opt, budget=budget)
        assert model[5][0].weight is model[0][0].weight
        loss_fn(reference, x).backward()
        loss_fn(planned, x).backward()
        _assert_same_grads(planned, reference)
        planned.zero_grad(set_to_none=True)
        measured = _peak(planned, lambda m: loss_fn(m, x), x, opt)
        assert measured <= budget, (measured, budget, summary.plan.describe())


def test_a_squared_error_loop_without_loss_fn_at_the_minimum() -> None:
    # before the fix: the criterion remat did not see counted as one output-sized tensor all
    # step (a cross-entropy's log-softmax); out.pow(2).mean() holds four at its backward:
    # measured 3,573,496 B at the named minimum 3,314,420 B. Now counted at the loss as the
    # bound of remat.core.step.CRITERIA (five), and the output's gradient to the first backward
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(6)])

    x = torch.randn(512, 128)
    opt_of = lambda m: torch.optim.Adam(m.parameters())  # noqa: E731
    least = _minimum(build, x, optimizer=opt_of(build()))
    model = build()
    opt = opt_of(model)
    planned, _ = _auto(model, x, optimizer=opt, budget=least)
    measured = _peak(planned, lambda m: m(x).pow(2).mean(), x, opt)
    assert measured <= least, (measured, least)


# ---------------------------------------------------------------------- token ids
class Tokens(nn.Module):
    """Token ids with a padding mask: embedding, blocks masked, a masked mean, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 64, padding_idx=0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6))
        self.head = nn.Linear(64, 5)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        for block in self.blocks:
            h = block(h) * attention_mask.unsqueeze(-1)
        return self.head(h.sum(1) / attention_mask.sum(1, keepdim=True))


def _tokens() -> Tokens:
    torch.manual_seed(0)
    return Tokens()


def _token_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 1000, (32, 64), generator=g)
    mask = torch.ones(32, 64)
    for i in range(32):
        length = int(torch.randint(10, 64, (), generator=g))
        ids[i, length:] = 0
        mask[i, length:] = 0
    return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 5, (32,), generator=g)


def _token_trial(at_minimum: bool) -> tuple[int, int]:
    batch, labels = _token_batch()

    def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(**b), labels)

    opt_of = lambda m: torch.optim.Adam(m.parameters())  # noqa: E731
    least = _minimum(_tokens, batch, loss_fn=loss_fn, optimizer=opt_of(_tokens()))
    eager = _tokens()
    eager_peak = _peak(eager, lambda m: loss_fn(m, batch), batch, opt_of(eager))
    budget = least if at_minimum else (least + eager_peak) // 2
    model = _tokens()
    opt = opt_of(model)
    planned, summary = _auto(model, batch, loss_fn=loss_fn, optimizer=opt, budget=budget)
    assert "not a chain" in str(summary)
    reference = _tokens()
    loss_fn(reference, batch).backward()
    loss_fn(planned, batch).backward()
    _assert_same_grads(planned, reference)
    planned.zero_grad(set_to_none=True)
    return _peak(planned, lambda m: loss_fn(m, batch), batch, opt), budget


def test_token_ids_with_a_padding_mask_within_a_binding_budget() -> None:
    # was under-predicted in 1 of 3 runs (the MILP's pick depends on measured times): plan
    # segments (0, 1), (4, 5, 6), (10, 11) predicted 6,358,924 B, measured 6,863,224 B under a
    # 6,366,224 B budget (the previous ``h``, held by the loop's variable: see below)
    measured, budget = _token_trial(at_minimum=False)
    assert measured <= budget, (measured, budget)


def test_token_ids_with_a_padding_mask_at_the_named_minimum() -> None:
    # was 4,766,072 B measured at the named minimum 4,295,052 B: the plan checkpointed nodes
    # {10, 11} (the last masked block's mul and Linear), which freed nothing when measured,
    # because ``h`` holds node 10's output until the next ``* attention_mask`` returns, where
    # the forward peaks (Node.held_until, tests/test_graph_free_times.py); now the named
    # minimum is about 4.77-4.80 MB and the step measures within it
    measured, budget = _token_trial(at_minimum=True)
    assert measured <= budget, (measured, budget)


# ---------------------------------------------------------------------- after auto
def test_eval_and_no_grad_after_auto_run_plainly_on_any_batch() -> None:
    x = torch.randn(512, 128)
    _, budget = _binding(_mlp, x)
    model = _mlp()
    planned, summary = _auto(model, x, budget=budget)
    big = torch.randn(4096, 128)  # no plan fits this batch within the budget (training)
    planned.eval()
    with torch.no_grad():
        torch.testing.assert_close(planned(big), model(big), rtol=0, atol=0)
    planned.train()
    with torch.no_grad():
        torch.testing.assert_close(planned(big), model(big), rtol=0, atol=0)
    with torch.inference_mode():
        planned(big)
    assert planned.plan == summary.plan  # no re-plan happened
    assert _peak(planned, lambda m: m(x).sum(), x) <= budget


def test_state_dict_round_trip() -> None:
    """The planned model's state_dict is the model's, keys and all (NOTE [ The model's
    state_dict keys ] in remat.execute.chain): it loads into the plain model and back, and a
    state_dict saved with the wrapper's "model." prefix (before) still loads."""
    x = torch.randn(512, 128)
    _, budget = _binding(_mlp, x)
    planned, _ = _auto(_mlp(), x, budget=budget)
    with torch.no_grad():
        for p in planned.parameters():
            p.add_(0.01)
    saved = io.BytesIO()
    torch.save(planned.state_dict(), saved)
    saved.seek(0)
    state = torch.load(saved)
    assert list(state) == list(planned.model.state_dict())
    other, _ = _auto(_mlp(seed=5), x, budget=budget)
    other.load_state_dict(state)
    plain = _mlp(seed=5)
    plain.load_state_dict(state)
    prefixed, _ = _auto(_mlp(seed=6), x, budget=budget)
    prefixed.load_state_dict({f"model.{k}": v for k, v in state.items()})
    for m in (planned, other, plain, prefixed):
        m(x).sum().backward()
    _assert_same_grads(other, planned, rtol=0)
    _assert_same_grads(prefixed, planned, rtol=0)
    _assert_same_grads(plain, planned)
    other.zero_grad(set_to_none=True)
    assert _peak(other, lambda m: m(x).sum(), x) <= budget
    with pytest.raises(RuntimeError, match='Unexpected key.*"extra"'):
        other.load_state_dict({**state, "extra": torch.zeros(1)})


def test_state_dict_inside_a_parent_and_of_a_model_with_a_model_submodule() -> None:
    """A planned model held by another module saves and loads under the parent's name for it,
    as the plain model would; a model whose own submodule is called ``model`` (Llama's) keeps
    its keys, and its keys saved with the wrapper's prefix load too."""

    class Wrapper(nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.model = _mlp(seed=seed)
            self.head = nn.Linear(10, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.model(x))

    class Parent(nn.Module):
        def __init__(self, backbone: nn.Module) -> None:
            super().__init__()
            self.backbone = backbone
            self.norm = nn.LayerNorm(2)

    x = torch.randn(512, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned = remat.apply(Wrapper(0), remat.Plan.every_stage(), stages=["model", "head"])
    plain_state = Wrapper(0).state_dict()
    assert list(planned.state_dict()) == list(plain_state)  # model.0.weight, ..., head.bias
    source = Wrapper(3)
    planned.load_state_dict(source.state_dict())
    planned.load_state_dict({f"model.{k}": v for k, v in source.state_dict().items()})
    for a, b in zip(planned.model.state_dict().values(), source.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    parent = Parent(planned)
    assert list(parent.state_dict()) == list(Parent(Wrapper(0)).state_dict())
    twin = Parent(Wrapper(1))
    twin.load_state_dict(parent.state_dict())
    back = Parent(remat.apply(Wrapper(2), remat.Plan.every_stage(), stages=["model", "head"]))
    back.load_state_dict(twin.state_dict())
    for a, b in zip(back.state_dict().values(), parent.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(back.backbone(x), planned(x))


def test_pickling_the_planned_module() -> None:
    # before the fix: AttributeError, a local lambda (split_stages' split_again) and remat.auto's
    # re-plan closure. The loaded module runs its plan; a call that needs a re-plan says what
    # to do (the closure over the model, loss and optimizer is not saved)
    x = torch.randn(512, 128)
    _, budget = _binding(_mlp, x)
    planned, summary = _auto(_mlp(), x, budget=budget)
    assert _has_checkpoint(summary.plan)
    saved = io.BytesIO()
    torch.save(planned, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert loaded.plan == planned.plan
    reference = _mlp()
    loaded(x).sum().backward()
    reference(x).sum().backward()
    _assert_same_grads(loaded, reference)
    loaded.zero_grad(set_to_none=True)
    assert _peak(loaded, lambda m: m(x).sum(), x) <= budget
    with pytest.raises(SignatureMismatchError, match=r"unpickled.*remat\.auto\(loaded"):
        loaded(x[:100]).sum().backward()
    loaded.zero_grad(set_to_none=True)
    loaded(x).sum().backward()  # no zero_grad: gradients held, another state
    with pytest.raises(SignatureMismatchError, match="another training state"):
        loaded(x).sum().backward()
    planned(x[:100]).sum().backward()  # the original still re-plans


def test_auto_twice_on_one_model_and_on_a_planned_model() -> None:
    x = torch.randn(512, 128)
    _, budget = _binding(_mlp, x)
    model = _mlp()
    first, _ = _auto(model, x, budget=budget)
    second, _ = _auto(model, x, budget=budget)
    for planned in (first, second):
        assert _peak(planned, lambda m: m(x).sum(), x) <= budget
    first(x).sum().backward()
    want = _grads(first)
    model.zero_grad(set_to_none=True)
    second(x).sum().backward()
    got = _grads(second)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="already has a plan; apply it to planned.model"):
        auto(first, x, budget=budget)


def test_budget_strings_and_a_zero_budget() -> None:
    x = torch.randn(64, 128)
    _, summary = _auto(_mlp(), x, budget="1.5GiB")
    assert summary.budget_bytes == 1_610_612_736
    _, summary = _auto(_mlp(), x, budget="1.5 GB")
    assert summary.budget_bytes == 1_500_000_000
    for zero in (0, "0B"):
        with pytest.raises(BudgetTooSmallError) as info:
            _auto(_mlp(), x, budget=zero)
    least = info.value.minimum_bytes
    planned, summary = _auto(_mlp(), x, budget=least)
    assert summary.predicted_peak_bytes <= least
    assert _peak(planned, lambda m: m(x).sum(), x) <= least


def test_a_smaller_last_microbatch_keeps_the_accumulated_gradients_on_the_graph_path() -> None:
    # the bug: the re-plan's graph trace ran its backward into the caller's .grad (the
    # gradients of stem.bias off by 136, head.bias by 256)
    torch.manual_seed(1)
    x, y = torch.randn(228, 128), torch.randint(0, 10, (228,))
    planned, _ = _auto(_skip(), x[:128], budget=float("inf"))
    reference = _skip()
    for m in (planned, reference):
        F.cross_entropy(m(x[:128]), y[:128]).backward()
        F.cross_entropy(m(x[128:]), y[128:]).backward()  # 100 rows: a re-plan
    _assert_same_grads(planned, reference)


def test_autocast_weight_copies_of_checkpointed_stages_are_not_kept() -> None:
    # autocast caches each bf16 weight copy until its region ends (the whole forward): before,
    # the copies a checkpointed segment made stayed through the rest of the forward, over the
    # budget (measured 985,480 B at the least, 972,352 B); remat runs the planned forward with
    # the cache off, as its capture measures
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(6)])

    x = torch.randn(128, 128)

    def in_bf16(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the cache on, torch's default
            return m(b).float().pow(2).mean()

    least = _minimum(build, x, loss_fn=in_bf16)
    model, reference = build(), build()
    planned, summary = _auto(model, x, loss_fn=in_bf16, budget=least)
    assert _has_checkpoint(summary.plan)
    measured = _peak(planned, lambda m: in_bf16(m, x), x)
    assert measured <= least, (measured, least)
    in_bf16(reference, x).backward()
    in_bf16(planned, x).backward()
    _assert_same_grads(planned, reference)


@pytest.mark.parametrize("at_minimum", [False, True])
def test_mse_loss_on_the_graph_path(at_minimum: bool) -> None:
    # F.mse_loss on the CPU returns a 0-d view of its elementwise buffer: the capture (real
    # tensors) saw the loss node hold 20,480 B, the executor's fake trace 4 B, and apply_graph
    # refused the graph as not this model's ("the graph does not match ...")
    torch.manual_seed(1)
    x, y = torch.randn(512, 128), torch.randn(512, 10)

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.mse_loss(m(b[0]), b[1])

    def step(m: nn.Module) -> torch.Tensor:
        return loss_fn(m, (x, y))

    adam = torch.optim.Adam(_skip().parameters())  # the same state bytes as the model's own
    least, budget = _binding(_skip, (x, y), loss_fn=loss_fn, loop="loss-only", optimizer=adam)
    budget = least if at_minimum else budget
    model = _skip()
    opt = torch.optim.Adam(model.parameters())
    planned, summary = _auto(
        model, (x, y), loss_fn=loss_fn, loop="loss-only", optimizer=opt, budget=budget
    )
    assert summary.predicted_peak_bytes <= budget
    measured = _peak(planned, step, (x, y), opt)
    assert measured <= summary.predicted_peak_bytes, (measured, summary.predicted_peak_bytes)
    reference, planned = _skip(), _skip()
    planned_model, _ = _auto(planned, (x, y), loss_fn=loss_fn, loop="loss-only", budget=budget)
    step(reference).backward()
    step(planned_model).backward()
    _assert_same_grads(planned_model, reference)


class _InferenceBuffer(nn.Module):
    """A block with a buffer made under ``torch.inference_mode`` (read, never written)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        with torch.inference_mode():
            self.register_buffer("shift", torch.full((width,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x) + self.shift)


def test_a_buffer_made_in_inference_mode() -> None:
    # inference tensors have no version counter: the capture's buffer snapshot read it and
    # raised "Inference tensors do not track version counter" (before that, its restore wrote
    # into the buffer: "Inplace update to inference tensor outside InferenceMode")
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[_InferenceBuffer(128) for _ in range(6)])

    x = torch.randn(512, 128)
    _, budget = _binding(build, x)
    model, reference = build(), build()
    planned, summary = _auto(model, x, budget=budget)
    assert _has_checkpoint(summary.plan)
    assert _peak(planned, lambda m: m(x).sum(), x) <= budget
    planned.zero_grad(set_to_none=True)
    planned(x).sum().backward()
    reference(x).sum().backward()
    _assert_same_grads(planned, reference)


def _timm_model(name: str) -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    if name == "mixer":
        return timm.models.mlp_mixer.MlpMixer(
            num_classes=5,
            img_size=32,
            patch_size=8,
            num_blocks=4,
            embed_dim=64,
            drop_path_rate=0.1,
        ).train()
    options = {
        "convnext_atto": {"drop_path_rate": 0.2},
        "resnet18d": {"drop_path_rate": 0.1},
    }[name]
    return timm.create_model(name, pretrained=False, num_classes=5, **options).train()


@pytest.mark.parametrize("name", ["convnext_atto", "resnet18d", "mixer"])
def test_timm_models_train_as_eager_within_the_budget(name: str) -> None:
    """timm's models as a user builds them (stochastic depth, dropout, batch norm, squeeze-
    excitation, layer scale): planned at a budget half-way between the named minimum and the
    unplanned step, and at that minimum, they train with eager's gradients and buffers (the
    same random masks) and their measured step stays within the budget. (EfficientNet-B0
    passed the same checks by hand, in 5 minutes: too long for the suite.)"""
    x = torch.randn(4, 3, 32, 32)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).square().mean()

    least, budget = _binding(lambda: _timm_model(name), x, loss_fn=loss_fn)
    for at in (budget, least):
        model = _timm_model(name)
        planned, summary = _auto(model, x, budget=at, loss_fn=loss_fn)
        assert _has_checkpoint(summary.plan), summary
        reference = _timm_model(name)
        torch.manual_seed(7)
        loss_fn(reference, x).backward()
        torch.manual_seed(7)
        loss_fn(planned, x).backward()
        _assert_same_grads(planned, reference, rtol=1e-4)
        for (key, got), want in zip(
            model.state_dict().items(), reference.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=key)
        planned.zero_grad(set_to_none=True)
        measured = _peak(planned, lambda m: loss_fn(m, x), x)
        assert measured <= at, (name, at, measured)


class _SparseBag(nn.Module):
    """A recommender's shape: a bag of sparse embeddings under an MLP (not a chain)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(500, 16, sparse=True)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.b(torch.relu(self.a(h))) + h


@pytest.mark.parametrize("entry", ["profile", "auto-chain", "auto-graph", "auto-fake"])
def test_a_sparse_gradient_is_refused_saying_which_module_and_what_to_do(entry: str) -> None:
    # nn.Embedding(sparse=True) makes a sparse gradient, which torch's MemTracker (counting
    # storages) cannot measure: every entry point raised NotImplementedError("Cannot access
    # storage of SparseTensorImpl") from inside the backward (the fake capture from remat's
    # scratch probe)
    ids = torch.randint(0, 500, (8, 4))
    if entry == "auto-chain":
        model: nn.Module = nn.Sequential(
            nn.Embedding(500, 16, sparse=True), nn.Flatten(), nn.Linear(64, 16), nn.ReLU()
        )
        name = "0"
    else:
        model, name = _SparseBag(), "emb"
    call = {
        "profile": lambda: remat.profile(model, ids),
        "auto-chain": lambda: remat.auto(model, ids, budget="80%"),
        "auto-graph": lambda: remat.auto(model, ids, budget="80%"),
        "auto-fake": lambda: remat.auto(model, ids, budget="80%", fake=True),
    }[entry]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the graph path says it plans the module graph)
        with pytest.raises(remat.UnsupportedModelError) as info:
            call()
    message = str(info.value)
    assert "torch.sparse_coo" in message and "use sparse=False" in message, message
    assert f".{name})" in message, message


class _LossInForward(nn.Module):
    """Hugging Face's way (ALBERT, BERT): the forward makes its ``CrossEntropyLoss()`` anew."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 5))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.CrossEntropyLoss()(self.body(x), labels)


def test_a_module_made_in_the_forward_leaves_no_tracker_warning() -> None:
    # the loss module is gone by the backward; torch's MemTracker warned "Module is None.
    # Skipping PRE_BW hook." to the user of remat.auto and remat.profile
    batch = {"x": torch.randn(256, 16), "labels": torch.randint(0, 5, (256,))}
    model = _LossInForward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remat.profile(model, batch, loss_fn=lambda m, b: m(**b))
        remat.auto(model, batch, budget=None, loss_fn=lambda m, b: m(**b))
    shown = [str(w.message) for w in caught]
    assert not [m for m in shown if "Module is None" in m], shown
