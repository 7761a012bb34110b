"""Graph planners against brute force: reforward (Feng & Huang), checkmate-milp / -lp
(Checkmate), articulation (chain planners over blocks), and the registry contract."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from remat import Chain, ChainSegment, Plan, simulate
from remat.core.synthetic import dense_block, inception_block, random_dag, residual_chain
from remat.graphs import (
    Graph,
    Node,
    available_graph_planners,
    plan_graph,
    simulate_graph,
)
from remat.planners import BudgetTooSmallError, available
from remat.planners.articulation import (
    ArticulationError,
    block_chain,
    chain_plan_to_graph,
    cut_points,
)
from remat.planners.checkmate_milp import MilpConfig, backward_floor
from remat.planners.reforward_graph import DivisionTree, FengGraph, feng_cost

SHAPES = {
    "residual": residual_chain(1),
    "residual2": residual_chain(2),
    "dense": dense_block(3),
    "inception": inception_block(3, 2),
    "inception4": inception_block(4, 2),
}

# ---------------------------------------------------------------------------- reforward


def independent_segments(feng: FengGraph, kept: set[int]) -> bool:
    """Feng & Huang's plan space: every segment (connected piece of the non-kept vertices)
    is entered from one vertex and left to one vertex."""
    inner = {x for x in range(feng.size) if x not in kept and x not in (feng.s, feng.t)}
    seen: set[int] = set()
    for x in inner:
        if x in seen:
            continue
        comp, stack = {x}, [x]
        while stack:
            y = stack.pop()
            for z in feng.succ[y] + feng.pred[y]:
                if z in inner and z not in comp:
                    comp.add(z)
                    stack.append(z)
        seen |= comp
        sources = {p for y in comp for p in feng.pred[y] if p not in comp}
        targets = {q for y in comp for q in feng.succ[y] if q not in comp}
        if len(sources) > 1 or len(targets) > 1:
            return False
    return True


def subsets(graph: Graph) -> list[tuple[int, ...]]:
    free = [v for v in range(graph.n) if v not in graph.sinks]
    return [c for r in range(len(free) + 1) for c in itertools.combinations(free, r)]


def feng_brute_force(graph: Graph) -> tuple[int, int]:
    """(least Feng cost, least simulated peak) over Feng & Huang's checkpoint sets."""
    feng = FengGraph(graph)
    best_cost, best_peak = math.inf, math.inf
    for kept in subsets(graph):
        if independent_segments(feng, {v + 1 for v in kept}):
            best_cost = min(best_cost, feng_cost(graph, kept))
            peak = simulate_graph(graph, Plan.from_kept(graph, kept)).peak_bytes
            best_peak = min(best_peak, peak)
    return int(best_cost), int(best_peak)


FENG_GRAPHS = [*SHAPES.items()] + [(f"dag{s}", random_dag(4 + s % 9, s)) for s in range(20)]


@pytest.mark.parametrize("name,graph", FENG_GRAPHS, ids=[n for n, _ in FENG_GRAPHS])
def test_reforward_is_optimal_in_feng_huang_model(name: str, graph: Graph) -> None:
    best_cost, best_peak = feng_brute_force(graph)
    plan = plan_graph(graph, "reforward")
    assert plan.params["feng_optimum_bytes"] == best_cost
    feng_plan = plan_graph(graph, "reforward", objective="feng")
    assert feng_cost(graph, feng_plan.params["checkpoints"]) == best_cost
    # the simulator's choice among break points is never worse than their argmin, and close
    # to the best simulated peak of their whole plan space (measured worst: 1.18 on 154 DAGs)
    assert plan.predicted_peak_bytes is not None and feng_plan.predicted_peak_bytes is not None
    assert plan.predicted_peak_bytes <= feng_plan.predicted_peak_bytes
    assert best_peak <= plan.predicted_peak_bytes <= 1.2 * best_peak
    if name.startswith(("dense", "inception")):
        assert plan.predicted_peak_bytes == best_peak


def test_reforward_is_not_optimal_over_all_checkpoint_sets() -> None:
    """Their optimality holds in their plan space only: here keeping b alone (whose segment
    {a} then has two exits, b and t) beats every independent-segment set in their own model."""
    g = Graph(
        (
            Node("a", (), 1, 2, 28, 28),
            Node("b", (0,), 1, 2, 15, 16),
            Node("c", (1,), 1, 2, 1, 1),
            Node("t", (0, 2), 1, 2, 34, 48),
        )
    )
    assert plan_graph(g, "reforward").params["feng_optimum_bytes"] == 44
    assert min(feng_cost(g, kept) for kept in subsets(g)) == 43 == feng_cost(g, [1])


def test_breakpoint_search_matches_every_candidate() -> None:
    for seed in range(12):
        tree = DivisionTree(FengGraph(random_dag(5 + seed, seed)))
        naive = min(m + tree.solve_with_max(m)[0] for m in tree.max_terms())
        full = tree.breakpoint_plans()
        assert min(gc + m for gc, m, _ in full) == naive
        assert tree.breakpoint_plans(limit=3)[0][:2] == full[0][:2]
        gcs = [tree.solve_with_max(m)[0] for m in tree.max_terms()]
        assert gcs == sorted(gcs, reverse=True)  # monotone: what the bisection relies on


def test_reforward_budget() -> None:
    g = residual_chain(3)
    lowest = plan_graph(g, "reforward")
    assert lowest.predicted_peak_bytes is not None
    fits = plan_graph(g, "reforward", budget=lowest.predicted_peak_bytes)
    assert fits.predicted_peak_bytes is not None
    assert fits.predicted_peak_bytes <= lowest.predicted_peak_bytes
    with pytest.raises(BudgetTooSmallError) as err:
        plan_graph(g, "reforward", budget=lowest.predicted_peak_bytes - 1)
    assert err.value.minimum_bytes == lowest.predicted_peak_bytes


# ---------------------------------------------------------------------------- checkmate


def run_plans(n: int) -> list[list[list[int]]]:
    """Every flat plan whose segments are runs of consecutive nodes."""
    out: list[list[list[int]]] = []

    def rec(i: int, segs: list[list[int]], cur: list[int] | None) -> None:
        closed = segs + ([cur] if cur else [])
        if i == n:
            out.append(closed)
            return
        rec(i + 1, closed, None)  # node i stored
        rec(i + 1, closed, [i])  # node i starts a segment
        if cur:
            rec(i + 1, segs, [*cur, i])  # node i continues the segment

    rec(0, [], None)
    return out


def brute_force_runs(graph: Graph) -> list[tuple[int, float]]:
    rows = []
    for segs in run_plans(graph.n):
        sim = simulate_graph(graph, Plan.from_segments(segs))
        rows.append((sim.peak_bytes, sim.total_time))
    return rows


MILP_GRAPHS = (
    [
        ("residual", residual_chain(1)),
        ("dense", dense_block(1)),
        ("inception", inception_block(3, 1)),
    ]
    + [(f"dag{s}", random_dag(3 + s % 5, s)) for s in range(9)]
    + [(f"free{s}", random_dag(4 + s % 5, 100 + s, free_outputs=True)) for s in range(8)]
    + [
        (f"held{s}", random_dag(4 + s % 4, s, free_outputs=s % 2 == 1, held_outputs=True))
        for s in (253, 335, 365, 371, 392, 393)  # of seeds 200..399, those where held matters
    ]
)
"""``free{s}``: about half of the nodes do not keep their own output (Node.keeps_output; a
convolution whose output the next batch norm saves); the MILP models when such an output, or
its recomputed copy, dies. Checked on 160 more such graphs at 5 budgets each while writing.
``held{s}``: outputs the program holds past their last reader (Node.held_until: ``h`` in
``h = block(h) * mask``), counted by the MILP in the forward stages up to that node's; the
seeds are those of 200..399 where some plan's peak depends on it (test below)."""


def test_held_outputs_change_some_plans_of_the_held_graphs() -> None:
    for name, graph in MILP_GRAPHS:
        if not name.startswith("held"):
            continue
        bare = Graph(
            tuple(replace(node, held_until=None) for node in graph.nodes), graph.input_bytes
        )
        pairs = [
            tuple(simulate_graph(g, Plan.from_segments(segs)).peak_bytes for g in (graph, bare))
            for segs in run_plans(graph.n)
        ]
        assert all(held >= free for held, free in pairs), name
        assert any(held > free for held, free in pairs), name


@pytest.mark.parametrize("name,graph", MILP_GRAPHS, ids=[n for n, _ in MILP_GRAPHS])
def test_checkmate_milp_matches_brute_force(name: str, graph: Graph) -> None:
    rows = brute_force_runs(graph)
    low, high = min(p for p, _ in rows), max(p for p, _ in rows)
    encodings = ("runs", "stages") if graph.n <= 6 else ("runs",)
    if not all(node.keeps_output for node in graph.nodes):
        with pytest.raises(ValueError, match="encoding='runs'"):
            plan_graph(graph, "checkmate-milp", high, encoding="stages")
        encodings = ("runs",)
    for budget in sorted({low - 1, low, (low + high) // 2, low + (high - low) // 5, high}):
        best = min((t for p, t in rows if p <= budget), default=None)
        for encoding in encodings:
            if best is None:
                with pytest.raises(BudgetTooSmallError) as err:
                    plan_graph(graph, "checkmate-milp", budget, encoding=encoding)
                assert err.value.minimum_bytes == low
                continue
            plan = plan_graph(graph, "checkmate-milp", budget, encoding=encoding)
            assert plan.predicted_time == pytest.approx(best)
            if encoding == "runs":  # the checkpoint links and bounds change no optimum
                plain = plan_graph(graph, "checkmate-milp", budget, strengthen=False)
                assert plain.predicted_time == pytest.approx(best)
            assert plan.predicted_time == pytest.approx(plan.params["objective"])
            assert plan.predicted_peak_bytes is not None
            assert plan.predicted_peak_bytes <= plan.params["milp_peak_bytes"] <= budget
            assert plan.params["status"] == "optimal" and plan.is_contiguous()


@pytest.mark.parametrize("name,graph", MILP_GRAPHS, ids=[n for n, _ in MILP_GRAPHS])
def test_backward_floor_bounds_every_plan(name: str, graph: Graph) -> None:
    # no plan goes below it: every flat run plan, and every set of segments (one node each or
    # any subset of nodes as one segment) on the small graphs
    floor, node = backward_floor(graph)
    peaks = [p for p, _ in brute_force_runs(graph)]
    if graph.n <= 7:
        for k in range(1, graph.n + 1):
            for subset in itertools.combinations(range(graph.n), k):
                plan = Plan.from_segments([list(subset)])
                peaks.append(simulate_graph(graph, plan).peak_bytes)
    assert floor <= min(peaks), (floor, min(peaks), node)
    assert node is None or 0 <= node < graph.n


@given(st.integers(2, 8), st.integers(0, 10_000), st.sampled_from([1.0, 0.7, 0.5, 0.35]))
def test_checkmate_milp_on_chains_agrees_with_optimal_time(
    n: int, seed: int, fraction: float
) -> None:
    if "optimal-time" not in available():
        pytest.skip("chain planner 'optimal-time' is not registered in this build")
    chain = Chain.random(n, seed=seed)
    graph = Graph.from_chain(chain)
    budget = int(simulate(chain, Plan.none(chain)).peak_bytes * fraction)
    from remat import plan as plan_chain

    try:
        milp = plan_graph(graph, "checkmate-milp", budget)
    except BudgetTooSmallError:
        milp = None
    try:
        rotor = plan_chain(chain, "optimal-time", budget)
    except BudgetTooSmallError:
        assert milp is None, "optimal-time found nothing where a flat plan fits"
        return
    if milp is None:
        assert rotor.depth() > 1  # only nested plans fit
        return
    assert milp.predicted_time is not None and rotor.predicted_time is not None
    # the MILP's flat plan is a chain plan with the same costs
    back = simulate(chain, milp)
    assert (back.peak_bytes, back.total_time) == (milp.predicted_peak_bytes, milp.predicted_time)
    # optimal-time searches nested plans too: it can only be faster, and ties on flat plans
    assert rotor.predicted_time <= milp.predicted_time + 1e-9
    if rotor.depth() <= 1:
        assert milp.predicted_time == pytest.approx(rotor.predicted_time)


def test_checkmate_lp_rounding() -> None:
    g = residual_chain(3)
    top = simulate_graph(g, Plan.none()).peak_bytes
    for fraction in (0.8, 0.6):
        budget = int(top * fraction)
        exact = plan_graph(g, "checkmate-milp", budget)
        approx = plan_graph(g, "checkmate-lp", budget)
        assert approx.predicted_peak_bytes is not None and approx.predicted_peak_bytes <= budget
        assert exact.predicted_time is not None and approx.predicted_time is not None
        assert approx.params["lp_bound"] <= exact.predicted_time + 1e-9
        assert exact.predicted_time <= approx.predicted_time + 1e-9


def test_checkmate_milp_accepts_the_least_it_names_where_its_model_prices_above_the_simulator():
    # Hugging Face BERT's graph (tests/data), with a constant (the dense output the program
    # holds through the layer norm, Constant via capture.graph._held_inside) read by nodes a
    # plan recomputes: the MILP counts such a constant as an upper bound, so it prices its own
    # least-peak plan 256 B above the simulator (156944 against 156688 B) and was infeasible at
    # the 156688 B it named as the minimum; the graph path's floor then lost its MILP plan
    data = Path(__file__).parent / "data" / "bert_graph_held_inside.json"
    g = Graph.from_json(data.read_text())
    with pytest.raises(BudgetTooSmallError) as refused:
        plan_graph(g, "checkmate-milp", 1)
    least = refused.value.minimum_bytes
    plan = plan_graph(g, "checkmate-milp", least)
    assert simulate_graph(g, plan).peak_bytes == least
    assert plan.params["least_peak"]  # the MILP itself is infeasible there
    with pytest.raises(BudgetTooSmallError) as below:
        plan_graph(g, "checkmate-milp", least - 1)
    assert below.value.minimum_bytes == least


def test_checkmate_options_and_defaults() -> None:
    g = residual_chain(2)
    assert plan_graph(g, "checkmate-milp").segments == ()  # no budget: store everything
    plan = plan_graph(g, "checkmate-milp", 120, time_limit_s=5.0, mip_rel_gap=0.5)
    assert plan.params["status"] in ("optimal", "time_limit")
    assert plan.params["mip_gap"] <= 0.5 and plan.params["time_limit_s"] == 5.0
    with pytest.raises(ValueError, match="encoding"):
        MilpConfig(encoding="dense")
    with pytest.raises(TypeError):
        plan_graph(g, "checkmate-milp", 120, budget_fraction=0.5)


# ---------------------------------------------------------------------------- articulation


def random_block_graph(seed: int) -> Graph:
    """Random DAG blocks joined at single nodes (so the joins are cut points); on odd seeds
    about half of the nodes do not keep their own output (Node.keeps_output), on seeds 2 and 3
    mod 4 about half of the outputs are held by the program past their last reader, inside
    their block (Node.held_until)."""
    rng = random.Random(seed)
    nodes: list[Node] = []
    prev = None
    for b in range(rng.randint(2, 5)):
        block = random_dag(
            rng.randint(1, 5),
            rng.randint(0, 10**6),
            free_outputs=seed % 2 == 1,
            held_outputs=seed % 4 >= 2,
        )
        off = len(nodes)
        for node in block.nodes:
            inputs = tuple(u + off for u in node.inputs) or ((prev,) if prev is not None else ())
            saved = node.saved_inputs
            saved = None if saved is None or not node.inputs else tuple(u + off for u in saved)
            nodes.append(
                Node(
                    f"b{b}.{node.name}",
                    inputs,
                    node.fwd_time,
                    node.bwd_time,
                    node.out_bytes,
                    node.saved_bytes,
                    node.fwd_overhead_bytes,
                    node.bwd_overhead_bytes,
                    saved,
                    node.keeps_output,
                    held_until=None if node.held_until is None else node.held_until + off,
                )
            )
        prev = len(nodes) - 1
    return Graph(tuple(nodes), input_bytes=rng.randint(1, 40))


def random_chain_plan(n: int, rng: random.Random) -> Plan:
    def cover(lo: int, hi: int, depth: int) -> list[ChainSegment]:
        out, i = [], lo
        while i <= hi:
            j = rng.randint(i, hi)
            children: tuple[ChainSegment, ...] = ()
            if rng.random() < 0.5:
                if depth < 2 and j > i and rng.random() < 0.5:
                    children = tuple(cover(i, j, depth + 1))
                    if len(children) == 1 and children[0].checkpoint:
                        children = ()
                out.append(ChainSegment(i, j, True, children))
            else:
                out.append(ChainSegment(i, j))
            i = j + 1
        return out

    return Plan.from_chain_segments(tuple(cover(1, n, 0)))


def test_cut_points_definition() -> None:
    for seed in range(20):
        g = random_block_graph(seed)
        held = [(u, node.held_until) for u, node in enumerate(g.nodes) if node.held_until]
        expected = [v for v in range(g.n - 1) if not any(u < v < w for u, w in g.edges() + held)]
        assert cut_points(g) == expected


def with_negative_bwd_overheads(graph: Graph, seed: int) -> Graph:
    """``graph`` with each backward overhead drawn between its floor (a backward that frees
    all it holds before its peak) and its value: what measured costs carry."""
    rng = random.Random(seed)
    nodes = tuple(
        replace(
            node, bwd_overhead_bytes=rng.randint(node.bwd_overhead_floor, node.bwd_overhead_bytes)
        )
        for node in graph.nodes
    )
    return Graph(nodes, input_bytes=graph.input_bytes)


@given(st.integers(0, 10**6), st.booleans())
def test_block_chain_bounds_every_mapped_plan(seed: int, negative: bool) -> None:
    graph = random_block_graph(seed)
    if negative:
        graph = with_negative_bwd_overheads(graph, seed)
    chain, blocks = block_chain(graph)
    assert sorted(v for b in blocks for v in b) == list(range(graph.n))
    rng = random.Random(seed)
    for _ in range(4):
        plan = random_chain_plan(chain.n, rng)
        on_chain = simulate(chain, plan)
        on_graph = simulate_graph(graph, chain_plan_to_graph(plan, blocks))
        assert on_graph.peak_bytes <= on_chain.peak_bytes
        assert on_graph.total_time == pytest.approx(on_chain.total_time)


def test_the_block_chain_of_a_chains_path_graph_is_the_chain() -> None:
    """One node per block: the aggregates are the chain's own costs, negative backward
    overheads included (they were clamped to 0, a looser bound than the chain itself)."""
    for seed in range(10):
        chain = Chain.random(2 + seed, seed=seed, negative_bwd_overheads=True)
        blocks_chain, blocks = block_chain(Graph.from_chain(chain))
        assert blocks == [[v] for v in range(chain.n)]
        assert replace(blocks_chain, names=chain.names) == chain


def test_articulation_planner() -> None:
    g = residual_chain(4)
    top = simulate_graph(g, Plan.none()).peak_bytes
    for method in ("hong-dp", "every-stage", None):
        if method is not None and method not in available():
            continue
        plan = plan_graph(g, "articulation", int(0.8 * top), chain_method=method)
        assert plan.predicted_peak_bytes is not None
        assert plan.predicted_peak_bytes <= 0.8 * top
        assert plan.params["blocks"] == 9
        assert plan.params["cut_points"] == cut_points(g)
    with pytest.raises(BudgetTooSmallError, match="articulation"):
        plan_graph(g, "articulation", 10, chain_method="every-stage")


def test_articulation_errors() -> None:
    with pytest.raises(ArticulationError, match=r"found 1 cut point\(s\).*'reforward'"):
        block_chain(dense_block(3), min_blocks=3)  # only the stem is a cut point
    two_outputs = random_dag(6, 1, single_sink=False)
    if len(two_outputs.sinks) > 1:
        with pytest.raises(ArticulationError, match="one output"):
            plan_graph(two_outputs, "articulation")
    with pytest.raises(ValueError, match="min_blocks"):
        plan_graph(residual_chain(2), "articulation", min_blocks=1)


# ---------------------------------------------------------------------------- all planners


@pytest.mark.parametrize(
    "method", ["none", "reforward", "checkmate-milp", "checkmate-lp", "articulation"]
)
def test_every_planner_returns_a_valid_plan(method: str) -> None:
    g = residual_chain(3)
    top = simulate_graph(g, Plan.none()).peak_bytes
    budget = int(0.75 * top) if method != "none" else None
    plan = plan_graph(g, method, budget)
    sim = simulate_graph(g, plan)  # the schedule checker raises on an invalid plan
    assert sim.peak_bytes == plan.predicted_peak_bytes
    assert budget is None or sim.peak_bytes <= budget
    assert Plan.from_json(plan.to_json()) == plan
    assert method in available_graph_planners()
