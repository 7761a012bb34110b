"""Graph, GraphPlan and simulate_graph: validation, JSON, hand-computed costs, the schedule
checker, and exact equivalence with the chain model on path graphs."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from remat import Chain, Plan, Segment, simulate
from remat.core.synthetic import inception_block, random_dag, residual_chain
from remat.graphs import (
    Graph,
    GraphPlan,
    GraphPlanError,
    GraphSegment,
    InfeasibleScheduleError,
    Node,
    ScheduleOp,
    available_graph_planners,
    lower_plan,
    plan_graph,
    run_schedule,
    simulate_graph,
)
from remat.planners import BudgetTooSmallError

# ---------------------------------------------------------------------------- helpers


def random_chain_plan(n: int, rng: random.Random, max_depth: int = 2) -> Plan:
    """A random (possibly nested) chain plan over stages 1..n."""

    def cover(lo: int, hi: int, depth: int) -> list[Segment]:
        out, i = [], lo
        while i <= hi:
            j = rng.randint(i, hi)
            if rng.random() < 0.5:
                children: tuple[Segment, ...] = ()
                if depth < max_depth and j > i and rng.random() < 0.5:
                    children = tuple(cover(i, j, depth + 1))
                    if len(children) == 1 and children[0].checkpoint:
                        children = ()
                out.append(Segment(i, j, True, children))
            else:
                out.append(Segment(i, j))
            i = j + 1
        return out

    return Plan(tuple(cover(1, n, 0)))


def random_graph_plan(graph: Graph, rng: random.Random) -> GraphPlan:
    """A random plan: random disjoint node sets, sometimes with a nested child."""
    nodes = list(range(graph.n))
    rng.shuffle(nodes)
    segments = []
    while nodes and rng.random() < 0.8:
        size = rng.randint(1, min(4, len(nodes)))
        part, nodes = tuple(nodes[:size]), nodes[size:]
        children: tuple[GraphSegment, ...] = ()
        if len(part) > 1 and rng.random() < 0.3:
            children = (GraphSegment(part[: len(part) - 1]),)
        segments.append(GraphSegment(part, children))
    return GraphPlan(tuple(segments))


def small_residual() -> Graph:
    return Graph(
        (
            Node("a", (), 1.0, 2.0, 10, 10),
            Node("b", (0,), 2.0, 4.0, 10, 10),
            Node("add", (0, 1), 0.5, 1.0, 10, 10, saved_inputs=()),
        ),
        input_bytes=5,
    )


# ---------------------------------------------------------------------------- Graph


def test_graph_validation_messages() -> None:
    with pytest.raises(ValueError, match="topological order"):
        Graph((Node("a", (1,), 1, 1, 1, 1), Node("b", (), 1, 1, 1, 1)))
    with pytest.raises(ValueError, match="names must be unique"):
        Graph((Node("a", (), 1, 1, 1, 1), Node("a", (0,), 1, 1, 1, 1)))
    with pytest.raises(ValueError, match="includes the node's own output"):
        Node("a", (), 1, 1, out_bytes=4, saved_bytes=2)
    with pytest.raises(ValueError, match="not all in inputs"):
        Node("a", (0,), 1, 1, 1, 1, saved_inputs=(1,))
    with pytest.raises(ValueError, match="list each once"):
        Node("a", (0, 0), 1, 1, 1, 1)
    with pytest.raises(ValueError, match="finite and >= 0"):
        Node("a", (), -1, 1, 1, 1)
    with pytest.raises(ValueError, match="at least one node"):
        Graph(())


def test_graph_structure_and_json_round_trip() -> None:
    g = residual_chain(2)
    assert g.sinks == (g.n - 1,)
    assert g.sources == (0,)
    assert g.consumers(0) == (1, 6)  # conv1 and the add of block 0
    again = Graph.from_json(g.to_json())
    assert again == g and again.fingerprint == g.fingerprint
    renamed = Graph(tuple(Node(f"x{v}", *_fields(n)) for v, n in enumerate(g.nodes)))
    assert renamed.fingerprint == Graph(g.nodes).fingerprint  # names are not costs
    with pytest.raises(ValueError, match="not a remat graph"):
        Graph.from_json('{"a": 1}')
    with pytest.raises(ValueError, match="version 9"):
        Graph.from_json(json.dumps(g.to_dict() | {"version": 9}))


def _fields(node: Node) -> tuple[object, ...]:
    return (
        node.inputs,
        node.fwd_time,
        node.bwd_time,
        node.out_bytes,
        node.saved_bytes,
        node.fwd_overhead_bytes,
        node.bwd_overhead_bytes,
        node.saved_inputs,
    )


# ---------------------------------------------------------------------------- GraphPlan


def test_graph_plan_validation_and_json() -> None:
    with pytest.raises(GraphPlanError, match="overlap"):
        GraphPlan.from_segments([[0, 1], [1, 2]])
    with pytest.raises(GraphPlanError, match="not inside its parent"):
        GraphSegment((0, 1), (GraphSegment((2,)),))
    with pytest.raises(GraphPlanError, match="checkpointed twice"):
        GraphSegment((0, 1), (GraphSegment((0, 1)),))
    with pytest.raises(GraphPlanError, match="graph has 3 nodes"):
        GraphPlan.from_segments([[2, 3]]).for_graph(small_residual())
    plan = GraphPlan((GraphSegment((0, 1, 3), (GraphSegment((0,)),)), GraphSegment((5,))))
    assert GraphPlan.from_json(plan.to_json()) == plan
    assert plan.describe() == "{0-1,3: {0}} {5}"
    assert plan.depth() == 2 and not plan.is_contiguous()
    stamped = plan_graph(small_residual(), "none")
    with pytest.raises(GraphPlanError, match="re-plan"):
        stamped.for_graph(residual_chain(1))


def test_from_checkpoints_semantics() -> None:
    g = residual_chain(2)  # stem 0; block0 1..7 (add 6, relu 7); block1 8..14
    plan = GraphPlan.from_checkpoints(g, [0, 7])
    # kept single-input nodes close the segment of their input; everything is recomputed
    assert [s.nodes for s in plan.segments] == [(0,), tuple(range(1, 8)), tuple(range(8, 15))]
    assert plan.checkpoints(g) == (0, 7)
    kept_add = GraphPlan.from_checkpoints(g, [0, 6])  # the add (two inputs) is stored
    assert 6 in kept_add.stored_nodes(g)
    chain = Chain.random(7, seed=1)
    path = Graph.from_chain(chain)
    for kept in ([], [2], [1, 3, 5]):  # chain activation a[k] is node k - 1's output
        a = simulate(chain, Plan.from_checkpoints(chain, kept))
        b = simulate_graph(path, GraphPlan.from_checkpoints(path, [k - 1 for k in kept]))
        assert (a.peak_bytes, a.total_time) == (b.peak_bytes, b.total_time)


# ---------------------------------------------------------------------------- simulate


def test_simulate_by_hand() -> None:
    g = small_residual()
    sim = simulate_graph(g, GraphPlan.none())
    # forward 5 + 10 + 10 + 10 = 35; loss +10 = 45; B(add) allocates both input grads: 65
    assert sim.forward_peak_bytes == 35
    assert sim.peak_bytes == 65
    assert sim.total_time == 10.5 and sim.recompute_time == 0
    seg = simulate_graph(g, GraphPlan.from_segments([[0, 1]]))
    # forward: a, b without grad (25), add stored (35), a and b freed -> 15; loss 25;
    # B(add) +20 -> 45; recompute a, b with grad: 25 + 10 + 10 = 45; B(b), B(a)
    assert seg.forward_peak_bytes == 35
    assert seg.peak_bytes == 45
    assert seg.recompute_time == 3.0
    assert seg.forward_counts == (2, 2, 1)
    assert [e.op for e in seg.timeline] == [
        "F_none", "F_none", "F_all", "loss", "B", "F_all", "F_all", "B", "B"
    ]  # fmt: skip
    assert seg.timeline[-1].live_bytes == g.input_bytes


def test_an_output_only_its_consumers_keep_dies_with_them() -> None:
    """conv -> bn -> sink, input 5, outputs 10: the batch norm saves the convolution's output,
    the convolution's own backward does not read it (only its input and weight), so with
    keeps_output=False it is freed after B(bn), before B(conv) and its 40-byte workspace."""
    nodes = [
        Node("conv", (), 1, 2, 10, 10, bwd_overhead_bytes=40),
        Node("bn", (0,), 1, 2, 10, 10, saved_inputs=(0,)),
        Node("sink", (1,), 1, 2, 10, 10, saved_inputs=()),
    ]
    kept = Graph(tuple(nodes), input_bytes=5)
    freed = Graph((replace(nodes[0], keeps_output=False), *nodes[1:]), input_bytes=5)
    a, b = simulate_graph(kept, GraphPlan.none()), simulate_graph(freed, GraphPlan.none())
    # forward 35, loss 45, B(sink) 55 -> 35; B(bn) 45 -> kept: 25 (input, conv, its grad)
    # or 15 (conv's output freed); B(conv): + 40
    assert [e.live_bytes for e in a.timeline] == [15, 25, 35, 45, 35, 25, 5]
    assert [e.live_bytes for e in b.timeline] == [15, 25, 35, 45, 35, 15, 5]
    assert (a.peak_bytes, b.peak_bytes) == (65, 55)
    b_conv = lower_plan(freed, GraphPlan.none())[-1]
    assert b_conv.node == 0 and ("out", 0, 0) not in b_conv.reads
    # a recomputed copy dies the same way; the MILP accounts for both (brute force tests)
    seg = simulate_graph(freed, GraphPlan.from_segments([[0, 1]]))
    assert seg.timeline[-1].peak_bytes == 5 + 10 + 40
    again = Graph.from_json(freed.to_json())
    assert again == freed and not again.nodes[0].keeps_output
    assert "keeps_output" not in kept.to_json()  # the default is not written: old files
    assert freed.fingerprint != kept.fingerprint


@given(st.integers(1, 9), st.integers(0, 10_000))
def test_path_graph_simulates_exactly_like_the_chain(n: int, seed: int) -> None:
    chain = Chain.random(n, seed=seed)
    graph = Graph.from_chain(chain)
    rng = random.Random(seed)
    plans = [Plan.none(chain), Plan.every_stage(chain)] + [
        random_chain_plan(n, rng) for _ in range(4)
    ]
    for plan in plans:
        a = simulate(chain, plan)
        gplan = GraphPlan.from_chain_plan(plan, n)
        b = simulate_graph(graph, gplan)
        assert (a.peak_bytes, a.forward_peak_bytes, a.forward_counts) == (
            b.peak_bytes,
            b.forward_peak_bytes,
            b.forward_counts,
        )
        assert a.total_time == b.total_time and a.recompute_time == b.recompute_time
        # event by event, live bytes included (tests/test_one_simulator.py: every planner)
        assert [(e.op, e.recompute, e.peak_bytes, e.live_bytes) for e in a.timeline] == [
            (e.op, e.recompute, e.peak_bytes, e.live_bytes) for e in b.timeline
        ]
        back = gplan.to_chain_plan(n)  # and back: the same costs
        c = simulate(chain, back)
        assert (c.peak_bytes, c.total_time) == (a.peak_bytes, a.total_time)


@given(st.integers(2, 12), st.integers(0, 10_000))
def test_simulation_invariants_on_random_dags(n: int, seed: int) -> None:
    graph = random_dag(n, seed, single_sink=seed % 2 == 0)
    rng = random.Random(seed)
    nodes = graph.nodes
    floor = max(graph.input_bytes + node.saved_bytes + node.bwd_overhead_bytes for node in nodes)
    for plan in (GraphPlan.none(), random_graph_plan(graph, rng), random_graph_plan(graph, rng)):
        sim = simulate_graph(graph, plan)
        assert sim.peak_bytes >= floor
        assert sim.timeline[-1].live_bytes == graph.input_bytes
        assert sum(e.op == "B" for e in sim.timeline) == n
        # each node is recomputed once per segment level that holds it
        depth = [0] * n
        for seg in plan.walk():
            for v in seg.nodes:
                depth[v] += 1
        assert sim.forward_counts == tuple(1 + d for d in depth)
        assert sim.recompute_time == pytest.approx(
            sum(d * node.fwd_time for d, node in zip(depth, nodes, strict=True))
        )
    assert simulate_graph(graph, GraphPlan.none()).recompute_time == 0


def test_any_topological_order_and_non_topological_orders() -> None:
    g = inception_block(3, 2)  # stem 0, branches (1,2) (3,4) (5,6), cat 7, head 8
    plan = GraphPlan.from_segments([[1, 2], [3, 4]])
    order = [0, 5, 6, 3, 4, 1, 2, 7, 8]
    sim = simulate_graph(g, plan, order)
    assert [e.node for e in sim.timeline if e.op == "B"] == list(reversed(order))
    assert sim.forward_counts == simulate_graph(g, plan).forward_counts
    with pytest.raises(InfeasibleScheduleError, match="before it is computed"):
        simulate_graph(g, plan, [1, 0, 2, 3, 4, 5, 6, 7, 8])
    with pytest.raises(ValueError, match="each of the 9 nodes once"):
        simulate_graph(g, plan, [0, 1, 2])


def test_schedule_checker_catches_invalid_schedules() -> None:
    g = small_residual()
    good = list(lower_plan(g, GraphPlan.from_segments([[0, 1]])))
    run_schedule(g, good)  # valid as lowered
    first_free = next(i for i, op in enumerate(good) if op.frees)
    freed = good[first_free].frees[0]
    late = ScheduleOp("B", 0, False, (), (freed,), (), 0, 0.0)
    with pytest.raises(InfeasibleScheduleError, match="after it was freed"):
        run_schedule(g, [*good[: first_free + 1], late])
    with pytest.raises(InfeasibleScheduleError, match="never runs"):
        run_schedule(g, [op for op in good if not (op.op == "B" and op.node == 0)])
    no_grad = [op for op in good if op.op != "loss"]
    with pytest.raises(
        InfeasibleScheduleError, match="gradient of node 2 .* before it is produced"
    ):
        run_schedule(g, no_grad)
    twice = [*good, good[-1]]
    with pytest.raises(InfeasibleScheduleError, match="after it was freed|ran twice"):
        run_schedule(g, twice)
    leaky = [replace(op, frees=()) for op in good]
    with pytest.raises(InfeasibleScheduleError, match="never freed"):
        run_schedule(g, leaky)


def test_lowered_schedules_of_random_plans_are_valid() -> None:
    for seed in range(30):
        graph = random_dag(3 + seed % 9, seed)
        plan = random_graph_plan(graph, random.Random(seed))
        schedule = lower_plan(graph, plan)
        sim = run_schedule(graph, schedule)
        assert sim.peak_bytes == simulate_graph(graph, plan).peak_bytes
        b_order = [op.node for op in schedule if op.op == "B"]
        assert b_order == list(reversed(range(graph.n)))


# ---------------------------------------------------------------------------- plan_graph


def test_plan_graph_entry_point() -> None:
    g = small_residual()
    assert {"none", "reforward", "checkmate-milp", "checkmate-lp", "articulation"} <= set(
        available_graph_planners()
    )
    p = plan_graph(g, "none", budget="1KiB")
    assert p.predicted_peak_bytes == 65 and p.params["budget_bytes"] == 1024
    assert p.graph_fingerprint == g.fingerprint and p.predicted_time == 10.5
    with pytest.raises(BudgetTooSmallError, match="at least 65 B"):
        plan_graph(g, "none", budget=60)
    with pytest.raises(ValueError, match="unknown graph planner 'nope'"):
        plan_graph(g, "nope")
