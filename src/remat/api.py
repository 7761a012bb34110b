"""The planning entry points: :func:`plan` and :func:`pareto` (pure Python, no torch)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from remat.costs import Chain
from remat.planners import BudgetTooSmallError, available, plan_chain, sweep
from remat.plans import Plan
from remat.simulate import simulate

__all__ = ["plan", "pareto", "ParetoPoint", "compare", "Comparison"]


_UNSET: Any = object()


def _activation_budget(activation_budget: Any, budget: Any, where: str) -> Any:
    """``activation_budget``, or the deprecated ``budget=`` alias (with a DeprecationWarning)."""
    if budget is _UNSET:
        return activation_budget
    if activation_budget is not None:
        raise TypeError(f"{where} got both activation_budget= and its deprecated alias budget=")
    warnings.warn(
        f"{where}(budget=...) is deprecated and will be removed in the next release: use "
        f"{where}(activation_budget=...) (the peak of the activations; budget= of remat.auto "
        "and remat.fit is the whole training step)",
        DeprecationWarning,
        stacklevel=3,
    )
    return budget


def plan(
    chain: Chain,
    method: str = "optimal-time",
    activation_budget: int | float | str | None = None,
    *,
    budget: int | float | str | None = _UNSET,
) -> Plan:
    """Plan ``chain`` with the planner ``method`` under an ``activation_budget``.

    ``activation_budget`` is the peak activation memory that :func:`remat.simulate` predicts
    (bytes, a string such as ``"512MiB"``, or a percentage of the unplanned activation peak such
    as ``"50%"``: :func:`remat.units.resolve_budget`), not the whole training step (that is
    ``budget=`` of :func:`remat.auto` and :func:`remat.fit`); ``None`` lets the planner pick its
    default. ``budget=`` is its deprecated alias (a DeprecationWarning). The returned plan
    carries its simulated peak and time and the chain's fingerprint. Raises
    :class:`~remat.planners.BudgetTooSmallError` (naming the minimum) when nothing fits.

    >>> from remat import Chain
    >>> p = plan(Chain.homogeneous(16), method="chen-sqrt")
    >>> p.method, p.predicted_peak_bytes is not None
    ('chen-sqrt', True)
    """
    activation_budget = _activation_budget(activation_budget, budget, "remat.plan")
    if not isinstance(chain, Chain):
        from remat.graphs.graph import Graph
        from remat.graphs.planners import plan_graph

        if isinstance(chain, Graph):  # the graph planners: reforward, checkmate-milp, ...
            return plan_graph(chain, method, activation_budget)  # type: ignore[return-value]
        raise TypeError(f"plan takes a Chain or a Graph, got {type(chain).__name__}")
    return plan_chain(chain, method, activation_budget)


@dataclass(frozen=True)
class ParetoPoint:
    """One plan on the memory–time plane."""

    method: str
    """Planner name."""
    budget_bytes: int | None
    """Budget the planner was given (None: its default)."""
    peak_bytes: int
    """Simulated peak activation bytes."""
    total_time: float
    """Simulated forward + recomputation + backward time."""
    plan: Plan
    """The plan itself."""


def pareto(
    chain: Chain, methods: list[str] | None = None, num_budgets: int = 12
) -> dict[str, list[ParetoPoint]]:
    """Each planner's points on the memory–time plane over a sweep of budgets.

    Budgets run evenly from the smallest peak any planner reached to the unplanned peak. Budget
    planners that cannot meet a budget simply have no point there. Returns, per method, its
    points sorted by peak with dominated points removed (that method's frontier).
    """
    methods = methods or available()
    top = simulate(chain, Plan.none(chain)).peak_bytes
    floor_points: list[ParetoPoint] = []
    for method in methods:
        try:
            p = plan(chain, method)
        except BudgetTooSmallError:
            continue
        floor_points.append(
            ParetoPoint(method, None, p.predicted_peak_bytes or 0, p.predicted_time or 0.0, p)
        )
    low = min((pt.peak_bytes for pt in floor_points), default=top)
    budgets = sorted(
        {int(low + (top - low) * k / max(1, num_budgets - 1)) for k in range(num_budgets)}
    )
    result: dict[str, list[ParetoPoint]] = {}
    for method in methods:
        points = [pt for pt in floor_points if pt.method == method]
        for b, p in zip(budgets, sweep(chain, method, budgets), strict=True):
            if p is not None:
                points.append(
                    ParetoPoint(method, b, p.predicted_peak_bytes or 0, p.predicted_time or 0.0, p)
                )
        result[method] = _frontier(points)
    return result


def _frontier(points: list[ParetoPoint]) -> list[ParetoPoint]:
    best: list[ParetoPoint] = []
    for pt in sorted(points, key=lambda q: (q.peak_bytes, q.total_time)):
        if not best or pt.total_time < best[-1].total_time:
            best.append(pt)
    return best


@dataclass(frozen=True)
class Comparison:
    """One planner's answer for a chain, for side-by-side tables."""

    method: str
    """Planner name."""
    peak_bytes: int | None
    """Simulated peak activation bytes (None when the planner failed)."""
    total_time: float | None
    """Simulated total time (None when the planner failed)."""
    recompute_time: float | None
    """Simulated recomputation time."""
    plan_seconds: float
    """Wall time the planner took."""
    plan: Plan | None
    """The plan (None when the planner failed)."""
    error: str = ""
    """Why the planner gave no plan (e.g. the budget is below its minimum)."""


def compare(
    chain: Chain,
    methods: list[str] | None = None,
    activation_budget: int | float | str | None = None,
    *,
    budget: int | float | str | None = _UNSET,
) -> list[Comparison]:
    """Run every planner (or ``methods``) on ``chain`` at ``activation_budget``; one row each
    (``budget=``: its deprecated alias)."""
    import time

    activation_budget = _activation_budget(activation_budget, budget, "remat.compare")
    rows = []
    for method in methods or available():
        start = time.perf_counter()
        try:
            p = plan(chain, method, activation_budget)
        except BudgetTooSmallError as err:
            rows.append(
                Comparison(method, None, None, None, time.perf_counter() - start, None, str(err))
            )
            continue
        elapsed = time.perf_counter() - start
        sim = simulate(chain, p)
        rows.append(
            Comparison(method, sim.peak_bytes, sim.total_time, sim.recompute_time, elapsed, p)
        )
    return rows
