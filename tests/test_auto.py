"""remat.auto and planned models measured: memory follows the simulation, budgets are honoured.

Issue 4: "the measured activation peak of a planned step is within 10% of simulate's
prediction, for every planner" (measured from the allocator's events, which also see the
scratch memory of oneDNN kernels that MemTracker misses); "the measured peak never rises when the budget
falls"; auto with a budget, without one, on a new batch shape, on a model it cannot split.
"""

from __future__ import annotations

import pytest
import torch
from models import Branchy
from torch import nn

import remat
from remat import zoo
from remat.auto import auto, fixed_bytes, predicted_step_peak_bytes
from remat.capture.chain import capture
from remat.capture.stages import UnsupportedModelError
from remat.execute.chain import apply
from remat.measure.events import step_peak_bytes
from remat.measure.profile import profile
from remat.planners import BudgetTooSmallError

SMALL = {
    "mlp-chain": {"batch_size": 64, "layers": 8, "width": 128},
    "resnet18": {"batch_size": 4, "image_size": 32},
    "vgg11": {"batch_size": 2, "image_size": 32},
    "mobilenet_v2": {"batch_size": 2, "image_size": 32},
    "gpt2": {"batch_size": 2, "seq_len": 64, "n_layer": 3, "n_embd": 64, "vocab_size": 256},
    "lstm-seq": {"batch_size": 4, "seq_len": 64, "hidden": 32, "layers": 3},
}


def _grads(model: nn.Module, entry: zoo.ZooModel) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = entry.loss_fn(model, entry.batch)
    loss.backward()
    loss = loss.detach()
    grads = {
        n.removeprefix("model."): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return float(loss), grads


def _measured_step_peak(model: nn.Module, entry: zoo.ZooModel) -> int:
    """Exact whole-step peak from the allocator's events (sees kernels' scratch memory too)."""

    def step() -> None:
        entry.loss_fn(model, entry.batch).backward()
        model.zero_grad(set_to_none=True)

    return step_peak_bytes(step, model, None, entry.batch)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_measured_peak_follows_simulation_for_every_planner(name: str) -> None:
    # The whole step's peak (parameters, gradients, activations, and the scratch memory oneDNN
    # kernels allocate, which MemTracker cannot see: an LSTM's workspace is 10% of its step)
    # against its prediction from the captured chain, for every planner.
    entry = zoo.get(name, **SMALL[name])
    captured = capture(entry.model, entry.batch, loss_fn=entry.loss_fn)
    chain = captured.chain
    unplanned = _measured_step_peak(entry.model, entry)
    none_pred = predicted_step_peak_bytes(entry.model, captured, remat.Plan.none(chain))
    assert abs(unplanned - none_pred) <= 0.02 * unplanned, (unplanned, none_pred)
    failures = []
    for method in remat.available():
        p = remat.plan(chain, method)
        planned = apply(entry.model, p, stages=captured.stages)
        measured = _measured_step_peak(planned, entry)
        predicted = predicted_step_peak_bytes(entry.model, captured, p)
        if abs(measured - predicted) > 0.10 * predicted:
            failures.append(f"{method}: measured {measured} predicted {predicted} ({p.describe()})")
    assert not failures, "\n".join(failures)


def test_auto_budget_is_met_and_gradients_are_equal() -> None:
    entry = zoo.get("mlp-chain", **(SMALL["mlp-chain"] | {"batch_size": 1024}))
    reference = profile(entry.model, entry.batch, loss_fn=entry.loss_fn)
    fixed = fixed_bytes(entry.model)  # parameters + their gradients
    # between "parameters + all gradients" (the end of the backward) and the unplanned peak
    budget = (fixed + reference.peak_bytes) // 2
    assert budget < reference.peak_bytes
    planned, summary = auto(entry.model, entry.batch, loss_fn=entry.loss_fn, budget=budget)
    assert summary.predicted_peak_bytes <= budget
    assert "predicted peak" in str(summary) and summary.plan.describe()[:40] in str(summary)
    measured = profile(planned, entry.batch, loss_fn=entry.loss_fn)
    assert measured.peak_bytes <= budget
    assert measured.peak_bytes <= 1.10 * summary.predicted_peak_bytes
    assert measured.activation_peak_bytes < reference.activation_peak_bytes
    loss_ref, grads_ref = _grads(entry.model, entry)
    loss_new, grads_new = _grads(planned, entry)
    assert loss_new == pytest.approx(loss_ref, rel=1e-6)
    assert grads_ref.keys() == grads_new.keys()
    for key in grads_ref:
        torch.testing.assert_close(grads_new[key], grads_ref[key], rtol=1e-5, atol=1e-7)


def test_auto_budget_below_minimum_names_it() -> None:
    entry = zoo.get("mlp-chain", **SMALL["mlp-chain"])
    fixed = fixed_bytes(entry.model)
    with pytest.raises(BudgetTooSmallError) as info:
        auto(entry.model, entry.batch, loss_fn=entry.loss_fn, budget=fixed + 1000)
    assert info.value.minimum_bytes > fixed + 1000
    # the minimum it names is feasible
    planned, summary = auto(
        entry.model, entry.batch, loss_fn=entry.loss_fn, budget=info.value.minimum_bytes
    )
    assert summary.predicted_peak_bytes <= info.value.minimum_bytes


def test_auto_without_budget_costs_at_most_one_forward() -> None:
    entry = zoo.get("mlp-chain", **SMALL["mlp-chain"])
    planned, summary = auto(entry.model, entry.batch, loss_fn=entry.loss_fn)
    chain = summary.chain
    assert summary.predicted_time <= summary.unplanned_time + chain.total_fwd_time() + 1e-12
    assert summary.predicted_activation_peak_bytes < summary.unplanned_activation_peak_bytes
    # least memory: a smaller budget would need more time than one extra forward
    sqrt_plan = remat.plan(chain, "chen-sqrt")
    if (sqrt_plan.predicted_time or 0) <= summary.unplanned_time + chain.total_fwd_time():
        assert summary.predicted_activation_peak_bytes <= (sqrt_plan.predicted_peak_bytes or 0)


def test_measured_peak_never_rises_when_budget_falls() -> None:
    # Whole-step budgets, as remat.auto takes them, from the unplanned step's predicted peak
    # down to the peak of the least-memory plan: the measured step peak stays within each
    # budget and never rises as the budget falls.
    entry = zoo.get("resnet18", batch_size=16, image_size=64)
    model = entry.model
    captured = capture(model, entry.batch, loss_fn=entry.loss_fn)
    chain = captured.chain
    from remat.auto import plan_for_total_budget, stage_grad_bytes
    from remat.planners.optimal_time import min_feasible_peak

    top = predicted_step_peak_bytes(model, captured, remat.Plan.none(chain))
    low_plan = remat.plan(chain, "optimal-time", min_feasible_peak(chain))
    low = predicted_step_peak_bytes(model, captured, low_plan)
    assert low < top
    grads, fixed = stage_grad_bytes(captured.stages), fixed_bytes(model)
    budgets = [int(low + (top - low) * k / 5) for k in range(5, -1, -1)]
    measured = []
    for budget in budgets:
        p = plan_for_total_budget(
            chain, fixed, budget, "optimal-time", grads, captured.grad_rise_bytes
        )
        measured.append(_measured_step_peak(apply(model, p, stages=captured.stages), entry))
    assert all(b <= a for a, b in zip(measured, measured[1:], strict=False)), measured
    assert measured[-1] < measured[0]
    # within each budget (exact bytes; 0.1% for the checkpoint machinery's own few KiB)
    assert all(m <= 1.001 * b for m, b in zip(measured, budgets, strict=True)), (
        measured,
        budgets,
    )


def test_auto_replans_on_a_new_batch_shape() -> None:
    entry = zoo.get("mlp-chain", **SMALL["mlp-chain"])
    planned, _ = auto(entry.model, entry.batch, loss_fn=entry.loss_fn, budget=None)
    bigger = torch.randn(2 * entry.batch.shape[0], entry.batch.shape[1])
    out = planned(bigger)
    torch.testing.assert_close(out, entry.model(bigger))


@pytest.mark.parametrize("budget_fraction", [None, 0.8])
def test_auto_plans_a_model_that_is_not_a_chain_as_a_graph(budget_fraction) -> None:
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(4096, 32)
    reference = _branchy_grads(model, x)
    budget = None
    if budget_fraction is not None:
        unplanned = profile(model, x).peak_bytes
        budget = int(budget_fraction * unplanned)
    with pytest.warns(UserWarning, match="not a chain"):
        planned, summary = auto(model, x, budget=budget)
    assert "graph" in str(summary)
    assert summary.method == ("reforward" if budget is None else "checkmate-milp")
    if budget is not None:
        assert summary.predicted_peak_bytes <= budget
        assert summary.predicted_activation_peak_bytes < summary.unplanned_activation_peak_bytes
        assert profile(planned, x).peak_bytes <= budget  # measured, the whole step

        def step() -> None:
            planned(x).square().mean().backward()
            planned.zero_grad(set_to_none=True)

        measured = step_peak_bytes(step, planned, None, x)  # the allocator's count
        assert measured <= budget
        assert abs(measured - summary.predicted_peak_bytes) <= 0.02 * measured
    for name, grad in _branchy_grads(planned, x).items():
        torch.testing.assert_close(grad, reference[name.removeprefix("model.")])


def test_auto_graph_counts_the_optimizer_step() -> None:
    # the graph path (a model that is not a chain) with foreach Adam, a tiny batch: the step's
    # peak is the optimizer's, which no plan changes; below it auto says so, at it the
    # predicted whole step is what the allocator measures
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(2, 32)
    opt = torch.optim.Adam(model.parameters(), foreach=True)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    fixed = fixed_bytes(model, opt)
    with pytest.warns(UserWarning, match="not a chain"):
        with pytest.raises(BudgetTooSmallError, match="optimizer step alone") as info:
            auto(model, x, budget=fixed + 1024, optimizer=opt)
    assert info.value.minimum_bytes >= fixed + params
    with pytest.warns(UserWarning, match="not a chain"):
        planned, summary = auto(model, x, budget=info.value.minimum_bytes, optimizer=opt)

    def step() -> None:
        planned(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured = step_peak_bytes(step, planned, opt, x)
    assert summary.predicted_peak_bytes <= info.value.minimum_bytes
    assert abs(measured - summary.predicted_peak_bytes) <= 0.01 * measured, (
        measured,
        summary.predicted_peak_bytes,
    )


def _branchy_grads(module: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    module(x).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return grads


def test_auto_with_named_stages_that_do_not_split_says_what_to_do() -> None:
    with pytest.raises(UnsupportedModelError):
        auto(Branchy(), torch.randn(4, 32), stages=["stem", "head"])


def test_apply_and_auto_refuse_a_wrapped_model_and_say_the_order() -> None:
    from remat.distributed import WrapOrderError

    entry = zoo.get("mlp-chain", **SMALL["mlp-chain"])
    wrapped = nn.DataParallel(entry.model)
    with pytest.raises(WrapOrderError, match="Apply remat to the bare model first"):
        apply(wrapped, remat.Plan.none())
    with pytest.raises(WrapOrderError, match="then wrap"):
        auto(wrapped, entry.batch)


def test_whole_step_peak_is_predicted_to_two_percent_on_a_chain() -> None:
    # A linear layer's or GELU's backward does not keep its output: the output is gone before
    # that backward runs, which capture folds into bwd_overhead_bytes. Without it every
    # checkpointed plan was over-predicted by one activation (1 MiB here, ~5%).
    from remat.auto import stage_grad_bytes, total_peak_bytes
    from remat.measure.events import step_peak_bytes

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(16)])
    x = torch.randn(1024, 256)
    captured = capture(model, x, loss_fn=lambda m, b: m(b).square().mean())
    chain, stages = captured.chain, captured.stages
    grads = stage_grad_bytes(stages)
    persistent = fixed_bytes(model) - sum(grads)
    plans = [
        remat.Plan.none(),
        remat.plan(chain, "chen-sqrt"),
        remat.plan(chain, "hong-dp"),
        remat.plan(chain, "optimal-time", simulate_peak(chain) // 3),
        remat.Plan.from_checkpoints(chain, [4, 8, 12]),  # checkpoints the last stage too
    ]
    for p in plans:
        planned = apply(model, p, stages=stages)

        def step(planned: nn.Module = planned) -> None:
            planned(x).square().mean().backward()
            model.zero_grad(set_to_none=True)

        step()
        measured = step_peak_bytes(step, model, None, x)
        predicted = total_peak_bytes(chain, p, persistent, grads)
        assert predicted >= 0.995 * measured, (p.describe(), predicted, measured)
        if not p.chain_segments(chain)[-1].checkpoint:
            assert predicted <= 1.02 * measured, (p.describe(), predicted, measured)
        # a checkpointed last stage cannot drop what the loss saves: over-predicted (capture.py)


def simulate_peak(chain: remat.Chain) -> int:
    return remat.simulate(chain, remat.Plan.none()).peak_bytes


def test_whole_step_peak_is_exact_on_gpt2_with_gradient_timing() -> None:
    # GPT-2's peak is in the backward of the LM head + loss, before the head's weight gradient
    # exists; counting that gradient during the whole backward over-predicted by its size
    # (0.5 MiB of 65 MiB here), enough to deny a planner the very plan a peer measured.
    from remat.auto import stage_grad_bytes, total_peak_bytes
    from remat.measure.events import step_peak_bytes

    entry = zoo.get("gpt2", batch_size=2, seq_len=128)
    torch.manual_seed(0)
    captured = capture(entry.model, entry.batch, loss_fn=entry.loss_fn)
    chain, stages = captured.chain, captured.stages
    grads = stage_grad_bytes(stages)
    opt = torch.optim.Adam(entry.model.parameters(), lr=0.0)
    persistent = fixed_bytes(entry.model, opt) - sum(grads)
    assert len(captured.grad_rise_bytes) == chain.n
    assert all(0 <= r for r in captured.grad_rise_bytes)
    for p in (remat.Plan.none(), remat.plan(chain, "chen-sqrt"), remat.plan(chain, "hong-dp")):
        planned = apply(entry.model, p, stages=stages)

        def step(planned: nn.Module = planned) -> None:
            torch.manual_seed(1)
            entry.loss_fn(planned, entry.batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        measured = step_peak_bytes(step, entry.model, opt, entry.batch)
        predicted = total_peak_bytes(chain, p, persistent, grads, captured.grad_rise_bytes)
        assert abs(predicted - measured) <= 0.002 * measured, (p.describe(), predicted, measured)
        safe = total_peak_bytes(chain, p, persistent, grads)
        assert safe >= predicted


def test_at_a_baseline_plans_whole_step_peak_optimal_time_is_no_slower() -> None:
    # The budget a user compares at is a baseline's measured peak: the plan remat picks for it
    # must be at least as fast (predicted) as every baseline plan that fits it.
    from remat.auto import plan_for_total_budget, stage_grad_bytes, total_peak_bytes

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(24)])
    captured = capture(model, torch.randn(1024, 256))
    chain, grads, rises = (
        captured.chain,
        stage_grad_bytes(captured.stages),
        captured.grad_rise_bytes,
    )
    fixed = fixed_bytes(model, torch.optim.Adam(model.parameters()))
    persistent = fixed - sum(grads)
    baselines = [remat.plan(chain, m) for m in ("chen-sqrt", "every-stage", "hong-dp")]
    baselines.append(remat.Plan.from_checkpoints(chain, [6, 12, 18]))
    for base in baselines:
        budget = total_peak_bytes(chain, base, persistent, grads, rises)
        chosen = plan_for_total_budget(chain, fixed, budget, "optimal-time", grads, rises)
        assert total_peak_bytes(chain, chosen, persistent, grads, rises) <= budget
        chosen_time = remat.simulate(chain, chosen).total_time
        assert chosen_time <= remat.simulate(chain, base).total_time * (1 + 1e-9), base.describe()


def _wide_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 64)
    )


@pytest.mark.parametrize("foreach", [False, True])
def test_predicted_step_peak_counts_the_optimizer_step(foreach: bool) -> None:
    # Wide layers, a small batch: the step's peak is Adam's step, whose temporaries (sqrt and
    # division: twice the largest parameter with the for-loop implementation, every parameter
    # once with foreach) sit on top of parameters, gradients and state.
    model = _wide_mlp()
    x = torch.randn(4, 256)
    opt = torch.optim.Adam(model.parameters(), foreach=foreach)
    captured = capture(model, x)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured = step_peak_bytes(step, model, opt, x)
    plan = remat.Plan.none(captured.chain)
    predicted = predicted_step_peak_bytes(model, captured, plan, opt)
    assert abs(measured - predicted) <= 0.001 * measured, (measured, predicted)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    temporaries = predicted - (4 * params + x.numel() * x.element_size())
    assert temporaries == pytest.approx(params if foreach else 2 * largest, rel=0.01)


def test_auto_budget_below_the_optimizer_step_names_it() -> None:
    model = _wide_mlp()
    x = torch.randn(4, 256)
    opt = torch.optim.Adam(model.parameters(), foreach=True)
    fixed = fixed_bytes(model, opt)  # parameters, gradients, two Adam copies
    with pytest.raises(BudgetTooSmallError, match="optimizer step alone") as info:
        auto(model, x, budget=fixed + x.numel() * 4 + 1000, optimizer=opt)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert info.value.minimum_bytes >= fixed + params  # foreach: one temporary per parameter
    _, summary = auto(model, x, budget=info.value.minimum_bytes, optimizer=opt)
    assert summary.predicted_peak_bytes <= info.value.minimum_bytes
