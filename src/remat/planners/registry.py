"""The one planner registry: a table of planners by name, each entry saying what it plans.

Every planner satisfies :class:`Planner`: it is called as ``planner(structure, budget,
**options)`` (``structure`` a :class:`~remat.core.chain.Chain` or a
:class:`~remat.core.graph.Graph`, ``budget`` the peak in bytes the simulator must predict for
the plan, ``None`` for the planner's default) and may carry three optional methods,
``sweep(structure, budgets) -> list[plan | None]`` (many budgets at once, e.g. one DP table),
``least_peak(structure) -> int`` (the least peak it reaches) and ``candidates(chain) ->
list[Plan]`` (the plans to weigh against a budget on something else than the activation peak,
such as :func:`remat.auto`'s whole-step budget). :func:`register` files it under a name and a
kind (:data:`KINDS`): what it plans, a chain or a graph. One name may hold one planner of each
kind (``none``, ``reforward``): a :class:`PlannerEntry`. A name with only a chain planner also
plans a path graph (:meth:`Graph.is_chain`): the chain planner on :meth:`Graph.to_chain`, its plan
the same plan (one type for chains and graphs; the chain simulator and the interpreter on the
path graph agree exactly, tests/test_one_simulator.py, so the stamped plan is the same).

Callers never branch on a planner's name: :func:`plan_chain` / :func:`plan_graph` parse the
budget, call the planner, check its plan against the budget and stamp it with its simulated cost;
:func:`sweep`, :func:`least_peak` and :func:`candidates` use the planner's own method when it has
one and a generic rule otherwise. Planners never import torch.

This module imports no planner: the planner modules import it to register themselves and
:func:`available` / :func:`get` load them by name (``_MODULES``) on first use.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from remat.core.chain import Chain
from remat.core.chain_simulate import simulate
from remat.core.errors import BUDGET_KINDS, BudgetTooSmallError
from remat.core.graph import Graph
from remat.core.plan import Plan
from remat.core.simulate import simulate_graph
from remat.core.units import resolve_budget

__all__ = [
    "KINDS",
    "BUDGET_KINDS",
    "Planner",
    "GraphPlanner",
    "PlannerEntry",
    "BudgetTooSmallError",
    "register",
    "available",
    "get",
    "get_planner",
    "plan_chain",
    "plan_graph",
    "stamp",
    "sweep",
    "least_peak",
    "candidates",
    "grid_candidates",
    "GRID_POINTS",
    "register_graph_planner",
    "available_graph_planners",
    "get_graph_planner",
    "sweep_graph",
    "least_graph_peak",
]

KINDS = ("chain", "graph")
"""What a planner plans: a :class:`~remat.core.chain.Chain` or a :class:`~remat.core.graph.Graph`."""


_MODULES = (
    "baselines",
    "chen",
    "hong",
    "reforward",
    "optimal_time",
    "reforward_graph",
    "checkmate_milp",
    "articulation",
)
"""The planner modules (under ``remat.planners``) that register themselves when imported."""


@runtime_checkable
class Planner(Protocol):
    """A planner: ``planner(structure, budget_bytes, **options) -> plan``.

    ``structure`` is what the planner's kind says (a chain planner takes a ``Chain`` and
    returns a ``Plan``, a graph planner a ``Graph`` and a ``Plan``); ``budget_bytes`` the
    peak the simulator must predict for the plan (``None``: the planner's default); ``options``
    a graph planner's keyword settings (validated by its own config dataclass). Optional, found
    with ``getattr`` (:func:`sweep`, :func:`least_peak`, :func:`candidates`):

    * ``sweep(structure, budgets, **options) -> list[plan | None]``: the plans of
      ``planner(structure, b)`` for each budget, ``None`` where it raises
      :class:`BudgetTooSmallError`;
    * ``least_peak(structure, **options) -> int``: the least peak of any of its plans;
      planning at it succeeds;
    * ``candidates(chain) -> list[Plan]`` (chain planners): stamped plans (:func:`plan_chain`'s)
      to choose from under a budget that is not the activation peak (default:
      :func:`grid_candidates`).
    """

    def __call__(self, structure: Any, budget: int | None, /, **options: Any) -> Any: ...


GraphPlanner = Planner
"""The old name of :class:`Planner` for graph planners (one protocol now)."""


@dataclass
class PlannerEntry:
    """One row of the table: a name and its planner of each kind (``None``: none of it)."""

    name: str
    chain: Planner | None = None
    graph: Planner | None = None

    @property
    def plans(self) -> tuple[str, ...]:
        """The kinds this entry has a planner of (a chain planner also plans path graphs)."""
        return tuple(kind for kind in KINDS if getattr(self, kind) is not None)


_REGISTRY: dict[str, PlannerEntry] = {}


def register(
    name: str,
    *,
    plans: str = "chain",
    sweep: Callable[..., list[Any]] | None = None,
    least_peak: Callable[..., int] | None = None,
    candidates: Callable[[Chain], list[Plan]] | None = None,
) -> Callable[[Planner], Planner]:
    """Decorator: register ``fn`` as the planner called ``name`` of kind ``plans`` (what it
    plans, one of :data:`KINDS`), with its optional ``sweep``, ``least_peak`` and
    ``candidates`` methods (see :class:`Planner`) attached to it."""
    if plans not in KINDS:
        raise ValueError(f"plans must be one of {KINDS}, got {plans!r}")

    def wrap(fn: Planner) -> Planner:
        entry = _REGISTRY.setdefault(name, PlannerEntry(name))
        old = getattr(entry, plans)
        if old is not None and old is not fn:
            raise ValueError(f"{plans} planner {name!r} is registered twice")
        if sweep is not None:
            fn.sweep = sweep  # type: ignore[attr-defined]
        if least_peak is not None:
            fn.least_peak = least_peak  # type: ignore[attr-defined]
        if candidates is not None:
            fn.candidates = candidates  # type: ignore[attr-defined]
        setattr(entry, plans, fn)
        return fn

    return wrap


def _load_all() -> None:
    for module in _MODULES:
        try:
            importlib.import_module(f"remat.planners.{module}")
        except ModuleNotFoundError as err:  # a planner module not written yet
            if err.name != f"remat.planners.{module}":
                raise


def available(kind: str | None = "chain") -> list[str]:
    """Names of the registered planners of ``kind`` (:data:`KINDS`; the default ``"chain"``:
    what :func:`remat.plan` takes for a chain; ``"graph"``: those that plan any graph;
    ``None``: every name)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    _load_all()
    return sorted(name for name, entry in _REGISTRY.items() if kind is None or getattr(entry, kind))


def get(name: str, kind: str = "chain") -> Planner:
    """The ``kind`` planner registered as ``name`` (clear error listing the names otherwise)."""
    _load_all()
    entry = _REGISTRY.get(name)
    found = None if entry is None else getattr(entry, kind)
    if found is None:
        what = "planner" if kind == "chain" else f"{kind} planner"
        raise ValueError(f"unknown {what} {name!r}; choose one of: {', '.join(available(kind))}")
    return found


def get_planner(name: str) -> Planner:
    """The chain planner registered as ``name``: :func:`get`."""
    return get(name, "chain")


def get_graph_planner(name: str) -> Planner:
    """The graph planner registered as ``name``: ``get(name, "graph")``."""
    return get(name, "graph")


def available_graph_planners() -> list[str]:
    """Names of the planners that plan any graph: ``available("graph")``."""
    return available("graph")


def register_graph_planner(
    name: str,
    *,
    sweep: Callable[..., list[Any]] | None = None,
    least_peak: Callable[..., int] | None = None,
) -> Callable[[Planner], Planner]:
    """``register(name, plans="graph", ...)``."""
    return register(name, plans="graph", sweep=sweep, least_peak=least_peak)


def _via_chain(graph: Graph, method: str) -> bool:
    """Whether ``method`` plans ``graph`` as a chain: a path graph and no graph planner of that
    name, but a chain one."""
    _load_all()
    entry = _REGISTRY.get(method)
    return (
        entry is not None and entry.graph is None and entry.chain is not None and (graph.is_chain())
    )


def _on_path(plan: Plan | None, graph: Graph) -> Plan | None:
    return None if plan is None else _described_by_nodes(plan)


def _described_by_nodes(plan: Plan) -> Plan:
    """A chain planner's plan of a path graph, made for the graph: the same plan (a chain and
    its path graph share one fingerprint), described by the graph's nodes."""
    return replace(plan, chain=False)


def plan_chain(
    chain: Chain, method: str = "optimal-time", budget: int | float | str | None = None
) -> Plan:
    """Plan ``chain`` with the planner registered as ``method`` under a peak-memory ``budget``.

    ``budget`` is the peak activation memory that :func:`remat.simulate` predicts (bytes, or a
    string such as ``"512MiB"``); ``None`` lets the planner pick its default. The returned plan
    carries its simulated peak and time and the chain's fingerprint. Raises
    :class:`BudgetTooSmallError` (naming the minimum) when the planner's plan does not fit.
    What :func:`remat.plan` does for a chain (graph planners call it too, e.g. ``articulation``).
    """
    budget_bytes = None
    if budget is not None:
        budget_bytes = resolve_budget(
            budget,
            lambda: simulate(chain, Plan.none(chain)).peak_bytes,
            "the unplanned activation peak",
        )
    try:
        found = get(method)(chain, budget_bytes)
    except BudgetTooSmallError as refused:
        if budget_bytes is None or not chain.frozen_prefix:
            raise
        found = _least_within(chain, method, budget_bytes, refused)
    return _stamped(chain, method, found, budget_bytes)


# NOTE [ A frozen prefix in the planners ]: the flat planners' closed-form costs (hong-dp,
# hong-linear, reforward: Note [flat plan peak]) and optimal-time's DP count every stage as one
# with a backward. The simulator knows ``Chain.frozen_prefix``: a frozen stage stored holds
# nothing and its input gets no gradient, so a plan peaks at most where those planners think, and
# often below. A segment that checkpoints a frozen embedding with the first block holds the token
# ids instead of the embeddings: a LoRA GPT-2's least plan simulates at 549,124 B where hong-dp's
# own costs say 563,972 B. So a planner refused budgets its own least plan meets (least_peak is
# that plan's simulated peak) and auto(compile=) crashed planning at it. Here, the one place
# every chain plan is made: where a planner refuses a budget on a chain with a frozen prefix,
# its plan without a budget runs if the simulator puts it within, else the refusal names the
# lower of the two minima; :func:`least_peak` names that lower one too (optimal-time's own least
# is its DP's, above the simulated peak of its plan without a budget on some frozen chains).
def _least_within(chain: Chain, method: str, budget: int, refused: BudgetTooSmallError) -> Plan:
    """``method``'s plan without a budget if its simulated peak fits ``budget`` (NOTE [ A frozen
    prefix in the planners ]), else ``refused`` naming the least simulated peak known."""
    least, peak = _no_budget_plan(chain, method)
    if peak <= budget:
        return least
    raise BudgetTooSmallError(
        budget, min(refused.minimum_bytes, peak), method, refused.detail
    ) from None


@functools.lru_cache(maxsize=64)
def _no_budget_plan(chain: Chain, method: str) -> tuple[Plan, int]:
    """``method``'s plan of ``chain`` without a budget and its simulated peak (a sweep over
    budgets asks for it again at each)."""
    plan = get(method)(chain, None)
    return plan, simulate(chain, plan.for_graph(chain)).peak_bytes


def plan_graph(
    graph: Graph,
    method: str = "checkmate-milp",
    budget: int | float | str | None = None,
    **options: Any,
) -> Plan:
    """Plan ``graph`` with the planner ``method`` under a peak-memory ``budget``.

    ``budget`` is the peak that :func:`remat.graphs.simulate_graph` predicts (bytes, a string
    such as ``"512MiB"``, or a percentage of the unplanned peak such as ``"50%"``:
    :func:`remat.core.units.resolve_budget`); ``None`` lets the planner pick its default.
    ``options`` go to the planner (e.g. ``time_limit_s=10`` for ``checkmate-milp``). A chain
    planner plans a path graph (module docstring). The returned plan carries its simulated peak
    and time and the graph's fingerprint. Raises :class:`BudgetTooSmallError` (naming the
    minimum) when nothing fits.

    >>> from remat.core.graph import Graph
    >>> g = Graph.from_edges([(), (0,), (1,)], out_bytes=[4, 4, 4])
    >>> p = plan_graph(g, "none")
    >>> p.method, p.predicted_peak_bytes
    ('none', 20)
    """
    if _via_chain(graph, method) and not options:
        return _described_by_nodes(plan_chain(graph.to_chain(), method, budget))
    budget_bytes = None
    if budget is not None:
        budget_bytes = resolve_budget(
            budget,
            lambda: simulate_graph(graph, Plan.none()).peak_bytes,
            "the unplanned peak",
        )
    found = get(method, "graph")(graph, budget_bytes, **options)
    return _stamped(graph, method, found, budget_bytes)


def _kind(structure: Chain | Graph) -> str:
    if isinstance(structure, Chain):
        return "chain"
    if isinstance(structure, Graph):
        return "graph"
    raise TypeError(f"planners take a Chain or a Graph, got {type(structure).__name__}")


def _plan(structure: Any, method: str, budget: int | None, **options: Any) -> Any:
    if _kind(structure) == "chain":
        return plan_chain(structure, method, budget)
    return plan_graph(structure, method, budget, **options)


def sweep(structure: Any, method: str, budgets: Iterable[int], **options: Any) -> list[Any]:
    """:func:`plan_chain` / :func:`plan_graph` at each of ``budgets`` (bytes): one plan per
    budget, ``None`` where the planner raises :class:`BudgetTooSmallError`. Uses the planner's
    own ``sweep`` (e.g. optimal-time's one DP table for all budgets) when it has one; plans them
    one by one otherwise."""
    budgets = list(budgets)
    kind = _kind(structure)
    if kind == "graph" and _via_chain(structure, method) and not options:
        return [_on_path(p, structure) for p in sweep(structure.to_chain(), method, budgets)]
    own = getattr(get(method, kind), "sweep", None)
    if own is None:
        result: list[Any] = []
        for budget in budgets:
            try:
                result.append(_plan(structure, method, budget, **options))
            except BudgetTooSmallError:
                result.append(None)
        return result
    plans = own(structure, budgets, **options)
    if len(plans) != len(budgets):
        raise RuntimeError(
            f"planner {method!r}'s sweep returned {len(plans)} plans for {len(budgets)} budgets"
        )
    stamped: list[Any] = []
    for budget, found in zip(budgets, plans, strict=True):
        if found is None and kind == "chain" and structure.frozen_prefix:
            plan, peak = _no_budget_plan(structure, method)  # NOTE [ A frozen prefix ...
            found = plan if peak <= budget else None
        try:
            stamped.append(None if found is None else _stamped(structure, method, found, budget))
        except BudgetTooSmallError:
            stamped.append(None)
    return stamped


def least_peak(structure: Any, method: str, **options: Any) -> int:
    """The least peak (bytes) the planner ``method`` reaches on ``structure``;
    planning at it succeeds. The planner's own ``least_peak`` when it has one (optimal-time: the
    least peak of any nested plan); otherwise the simulated peak of its plan without a budget
    (its least-peak plan for the budget planners chen-budget, hong-dp, hong-linear; its only
    plan for the fixed ones)."""
    kind = _kind(structure)
    if kind == "graph" and _via_chain(structure, method) and not options:
        return least_peak(structure.to_chain(), method)
    own = getattr(get(method, kind), "least_peak", None)
    if own is None:
        return _plan(structure, method, None, **options).predicted_peak_bytes or 0
    least = int(own(structure, **options))
    if kind == "chain" and structure.frozen_prefix:  # NOTE [ A frozen prefix in the planners ]
        least = min(least, _no_budget_plan(structure, method)[1])
    return least


sweep_graph = sweep
"""The old name of :func:`sweep` for graphs."""

least_graph_peak = least_peak
"""The old name of :func:`least_peak` for graphs."""


GRID_POINTS = 16
"""Activation budgets of :func:`grid_candidates` (geometric from the least peak)."""


def grid_candidates(chain: Chain, method: str) -> list[Plan]:
    """``method``'s plans (:func:`sweep`) at :data:`GRID_POINTS` activation budgets, geometric
    from :func:`least_peak` to the unplanned activation peak (both included)."""
    floor = least_peak(chain, method)
    top = simulate(chain, Plan.none(chain)).peak_bytes
    ratio = (top / floor) ** (1 / (GRID_POINTS - 1)) if 0 < floor < top else 1.0
    budgets = sorted({int(floor * ratio**k) for k in range(GRID_POINTS)} | {floor, top})
    return [p for p in sweep(chain, method, budgets) if p is not None]


def candidates(chain: Chain, method: str) -> list[Plan]:
    """Plans of ``method`` to choose from under a budget that is not the activation peak (the
    fastest whose whole-step peak fits: :func:`remat.auto`): the planner's own ``candidates``
    when it has one (optimal-time adds the baselines' plans to its grid), else
    :func:`grid_candidates`. Stamped like :func:`plan_chain`'s plans."""
    own = getattr(get(method), "candidates", None)
    return list(own(chain)) if own is not None else grid_candidates(chain, method)


def _stamped(structure: Any, method: str, found: Any, budget_bytes: int | None) -> Any:
    """``found`` checked and stamped (:func:`stamp`) with the chain's or graph's fingerprint."""
    result = found.for_graph(structure)
    sim = (
        simulate(structure, result)
        if _kind(structure) == "chain"
        else simulate_graph(structure, result)
    )
    return stamp(result, sim, method, budget_bytes).made_for(structure)


def stamp(result: Any, sim: Any, method: str, budget_bytes: int | None, **fields: Any) -> Any:
    """A chain or graph plan ``result`` checked against ``budget_bytes``
    (:class:`BudgetTooSmallError` when its simulated peak ``sim.peak_bytes`` exceeds it) and
    stamped with its method, budget, simulated cost and ``fields``: the one place both
    :func:`plan_chain` and :func:`plan_graph` finish a planner's plan."""
    if budget_bytes is not None and sim.peak_bytes > budget_bytes:
        raise BudgetTooSmallError(
            budget_bytes, sim.peak_bytes, method, "the planner's best plan does not fit"
        )
    params = dict(result.params)
    if budget_bytes is not None:
        params.setdefault("budget_bytes", budget_bytes)
    return replace(
        result,
        method=method,
        params=params,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_time=sim.total_time,
        **fields,
    )
