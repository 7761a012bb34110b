"""Graph, Plan and simulate_graph: validation, JSON, hand-computed costs, the schedule
checker, and exact equivalence with the chain model on path graphs."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

import remat
from remat import Chain, ChainSegment, Plan, simulate
from remat.core.plan import PlanError
from remat.core.synthetic import inception_block, random_dag, residual_chain
from remat.graphs import (
    Graph,
    InfeasibleScheduleError,
    Node,
    ScheduleOp,
    Segment,
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

    def cover(lo: int, hi: int, depth: int) -> list[ChainSegment]:
        out, i = [], lo
        while i <= hi:
            j = rng.randint(i, hi)
            if rng.random() < 0.5:
                children: tuple[ChainSegment, ...] = ()
                if depth < max_depth and j > i and rng.random() < 0.5:
                    children = tuple(cover(i, j, depth + 1))
                    if len(children) == 1 and children[0].checkpoint:
                        children = ()
                out.append(ChainSegment(i, j, True, children))
            else:
                out.append(ChainSegment(i, j))
            i = j + 1
        return out

    return Plan.from_chain_segments(tuple(cover(1, n, 0)))


def random_graph_plan(graph: Graph, rng: random.Random) -> Plan:
    """A random plan: random disjoint node sets, sometimes with a nested child."""
    nodes = list(range(graph.n))
    rng.shuffle(nodes)
    segments = []
    while nodes and rng.random() < 0.8:
        size = rng.randint(1, min(4, len(nodes)))
        part, nodes = tuple(nodes[:size]), nodes[size:]
        children: tuple[Segment, ...] = ()
        if len(part) > 1 and rng.random() < 0.3:
            children = (Segment(part[: len(part) - 1]),)
        segments.append(Segment(part, children))
    return Plan(tuple(segments))


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


# ---------------------------------------------------------------------------- Plan


def test_graph_plan_validation_and_json() -> None:
    with pytest.raises(PlanError, match="overlap"):
        Plan.from_segments([[0, 1], [1, 2]])
    with pytest.raises(PlanError, match="not inside its parent"):
        Segment((0, 1), (Segment((2,)),))
    with pytest.raises(PlanError, match="checkpointed twice"):
        Segment((0, 1), (Segment((0, 1)),))
    with pytest.raises(PlanError, match="graph has 3 nodes"):
        Plan.from_segments([[2, 3]]).for_graph(small_residual())
    plan = Plan((Segment((0, 1, 3), (Segment((0,)),)), Segment((5,))))
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.describe() == "{0-1,3: {0}} {5}"
    assert plan.depth() == 2 and not plan.is_contiguous()
    stamped = plan_graph(small_residual(), "none")
    with pytest.raises(PlanError, match="re-plan"):
        stamped.for_graph(residual_chain(1))


def test_from_checkpoints_semantics() -> None:
    g = residual_chain(2)  # stem 0; block0 1..7 (add 6, relu 7); block1 8..14
    plan = Plan.from_kept(g, [0, 7])
    # kept single-input nodes close the segment of their input; everything is recomputed
    assert [s.nodes for s in plan.segments] == [(0,), tuple(range(1, 8)), tuple(range(8, 15))]
    assert plan.checkpoints(g) == (0, 7)
    kept_add = Plan.from_kept(g, [0, 6])  # the add (two inputs) is stored
    assert 6 in kept_add.stored_nodes(g)
    chain = Chain.random(7, seed=1)
    path = Graph.from_chain(chain)
    for kept in ([], [2], [1, 3, 5]):  # chain activation a[k] is node k - 1's output
        a = simulate(chain, Plan.from_checkpoints(chain, kept))
        b = simulate_graph(path, Plan.from_kept(path, [k - 1 for k in kept]))
        assert (a.peak_bytes, a.total_time) == (b.peak_bytes, b.total_time)


# ---------------------------------------------------------------------------- simulate


def test_simulate_by_hand() -> None:
    g = small_residual()
    sim = simulate_graph(g, Plan.none())
    # forward 5 + 10 + 10 + 10 = 35; loss +10 = 45; B(add) allocates both input grads: 65
    assert sim.forward_peak_bytes == 35
    assert sim.peak_bytes == 65
    assert sim.total_time == 10.5 and sim.recompute_time == 0
    seg = simulate_graph(g, Plan.from_segments([[0, 1]]))
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
    a, b = simulate_graph(kept, Plan.none()), simulate_graph(freed, Plan.none())
    # forward 35, loss 45, B(sink) 55 -> 35; B(bn) 45 -> kept: 25 (input, conv, its grad)
    # or 15 (conv's output freed); B(conv): + 40
    assert [e.live_bytes for e in a.timeline] == [15, 25, 35, 45, 35, 25, 5]
    assert [e.live_bytes for e in b.timeline] == [15, 25, 35, 45, 35, 15, 5]
    assert (a.peak_bytes, b.peak_bytes) == (65, 55)
    b_conv = lower_plan(freed, Plan.none())[-1]
    assert b_conv.node == 0 and ("out", 0, 0) not in b_conv.reads
    # a recomputed copy dies the same way; the MILP accounts for both (brute force tests)
    seg = simulate_graph(freed, Plan.from_segments([[0, 1]]))
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
        b = simulate_graph(graph, plan)
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
        back = Plan.from_chain_segments(plan.chain_segments(n))  # its stage tree: same costs
        c = simulate(chain, back)
        assert (c.peak_bytes, c.total_time) == (a.peak_bytes, a.total_time)


@given(st.integers(2, 12), st.integers(0, 10_000))
def test_simulation_invariants_on_random_dags(n: int, seed: int) -> None:
    graph = random_dag(n, seed, single_sink=seed % 2 == 0)
    rng = random.Random(seed)
    nodes = graph.nodes
    floor = max(graph.input_bytes + node.saved_bytes + node.bwd_overhead_bytes for node in nodes)
    for plan in (Plan.none(), random_graph_plan(graph, rng), random_graph_plan(graph, rng)):
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
    assert simulate_graph(graph, Plan.none()).recompute_time == 0


def test_any_topological_order_and_non_topological_orders() -> None:
    g = inception_block(3, 2)  # stem 0, branches (1,2) (3,4) (5,6), cat 7, head 8
    plan = Plan.from_segments([[1, 2], [3, 4]])
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
    good = list(lower_plan(g, Plan.from_segments([[0, 1]])))
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
    assert p.fingerprint == g.fingerprint and p.predicted_time == 10.5
    with pytest.raises(BudgetTooSmallError, match="at least 65 B"):
        plan_graph(g, "none", budget=60)
    with pytest.raises(ValueError, match="unknown graph planner 'nope'"):
        plan_graph(g, "nope")


def test_a_chain_plan_and_its_path_graph_plan_are_one_plan() -> None:
    """One plan type: a chain's plan is checked against the chain or its path graph alike (the
    path graph has the chain's fingerprint), simulates the same on both, reads back equal from
    JSON, and its stage tree (``chain_segments``) builds it back (every planner's plans:
    tests/test_one_simulator.py)."""
    chain = replace(Chain.random(6, seed=3, negative_bwd_overheads=True), stages_fingerprint="s1")
    graph = Graph.from_chain(chain)
    assert graph.is_chain() and graph.fingerprint == chain.fingerprint
    assert graph.to_chain() == replace(chain, stages_fingerprint="")
    plan = remat.plan(chain, "optimal-time", simulate(chain, Plan.none(chain)).peak_bytes * 3 // 4)
    assert plan.depth() >= 1 and plan.stages_fingerprint == "s1"
    assert plan.fingerprint == graph.fingerprint and plan.n == graph.n == 6 and plan.chain
    assert plan.for_graph(graph) == plan.for_chain(chain) == plan.for_chain(6) == plan
    assert simulate_graph(graph, plan).peak_bytes == plan.predicted_peak_bytes
    assert simulate(graph, plan) == simulate(chain, plan)
    assert Plan.from_json(plan.to_json()) == plan
    tree = plan.chain_segments()
    assert tree == plan.chain_segments(chain) == plan.chain_segments(graph)
    rebuilt = Plan.from_chain_segments(tree)
    assert (rebuilt.segments, rebuilt.n, rebuilt.chain) == (plan.segments, 6, True)
    other = Graph.from_chain(Chain.random(6, seed=4))
    for use in (plan.for_graph, plan.chain_segments):
        with pytest.raises(PlanError, match="re-plan"):
            use(other)
    with pytest.raises(PlanError, match="made for 6 stages but this chain has 7 stages"):
        plan.for_chain(Chain.random(7, seed=4))
    # from the graph side: contiguous (nested) plans of the path graph come back equal
    rng = random.Random(0)
    for _ in range(20):
        back = random_chain_plan(chain.n, rng).for_graph(graph)
        stamped = replace(back, predicted_peak_bytes=7, predicted_time=1.5, method="m")
        assert replace(
            Plan.from_chain_segments(stamped.chain_segments()), **_plan_fields(stamped)
        ) == (stamped)
    # rule plans: Plan.none() is the plan with no segment; every-stage is fitted to its size
    assert Plan.none().segments == () and Plan.none().for_chain(chain) == Plan.none(chain)
    assert Plan.none(chain).chain_segments() == (ChainSegment(1, 6),)
    assert Plan.none(chain).describe() == "[1-6]" and Plan.none().describe() == "<store all>"
    with pytest.raises(PlanError, match="made for no chain"):
        Plan.every_stage().chain_segments()
    every = Plan.every_stage().for_chain(chain)
    assert every == Plan.every_stage(chain) and every.describe() == "(1) (2) (3) (4) (5) (6)"
    assert Plan.every_stage(graph).describe() == "{0} {1} {2} {3} {4} {5}"
    assert Plan.every_stage().made_for(graph) == Plan.every_stage(chain).made_for(graph)
    # stored segments side by side run as one: they come back merged
    split = Plan.from_chain_segments((ChainSegment(1, 2), ChainSegment(3, 6)))
    assert split.chain_segments() == (ChainSegment(1, 6),) and split.segments == ()
    # a segment that is not a run of nodes has no stage tree
    with pytest.raises(PlanError, match="not a run of consecutive nodes"):
        Plan.from_segments([[0, 2]]).chain_segments(chain)
    # a plan file written before stages_fingerprint reads as before
    data = json.loads(Plan.from_segments([[0, 1]]).to_json())
    del data["stages_fingerprint"]
    assert Plan.from_json(json.dumps(data)) == Plan.from_segments([[0, 1]])


def _plan_fields(plan: Plan) -> dict:
    return {
        "method": plan.method,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_time": plan.predicted_time,
        "fingerprint": plan.fingerprint,
    }


def test_version_1_plan_files_of_chains_and_graphs_read_as_the_one_plan() -> None:
    """Files written before the one plan type: a chain plan (``remat.plan`` version 1, a stage
    tree) and a graph plan (``remat.graph_plan`` version 1) read as the same plans."""
    chain_file = json.dumps(
        {
            "schema": "remat.plan",
            "version": 1,
            "method": "optimal-time",
            "params": {"budget_bytes": 100},
            "rule": None,
            "segments": [
                [1, 3, "checkpoint", [[1, 1, "checkpoint"], [2, 3, "store"]]],
                [4, 5, "store"],
            ],
            "predicted_peak_bytes": 90,
            "predicted_time": 2.5,
            "chain_fingerprint": "abc",
        }
    )
    plan = Plan.from_json(chain_file)
    assert plan.segments == (Segment((0, 1, 2), (Segment((0,)),)),)
    assert (plan.n, plan.chain, plan.fingerprint, plan.stages_fingerprint) == (5, True, "abc", None)
    assert (plan.method, plan.predicted_peak_bytes, plan.predicted_time) == (
        "optimal-time",
        90,
        2.5,
    )
    assert plan.describe() == "(1-3: (1) [2-3]) [4-5]"
    assert Plan.from_json(plan.to_json()) == plan
    rule_file = json.loads(chain_file)
    rule_file.update(rule="none", segments=[])
    assert Plan.from_json(json.dumps(rule_file)).segments == ()
    rule_file.update(rule="every-stage")
    assert Plan.from_json(json.dumps(rule_file)).for_chain(3) == replace(
        Plan.every_stage(3), method="optimal-time", params={"budget_bytes": 100}
    )
    graph_file = json.dumps(
        {
            "schema": "remat.graph_plan",
            "version": 1,
            "method": "reforward",
            "params": {},
            "segments": [{"nodes": [0, 2], "children": [{"nodes": [2]}]}],
            "predicted_peak_bytes": 7,
            "predicted_time": None,
            "graph_fingerprint": "g1",
            "stages_fingerprint": None,
        }
    )
    plan = Plan.from_json(graph_file)
    assert plan == Plan(
        (Segment((0, 2), (Segment((2,)),)),),
        method="reforward",
        predicted_peak_bytes=7,
        fingerprint="g1",
    )
    assert plan.describe() == "{0,2: {2}}"
    for bad in (
        '{"schema": "remat.plan", "version": 3}',
        '{"schema": "remat.graph_plan", "version": 2}',
    ):
        with pytest.raises(PlanError, match="version"):
            Plan.from_json(bad)


def test_only_a_chains_path_graph_is_a_chain() -> None:
    chain = Chain.random(3, seed=0)
    nodes = Graph.from_chain(chain).nodes
    for changed in (
        replace(nodes[1], keeps_output=False),
        replace(nodes[1], saved_inputs=()),
        replace(nodes[1], inputs=()),
    ):
        graph = Graph((nodes[0], changed, nodes[2]))
        assert not graph.is_chain() and graph.fingerprint != chain.fingerprint
        with pytest.raises(ValueError, match="not a chain"):
            graph.to_chain()
    same = Graph((nodes[0], replace(nodes[1], saved_inputs=(0,)), nodes[2]), chain.input_bytes)
    assert same.is_chain() and same.fingerprint == chain.fingerprint  # saved_inputs = all
