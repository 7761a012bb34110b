"""The one whole-step budget search, :func:`remat.planning.plan_for_step`, on chains and module
graphs: its five contracts, on small random instances (hypothesis) and on captured models.

1. the minimum its BudgetTooSmallError names is accepted when passed back;
2. it never refuses a budget that one of its candidates (:func:`step_candidates`) meets;
3. that minimum never exceeds the unplanned (store-all) step peak;
4. it is deterministic: the same inputs give the same plan;
5. the plan it returns has a step peak within the budget.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import fields, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from models import Branchy
from nested_plans import nested_plans

from remat.core.chain import Chain
from remat.core.chain_simulate import simulate
from remat.core.graph import Graph
from remat.core.plan import ChainSegment, Plan
from remat.core.simulate import checkpoint_spans, simulate_graph
from remat.core.step import StepCosts, StepEvent, segment_state_bytes, step_peak
from remat.core.synthetic import random_dag, residual_chain
from remat.planners import BudgetTooSmallError, available, least_peak, plan_chain
from remat.planning import (
    least_step_plan,
    plan_for_step,
    step_candidates,
    step_peak_of,
    unit_time_least_plan,
)


def _none(structure):
    return Plan.none(structure) if isinstance(structure, Chain) else Plan.none()


def check_contracts(structure, costs, budgets, method=None) -> None:
    """The five contracts at ``budgets`` (bytes)."""
    unplanned = step_peak_of(structure, _none(structure), costs)
    with pytest.raises(BudgetTooSmallError) as info:
        plan_for_step(structure, costs, 0, method)
    minimum = info.value.minimum_bytes
    assert info.value.kind == "whole-step"
    assert minimum <= unplanned  # 3
    assert least_step_plan(structure, costs, method)[1] == minimum
    back = plan_for_step(structure, costs, minimum, method)  # 1
    assert step_peak_of(structure, back, costs) <= minimum
    pool = [step_peak_of(structure, p, costs) for p in step_candidates(structure, costs, method)]
    for budget in budgets:
        try:
            found = plan_for_step(structure, costs, budget, method)
        except BudgetTooSmallError as err:
            assert min(pool) > budget, (min(pool), budget)  # 2
            assert err.minimum_bytes > budget
            assert err.minimum_bytes == minimum
            continue
        assert step_peak_of(structure, found, costs) <= budget  # 5
        again = plan_for_step(structure, costs, budget, method)  # 4
        assert _decision(again) == _decision(found)


def _decision(p):
    """What a plan decides (a graph plan's params hold the solver's wall time)."""
    return (p.method, p.segments) if isinstance(p, Plan) else p


def _costs(draw, n: int, input_bytes: int, scale: int) -> StepCosts:
    grads = tuple(draw(st.lists(st.integers(0, scale), min_size=n, max_size=n)))
    rises = tuple(draw(st.integers(0, g)) for g in grads) if draw(st.booleans()) else ()
    return StepCosts(
        persistent_bytes=draw(st.integers(0, 4 * scale)),
        grad_bytes=grads,
        grad_rise_bytes=rises,
        optimizer_step_bytes=draw(st.sampled_from([0, scale, 8 * scale])),
        output_held_bytes=draw(st.integers(0, scale)),
        input_bytes=input_bytes,
        grads_live=draw(st.booleans()),
        checkpoint_state_bytes=draw(st.sampled_from([0, 1, scale // 4])),
    )


@st.composite
def chains_with_costs(draw):
    n = draw(st.integers(2, 7))
    chain = Chain.random(n, seed=draw(st.integers(0, 10**6)), max_bytes=100)
    return chain, _costs(draw, n, chain.input_bytes, 40)


@settings(max_examples=25)
@given(
    chains_with_costs(),
    st.sampled_from(["optimal-time", "chen-budget", "hong-dp", "chen-sqrt", "none"]),
    st.lists(st.floats(0.3, 1.2), min_size=1, max_size=4),
)
def test_plan_for_step_contracts_on_random_chains(chain_costs, method, fractions) -> None:
    chain, costs = chain_costs
    unplanned = step_peak_of(chain, Plan.none(chain), costs)
    check_contracts(chain, costs, [int(unplanned * f) for f in fractions], method)


@st.composite
def graphs_with_costs(draw):
    n = draw(st.integers(3, 7))
    graph = random_dag(n, seed=draw(st.integers(0, 10**6)), max_bytes=50)
    return graph, _costs(draw, graph.n, graph.input_bytes, 20)


@settings(max_examples=8)
@given(graphs_with_costs(), st.lists(st.floats(0.3, 1.2), min_size=1, max_size=3))
def test_plan_for_step_contracts_on_random_graphs(graph_costs, fractions) -> None:
    graph, costs = graph_costs
    unplanned = step_peak_of(graph, Plan.none(), costs)
    check_contracts(graph, costs, [int(unplanned * f) for f in fractions])


def test_budgets_between_the_minimum_and_the_unplanned_peak_on_a_residual_graph() -> None:
    graph = residual_chain(2, 100)
    costs = StepCosts(persistent_bytes=1000, grad_bytes=(30,) * graph.n, optimizer_step_bytes=50)
    unplanned = step_peak_of(graph, Plan.none(), costs)
    minimum = least_step_plan(graph, costs)[1]
    check_contracts(
        graph, costs, range(minimum - 1, unplanned + 2, max(1, (unplanned - minimum) // 6))
    )


def test_brute_force_chain_every_budget() -> None:
    # every byte budget around the step peaks of the candidates on a small chain
    chain = Chain.random(5, seed=3, max_bytes=60)
    costs = StepCosts(
        persistent_bytes=50,
        grad_bytes=(5, 0, 9, 3, 7),
        grad_rise_bytes=(2, 0, 9, 1, 7),
        optimizer_step_bytes=20,
        input_bytes=chain.input_bytes,
        checkpoint_state_bytes=2,
    )
    peaks = {step_peak_of(chain, p, costs) for p in step_candidates(chain, costs)}
    budgets = sorted({b + d for b in peaks for d in (-1, 0, 1)})
    check_contracts(chain, costs, budgets)


def test_optimizer_step_refusal_names_an_accepted_minimum() -> None:
    chain = Chain.homogeneous(6, out_bytes=10)
    costs = StepCosts(persistent_bytes=100, grad_bytes=(4,) * 6, optimizer_step_bytes=500)
    with pytest.raises(BudgetTooSmallError, match="optimizer step alone") as info:
        plan_for_step(chain, costs, costs.optimizer_phase_bytes - 1)
    assert info.value.minimum_bytes >= costs.optimizer_phase_bytes
    found = plan_for_step(chain, costs, info.value.minimum_bytes)
    assert step_peak_of(chain, found, costs) <= info.value.minimum_bytes


def test_checkpoint_state_bytes_are_counted_per_checkpointed_segment() -> None:
    chain = Chain.homogeneous(6, out_bytes=10)
    costs = StepCosts(persistent_bytes=0, grad_bytes=(0,) * 6)
    plan = Plan.from_checkpoints(chain, [2, 4])
    segments = sum(1 for _ in plan.for_chain(chain).walk())
    with_state = StepCosts(persistent_bytes=0, grad_bytes=(0,) * 6, checkpoint_state_bytes=1000)
    assert segments > 0
    # every checkpoint's state, and while a segment is recomputed the RNG state torch's
    # checkpoint forks aside (at most one more)
    bare = step_peak_of(chain, plan, costs)
    assert bare + 1000 * segments <= step_peak_of(chain, plan, with_state)
    assert step_peak_of(chain, plan, with_state) <= bare + 1000 * (segments + 1)
    # the search counts them: its plan for a budget that includes them fits with them
    budget = step_peak_of(chain, plan, with_state)
    assert step_peak_of(chain, plan_for_step(chain, with_state, budget), with_state) <= budget


CHAIN_PLANNERS = available()


def _path_graph_step_peak(chain: Chain, plan: Plan, costs: StepCosts) -> int:
    """``step_peak_of`` of ``plan`` read as a graph plan on the chain's path graph."""
    return step_peak_of(Graph.from_chain(chain), plan, costs)


@st.composite
def chains_with_state_costs(draw):
    """Random chains (half with negative backward overheads) and step costs with a nonzero
    checkpoint state per segment."""
    n = draw(st.integers(1, 9))
    negative = draw(st.booleans())
    chain = Chain.random(n, seed=draw(st.integers(0, 10**6)), negative_bwd_overheads=negative)
    costs = _costs(draw, n, chain.input_bytes, 40)
    state = draw(st.sampled_from([1, 7, 10, 40, 5056]))
    return chain, replace(costs, checkpoint_state_bytes=state)


@settings(max_examples=60, deadline=None)
@given(
    chains_with_state_costs(),
    st.sampled_from(CHAIN_PLANNERS),
    st.sampled_from([None, "least", "middle"]),
)
def test_a_chain_and_its_path_graph_have_one_step_peak(chain_costs, method, budget) -> None:
    """One whole-step model: every registered chain planner's plan costs the same whole step
    on the chain and, as a graph plan, on its path graph (checkpoint states live from each
    checkpointed segment's forward to its backward in both; the graph branch counted every
    segment's state all step before)."""
    chain, costs = chain_costs
    low = least_peak(chain, method)
    top = simulate(chain, Plan.none(chain)).peak_bytes
    # (a planner's least can be above storing everything: every-stage on one stage)
    middle = max(low, (low + top) // 2)
    activation_budget = {None: None, "least": low, "middle": middle}[budget]
    plan = plan_chain(chain, method, activation_budget)
    assert step_peak_of(chain, plan, costs) == _path_graph_step_peak(chain, plan, costs)


def test_every_nested_plan_has_one_step_peak_on_the_chain_and_its_path_graph() -> None:
    """Brute force: all 352 nested plans of 4-stage chains (negative backward overheads too),
    with the gradients made as the backward runs and accumulated, the output held, and a
    checkpoint state large enough to move the peak."""
    checked = moved = 0
    for seed in range(2):
        for negative in (False, True):
            chain = Chain.random(4, seed=seed, negative_bwd_overheads=negative)
            for grads_live in (False, True):
                costs = StepCosts(
                    persistent_bytes=30,
                    grad_bytes=(5, 0, 9, 3),
                    grad_rise_bytes=(2, 0, 9, 1),
                    output_held_bytes=4,
                    input_bytes=chain.input_bytes,
                    grads_live=grads_live,
                    checkpoint_state_bytes=25,
                )
                for plan in nested_plans(4):
                    peak = step_peak_of(chain, plan, costs)
                    assert peak == _path_graph_step_peak(chain, plan, costs), plan.describe()
                    stateless = replace(costs, checkpoint_state_bytes=0)
                    moved += peak > step_peak_of(chain, plan, stateless)
                    checked += 1
    assert checked == 8 * len(nested_plans(4)) == 8 * 352
    assert moved > 0


def test_a_graph_counts_a_segments_state_only_until_its_backward() -> None:
    # path graph of 4 nodes of 10 B each, segments [0-1] and [2-3]: during the backward of
    # node 3 (after its recomputation) both segments' states are held, from the backward of
    # node 1 on only [0-1]'s, until node 0's backward frees it
    chain = Chain.homogeneous(4, out_bytes=10)
    plan = Plan.from_checkpoints(chain, [2])
    graph = Graph.from_chain(chain)
    graph_plan = plan
    assert [s.nodes for s in graph_plan.segments] == [(0, 1), (2, 3)]
    assert checkpoint_spans(graph_plan) == ((0, 1), (2, 1))
    timeline = [
        StepEvent(e.op == "B", e.node, e.peak_bytes, e.live_bytes)
        for e in simulate_graph(graph, graph_plan).timeline
    ]
    states = segment_state_bytes(timeline, checkpoint_spans(graph_plan), 1000)
    backward_of = {e.index: s for e, s in zip(timeline, states, strict=True) if e.backward}
    assert backward_of == {3: 2000, 2: 2000, 1: 1000, 0: 1000}
    assert states[0] == 1000
    # node 0's backward makes 500 B of gradients: the step's peak (530 B without states), where
    # one state of 100 B is left, not both (730 B, as the graph branch counted before)
    costs = StepCosts(persistent_bytes=0, grad_bytes=(500, 0, 0, 0), checkpoint_state_bytes=100)
    stateless = replace(costs, checkpoint_state_bytes=0)
    assert step_peak_of(graph, graph_plan, stateless) == 530
    assert step_peak_of(graph, graph_plan, costs) == 630 == step_peak_of(chain, plan, costs)
    assert step_peak(timeline, costs, checkpoint_spans(graph_plan)) == 630


def test_no_budget_is_least_memory_within_one_forward() -> None:
    chain = Chain.random(10, seed=1, max_bytes=100)
    costs = StepCosts(persistent_bytes=0, grad_bytes=(0,) * 10)
    chosen = plan_for_step(chain, costs, None)
    none = Plan.none(chain)
    limit = simulate(chain, none).total_time + chain.total_fwd_time()
    assert simulate(chain, chosen).total_time <= limit
    assert simulate(chain, chosen).peak_bytes < simulate(chain, none).peak_bytes
    graph = residual_chain(4, 100)
    graph_costs = StepCosts(persistent_bytes=0, grad_bytes=(0,) * graph.n)
    assert plan_for_step(graph, graph_costs, None).method in ("reforward", "none")


def test_a_structure_that_is_neither_a_chain_nor_a_graph_is_refused() -> None:
    with pytest.raises(TypeError, match="Chain or a Graph"):
        plan_for_step([1, 2, 3], StepCosts(persistent_bytes=0, grad_bytes=()), 100)


# ---------------------------------------------------------------------- captured models
def test_plan_for_step_contracts_on_captured_models() -> None:
    # the models of tests/test_auto.py: a chain (mlp-chain, resnet18) as remat.auto captures
    # it, and the branchy module graph auto plans with the graph planners
    import torch

    from remat import zoo
    from remat.auto import checkpoint_state_bytes, fixed_bytes, stage_grad_bytes
    from remat.capture.chain import capture
    from remat.capture.graph import trace_graph

    for name, kwargs in (
        ("mlp-chain", {"batch_size": 64, "layers": 8, "width": 128}),
        ("resnet18", {"batch_size": 4, "image_size": 32}),
    ):
        entry = zoo.get(name, **kwargs)
        captured = capture(entry.model, entry.batch, loss_fn=entry.loss_fn)
        grads = stage_grad_bytes(captured.stages)
        costs = StepCosts(
            persistent_bytes=fixed_bytes(entry.model) - sum(grads),
            grad_bytes=tuple(grads),
            grad_rise_bytes=tuple(captured.grad_rise_bytes or ()),
            input_bytes=captured.chain.input_bytes,
            checkpoint_state_bytes=checkpoint_state_bytes(),
        )
        unplanned = step_peak_of(captured.chain, Plan.none(captured.chain), costs)
        check_contracts(captured.chain, costs, [int(unplanned * f) for f in (0.5, 0.7, 0.9, 1)])

    torch.manual_seed(0)
    model = Branchy()
    trace = trace_graph(model, torch.randn(256, 32), level="module")
    costs = StepCosts(
        persistent_bytes=fixed_bytes(model) - sum(trace.param_grad_bytes),
        grad_bytes=tuple(trace.param_grad_bytes),
        input_bytes=trace.graph.input_bytes,
    )
    unplanned = step_peak_of(trace.graph, Plan.none(), costs)
    check_contracts(trace.graph, costs, [int(unplanned * f) for f in (0.6, 0.8, 1)])


def test_a_budget_without_gradient_timing_counts_the_checkpoints_rng_states() -> None:
    # auto_distributed's reading (plan_for_total_budget without grad_bytes: every gradient in
    # the fixed bytes): the plan's predicted step, with the executor's RNG state per checkpoint
    # (total_peak_bytes), stays within the budget. Before the one search it planned the
    # activation budget alone: here 27,001,915 B predicted at a 27,000,000 B budget.
    import importlib

    auto = importlib.import_module("remat.auto")
    chain = Chain.random(9, seed=1, max_bytes=2_000_000)
    fixed = 10_000_000 + 9 * 300_000
    budgets = range(21_000_000, 45_000_000, 1_500_000)
    for budget in budgets:
        try:
            found = auto.plan_for_total_budget(
                chain, fixed, budget, "optimal-time", optimizer_step_bytes=500
            )
        except BudgetTooSmallError:
            continue
        predicted = auto.total_peak_bytes(
            chain, found, fixed, [0] * chain.n, optimizer_step_bytes=500
        )
        assert predicted <= budget, (budget, predicted, found.describe())


def test_the_graph_least_does_not_move_with_the_measured_times():
    # three captures of T5 (graph path) with equal bytes: the MILP's plan at the least
    # activation peak followed the measured times, and the least whole-step peak it named
    # moved with them (486920 B at the first capture of a process, 474632 B after; the
    # conformance table's T5 at 10 % was refused: a 486511 B budget, 505096 B named). The
    # floor's graph plan is chosen on unit times now
    data = json.loads((Path(__file__).parent / "data" / "t5_graph_captures.json").read_text())
    leasts = set()
    for capture in data["captures"]:
        graph = Graph.from_json(json.dumps(capture["graph"]))
        known = {f.name for f in fields(StepCosts)}
        costs = StepCosts(**{k: v for k, v in capture["costs"].items() if k in known})
        plan, least = least_step_plan(graph, costs)
        assert plan_for_step(graph, costs, least) is not None  # the named least is accepted
        leasts.add(least)
    assert len({c["graph"]["nodes"][0]["fwd_time"] for c in data["captures"]}) == 3
    assert len(leasts) == 1, leasts  # was {478472, 482432}


def test_the_least_named_is_the_least_step_of_the_plans_weighed_on_a_frozen_resnet():
    # torchvision ResNet-10 with a frozen stem and layer1 (tests/data, captured on an AMX
    # machine): the least-activation plan's step (61567904 B) was the minimum named, while
    # a candidate's step, 60647328 B, was accepted: budgets between them were refused naming
    # a minimum remat's own plans beat. The floor has the candidates made on unit times now,
    # and the step's descent (planning.step_descent) below them: checkpointing the two middle
    # stages alone, as checkpointing every block does there, the least flat plan
    data = json.loads((Path(__file__).parent / "data" / "resnet_frozen_step.json").read_text())
    chain = Chain.from_json(json.dumps(data["chain"]))
    costs = StepCosts(**data["costs"])
    assert chain.frozen_prefix == 2
    pool = [step_peak_of(chain, p, costs) for p in step_candidates(chain, costs)]
    plan, least = least_step_plan(chain, costs)
    assert least == min(pool) == min(step_peak_of(chain, p, costs) for p in _flat_plans(6))
    assert least == 60552096  # the candidates' least: 60647328
    assert plan.params.get("step_descent")
    check_contracts(chain, costs, [least - 1, least, (least + max(pool)) // 2])


def _flat_plans(n: int):
    """Every flat plan of ``n`` stages: each partition into segments, each stored or not."""
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), n]
        spans = list(itertools.pairwise(bounds))
        for flags in itertools.product([False, True], repeat=len(spans)):
            yield Plan.from_chain_segments(
                tuple(ChainSegment(a + 1, b, f) for (a, b), f in zip(spans, flags, strict=True))
            )


def test_the_least_named_is_never_above_the_least_flat_plan_on_random_chains():
    # the planners minimise the activation peak; the whole step's least can lie elsewhere.
    # Without the descent, 2 of these 300 chains named a least above a flat plan's step
    below = 0
    for seed in range(300):
        rnd = random.Random(seed)
        n = rnd.randint(2, 7)
        chain = Chain.random(n, seed=seed, max_bytes=100)
        costs = StepCosts(
            persistent_bytes=rnd.randint(0, 160),
            grad_bytes=tuple(rnd.randint(0, 40) for _ in range(n)),
            input_bytes=chain.input_bytes,
            checkpoint_state_bytes=rnd.choice([0, 1, 10]),
            output_held_bytes=rnd.randint(0, 40),
        )
        flat = min(step_peak_of(chain, p, costs) for p in _flat_plans(n))
        least = least_step_plan(chain, costs)[1]
        assert least <= flat, (seed, least, flat)
        below += least < flat
    assert below > 100  # nested plans go lower still on many of them


def test_the_graph_least_named_no_single_move_lowers_on_random_graphs():
    # the graph floor's descent (planning.step_descent): from the least-activation plan of the
    # MILP, Re-forwarding's and store-everything, a node stored or recomputed with a segment it
    # reads or feeds, moved between two, a segment dropped or merged. On Hugging Face T5 the
    # MILP's least-activation plan stepped at 531,980 B; the descent names 503,312 B, which
    # the planned step then measured below (497,544 B). Without it, 4 of these 60 graphs named
    # a least above the best flat plan (brute force), with it 1
    from remat.planning import _graph_neighbours

    descended = 0
    for seed in range(60):
        rnd = random.Random(seed)
        graph = random_dag(rnd.randint(3, 6), seed=seed, max_bytes=50)
        costs = StepCosts(
            persistent_bytes=rnd.randint(0, 80),
            grad_bytes=tuple(rnd.randint(0, 20) for _ in range(graph.n)),
            input_bytes=graph.input_bytes,
            output_held_bytes=rnd.randint(0, 20),
        )
        plan, least = least_step_plan(graph, costs)
        assert plan_for_step(graph, costs, least) is not None
        if not plan.params.get("step_descent"):
            continue  # a floor plan was already the least
        descended += 1
        here = tuple(seg.nodes for seg in plan.segments)
        for near in _graph_neighbours(graph, here):
            assert step_peak_of(graph, Plan.from_segments(near), costs) >= least, seed
    assert descended >= 3  # the descent named the least on 3 of them


def test_the_least_named_is_the_least_activation_plan_that_makes_gradients_late():
    # An MLP of Linear and GELU stages (a distillation loss, tests/data): two plans reach the
    # least activation peak, and their steps differ by one layer's gradient. The floor chose on
    # unit times and named 5,956,376 B; a budget of 5,700,000 B was accepted or refused as the
    # measured times picked one plan or the other. The floor has the least plan on times
    # weighted by each stage's parameters too (a proxy that does not move with the timing)
    data = json.loads((Path(__file__).parent / "data" / "mlp_distill_step.json").read_text())
    chain = Chain.from_json(json.dumps(data["chain"]))
    costs = StepCosts(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in data["costs"].items()}
    )
    plan, least = least_step_plan(chain, costs)
    assert least == 5_693_208, plan.describe()  # was 5,956,376
    unit = unit_time_least_plan(chain, "optimal-time")
    assert step_peak_of(chain, unit, costs) == 5_956_376
    for times in (1.0, 7.3):  # other measured times: the same least, accepted
        timed = replace(chain, fwd_time=(times,) * chain.n, bwd_time=(2 * times,) * chain.n)
        assert least_step_plan(timed, costs)[1] == least
        assert step_peak_of(timed, plan_for_step(timed, costs, least), costs) <= least
