"""The planner protocol: ``planner(chain, budget)`` with optional ``sweep`` / ``least_peak``,
used through :func:`remat.planners.sweep` / :func:`remat.planners.least_peak` so that no caller
branches on a planner's name (the last test checks the source for such branches)."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nested_plans import brute_force, min_time_within

import remat
from remat import BudgetTooSmallError, Chain, Plan, simulate
from remat.core.graph import Graph
from remat.core.simulate import simulate_graph
from remat.core.synthetic import random_dag
from remat.planners import (
    _REGISTRY,
    Planner,
    PlannerEntry,
    available,
    candidates,
    get,
    get_planner,
    grid_candidates,
    least_peak,
    plan_chain,
    register,
    sweep,
)
from remat.planners.graph import (
    GraphPlanner,
    available_graph_planners,
    get_graph_planner,
    least_graph_peak,
    plan_graph,
    sweep_graph,
)
from remat.planners.optimal_time import min_feasible_peak
from remat.planners.optimal_time import sweep as optimal_time_sweep

SRC = Path(__file__).resolve().parents[1] / "src" / "remat"

chains = st.builds(
    Chain.random,
    st.integers(1, 8),
    seed=st.integers(0, 10_000),
    overheads=st.booleans(),
)
frozen_chains = st.builds(
    lambda chain, k: dataclasses.replace(chain, frozen_prefix=min(k, chain.n)),
    chains,
    st.integers(1, 8),
)
"""Chains whose first stages have no backward (a fine-tuned model's frozen stem): the
planners' own costs count those stages' gradients, the simulator does not (NOTE [ A frozen
prefix in the planners ] in remat.planners.registry)."""


def test_every_registered_planner_satisfies_the_protocol() -> None:
    for method in available():
        planner = get_planner(method)
        assert isinstance(planner, Planner), method
        for optional in ("sweep", "least_peak", "candidates"):
            assert callable(getattr(planner, optional, callable)), (method, optional)
    for method in available_graph_planners():
        assert isinstance(get_graph_planner(method), GraphPlanner), method


def test_optimal_time_brings_its_own_sweep_and_least_peak() -> None:
    planner = get_planner("optimal-time")
    assert planner.sweep is optimal_time_sweep  # type: ignore[attr-defined]
    assert planner.least_peak is min_feasible_peak  # type: ignore[attr-defined]


@settings(max_examples=50)
@given(st.one_of(chains, frozen_chains))
def test_least_peak_is_feasible_and_exact_for_every_planner(chain: Chain) -> None:
    """Planning at ``least_peak`` succeeds within it; one byte less fails with the specific
    error (for every planner: the budget planners search down to it, the fixed ones have one
    plan). Any other exception fails the test: a planner that cannot plan a chain is a bug."""
    for method in available():
        least = least_peak(chain, method)
        found = plan_chain(chain, method, least)
        assert simulate(chain, found).peak_bytes <= least, method
        with pytest.raises(BudgetTooSmallError):
            plan_chain(chain, method, least - 1)


@settings(max_examples=10)
@given(st.integers(1, 5), st.integers(0, 10_000))
def test_optimal_time_least_peak_is_the_least_nested_peak(n: int, seed: int) -> None:
    chain = Chain.random(n, seed=seed)
    rows = brute_force(chain)
    assert least_peak(chain, "optimal-time") == min(peak for peak, _, _ in rows)


def _budgets(chain: Chain, data: st.DataObject) -> list[int]:
    top = simulate(chain, Plan.none(chain)).peak_bytes
    return data.draw(st.lists(st.integers(0, top + 5), min_size=1, max_size=6))


@settings(max_examples=50)
@given(st.one_of(chains, frozen_chains), st.data())
def test_sweep_equals_planning_each_budget(chain: Chain, data: st.DataObject) -> None:
    budgets = _budgets(chain, data)
    for method in available():
        swept = sweep(chain, method, budgets)
        assert len(swept) == len(budgets)
        for budget, got in zip(budgets, swept, strict=True):
            try:
                one = plan_chain(chain, method, budget)
            except BudgetTooSmallError:
                assert got is None, (method, budget)
                continue
            assert got is not None, (method, budget)
            assert got.method == method
            assert got.fingerprint == one.fingerprint
            assert got.predicted_peak_bytes == simulate(chain, got).peak_bytes <= budget
            assert got.predicted_time == pytest.approx(one.predicted_time), (method, budget)
            if getattr(get_planner(method), "sweep", None) is None:
                assert got == one, (method, budget)


@settings(max_examples=10)
@given(st.integers(1, 5), st.integers(0, 10_000), st.data())
def test_optimal_time_sweep_is_the_brute_force_least_time(
    n: int, seed: int, data: st.DataObject
) -> None:
    chain = Chain.random(n, seed=seed)
    rows = brute_force(chain)
    budgets = _budgets(chain, data)
    for budget, got in zip(budgets, sweep(chain, "optimal-time", budgets), strict=True):
        best = min_time_within(rows, budget)
        if best is None:
            assert got is None
        else:
            assert got is not None and got.predicted_time == pytest.approx(best)


@settings(max_examples=10)
@given(chains)
def test_candidates_are_stamped_plans(chain: Chain) -> None:
    """Every planner's candidates are simulated plans for the chain; without its own
    ``candidates`` a planner's are its grid; optimal-time's add the baselines' default plans."""
    for method in available():
        found = candidates(chain, method)
        assert found, method
        for p in found:
            assert p.predicted_peak_bytes == simulate(chain, p).peak_bytes, method
            assert p.fingerprint == chain.fingerprint
        if getattr(get_planner(method), "candidates", None) is None:
            assert found == grid_candidates(chain, method)
    found = candidates(chain, "optimal-time")
    assert {p.method for p in found} >= {"optimal-time", "none", "chen-sqrt", "hong-dp"}


def test_sweep_and_least_peak_do_not_swallow_other_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only BudgetTooSmallError means "no plan at this budget"; a planner's bug surfaces."""

    def broken(chain: Chain, budget: int | None) -> Plan:
        raise RuntimeError("a planner bug")

    monkeypatch.setitem(_REGISTRY, "broken-test-planner", PlannerEntry("broken", chain=broken))
    chain = Chain.homogeneous(4)
    with pytest.raises(RuntimeError, match="a planner bug"):
        sweep(chain, "broken-test-planner", [1, 10**9])
    with pytest.raises(RuntimeError, match="a planner bug"):
        least_peak(chain, "broken-test-planner")
    with pytest.raises(RuntimeError, match="a planner bug"):
        candidates(chain, "broken-test-planner")


@pytest.mark.parametrize("seed", range(3))
def test_graph_planners_least_peak_and_sweep(seed: int) -> None:
    graph = random_dag(6, seed)
    top = plan_graph(graph, "none").predicted_peak_bytes or 0
    budgets = [0, top // 2, (3 * top) // 4, top]
    for method in available_graph_planners():
        least = least_graph_peak(graph, method)
        assert (plan_graph(graph, method, least).predicted_peak_bytes or 0) <= least, method
        for budget, got in zip(budgets, sweep_graph(graph, method, budgets), strict=True):
            try:
                one = plan_graph(graph, method, budget)
            except BudgetTooSmallError:
                assert got is None, (method, budget)
                continue
            assert got is not None, (method, budget)
            assert got.predicted_time == pytest.approx(one.predicted_time), (method, budget)
            assert (got.predicted_peak_bytes or 0) <= budget


def test_plan_takes_activation_budget_and_budget_is_a_deprecated_alias() -> None:
    chain = Chain.homogeneous(8)
    new = remat.plan(chain, "chen-budget", activation_budget="90%")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert remat.plan(chain, "chen-budget", "90%") == new  # positional: no warning
    with pytest.warns(DeprecationWarning, match="activation_budget"):
        old = remat.plan(chain, "chen-budget", budget="90%")
    assert old == new
    with pytest.raises(TypeError, match="both"):
        remat.plan(chain, "chen-budget", activation_budget="90%", budget="90%")


def test_cli_activation_budget_and_its_budget_alias(capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main

    assert (
        main(["plan", "homogeneous:8", "--method", "chen-sqrt", "--activation-budget", "90%"]) == 0
    )
    new = capsys.readouterr().out
    assert main(["plan", "homogeneous:8", "--method", "chen-sqrt", "--budget", "90%"]) == 0
    old = capsys.readouterr().out
    header = new.splitlines()[0]
    assert "activation budget 31.50 MiB" in header, header  # 90% of the 35 MiB unplanned peak
    assert old.splitlines()[0] == header


def test_errors_and_summaries_name_the_budget() -> None:
    chain = Chain.homogeneous(8)
    with pytest.raises(BudgetTooSmallError, match="activation budget 1 B") as info:
        remat.plan(chain, "optimal-time", activation_budget=1)
    assert info.value.kind == "activation"
    whole = BudgetTooSmallError(10, 20, "optimal-time", kind="whole-step")
    assert str(whole).startswith("whole-step budget 10 B") and "whole-step peak" in str(whole)


_BRANCH = re.compile(r"""\bmethod\s*(?:==|!=)\s*["']([^"']+)["']""")


def test_no_module_branches_on_a_planner_name() -> None:
    """Outside ``planners/``, no ``method == "<planner>"`` / ``!=``: use the protocol."""
    names = set(available()) | set(available_graph_planners())
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if "planners" in path.relative_to(SRC).parts[:1]:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in _BRANCH.finditer(line):
                if match.group(1) in names:
                    found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_one_registry_each_entry_says_what_it_plans() -> None:
    """One table: ``available(None)`` is every name, the chain and graph names its parts; a
    name may hold a planner of each kind (``none``, ``reforward``); the old graph names read the
    same table."""
    every = available(None)
    assert set(every) == set(available("chain")) | set(available("graph"))
    assert available() == available("chain")
    assert available_graph_planners() == available("graph")
    assert _REGISTRY["none"].plans == ("chain", "graph")
    assert _REGISTRY["reforward"].plans == ("chain", "graph")
    assert _REGISTRY["optimal-time"].plans == ("chain",)
    assert _REGISTRY["checkmate-milp"].plans == ("graph",)
    for name in every:
        for kind in _REGISTRY[name].plans:
            assert get(name, kind) is getattr(_REGISTRY[name], kind)
            assert isinstance(get(name, kind), Planner)
    assert get_graph_planner("reforward") is get("reforward", "graph")
    assert get_graph_planner("reforward") is not get_planner("reforward")
    with pytest.raises(ValueError, match="unknown graph planner 'optimal-time'"):
        get("optimal-time", "graph")
    with pytest.raises(ValueError, match="kind must be one of"):
        available("tree")
    with pytest.raises(ValueError, match="registered twice"):
        register("none", plans="graph")(lambda graph, budget: None)


@settings(max_examples=15)
@given(chains, st.data())
def test_a_chain_planner_plans_the_path_graph_as_its_chain(
    chain: Chain, data: st.DataObject
) -> None:
    """A chain-only planner plans a path graph: its chain plan carried over, the same stamp
    (the interpreter on the path graph agrees with the chain simulator), for one budget, a
    sweep and the least peak; a graph that is not a path is refused by name."""
    graph = Graph.from_chain(chain)
    budgets = _budgets(chain, data)
    for method in sorted(set(available("chain")) - set(available("graph"))):
        assert least_peak(graph, method) == least_peak(chain, method), method
        assert least_graph_peak(graph, method) == least_peak(chain, method), method
        chain_plans = sweep(chain, method, budgets)
        graph_plans = sweep_graph(graph, method, budgets)
        for budget, one, got in zip(budgets, chain_plans, graph_plans, strict=True):
            if one is None:
                assert got is None, (method, budget)
                with pytest.raises(BudgetTooSmallError):
                    plan_graph(graph, method, budget)
                continue
            assert got == dataclasses.replace(one, chain=False), (method, budget)
            assert got.fingerprint == graph.fingerprint
            assert simulate_graph(graph, got).peak_bytes == got.predicted_peak_bytes
            assert got.predicted_peak_bytes == one.predicted_peak_bytes <= budget
            assert plan_graph(graph, method, budget) == got, (method, budget)
    with pytest.raises(ValueError, match="unknown graph planner 'optimal-time'"):
        plan_graph(random_dag(6, 0), "optimal-time")
