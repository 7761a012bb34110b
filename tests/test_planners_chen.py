"""Chen et al.'s planners (chen-sqrt, chen-budget, chen-recursive) and every planner's budget."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import remat
from remat import BudgetTooSmallError, Chain, Plan, simulate
from remat.planners import available
from remat.planners.chen import greedy_checkpoints

CHEN = ("chen-sqrt", "chen-budget", "chen-recursive")

chains = st.builds(
    Chain.random,
    n=st.integers(1, 40),
    seed=st.integers(0, 10**6),
    max_bytes=st.sampled_from([5, 100, 10**9]),
    overheads=st.booleans(),
)


# ---------------------------------------------------------------- chen-sqrt
@pytest.mark.parametrize("n", [1, 2, 3, 10, 17, 99, 100, 1000])
def test_sqrt_segments_are_nearly_equal(n: int) -> None:
    plan = remat.plan(Chain.homogeneous(n), "chen-sqrt")
    lengths = [s.length for s in plan.chain_segments()]
    assert len(lengths) == max(1, round(math.sqrt(n)))
    assert max(lengths) - min(lengths) <= 1
    assert all(s.checkpoint for s in plan.chain_segments()[:-1])
    assert not plan.chain_segments()[-1].checkpoint  # Note [store the last segment]


@given(chains)
def test_sqrt_stored_last_segment_is_never_worse(chain: Chain) -> None:
    plan = remat.plan(chain, "chen-sqrt")
    kept = [s.start - 1 for s in plan.chain_segments()[1:]]
    recomputed = simulate(chain, Plan.from_checkpoints(chain, kept, store_last=False))
    assert plan.predicted_peak_bytes <= recomputed.peak_bytes
    assert plan.predicted_time == pytest.approx(
        recomputed.total_time - sum(chain.fwd_time[plan.chain_segments()[-1].start - 1 :])
    )


@given(chains)
def test_chen_flat_plans_recompute_at_most_one_forward(chain: Chain) -> None:
    for method in ("chen-sqrt", "chen-budget"):
        sim = simulate(chain, remat.plan(chain, method))
        assert sim.recompute_time <= chain.total_fwd_time()
        assert max(sim.forward_counts) <= 2


def test_sqrt_peak_grows_as_sqrt_n_on_homogeneous_chains() -> None:
    peaks = {}
    for n in (16, 64, 256, 1000, 1024, 4000):
        chain = Chain.homogeneous(n, out_bytes=4, saved_bytes=12, input_bytes=4)
        peaks[n] = simulate(chain, remat.plan(chain, "chen-sqrt")).peak_bytes
        # sqrt(n) kept activations (4 B) + one segment of sqrt(n) stages (12 B) + a few
        assert peaks[n] / math.sqrt(n) <= 18.0, n
    for n in (16, 64, 256, 1000):
        assert 1.7 <= peaks[4 * n] / peaks[n] <= 2.1, n


# ---------------------------------------------------------------- chen-budget
def test_greedy_keeps_a_boundary_once_the_segment_exceeds_the_budget() -> None:
    chain = Chain.homogeneous(7, out_bytes=2, saved_bytes=5)
    assert greedy_checkpoints(chain, 0) == ([1, 2, 3, 4, 5, 6], 12, 5)
    assert greedy_checkpoints(chain, 9) == ([2, 4, 6], 6, 10)
    assert greedy_checkpoints(chain, 10) == ([3, 6], 4, 15)
    assert greedy_checkpoints(chain, 10**6) == ([], 0, 0)


def test_greedy_sums_saved_bytes_and_keeps_out_bytes() -> None:
    chain = Chain(
        fwd_time=[1] * 4, bwd_time=[1] * 4, out_bytes=[1, 2, 3, 4], saved_bytes=[10, 2, 10, 4]
    )
    kept, x, y = greedy_checkpoints(chain, 10)
    assert kept == [2]  # 10 is not > 10; 12 is
    assert (x, y) == (2, 12)  # x counts out_bytes of a[2]; the tail (stages 3-4) is not in y


@pytest.mark.parametrize("seed", range(4))
def test_budget_search_follows_appendix_a(seed: int) -> None:
    chain = Chain.random(60, seed=seed)
    plan = remat.plan(chain, "chen-budget")
    _, x, y = greedy_checkpoints(chain, 0)
    guess = math.isqrt(x * y)
    tried = plan.params["segment_budgets_tried"]
    assert tried[:2] == [0, guess]
    assert tried[2] == round(guess / 2) and tried[-1] == 2 * guess and len(tried) == 8
    # the least simulated peak over the candidate plans
    peaks = [
        simulate(chain, Plan.from_checkpoints(chain, greedy_checkpoints(chain, b)[0], True))
        for b in tried
    ]
    assert plan.predicted_peak_bytes == min(p.peak_bytes for p in peaks)
    assert plan.params["kept"] == greedy_checkpoints(chain, plan.params["segment_budget_bytes"])[0]


@pytest.mark.parametrize("seed", range(4))
def test_budget_picks_the_fastest_candidate_that_fits(seed: int) -> None:
    chain = Chain.random(60, seed=seed)
    tried = remat.plan(chain, "chen-budget").params["segment_budgets_tried"]
    sims = [
        simulate(chain, Plan.from_checkpoints(chain, greedy_checkpoints(chain, b)[0], True))
        for b in tried
    ]
    for budget in sorted({s.peak_bytes for s in sims}):
        plan = remat.plan(chain, "chen-budget", budget)
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_time == min(s.total_time for s in sims if s.peak_bytes <= budget)


# ---------------------------------------------------------------- chen-recursive
def test_recursive_peak_grows_as_log_n_on_homogeneous_chains() -> None:
    previous = None
    for k in range(1, 11):  # n = 2 .. 1024
        n = 2**k
        chain = Chain.homogeneous(n, out_bytes=4, saved_bytes=12, input_bytes=4)
        sim = simulate(chain, remat.plan(chain, "chen-recursive"))
        if previous is not None:
            assert sim.peak_bytes - previous <= 2 * 4  # at most two more activations
        previous = sim.peak_bytes
        assert max(sim.forward_counts) <= k + 1  # recomputed at most log2 n times
    assert previous is not None and previous <= 4 * (10 + 4) + 12


def test_recursive_plan_shape() -> None:
    plan = remat.plan(Chain.homogeneous(8), "chen-recursive")
    assert plan.describe() == "(1-4: (1-2: (1) [2]) (3) [4]) (5-6: (5) [6]) (7) [8]"
    assert plan.depth() == 3


@given(chains)
def test_recursive_is_log_depth_and_valid(chain: Chain) -> None:
    plan = remat.plan(chain, "chen-recursive")
    sim = simulate(chain, plan)
    assert max(sim.forward_counts) <= math.ceil(math.log2(chain.n)) + 1
    assert Plan.from_json(plan.to_json()) == plan


# ---------------------------------------------------------------- budgets, every planner
@pytest.mark.parametrize("method", CHEN)
def test_chen_budget_minimum_is_named_and_sufficient(method: str) -> None:
    chain = Chain.random(30, seed=3)
    least = remat.plan(chain, method).predicted_peak_bytes
    assert least is not None
    with pytest.raises(BudgetTooSmallError) as err:
        remat.plan(chain, method, least - 1)
    assert err.value.minimum_bytes == least and err.value.method == method
    assert remat.plan(chain, method, err.value.minimum_bytes).predicted_peak_bytes == least


@given(chains, st.floats(0.0, 1.2))
def test_every_planner_fits_its_budget(chain: Chain, fraction: float) -> None:
    top = simulate(chain, Plan.none(chain)).peak_bytes
    budget = int(fraction * top)
    for method in available():
        try:
            plan = remat.plan(chain, method, budget)
        except BudgetTooSmallError as err:
            assert err.minimum_bytes > budget
            continue
        assert simulate(chain, plan).peak_bytes <= budget, method


@pytest.mark.parametrize("method", CHEN)
def test_chen_deterministic(method: str) -> None:
    chain = Chain.random(50, seed=1)
    assert remat.plan(chain, method) == remat.plan(Chain.from_json(chain.to_json()), method)
