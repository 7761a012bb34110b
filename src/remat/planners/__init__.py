"""Planners: pure functions ``(chain, budget) -> Plan``, selected by name.

Every planner has the signature ``planner(chain: Chain, budget: int | None) -> Plan`` and is
registered under a name with :func:`register`. ``budget`` is the peak activation memory in bytes
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
from collections.abc import Callable
from dataclasses import replace

from remat.costs import Chain
from remat.plans import Plan
from remat.simulate import simulate
from remat.units import format_bytes, resolve_budget

__all__ = [
    "register",
    "get_planner",
    "available",
    "plan_chain",
    "Planner",
    "BudgetTooSmallError",
]

Planner = Callable[[Chain, "int | None"], Plan]

_REGISTRY: dict[str, Planner] = {}
_MODULES = ("baselines", "chen", "hong", "reforward", "optimal_time")


class BudgetTooSmallError(ValueError):
    """No plan of the chosen planner fits the budget; ``minimum_bytes`` says what would."""

    def __init__(
        self, budget_bytes: int, minimum_bytes: int, method: str, detail: str = ""
    ) -> None:
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.method = method
        message = (
            f"budget {format_bytes(budget_bytes)} ({budget_bytes} B) is below the minimum "
            f"feasible peak {format_bytes(minimum_bytes)} ({minimum_bytes} B) for planner "
            f"{method!r}: raise the budget to at least {minimum_bytes} B"
        )
        if detail:
            message += f" ({detail})"
        super().__init__(message)


def register(name: str) -> Callable[[Planner], Planner]:
    """Decorator: register ``fn`` as the planner called ``name``."""

    def wrap(fn: Planner) -> Planner:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"planner {name!r} is registered twice")
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
    result = get_planner(method)(chain, budget_bytes).for_chain(chain)
    sim = simulate(chain, result)
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
    ).made_for(chain)
