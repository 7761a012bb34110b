"""The min-memory planners (hong-dp, hong-linear, reforward) against simulate and brute force."""

from __future__ import annotations

import random
from functools import cache

import pytest
from bruteforce import (
    Best,
    FlatPlan,
    all_flat_plans,
    brute_force_best,
    brute_force_min_peak,
    closed_form,
    fastest_under,
    simulated,
)
from hypothesis import given
from hypothesis import strategies as st

import remat
from remat import BudgetTooSmallError, Chain, Plan, simulate
from remat.planners.hong import FlatCosts, fastest_flat_plan, flat_plan_peak

MIN_MEMORY = ("hong-dp", "hong-linear", "reforward")


def one_huge_stage(n: int, where: int, seed: int = 0) -> Chain:
    """A random chain whose stage ``where`` saves and needs 50x more than the others."""
    data = Chain.random(n, seed=seed).to_dict()
    data["saved_bytes"][where - 1] *= 50
    data["bwd_overhead_bytes"][where - 1] += 2000
    return Chain._from_dict(data)


def with_field(chain: Chain, **fields: list[int]) -> Chain:
    return Chain._from_dict(chain.to_dict() | fields)


# Chains for the exhaustive checks: heterogeneous with and without overheads, homogeneous
# (many ties), one huge stage (first, middle, last), forward overheads larger than backward.
SMALL_CHAINS = {
    "random": Chain.random(10, seed=1),
    "random-no-overheads": Chain.random(10, seed=2, overheads=False),
    "homogeneous": Chain.homogeneous(10, out_bytes=8, saved_bytes=24),
    "huge-middle": one_huge_stage(9, 5),
}
N14_CHAINS = {
    "random": Chain.random(14, seed=11),
    "random-2": Chain.random(14, seed=12, max_bytes=10**9),
    "random-no-overheads": Chain.random(14, seed=13, overheads=False),
    "homogeneous": Chain.homogeneous(14),
    "homogeneous-saved": Chain.homogeneous(14, out_bytes=3, saved_bytes=7, input_bytes=5),
    "huge-first": one_huge_stage(14, 1, seed=3),
    "huge-middle": one_huge_stage(14, 7, seed=4),
    "huge-last": one_huge_stage(14, 14, seed=5),
    "forward-overheads": with_field(
        Chain.random(14, seed=6, overheads=False),
        fwd_overhead_bytes=[random.Random(6).randint(0, 400) for _ in range(14)],
    ),
    "one-stage": Chain.random(1, seed=7),
    "two-stages": Chain.random(2, seed=8),
}


@cache
def best14(name: str) -> Best:
    chain = N14_CHAINS[name]
    return brute_force_best(chain, closed_form(chain))


chains = st.builds(
    Chain.random,
    n=st.integers(1, 10),
    seed=st.integers(0, 10**6),
    max_bytes=st.sampled_from([3, 100, 10**9]),
    overheads=st.booleans(),
)


# ---------------------------------------------------------------- the closed form of a flat plan
@given(chains, st.data())
def test_closed_form_equals_simulate(chain: Chain, data: st.DataObject) -> None:
    costs = FlatCosts.of(chain)
    interior = list(range(1, chain.n))
    for _ in range(6):
        kept = sorted(data.draw(st.sets(st.sampled_from(interior)) if interior else st.just(())))
        store_last = data.draw(st.booleans())
        plan = Plan.from_checkpoints(chain, kept, store_last=store_last)
        assert flat_plan_peak(costs, kept, store_last) == simulate(chain, plan).peak_bytes


@pytest.mark.parametrize("name", ["random", "huge-middle"])
def test_closed_form_equals_simulate_on_every_plan(name: str) -> None:
    chain = SMALL_CHAINS[name]
    fast = closed_form(chain)
    for flat in all_flat_plans(chain):
        peak, time = simulated(chain, flat)
        assert fast(chain, flat) == (peak, pytest.approx(time))


@given(chains, st.data())
def test_storing_the_last_segment_is_never_worse(chain: Chain, data: st.DataObject) -> None:
    interior = list(range(1, chain.n))
    kept = sorted(data.draw(st.sets(st.sampled_from(interior)) if interior else st.just(())))
    recomputed = simulate(chain, Plan.from_checkpoints(chain, kept, store_last=False))
    stored = simulate(chain, Plan.from_checkpoints(chain, kept, store_last=True))
    assert stored.peak_bytes <= recomputed.peak_bytes
    last = chain.fwd_time[(kept[-1] if kept else 0) :]
    assert stored.total_time == pytest.approx(recomputed.total_time - sum(last))


def test_segment_cost_is_not_monotone_in_its_end() -> None:
    """Why no sliding window is exact (hong.py docstring): with a large forward overhead in
    stage 1, ending the segment where the gradient is large (a[1]) costs more than going on."""
    chain = Chain(
        fwd_time=[1, 1, 1],
        bwd_time=[1, 1, 1],
        out_bytes=[9, 1, 1],
        saved_bytes=[9, 1, 1],
        input_bytes=1,
        fwd_overhead_bytes=[20, 0, 0],
    )
    costs = FlatCosts.of(chain)
    assert costs.segment_cost(0, 1, recomputed=True) == 38
    assert costs.segment_cost(0, 2, recomputed=True) == 30
    # hence a bound of 31 admits (0, 2] as a first segment but not (0, 1]
    assert flat_plan_peak(costs, [1], True) == 1 + 38
    assert flat_plan_peak(costs, [2], True) == 1 + 30


# ---------------------------------------------------------------- least peak = brute force
@pytest.mark.parametrize("name", sorted(SMALL_CHAINS))
def test_reach_the_simulated_brute_force_minimum(name: str) -> None:
    chain = SMALL_CHAINS[name]
    best = brute_force_best(chain)  # every plan through simulate
    for method in MIN_MEMORY:
        sim = simulate(chain, remat.plan(chain, method))
        assert sim.peak_bytes == best.peak_bytes, method
        assert sim.total_time == pytest.approx(best.time), method


@pytest.mark.parametrize("name", sorted(N14_CHAINS))
def test_reach_the_brute_force_minimum_up_to_n14(name: str) -> None:
    chain = N14_CHAINS[name]
    best = best14(name)
    plans = {method: remat.plan(chain, method) for method in MIN_MEMORY}
    for method, plan in plans.items():
        sim = simulate(chain, plan)
        assert sim.peak_bytes == best.peak_bytes == plan.predicted_peak_bytes, method
        assert sim.total_time == pytest.approx(best.time), method
        assert FlatPlan(tuple(plan.params["kept"]), True) in best.plans, method
    assert plans["hong-dp"].segments == plans["hong-linear"].segments == plans["reforward"].segments


@given(chains)
def test_reach_the_brute_force_minimum_random(chain: Chain) -> None:
    best = brute_force_best(chain, closed_form(chain))
    dp = remat.plan(chain, "hong-dp")
    assert dp.predicted_peak_bytes == best.peak_bytes
    assert dp.predicted_time == pytest.approx(best.time)
    # hong-linear and reforward find the same optimum and break ties the same way
    assert remat.plan(chain, "hong-linear").segments == dp.segments
    assert remat.plan(chain, "reforward").segments == dp.segments


@pytest.mark.parametrize("seed", range(3))
def test_agree_on_long_chains(seed: int) -> None:
    """No brute force at n = 300, but three searches of different shape must agree, and the
    answer beats the equal-segment and every-stage plans."""
    chain = Chain.random(300, seed=seed, max_bytes=10**6)
    plans = [remat.plan(chain, method) for method in MIN_MEMORY]
    assert plans[0].segments == plans[1].segments == plans[2].segments
    peak = plans[0].predicted_peak_bytes
    assert peak <= remat.plan(chain, "chen-sqrt").predicted_peak_bytes
    assert peak <= remat.plan(chain, "every-stage").predicted_peak_bytes


# ---------------------------------------------------------------- budgets
@pytest.mark.parametrize("method", MIN_MEMORY)
@pytest.mark.parametrize("name", ["random", "huge-middle", "homogeneous"])
def test_budget_minimum_is_named_and_sufficient(method: str, name: str) -> None:
    chain = N14_CHAINS[name]
    least = best14(name).peak_bytes
    with pytest.raises(BudgetTooSmallError) as err:
        remat.plan(chain, method, least - 1)
    assert err.value.minimum_bytes == least
    assert err.value.method == method
    assert remat.plan(chain, method, err.value.minimum_bytes).predicted_peak_bytes == least


@given(chains, st.floats(0, 1.5))
def test_budget_gives_the_fastest_flat_plan_that_fits(chain: Chain, slack: float) -> None:
    cost = closed_form(chain)
    least = brute_force_min_peak(chain, cost)
    top = simulate(chain, Plan.none(chain)).peak_bytes
    budget = least + int(slack * (top - least))
    for method in MIN_MEMORY:
        plan = remat.plan(chain, method, budget)
        sim = simulate(chain, plan)
        assert sim.peak_bytes <= budget
        assert sim.total_time == pytest.approx(fastest_under(chain, budget, cost))


def test_fastest_flat_plan_returns_none_below_the_minimum() -> None:
    chain = N14_CHAINS["random"]
    least = best14("random").peak_bytes
    costs = FlatCosts.of(chain)
    assert fastest_flat_plan(costs, least - 1) is None
    found = fastest_flat_plan(costs, least)
    assert found is not None and found.peak_bytes == least


# ---------------------------------------------------------------- determinism, plan shape
@pytest.mark.parametrize("method", MIN_MEMORY)
def test_deterministic(method: str) -> None:
    chain = Chain.random(40, seed=5)
    again = Chain.from_json(chain.to_json())
    first = remat.plan(chain, method)
    assert remat.plan(again, method) == first
    assert remat.plan(chain, method, first.predicted_peak_bytes + 500) == remat.plan(
        again, method, first.predicted_peak_bytes + 500
    )


@pytest.mark.parametrize("method", MIN_MEMORY)
def test_plans_are_flat_with_the_last_segment_stored(method: str) -> None:
    chain = Chain.random(30, seed=9)
    plan = remat.plan(chain, method)
    assert plan.depth() <= 1
    tree = plan.chain_segments()
    assert not tree[-1].checkpoint
    assert [s.start - 1 for s in tree[1:]] == plan.params["kept"]
    assert Plan.from_json(plan.to_json()) == plan
