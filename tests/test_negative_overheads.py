"""Measured chains have negative backward overheads (autograd frees saved tensors and δ[i] during
a stage's backward, before its peak). Every exact planner stays exact on such chains."""

from __future__ import annotations

from pathlib import Path

import pytest
from bruteforce import brute_force_best, fastest_under
from nested_plans import brute_force, min_time_within

import remat
from remat import Chain, simulate
from remat.graphs import Graph, Node
from remat.planners.optimal_time import min_feasible_peak

SEEDS = range(30)
DATA = Path(__file__).parent / "data"


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


def test_graph_node_accepts_negative_bwd_overhead_within_what_it_holds() -> None:
    """The path graph of a measured chain carries its negative overheads (``Graph.from_chain``
    refused every captured chain that had one: 11 of the 16 small zoo captures)."""
    Node("n", (), 1.0, 1.0, out_bytes=4, saved_bytes=10, bwd_overhead_bytes=-14)
    with pytest.raises(ValueError, match="cannot free more than it holds"):
        Node("n", (), 1.0, 1.0, out_bytes=4, saved_bytes=10, bwd_overhead_bytes=-15)
    # without keeps_output the backward holds its residual (6) and its output gradient (4)
    Node("n", (), 1.0, 1.0, 4, 10, bwd_overhead_bytes=-10, keeps_output=False)
    with pytest.raises(ValueError, match="below -10"):
        Node("n", (), 1.0, 1.0, 4, 10, bwd_overhead_bytes=-11, keeps_output=False)
    with pytest.raises(ValueError, match="bytes must be >= 0"):
        Node("n", (), 1.0, 1.0, 4, 10, fwd_overhead_bytes=-1)


def test_a_measured_chain_is_a_path_graph() -> None:
    """DenseNet-121's captured chain (56 of its 63 backward overheads negative, down to -4.1 MB)."""
    chain = Chain.from_json((DATA / "densenet121_chain.json").read_text())
    assert min(chain.bwd_overhead_bytes) < 0
    graph = Graph.from_chain(chain)
    assert graph.is_path() and Graph.from_json(graph.to_json()) == graph
    assert [node.bwd_overhead_bytes for node in graph.nodes] == list(chain.bwd_overhead_bytes)
    for plan in (remat.Plan.none(chain), remat.plan(chain, "hong-dp")):
        assert simulate(graph, plan) == simulate(chain, plan)


@pytest.mark.parametrize("factor", [0.2, 0.5, 0.75, 1.3])
def test_scaled_keeps_a_negative_overhead_above_its_floor(factor: float) -> None:
    """Rounded apart, ``-4 * 0.2`` is -1 but ``-(2 * 0.2 + 2 * 0.2)`` is 0: ``scaled`` raised."""
    chain = Chain(
        fwd_time=[1, 1], bwd_time=[1, 1], out_bytes=[2, 7], saved_bytes=[2, 9],
        bwd_overhead_bytes=[-4, -16],
    )  # fmt: skip
    for scaled in (chain.scaled(factor), Graph.from_chain(chain).scaled(factor)):
        assert scaled.to_json()  # built: the floor held
    assert Graph.from_chain(chain.scaled(factor)) == Graph.from_chain(chain).scaled(factor)
