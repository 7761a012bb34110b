"""The planning entry points: :func:`plan` and :func:`pareto` (pure Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from remat.costs import Chain
from remat.planners import BudgetTooSmallError, available, plan_chain
from remat.plans import Plan
from remat.simulate import simulate

__all__ = ["plan", "pareto", "ParetoPoint", "compare", "Comparison"]


def plan(
    chain: Chain, method: str = "optimal-time", budget: int | float | str | None = None
) -> Plan:
    """Plan ``chain`` with the planner ``method`` under a peak-memory ``budget``.

    ``budget`` is the peak activation memory that :func:`remat.simulate` predicts (bytes, a
    string such as ``"512MiB"``, or a percentage of the unplanned activation peak such as
    ``"50%"``: :func:`remat.units.resolve_budget`); ``None`` lets the planner pick its default. The returned plan
    carries its simulated peak and time and the chain's fingerprint. Raises
    :class:`~remat.planners.BudgetTooSmallError` (naming the minimum) when nothing fits.

    >>> from remat import Chain
    >>> p = plan(Chain.homogeneous(16), method="chen-sqrt")
    >>> p.method, p.predicted_peak_bytes is not None
    ('chen-sqrt', True)
    """
    if not isinstance(chain, Chain):
        from remat.graphs.graph import Graph
        from remat.graphs.planners import plan_graph

        if isinstance(chain, Graph):  # the graph planners: reforward, checkmate-milp, ...
            return plan_graph(chain, method, budget)  # type: ignore[return-value]
        raise TypeError(f"plan takes a Chain or a Graph, got {type(chain).__name__}")
    return plan_chain(chain, method, budget)


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
        for b, p in zip(budgets, _plans_for_budgets(chain, method, budgets), strict=True):
            if p is not None:
                points.append(
                    ParetoPoint(method, b, p.predicted_peak_bytes or 0, p.predicted_time or 0.0, p)
                )
        result[method] = _frontier(points)
    return result


def _plans_for_budgets(chain: Chain, method: str, budgets: list[int]) -> list[Plan | None]:
    """One plan per budget (None where it does not fit); optimal-time shares one DP table."""
    if method == "optimal-time":
        from remat.planners.optimal_time import sweep

        plans = sweep(chain, budgets)
        return [
            None
            if p is None
            else replace(
                p,
                method=method,
                predicted_peak_bytes=simulate(chain, p).peak_bytes,
                predicted_time=simulate(chain, p).total_time,
            ).made_for(chain)
            for p in plans
        ]
    result: list[Plan | None] = []
    for b in budgets:
        try:
            result.append(plan(chain, method, b))
        except BudgetTooSmallError:
            result.append(None)
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
    chain: Chain, methods: list[str] | None = None, budget: int | float | str | None = None
) -> list[Comparison]:
    """Run every planner (or ``methods``) on ``chain`` at ``budget``; one row each."""
    import time

    rows = []
    for method in methods or available():
        start = time.perf_counter()
        try:
            p = plan(chain, method, budget)
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
