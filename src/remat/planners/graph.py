"""Graph planners: pure functions ``(graph, budget, **options) -> GraphPlan``, selected by name.

Every graph planner satisfies :class:`GraphPlanner`: it is called as
``planner(graph: Graph, budget: int | None, **options)`` and may carry the optional ``sweep``
and ``least_peak`` methods of the chain planners' protocol (:class:`remat.planners.Planner`);
:func:`sweep_graph` and :func:`least_graph_peak` use them, or a generic rule. It is registered
with :func:`register_graph_planner`. ``budget`` is the peak memory in bytes
that :func:`remat.graphs.simulate_graph` must predict (``None``: the planner's default);
``options`` are the planner's keyword settings (validated by its own config dataclass).
:func:`plan_graph` is the entry point: it parses the budget, calls the planner, and stamps the
plan with its simulated cost, raising :class:`~remat.planners.BudgetTooSmallError` (which names
the minimum) when the plan does not fit.

Registered planners (name -> module):

==================  ================  ==========================================================
``none``            ``planners``      store everything
``reforward``       ``reforward``     Feng & Huang, division tree; minimal peak (their model)
``checkmate-milp``  ``milp``          Jain et al. 2020 (Checkmate), exact MILP, minimal time
``checkmate-lp``    ``milp``          Checkmate's LP relaxation + rounding (fast, approximate)
``articulation``    ``articulation``  cut points -> a Chain of blocks -> any chain planner
==================  ================  ==========================================================
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from remat.core.graph import Graph
from remat.core.graph_plan import GraphPlan
from remat.core.simulate import simulate_graph
from remat.core.units import resolve_budget
from remat.planners import BudgetTooSmallError, stamp

__all__ = [
    "plan_graph",
    "register_graph_planner",
    "get_graph_planner",
    "available_graph_planners",
    "sweep_graph",
    "least_graph_peak",
    "GraphPlanner",
]


@runtime_checkable
class GraphPlanner(Protocol):
    """A graph planner: ``planner(graph, budget_bytes, **options) -> GraphPlan``.

    Optional, as for chain planners (:class:`remat.planners.Planner`):
    ``sweep(graph, budgets, **options) -> list[GraphPlan | None]`` and
    ``least_peak(graph, **options) -> int``.
    """

    def __call__(self, graph: Graph, budget: int | None, /, **options: Any) -> GraphPlan: ...


_REGISTRY: dict[str, GraphPlanner] = {}
_MODULES = ("reforward", "milp", "articulation")


def register_graph_planner(
    name: str,
    *,
    sweep: Callable[..., list[GraphPlan | None]] | None = None,
    least_peak: Callable[..., int] | None = None,
) -> Callable[[GraphPlanner], GraphPlanner]:
    """Decorator: register ``fn`` as the graph planner called ``name``, with its optional
    ``sweep`` and ``least_peak`` methods (see :class:`GraphPlanner`) attached to it."""

    def wrap(fn: GraphPlanner) -> GraphPlanner:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"graph planner {name!r} is registered twice")
        if sweep is not None:
            fn.sweep = sweep  # type: ignore[attr-defined]
        if least_peak is not None:
            fn.least_peak = least_peak  # type: ignore[attr-defined]
        _REGISTRY[name] = fn
        return fn

    return wrap


def _load_all() -> None:
    for module in _MODULES:
        importlib.import_module(f"remat.graphs.{module}")


def available_graph_planners() -> list[str]:
    """Names of every registered graph planner."""
    _load_all()
    return sorted(_REGISTRY)


def get_graph_planner(name: str) -> GraphPlanner:
    """The graph planner registered as ``name`` (clear error listing the names otherwise)."""
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown graph planner {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}"
        ) from None


def plan_graph(
    graph: Graph,
    method: str = "checkmate-milp",
    budget: int | float | str | None = None,
    **options: Any,
) -> GraphPlan:
    """Plan ``graph`` with the graph planner ``method`` under a peak-memory ``budget``.

    ``budget`` is the peak that :func:`remat.graphs.simulate_graph` predicts (bytes, a string
    such as ``"512MiB"``, or a percentage of the unplanned peak such as ``"50%"``:
    :func:`remat.core.units.resolve_budget`); ``None`` lets the planner pick its default. ``options`` go to
    the planner (e.g. ``time_limit_s=10`` for ``checkmate-milp``). The returned plan carries its
    simulated peak and time and the graph's fingerprint. Raises
    :class:`~remat.planners.BudgetTooSmallError` (naming the minimum) when nothing fits.

    >>> from remat.core.graph import Graph
    >>> g = Graph.from_edges([(), (0,), (1,)], out_bytes=[4, 4, 4])
    >>> p = plan_graph(g, "none")
    >>> p.method, p.predicted_peak_bytes
    ('none', 20)
    """
    budget_bytes = None
    if budget is not None:
        budget_bytes = resolve_budget(
            budget,
            lambda: simulate_graph(graph, GraphPlan.none()).peak_bytes,
            "the unplanned peak",
        )
    found = get_graph_planner(method)(graph, budget_bytes, **options)
    return _stamped(graph, method, found, budget_bytes)


def sweep_graph(
    graph: Graph, method: str, budgets: Iterable[int], **options: Any
) -> list[GraphPlan | None]:
    """:func:`plan_graph` at each of ``budgets`` (bytes), ``None`` where the planner raises
    :class:`~remat.planners.BudgetTooSmallError`; the planner's own ``sweep`` when it has one."""
    budgets = list(budgets)
    own = getattr(get_graph_planner(method), "sweep", None)
    if own is None:
        result: list[GraphPlan | None] = []
        for budget in budgets:
            try:
                result.append(plan_graph(graph, method, budget, **options))
            except BudgetTooSmallError:
                result.append(None)
        return result
    stamped: list[GraphPlan | None] = []
    for budget, found in zip(budgets, own(graph, budgets, **options), strict=True):
        try:
            stamped.append(None if found is None else _stamped(graph, method, found, budget))
        except BudgetTooSmallError:
            stamped.append(None)
    return stamped


def least_graph_peak(graph: Graph, method: str, **options: Any) -> int:
    """The least peak (bytes) the graph planner ``method`` reaches on ``graph``: its own
    ``least_peak`` when it has one, else the simulated peak of its plan without a budget."""
    own = getattr(get_graph_planner(method), "least_peak", None)
    if own is not None:
        return int(own(graph, **options))
    return plan_graph(graph, method, None, **options).predicted_peak_bytes or 0


def _stamped(graph: Graph, method: str, found: GraphPlan, budget_bytes: int | None) -> GraphPlan:
    """``found`` checked and stamped (:func:`remat.planners.stamp`) with the graph's
    fingerprint (see :func:`plan_graph`)."""
    result = found.for_graph(graph)
    sim = simulate_graph(graph, result)
    return stamp(result, sim, method, budget_bytes, graph_fingerprint=graph.fingerprint)


@register_graph_planner("none")
def plan_none(graph: Graph, budget: int | None = None) -> GraphPlan:
    """Store every node: the fastest plan and the largest peak."""
    return GraphPlan.none()
