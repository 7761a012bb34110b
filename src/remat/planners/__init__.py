"""Planners: pure functions ``(chain, budget) -> Plan``, selected by name.

Every planner satisfies :class:`Planner`: it is called as ``planner(chain, budget) -> Plan`` and
may carry three optional methods, ``sweep(chain, budgets) -> list[Plan | None]`` (many budgets
at once, e.g. one DP table), ``least_peak(chain) -> int`` (the least activation peak it reaches)
and ``candidates(chain) -> list[Plan]`` (the plans to weigh against a budget on something else
than the activation peak, such as :func:`remat.auto`'s whole-step budget).
It is registered under a name with :func:`register`. Callers never branch on a planner's name:
:func:`sweep`, :func:`least_peak` and :func:`candidates` use the planner's own method when it has one and a generic
rule otherwise. ``budget`` is the peak activation memory in bytes
that :func:`remat.simulate` must predict for the plan (``None``: the planner's own default).
Planners never import torch. :func:`plan_chain` runs one by name: it parses the budget, calls
the planner, checks the plan against the budget and stamps it with its simulated cost;
:func:`remat.plan` (the public entry point) calls it for a chain and
:func:`remat.graphs.plan_graph` for a graph.

Registered planners (name -> module):

==================  ===========================  =============================================
``none``            ``baselines``                store everything
``every-stage``     ``baselines``                checkpoint each stage
``chen-sqrt``       ``chen``                     Chen et al. 2016, sqrt(n) equal segments
``chen-budget``     ``chen``                     Chen et al. 2016, Alg. 3 greedy + search over B
``chen-recursive``  ``chen``                     Chen et al. 2016, recursive O(log n) memory
``hong-dp``         ``hong``                     Hong et al., optimal subset, O(n^3) DP
``hong-linear``     ``hong``                     Hong et al., the linear-time algorithm
``reforward``       ``reforward``                Feng & Huang, optimal for linear graphs
``optimal-time``    ``optimal_time``             Beaumont et al. 2019 (rotor), min time
==================  ===========================  =============================================
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from remat.core.chain import Chain
from remat.core.chain_simulate import simulate
from remat.core.plan import Plan
from remat.core.units import format_bytes, resolve_budget

__all__ = [
    "register",
    "get_planner",
    "available",
    "plan_chain",
    "stamp",
    "sweep",
    "least_peak",
    "candidates",
    "grid_candidates",
    "GRID_POINTS",
    "Planner",
    "BudgetTooSmallError",
]


@runtime_checkable
class Planner(Protocol):
    """A chain planner: ``planner(chain, budget_bytes) -> Plan``.

    ``budget_bytes`` is the activation peak :func:`remat.simulate` must predict for the plan
    (``None``: the planner's default). Optional, found with ``getattr`` (:func:`sweep`,
    :func:`least_peak`):

    * ``sweep(chain, budgets) -> list[Plan | None]``: the plans of ``planner(chain, b)`` for each
      budget, ``None`` where it raises :class:`BudgetTooSmallError`;
    * ``least_peak(chain) -> int``: the least activation peak of any of its plans; planning at
      it succeeds;
    * ``candidates(chain) -> list[Plan]``: stamped plans (:func:`plan_chain`'s) to choose from
      under a budget that is not the activation peak (default: :func:`grid_candidates`).
    """

    def __call__(self, chain: Chain, budget: int | None, /) -> Plan: ...


_REGISTRY: dict[str, Planner] = {}
_MODULES = ("baselines", "chen", "hong", "reforward", "optimal_time")


BUDGET_KINDS = ("activation", "whole-step")
"""What a budget bounds: the activation peak (:func:`remat.plan`'s ``activation_budget``) or
the whole training step (``budget=`` of :func:`remat.auto` and :func:`remat.fit`)."""


class BudgetTooSmallError(ValueError):
    """No plan of the chosen planner fits the budget; ``minimum_bytes`` says what would.

    ``kind`` says which budget (:data:`BUDGET_KINDS`): ``"activation"`` (the planners') or
    ``"whole-step"`` (``remat.auto`` / ``remat.fit``); the message names it."""

    def __init__(
        self,
        budget_bytes: int,
        minimum_bytes: int,
        method: str,
        detail: str = "",
        *,
        kind: str = "activation",
    ) -> None:
        if kind not in BUDGET_KINDS:
            raise ValueError(f"kind must be one of {BUDGET_KINDS}, got {kind!r}")
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.method = method
        self.kind = kind
        message = (
            f"{kind} budget {format_bytes(budget_bytes)} ({budget_bytes} B) is below the "
            f"minimum feasible {kind} peak {format_bytes(minimum_bytes)} ({minimum_bytes} B) for "
            f"planner {method!r}: raise the budget to at least {minimum_bytes} B"
        )
        if detail:
            message += f" ({detail})"
        super().__init__(message)


def register(
    name: str,
    *,
    sweep: Callable[[Chain, list[int | None]], list[Plan | None]] | None = None,
    least_peak: Callable[[Chain], int] | None = None,
    candidates: Callable[[Chain], list[Plan]] | None = None,
) -> Callable[[Planner], Planner]:
    """Decorator: register ``fn`` as the planner called ``name``, with its optional ``sweep``,
    ``least_peak`` and ``candidates`` methods (see :class:`Planner`) attached to it."""

    def wrap(fn: Planner) -> Planner:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"planner {name!r} is registered twice")
        if sweep is not None:
            fn.sweep = sweep  # type: ignore[attr-defined]
        if least_peak is not None:
            fn.least_peak = least_peak  # type: ignore[attr-defined]
        if candidates is not None:
            fn.candidates = candidates  # type: ignore[attr-defined]
        _REGISTRY[name] = fn
        return fn

    return wrap


def _load_all() -> None:
    for module in _MODULES:
        try:
            importlib.import_module(f"remat.planners.{module}")
        except ModuleNotFoundError as err:  # a planner module not written yet
            if err.name != f"remat.planners.{module}":
                raise


def available() -> list[str]:
    """Names of every registered planner."""
    _load_all()
    return sorted(_REGISTRY)


def get_planner(name: str) -> Planner:
    """The planner registered as ``name`` (clear error listing the names otherwise)."""
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown planner {name!r}; choose one of: {', '.join(sorted(_REGISTRY))}"
        ) from None


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
    return _stamped(chain, method, get_planner(method)(chain, budget_bytes), budget_bytes)


def sweep(chain: Chain, method: str, budgets: Iterable[int]) -> list[Plan | None]:
    """:func:`plan_chain` at each of ``budgets`` (bytes): one plan per budget, ``None`` where
    the planner raises :class:`BudgetTooSmallError`. Uses the planner's own ``sweep`` (e.g.
    optimal-time's one DP table for all budgets) when it has one; plans them one by one
    otherwise."""
    budgets = list(budgets)
    planner = get_planner(method)
    own = getattr(planner, "sweep", None)
    if own is None:
        result: list[Plan | None] = []
        for budget in budgets:
            try:
                result.append(plan_chain(chain, method, budget))
            except BudgetTooSmallError:
                result.append(None)
        return result
    plans = own(chain, budgets)
    if len(plans) != len(budgets):
        raise RuntimeError(
            f"planner {method!r}'s sweep returned {len(plans)} plans for {len(budgets)} budgets"
        )
    stamped: list[Plan | None] = []
    for budget, found in zip(budgets, plans, strict=True):
        try:
            stamped.append(None if found is None else _stamped(chain, method, found, budget))
        except BudgetTooSmallError:
            stamped.append(None)
    return stamped


def least_peak(chain: Chain, method: str) -> int:
    """The least activation peak (bytes) the planner ``method`` reaches on ``chain``;
    ``plan_chain(chain, method, least_peak(chain, method))`` succeeds. The planner's own
    ``least_peak`` when it has one (optimal-time: the least peak of any nested plan); otherwise
    the simulated peak of its plan without a budget (its least-peak plan for the budget planners
    chen-budget, hong-dp, hong-linear; its only plan for the fixed ones)."""
    own = getattr(get_planner(method), "least_peak", None)
    if own is not None:
        return int(own(chain))
    return plan_chain(chain, method, None).predicted_peak_bytes or 0


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
    own = getattr(get_planner(method), "candidates", None)
    return list(own(chain)) if own is not None else grid_candidates(chain, method)


def _stamped(chain: Chain, method: str, found: Plan, budget_bytes: int | None) -> Plan:
    """``found`` checked and stamped (:func:`stamp`) with the chain's fingerprint."""
    result = found.for_chain(chain)
    return stamp(result, simulate(chain, result), method, budget_bytes).made_for(chain)


def stamp(result: Any, sim: Any, method: str, budget_bytes: int | None, **fields: Any) -> Any:
    """A chain or graph plan ``result`` checked against ``budget_bytes``
    (:class:`BudgetTooSmallError` when its simulated peak ``sim.peak_bytes`` exceeds it) and
    stamped with its method, budget, simulated cost and ``fields``: the one place both
    :func:`plan_chain` and :func:`remat.graphs.plan_graph` finish a planner's plan."""
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
