"""New input shapes, budget arguments and plan files: never silently wrong, never a crash.

A training call with other shapes than the plan was made for (a last partial batch, another
sequence length, an added ``attention_mask``) re-plans under the same budget, on the chain and
the graph path, or says clearly that the budget is too small for that shape; the plan is
recorded for the planning batch's model arguments, so a first call that is larger re-plans
too. Budgets are bytes, ``"4GiB"``, ``"50%"`` of the unplanned step or ``inf``; anything else
is a clear error. A plan file of another schema version is a clear error.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.auto import AutoSummary, auto
from remat.execute.chain import SignatureMismatchError, input_signature
from remat.measure.events import step_peak_bytes
from remat.planners import BudgetTooSmallError


def _mlp(width: int = 128, layers: int = 8, classes: int = 10) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


def _grads(module: nn.Module, step: Callable[[nn.Module], torch.Tensor]) -> dict[str, Any]:
    module.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    step(module).backward()
    grads = {n.removeprefix("model."): p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return grads


def _assert_same_grads(planned: nn.Module, model: nn.Module, step: Callable) -> None:
    """Gradients of the planned model (after a re-plan, on its cached plan) equal eager's."""
    got = _grads(planned, step)
    want = _grads(model, step)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def _measured_peak(planned: nn.Module, step: Callable[[nn.Module], torch.Tensor], inputs) -> int:
    """The whole step's peak from the allocator's events (as tests/test_auto.py measures),
    after a warm-up step (the warm-up makes the re-plan, which is then cached)."""

    def run() -> None:
        torch.manual_seed(7)
        step(planned).backward()
        planned.zero_grad(set_to_none=True)

    return step_peak_bytes(run, planned, None, inputs)


def _check_new_shape(
    planned: nn.Module,
    model: nn.Module,
    budget: int,
    step: Callable[[nn.Module], torch.Tensor],
    inputs: Any,
) -> str:
    """Run a training step at a new shape: either it fits the budget (measured) with eager's
    gradients, or it raises BudgetTooSmallError naming a larger minimum and the shape."""
    before = planned.plan
    try:
        measured = _measured_peak(planned, step, inputs)
    except BudgetTooSmallError as err:
        assert err.budget_bytes == budget
        assert err.minimum_bytes > budget
        assert "new inputs" in str(err)
        return "refused"
    assert planned.signature == _signature_of(inputs)
    assert measured <= budget, (measured, budget, planned.plan.describe(), before.describe())
    _assert_same_grads(planned, model, step)
    return "fits"


def _signature_of(inputs: Any) -> tuple:
    if isinstance(inputs, dict):
        return input_signature(**inputs)
    return input_signature(inputs)


def _half_way(summary: AutoSummary) -> int:
    return (summary.fixed_bytes + summary.unplanned_peak_bytes) // 2


# ---------------------------------------------------------------------- item 1: new shapes


def test_chain_replans_a_partial_and_a_bigger_batch_within_the_budget() -> None:
    model = _mlp()
    x = torch.randn(256, 128)
    _, unlimited = auto(model, x)
    budget = _half_way(unlimited)
    planned, summary = auto(model, x, budget=budget)
    assert summary.predicted_peak_bytes <= budget
    results = []
    for n in (160, 384):  # a last partial batch, a bigger one
        xx = torch.randn(n, 128)
        results.append(_check_new_shape(planned, model, budget, lambda m, xx=xx: m(xx).sum(), xx))
    assert results == ["fits", "fits"]
    # a batch no plan fits: a clear error naming the minimum for that shape, which fits
    huge = torch.randn(4096, 128)
    with pytest.raises(BudgetTooSmallError, match=r"new inputs \(\[4096, 128\] float32\)") as info:
        planned(huge).sum().backward()
    _, at_minimum = auto(model, huge, budget=info.value.minimum_bytes)
    assert at_minimum.predicted_peak_bytes <= info.value.minimum_bytes
    # back to the first shape: its plan again, no re-plan
    planned(x).sum().backward()
    assert planned.plan == summary.plan


def _tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
    return transformers.GPT2LMHeadModel(config).train()


def test_gpt2_called_with_keyword_arguments_replans_other_lengths_and_a_mask() -> None:
    # the bug: replan(new_batch) got input_ids=..., labels=... (TypeError)
    model = _tiny_gpt2()
    ids = torch.randint(0, 128, (4, 48))
    batch = {"input_ids": ids, "labels": ids}
    _, unlimited = auto(model, batch)
    budget = _half_way(unlimited)
    planned, _ = auto(model, batch, budget=budget)
    shorter = torch.randint(0, 128, (4, 32))
    calls = [
        {"input_ids": shorter, "labels": shorter},
        {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)},
    ]
    results = []
    for kwargs in calls:

        def step(m: nn.Module, kwargs: dict = kwargs) -> torch.Tensor:
            return m(**kwargs).loss

        results.append(_check_new_shape(planned, model, budget, step, kwargs))
    assert results == ["fits", "fits"]


def test_slow_replans_warn_at_the_third_input_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    # with compile=True a new shape compiles the stages and the one-graph trials again (46-203 s
    # for a tiny GPT-2 under inductor on the CPU): where the re-plans took
    # SLOW_REPLANNING_SECONDS, the third shape warns (two are common: an epoch's last batch);
    # here that threshold is 0 s, and an eager re-plan stands in for a slow compiled one
    from remat.execute import chain

    monkeypatch.setattr(chain, "SLOW_REPLANNING_SECONDS", 0.0)
    model = _tiny_gpt2()
    ids = torch.randint(0, 128, (2, 48))
    planned, _ = auto(model, {"input_ids": ids, "labels": ids}, budget="60%")
    warned = []
    for length in [48, 40, 48, 40, 33, 21]:
        batch = {"input_ids": ids[:, :length], "labels": ids[:, :length]}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            planned(**batch).loss.backward()
        planned.zero_grad(set_to_none=True)
        warned += [
            (length, str(w.message)) for w in caught if "pad them to a few" in str(w.message)
        ]
    assert [length for length, _ in warned] == [33], warned
    assert "for 3 input shapes" in warned[0][1] and "compile again" in warned[0][1]


def test_batches_padded_to_their_longest_sequence_warn_once_to_pad_to_fixed_lengths() -> None:
    # a user's loop with transformers' default collator: every batch another length, so every
    # step re-plans (with compile=True, a minute or more of compiling each); the user is
    # told once, with what to do, and training stays right
    from remat.execute.chain import MANY_SIGNATURES

    model = _tiny_gpt2()
    ids = torch.randint(0, 128, (2, 48))
    planned, _ = auto(model, {"input_ids": ids, "labels": ids}, budget="60%")
    lengths = [48, 40, 33, 47, 12, 40, 25, 48, 30, 21, 9, 33, 17]
    seen: list[int] = []
    for length in lengths:
        batch = {"input_ids": ids[:, :length], "labels": ids[:, :length]}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            planned(**batch).loss.backward()
        planned.zero_grad(set_to_none=True)
        new = length not in seen
        seen += [length] if new else []
        padding = [w for w in caught if "pad them to a few fixed lengths" in str(w.message)]
        if new and len(seen) == MANY_SIGNATURES:
            assert len(padding) == 1, [str(w.message) for w in caught]
            assert f"for {MANY_SIGNATURES} input shapes" in str(padding[0].message)
            assert "pad_to_multiple_of" in str(padding[0].message)
        else:
            assert padding == [], (length, len(seen))
    assert len(seen) > MANY_SIGNATURES  # (shapes past the warning: no second one)

    def step(m: nn.Module) -> torch.Tensor:
        return m(input_ids=ids[:, :17], labels=ids[:, :17]).loss

    _assert_same_grads(planned, model, step)


def test_an_x_y_batch_with_a_loss_fn_replans_on_the_models_arguments() -> None:
    # the bug: the re-plan called loss_fn(model, x) on the model's input alone
    model = _mlp()
    x, y = torch.randn(256, 128), torch.randint(0, 10, (256,))

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    _, unlimited = auto(model, (x, y), loss_fn=loss_fn)
    budget = _half_way(unlimited)
    planned, summary = auto(model, (x, y), loss_fn=loss_fn, budget=budget)
    assert planned.signature == input_signature(x)  # the model's arguments, not (x, y)
    last = (x[:100], y[:100])  # a last partial batch
    result = _check_new_shape(planned, model, budget, lambda m: loss_fn(m, last), last[0])
    assert result == "fits"
    assert planned.plan != summary.plan or planned.signature != input_signature(x)


@pytest.mark.parametrize("graph", [False, True])
def test_a_loss_fn_that_keeps_more_than_a_sum_is_held_back_on_a_replan(graph: bool) -> None:
    # A cross-entropy over 1024 classes keeps its log-softmax and the logits' gradient; a
    # re-plan sees only the model's arguments and measures a sum instead. Measured before
    # the margin: a last partial batch of 200 ran at 5.29 MB under a 5.14 MB budget.
    torch.manual_seed(0)
    model = _mlp(classes=1024) if not graph else SkipHead(classes=1024)
    x, y = torch.randn(256, 128), torch.randint(0, 1024, (256,))

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph path says it is not a chain
        _, unlimited = auto(model, (x, y), loss_fn=loss_fn)
        with pytest.raises(BudgetTooSmallError) as refused:
            auto(model, (x, y), loss_fn=loss_fn, budget=1)
        least = refused.value.minimum_bytes
        budget = int(least + 0.5 * (unlimited.unplanned_peak_bytes - least))
        planned, _ = auto(model, (x, y), loss_fn=loss_fn, budget=budget)
    results = []
    for n in (200, 320):
        g = torch.Generator().manual_seed(n)
        batch = (torch.randn(n, 128, generator=g), torch.randint(0, 1024, (n,), generator=g))
        step = lambda m, batch=batch: loss_fn(m, batch)  # noqa: E731
        results.append(_check_new_shape(planned, model, budget, step, batch[0]))
    assert results[0] == "fits"


class Skip(nn.Module):
    """Not a chain: a skip connection around two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(32, 128), nn.Tanh())
        self.a = nn.Sequential(nn.Linear(128, 128), nn.GELU())
        self.b = nn.Sequential(nn.Linear(128, 128), nn.Tanh())
        self.head = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(self.b(self.a(h)) + h)


class SkipHead(nn.Module):
    """Not a chain: a wide MLP with a skip over its middle blocks and a classifier head."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(128, 128), nn.GELU())
        self.body = nn.Sequential(
            *[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(4)]
        )
        self.head = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(self.body(h) + h)


def test_graph_path_replans_a_new_batch_size_within_the_budget() -> None:
    # the graph path said "call apply_graph again"; now it re-traces and re-plans
    torch.manual_seed(0)
    model = Skip()
    x = torch.randn(1024, 32)
    with pytest.warns(UserWarning, match="not a chain"):
        _, unlimited = auto(model, x)
    # 80% of the way from the fixed bytes to the unplanned peak (feasible: {0-2} is kept)
    fixed = unlimited.fixed_bytes
    budget = int(fixed + 0.8 * (unlimited.unplanned_peak_bytes - fixed))
    with pytest.warns(UserWarning, match="not a chain"):
        planned, summary = auto(model, x, budget=budget)
    assert summary.method == "checkmate-milp"
    assert planned.signature == input_signature(x)
    xx = torch.randn(640, 32)
    step = lambda m: m(xx).square().mean()  # noqa: E731
    assert _check_new_shape(planned, model, budget, step, xx) == "fits"
    assert planned.graph is not summary.chain  # traced again for the new shape
    with pytest.raises(BudgetTooSmallError, match="new inputs"):
        planned(torch.randn(16384, 32)).sum().backward()


def test_apply_graph_without_replan_still_refuses_clearly() -> None:
    from remat.capture.graph import trace_graph
    from remat.execute.graph import apply_graph
    from remat.graphs import Plan

    model = Skip()
    x = torch.randn(8, 32)
    graph = trace_graph(model, x, level="module", fake=True).graph
    planned = apply_graph(model, Plan.none(), graph, x)
    assert planned.signature == input_signature(x)  # recorded from the batch
    with pytest.raises(SignatureMismatchError, match=r"\[8, 32\].*\[4, 32\].*replan="):
        planned(torch.randn(4, 32))


# ---------------------------------------------------------------------- item 2: first call


def test_a_first_call_larger_than_the_planning_batch_replans() -> None:
    # the bug: no example= was passed to apply, so the first call's (larger) signature was
    # adopted for the small batch's plan, which then ran over the budget silently
    model = _mlp(width=64)  # on sequences: activations outweigh the parameters
    small = torch.randn(8, 256, 64)
    big = torch.randn(64, 256, 64)
    _, at_small = auto(model, small)
    _, at_big = auto(model, big)
    # feasible at batch 64 (above its least-memory plan), and above batch 8's unplanned peak:
    # the small batch's plan stores everything, which at batch 64 would exceed the budget
    budget = (at_big.predicted_peak_bytes + at_big.unplanned_peak_bytes) // 2
    assert at_small.unplanned_peak_bytes < budget < at_big.unplanned_peak_bytes
    planned, summary = auto(model, small, budget=budget)
    assert planned.signature == input_signature(small)
    result = _check_new_shape(planned, model, budget, lambda m: m(big).sum(), big)
    assert result == "fits"


def test_a_first_call_larger_than_the_planning_batch_replans_on_the_graph_path() -> None:
    torch.manual_seed(0)
    model = Skip()
    small, big = torch.randn(64, 32), torch.randn(512, 32)
    with pytest.warns(UserWarning, match="not a chain"):
        planned, _ = auto(model, small, budget=None)
    assert planned.signature == input_signature(small)
    planned(big).sum().backward()
    assert planned.signature == input_signature(big)
    assert planned.graph.input_bytes > 0 and planned.trace.graph is not None


def _auto_distributed_records_the_planning_batch(rank: int) -> None:
    import remat.distributed

    model = _mlp(width=32, layers=2)
    small = torch.randn(8, 32)
    planned, _ = remat.distributed.auto_distributed(model, small)
    assert planned.signature == input_signature(small)
    with pytest.raises(SignatureMismatchError):  # not a collective: refused, never adopted
        planned(torch.randn(64, 32))


@pytest.mark.fresh_process  # forks ranks: see tests/test_distributed.py's pytestmark
def test_auto_distributed_records_the_planning_batch() -> None:
    from test_distributed import run_ranks

    run_ranks(_auto_distributed_records_the_planning_batch)


# ---------------------------------------------------------------------- item 3: budgets


def test_budget_percent_inf_and_fraction() -> None:
    model = _mlp()
    x = torch.randn(256, 128)
    planned, half = auto(model, x, budget="60%")
    assert half.budget_bytes == int(0.6 * half.unplanned_peak_bytes)
    assert half.predicted_peak_bytes <= half.budget_bytes
    _, unlimited = auto(model, x, budget=float("inf"))
    assert unlimited.predicted_time == pytest.approx(unlimited.unplanned_time)
    assert unlimited.predicted_peak_bytes <= unlimited.unplanned_peak_bytes
    with pytest.raises(ValueError, match=r"fractions are not bytes; pass '50%'.*'4GiB'"):
        auto(model, x, budget=0.5)


@pytest.mark.parametrize(
    ("budget", "error", "message"),
    [
        (-1, ValueError, ">= 0"),
        ("-2GiB", ValueError, ">= 0"),
        (float("nan"), ValueError, "non-negative number"),
        (float("-inf"), ValueError, "non-negative number"),
        (True, TypeError, "bool"),
        ("lots", ValueError, r"cannot read 'lots'.*'50%'"),
        ("12 parsecs", ValueError, "cannot read"),
        ("-5%", ValueError, "percentage"),
        ("0%", ValueError, "> 0%"),
        ("0.5", ValueError, "fractions are not bytes"),
        ([1], TypeError, "list"),
    ],
)
def test_bad_budgets_are_clear_errors(budget: Any, error: type, message: str) -> None:
    from remat.core.units import resolve_budget

    with pytest.raises(error, match=message):
        resolve_budget(budget, 1000)
    with pytest.raises(error, match=message):
        remat.plan(remat.Chain.homogeneous(8), "optimal-time", budget)
    with pytest.raises(error, match=message):
        auto(_mlp(layers=2), torch.randn(4, 128), budget=budget)


def test_percent_budgets_in_plan_fit_and_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main

    chain = remat.Chain.homogeneous(8)
    unplanned = remat.simulate(chain, remat.Plan.none(chain)).peak_bytes
    p = remat.plan(chain, "optimal-time", "50%")
    assert p.params["budget_bytes"] == unplanned // 2
    assert p.predicted_peak_bytes <= unplanned // 2
    assert (
        main(["plan", "homogeneous:8", "--method", "optimal-time", "--activation-budget", "50%"])
        == 0
    )
    assert "optimal-time" in capsys.readouterr().out
    assert main(["plan", "homogeneous:8", "--activation-budget", "0.5"]) != 0
    assert "fractions are not bytes" in capsys.readouterr().err
    model, x = _mlp(layers=4), torch.randn(64, 128)
    with pytest.raises(ValueError, match="fractions are not bytes"):
        remat.fit(model, x, budget=0.5, progress=False)
    setup = remat.fit(
        model,
        x,
        budget="90%",
        precisions=("fp32",),
        microbatches=[1],
        measure=False,
        progress=False,
    )
    (unplanned_step,) = [c for c in setup.candidates if c.microbatches == 1]
    assert setup.budget_bytes == int(0.9 * unplanned_step.unplanned_peak_bytes)
    assert setup.predicted_peak_bytes <= setup.budget_bytes


# ---------------------------------------------------------------------- item 4: plan files


@pytest.mark.parametrize("version", ["2", 3, None, 2.0, "1", 1.0])
def test_plan_files_of_another_version_are_clear_errors(version: Any) -> None:
    from remat.core.plan import PlanError
    from remat.graphs import Plan

    plan = remat.Plan.from_checkpoints(8, [3, 6])
    data = json.loads(plan.to_json()) | {"version": version}
    with pytest.raises(PlanError, match=rf"version {version!r}.*not supported.*version 2"):
        remat.Plan.from_json(json.dumps(data))
    # the old graph plan files (schema remat.graph_plan) were only ever version 1
    graph_plan = Plan.from_segments([[0, 1]])
    data = json.loads(graph_plan.to_json()) | {"schema": "remat.graph_plan", "version": version}
    with pytest.raises(PlanError, match=rf"version {version!r}.*not supported.*version 1"):
        Plan.from_json(json.dumps(data))
    if isinstance(version, str | float):
        with pytest.raises(PlanError, match="not an integer"):
            remat.Plan.from_json(json.dumps(json.loads(plan.to_json()) | {"version": version}))
    with pytest.raises(PlanError, match="not valid JSON"):
        remat.Plan.from_json("{not json")
    assert remat.Plan.from_json(plan.to_json()) == plan
