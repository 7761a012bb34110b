"""One simulator: every planner's plans, chain and graph, run through ``lower_plan`` +
``run_schedule`` (the symbolic interpreter of :mod:`remat.core.simulate`).

:func:`remat.simulate` keeps a chain fast path (it is several times faster than the general
interpreter on the long chains the planners' sweeps simulate, and the interpreter cannot sit
below the chain planners while it lives in the ``graphs`` package, which holds graph planners
that use them). These tests make it provably the same simulator: on random chains, for every
registered chain planner (the registries are read at collection time, so a new planner is
covered without touching this file), the chain simulator and the interpreter on the path graph
agree on the peak, the times and the whole event sequence, live bytes included; so they do on
chains captured from zoo models, whose negative backward overheads the path graph carries. Every graph
planner's plans are checked the same way against the interpreter run on their own schedule.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nested_plans import nested_plans

import remat.core.simulate as graphs_simulate
from remat import Chain, Plan, simulate, zoo
from remat.capture.chain import capture_chain
from remat.core.errors import InfeasibleScheduleError, RematError, UnsupportedModelError
from remat.core.synthetic import inception_block, random_dag, residual_chain
from remat.graphs import (
    Graph,
    available_graph_planners,
    least_graph_peak,
    lower_plan,
    plan_graph,
    run_schedule,
)
from remat.planners import BudgetTooSmallError, available, least_peak, plan_chain

CHAIN_PLANNERS = available()
GRAPH_PLANNERS = available_graph_planners()
DATA = Path(__file__).parent / "data"
SMALL_ZOO = {
    "mlp-chain": dict(layers=3, width=32, batch_size=4),
    "resnet18": dict(image_size=32, batch_size=2),
    "wrn-28-2": dict(batch_size=2),
    "resnet1001": dict(depth=14, image_size=64, num_classes=10, width=8, batch_size=2),
}
CAPTURED = [("mlp-chain", False), ("resnet18", False), ("wrn-28-2", True), ("resnet1001", True)]


def interpret(chain: Chain, plan: Plan):  # noqa: ANN201 (a GraphSimulation)
    """``plan`` run by the interpreter on the path graph of ``chain``."""
    graph = Graph.from_chain(chain)  # the chain's fingerprint: lower_plan checks the plan's
    return run_schedule(graph, lower_plan(graph, plan))


def assert_same_simulation(chain: Chain, plan: Plan) -> None:
    """The chain simulator and the interpreter agree on everything they report: peaks, times
    (the same floats), forward counts and every event (one type: stage ``i`` is node
    ``i - 1``, the loss node -1), live bytes included. And the plan is one plan: fitted to the
    path graph it is the plan fitted to the chain, its JSON reads back equal, and its stage tree
    builds its segments back."""
    a, b = simulate(chain, plan), interpret(chain, plan)
    assert a == b, plan.describe()
    fitted = plan.for_chain(chain)
    assert plan.for_graph(Graph.from_chain(chain)) == fitted
    assert Plan.from_json(fitted.to_json()) == fitted
    assert Plan.from_chain_segments(fitted.chain_segments()).segments == fitted.segments


def chain_plans(chain: Chain, method: str) -> list[Plan]:
    """``method``'s plans on ``chain``: without a budget, at its least peak and halfway to the
    unplanned peak (those that fit)."""
    low = least_peak(chain, method)
    top = simulate(chain, Plan.none(chain)).peak_bytes
    plans = [plan_chain(chain, method, None)]
    for budget in sorted({low, (low + top) // 2, top}):
        try:
            plans.append(plan_chain(chain, method, budget))
        except BudgetTooSmallError:
            pass
    return plans


def _random_chains() -> list[Chain]:
    """Homogeneous and random chains of 1 to 11 stages, half the random ones with negative
    backward overheads (as measured chains have)."""
    chains = []
    for seed in range(12):
        n = 1 + seed % 11
        if seed % 3 == 0:
            chains.append(Chain.homogeneous(n, out_bytes=10))
            continue
        chains.append(Chain.random(n, seed=seed))
        chains.append(Chain.random(n, seed=seed, negative_bwd_overheads=True))
    return chains


@pytest.mark.parametrize("method", CHAIN_PLANNERS)
def test_every_chain_planners_plans_simulate_alike_on_the_interpreter(method: str) -> None:
    nested = 0
    for chain in _random_chains():
        for plan in chain_plans(chain, method):
            assert_same_simulation(chain, plan)
            assert plan.predicted_peak_bytes == interpret(chain, plan).peak_bytes
            nested += plan.depth() > 1
    if method in ("chen-recursive", "optimal-time"):
        assert nested, f"{method} made no nested plan: the nested case went untested"


@pytest.fixture(scope="module")
def captured_chains() -> dict[str, Chain]:
    """Chains captured from zoo models (real and fake tensors; most carry negative backward
    overheads) and DenseNet-121's stored capture."""
    chains = {}
    for name, fake in CAPTURED:
        entry = zoo.get(name, **SMALL_ZOO[name])
        chain = capture_chain(entry.model, entry.batch, entry.loss_fn, repeats=1, fake=fake)
        chains[f"{name}{'-fake' if fake else ''}"] = chain
    chains["densenet121"] = Chain.from_json((DATA / "densenet121_chain.json").read_text())
    return chains


@pytest.mark.parametrize("method", CHAIN_PLANNERS)
def test_every_chain_planners_plans_on_captured_chains_simulate_alike(
    method: str, captured_chains: dict[str, Chain]
) -> None:
    """On measured chains, the path graph (``Graph.from_chain``) and the chain simulator agree
    event by event for every planner's plans (``Graph`` refused these chains' negative
    overheads before)."""
    negative = 0
    for name, chain in captured_chains.items():
        negative += min(chain.bwd_overhead_bytes) < 0
        for plan in chain_plans(chain, method):
            assert_same_simulation(chain, plan)
            assert plan.predicted_peak_bytes == interpret(chain, plan).peak_bytes, name
    assert negative >= 4, "the captured chains no longer carry negative overheads"


def test_every_nested_plan_of_small_chains_simulates_alike() -> None:
    """Brute force: all 224 nested plans of 4-stage chains (random costs, overheads, negative
    backward ones too)."""
    for seed in range(2):
        for negative in (False, True):
            chain = Chain.random(4, seed=seed, negative_bwd_overheads=negative)
            for plan in nested_plans(4):
                assert_same_simulation(chain, plan)


@settings(max_examples=30)
@given(st.integers(1, 16), st.integers(0, 10_000), st.sampled_from(CHAIN_PLANNERS), st.booleans())
def test_chain_planners_on_random_chains(n: int, seed: int, method: str, negative: bool) -> None:
    chain = Chain.random(n, seed=seed, negative_bwd_overheads=negative)
    budget = random.Random(seed).choice([None, "least", "middle"])
    if budget == "least":
        plan = plan_chain(chain, method, least_peak(chain, method))
    elif budget == "middle":
        low = least_peak(chain, method)
        top = simulate(chain, Plan.none(chain)).peak_bytes
        plan = plan_chain(chain, method, (low + top) // 2)
    else:
        plan = plan_chain(chain, method, None)
    assert_same_simulation(chain, plan)


def _graphs() -> list[tuple[str, Graph]]:
    return [
        ("residual", residual_chain(2)),
        ("inception", inception_block(3, 2)),
        ("dag", random_dag(8, 3)),
        ("dag-2-sinks", random_dag(7, 4, single_sink=False)),
        ("path", Graph.from_chain(Chain.random(7, seed=5))),
        ("path-negative", Graph.from_chain(Chain.random(7, seed=5, negative_bwd_overheads=True))),
    ]


@pytest.mark.parametrize("method", GRAPH_PLANNERS)
def test_every_graph_planners_plans_run_on_the_interpreter(method: str) -> None:
    planned = 0
    for name, graph in _graphs():
        try:
            low = least_graph_peak(graph, method)
        except BudgetTooSmallError:
            raise
        except ValueError as refused:  # e.g. articulation needs one output: a clear refusal
            assert "use" in str(refused), refused
            continue
        planned += 1
        top = plan_graph(graph, "none").predicted_peak_bytes
        assert top is not None
        for budget in (None, low, (low + top) // 2):
            try:
                plan = plan_graph(graph, method, budget)
            except BudgetTooSmallError:
                continue
            schedule = lower_plan(graph, plan)
            sim = run_schedule(graph, schedule)  # checks the schedule: raises if it cannot run
            assert (sim.peak_bytes, sim.total_time) == (
                plan.predicted_peak_bytes,
                plan.predicted_time,
            ), f"{method} on {name} at {budget}"
            assert sim.timeline[-1].live_bytes == graph.input_bytes
            assert sorted(op.node for op in schedule if op.op == "B") == list(range(graph.n))
    assert planned >= 3, f"{method} planned only {planned} of the test graphs"


def test_a_segment_input_is_freed_by_its_first_stages_backward() -> None:
    """(1-2) (3-4) on 4 stages of 10 bytes: segment (3-4) is the only holder of a[2]; it is
    released in the backward of stage 3, so that event's live bytes are a[0] + δ2 = 20 (the
    chain simulator said 30 before, showing it one event late, unlike the interpreter)."""
    from remat import ChainSegment

    chain = Chain.homogeneous(4, out_bytes=10)
    plan = Plan.from_chain_segments((ChainSegment(1, 2, True), ChainSegment(3, 4, True)))
    events = [(e.op, e.stage, e.live_bytes) for e in simulate(chain, plan).timeline]
    assert events[8] == ("B", 3, 20)
    assert_same_simulation(chain, plan)
    # a recomputation's output is dropped within its last forward: (1-4: (1-2) (3-4))
    nested = Plan.from_chain_segments(
        (ChainSegment(1, 4, True, (ChainSegment(1, 2, True), ChainSegment(3, 4, True))),)
    )
    timeline = simulate(chain, nested).timeline
    assert (timeline[8].op, timeline[8].stage, timeline[8].live_bytes) == ("F_none", 4, 30)
    assert_same_simulation(chain, nested)


def test_one_error_hierarchy() -> None:
    assert issubclass(InfeasibleScheduleError, RematError)
    assert issubclass(InfeasibleScheduleError, ValueError)  # what it was: old handlers hold
    assert issubclass(UnsupportedModelError, RematError)
    from remat import graphs

    assert graphs.InfeasibleScheduleError is InfeasibleScheduleError  # old import paths
    assert graphs_simulate.InfeasibleScheduleError is InfeasibleScheduleError
    g = residual_chain(1)
    with pytest.raises(RematError, match="before it is computed"):
        run_schedule(g, [op for op in lower_plan(g, Plan.none()) if op.node != 0])
