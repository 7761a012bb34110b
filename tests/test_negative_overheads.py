"""Measured chains have negative backward overheads (autograd frees saved tensors and δ[i] during
a stage's backward, before its peak). Every exact planner stays exact on such chains."""

from __future__ import annotations

import pytest
from bruteforce import brute_force_best, fastest_under
from nested_plans import brute_force, min_time_within

import remat
from remat import Chain, simulate
from remat.planners.optimal_time import min_feasible_peak

SEEDS = range(30)


def test_chain_accepts_negative_bwd_overhead_within_what_the_stage_holds() -> None:
    Chain(fwd_time=[1], bwd_time=[1], out_bytes=[4], saved_bytes=[10], bwd_overhead_bytes=[-14])
    with pytest.raises(ValueError, match="cannot free more than the stage holds"):
        Chain(fwd_time=[1], bwd_time=[1], out_bytes=[4], saved_bytes=[10], bwd_overhead_bytes=[-15])


@pytest.mark.parametrize("seed", SEEDS)
def test_min_memory_planners_exact_with_negative_overheads(seed: int) -> None:
    chain = Chain.random(3 + seed % 8, seed=seed, negative_bwd_overheads=True)
    best = brute_force_best(chain)
    for method in ("hong-dp", "hong-linear", "reforward"):
        plan = remat.plan(chain, method)
        assert simulate(chain, plan).peak_bytes == best.peak_bytes, method
    mid = (best.peak_bytes + simulate(chain, remat.Plan.none(chain)).peak_bytes) // 2
    want = fastest_under(chain, mid)
    for method in ("hong-dp", "hong-linear", "reforward"):
        assert remat.plan(chain, method, mid).predicted_time == want, method


@pytest.mark.parametrize("seed", SEEDS)
def test_optimal_time_exact_with_negative_overheads(seed: int) -> None:
    chain = Chain.random(2 + seed % 4, seed=100 + seed, negative_bwd_overheads=True)
    rows = brute_force(chain)
    floor = min(peak for peak, _, _ in rows)
    assert min_feasible_peak(chain) == floor
    top = max(peak for peak, _, _ in rows)
    for budget in sorted({floor, (floor + top) // 2, top}):
        plan = remat.plan(chain, "optimal-time", budget)
        assert plan.predicted_time == min_time_within(rows, budget), budget
