"""optimal-time (Beaumont et al. 2019, rotor) against simulate and brute force over nested plans."""

from __future__ import annotations

import itertools
import math
import random
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nested_plans import brute_force, min_time_within, nested_plans

import remat.planners.optimal_time as optimal_time
from remat import BudgetTooSmallError, Chain, Plan, available, simulate
from remat import plan as make_plan
from remat.planners import get_planner
from remat.planners.optimal_time import min_feasible_peak, predicted_cost, solve, sweep


@cache
def _brute(n: int, seed: int, overheads: bool = True) -> tuple[Chain, tuple]:
    chain = Chain.random(n, seed=seed, overheads=overheads)
    return chain, tuple(brute_force(chain))


def _check_fits(chain: Chain, plan: Plan, budget: int | None) -> None:
    sim = simulate(chain, plan)
    if budget is not None:
        assert sim.peak_bytes <= budget
    assert plan.predicted_peak_bytes == sim.peak_bytes  # the recurrence's peak is simulate's
    assert plan.predicted_time == pytest.approx(sim.total_time)


@settings(max_examples=12)
@given(st.integers(1, 4), st.integers(0, 10_000), st.booleans())
def test_recurrence_peak_is_simulated_peak_for_every_nested_plan(
    n: int, seed: int, overheads: bool
) -> None:
    chain = Chain.random(n, seed=seed, overheads=overheads)
    for plan in nested_plans(n):
        sim = simulate(chain, plan)
        peak, time = predicted_cost(chain, plan)
        assert peak == sim.peak_bytes, plan.describe()
        assert time == pytest.approx(sim.total_time)


@settings(max_examples=10)
@given(st.integers(1, 5), st.integers(0, 10_000), st.booleans(), st.data())
def test_matches_brute_force_over_nested_plans(
    n: int, seed: int, overheads: bool, data: st.DataObject
) -> None:
    chain, rows = _brute(n, seed, overheads)
    peaks = sorted({peak for peak, _, _ in rows})
    assert min_feasible_peak(chain) == peaks[0]
    budgets = [peaks[0], peaks[-1], peaks[-1] + 5]
    budgets += data.draw(st.lists(st.integers(peaks[0], peaks[-1]), min_size=1, max_size=6))
    for budget, plan in zip(budgets, sweep(chain, budgets), strict=True):
        assert plan is not None
        _check_fits(chain, plan, budget)
        assert simulate(chain, plan).total_time == pytest.approx(
            min_time_within(list(rows), budget)
        )
        assert plan.params["proven_optimal"] is True


@settings(max_examples=8)
@given(st.integers(2, 4), st.integers(0, 10_000), st.data())
def test_grid_search_is_still_exact(n: int, seed: int, data: st.DataObject) -> None:
    """Large byte counts: a coarse lower-bound table, exact branch and bound on top."""
    chain = Chain.random(n, seed=seed, max_bytes=10**6)
    rows = brute_force(chain)
    peaks = sorted({peak for peak, _, _ in rows})
    below_store_all = peaks[:-1]  # at the store-all peak the planner needs no table
    budgets = data.draw(st.lists(st.sampled_from(below_store_all), min_size=1, max_size=5))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optimal_time, "GRID_CELLS", 7)
        patch.setattr(optimal_time, "_TABLE_WORK", 0)
        plans = sweep(chain, budgets)
    for budget, plan in zip(budgets, plans, strict=True):
        assert plan is not None and plan.params["memory_unit_bytes"] > 1
        _check_fits(chain, plan, budget)
        assert simulate(chain, plan).total_time == pytest.approx(min_time_within(rows, budget))


@pytest.mark.parametrize("n, seed", [(6, 1), (8, 2), (10, 3)])
def test_never_slower_than_flat_and_baseline_plans_at_their_peaks(n: int, seed: int) -> None:
    chain = Chain.random(n, seed=seed)
    others = [Plan.none(chain), Plan.every_stage(chain)]
    for k in range(n):
        for kept in itertools.combinations(range(1, n), k):
            others += [Plan.from_checkpoints(chain, kept, store_last) for store_last in (0, 1)]
    best_at: dict[int, float] = {}
    for other in others:
        sim = simulate(chain, other)
        best_at[sim.peak_bytes] = min(best_at.get(sim.peak_bytes, math.inf), sim.total_time)
    budgets = sorted(best_at)
    for budget, plan in zip(budgets, sweep(chain, budgets), strict=True):
        assert plan is not None
        _check_fits(chain, plan, budget)
        assert simulate(chain, plan).total_time <= best_at[budget] + 1e-9


def test_more_budget_never_costs_more_time() -> None:
    chain = Chain.random(9, seed=11)
    low, high = min_feasible_peak(chain), simulate(chain, Plan.none(chain)).peak_bytes
    budgets = list(range(low, high + 2))
    times = [simulate(chain, p).total_time for p in sweep(chain, budgets) if p is not None]
    assert len(times) == len(budgets)
    assert all(a >= b - 1e-9 for a, b in itertools.pairwise(times))
    assert times[-1] == pytest.approx(chain.total_fwd_time() + chain.total_bwd_time())


def test_budget_too_small_names_the_true_minimum() -> None:
    chain, rows = _brute(5, 7)
    least = min(peak for peak, _, _ in rows)
    with pytest.raises(BudgetTooSmallError) as info:
        solve(chain, least - 1)
    assert info.value.minimum_bytes == least
    assert info.value.method == "optimal-time"
    assert str(least) in str(info.value)
    _check_fits(chain, solve(chain, least), least)
    assert sweep(chain, [least - 1, least])[0] is None
    with pytest.raises(BudgetTooSmallError):
        make_plan(chain, "optimal-time", least - 1)


def test_no_budget_is_least_memory_at_zero_recomputation() -> None:
    chain = Chain.random(7, seed=5)
    plan = solve(chain, None)
    sim = simulate(chain, plan)
    assert sim.recompute_time == 0
    assert sim.peak_bytes == simulate(chain, Plan.none(chain)).peak_bytes
    assert "budget_bytes" not in plan.params


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_budget_with_free_forwards_checkpoints_them(seed: int) -> None:
    """Stages with forward time 0 can be recomputed for free: the least memory at the least
    time may then checkpoint them (brute force over nested plans)."""
    rng = random.Random(seed)
    base = Chain.random(5, seed=seed)
    data = base.to_dict() | {"fwd_time": [rng.choice([0.0, 1.0]) for _ in range(5)]}
    chain = Chain._from_dict(data)
    rows = brute_force(chain)
    least_time = min(time for _, time, _ in rows)
    expected = min(peak for peak, time, _ in rows if time <= least_time + 1e-9)
    plan = solve(chain, None)
    sim = simulate(chain, plan)
    assert sim.total_time == pytest.approx(least_time)
    assert sim.peak_bytes == expected


def test_registered_and_stamped_by_remat_plan() -> None:
    assert "optimal-time" in available()
    chain = Chain.homogeneous(12, out_bytes=10, saved_bytes=40)
    budget = (min_feasible_peak(chain) + simulate(chain, Plan.none(chain)).peak_bytes) // 2
    plan = make_plan(chain, "optimal-time", budget)
    assert plan.method == "optimal-time"
    assert plan.params["budget_bytes"] == budget
    assert plan.predicted_peak_bytes == simulate(chain, plan).peak_bytes <= budget
    assert Plan.from_json(plan.to_json()) == plan


def _realistic(n: int, seed: int) -> Chain:
    rng = random.Random(seed)
    mib = 2**20
    out = [rng.randint(mib, 100 * mib) for _ in range(n)]
    return Chain(
        fwd_time=[rng.uniform(1e-3, 2e-2) for _ in range(n)],
        bwd_time=[rng.uniform(2e-3, 4e-2) for _ in range(n)],
        out_bytes=out,
        saved_bytes=[o * rng.randint(1, 4) for o in out],
        input_bytes=rng.randint(mib, 50 * mib),
        fwd_overhead_bytes=[rng.randint(0, 20 * mib) for _ in out],
        bwd_overhead_bytes=[rng.randint(0, 40 * mib) for _ in out],
    )


def test_long_chain_with_megabytes_fits_and_beats_baselines() -> None:
    chain = _realistic(40, seed=3)
    k = round(math.sqrt(chain.n))
    others = [
        Plan.every_stage(chain),
        Plan.from_checkpoints(chain, [round(i * chain.n / k) for i in range(1, k)]),
        Plan.from_checkpoints(chain, range(2, chain.n, 3), store_last=True),
    ]
    sims = [simulate(chain, other) for other in others]
    budgets = [sim.peak_bytes for sim in sims]
    for sim, plan in zip(sims, sweep(chain, budgets), strict=True):
        assert plan is not None and plan.params["memory_unit_bytes"] > 1
        _check_fits(chain, plan, sim.peak_bytes)
        assert simulate(chain, plan).total_time <= sim.total_time + 1e-12


@pytest.mark.parametrize(
    "chain", [Chain.random(12, seed=4), _realistic(40, seed=5)], ids=["random-12", "megabytes-40"]
)
def test_never_slower_than_any_registered_planner_at_its_peak(chain: Chain) -> None:
    others = []
    for name in available():
        if name != "optimal-time":
            try:
                others.append(get_planner(name)(chain, None))
            except BudgetTooSmallError:  # a planner with no default plan
                continue
    sims = [simulate(chain, other) for other in others]
    budgets = [sim.peak_bytes for sim in sims]
    for sim, plan in zip(sims, sweep(chain, budgets), strict=True):
        assert plan is not None
        _check_fits(chain, plan, sim.peak_bytes)
        assert simulate(chain, plan).total_time <= sim.total_time + 1e-12


def test_search_stays_within_its_node_limit_on_a_densenet_chain(monkeypatch) -> None:
    # A 63-stage DenseNet-121 chain (remat.bench.models.densenet_chain, 96², batch 8, fake
    # capture): the first, greedy descent used to backtrack without limit while trying to beat
    # plans it already knew (1.1 M nodes for one budget; a 16-budget sweep did not end in
    # minutes). Every search now stays within SEARCH_NODES.
    from pathlib import Path

    chain = Chain.from_json((Path(__file__).parent / "data/densenet121_chain.json").read_text())
    assert chain.n == 63
    floor = min_feasible_peak(chain)
    top = simulate(chain, Plan.none(chain)).peak_bytes
    budgets = [int(floor * (top / floor) ** (k / 15)) for k in range(16)]
    nodes: list[int] = []
    original = optimal_time._Search.plan

    def counted(self, limit):  # type: ignore[no-untyped-def]
        result = original(self, limit)
        nodes.append(self.nodes)
        return result

    monkeypatch.setattr(optimal_time._Search, "plan", counted)
    plans = sweep(chain, budgets)
    assert nodes and max(nodes) <= optimal_time.SEARCH_NODES + 1
    for budget, plan in zip(budgets, plans, strict=True):
        assert plan is not None
        _check_fits(chain, plan, budget)
