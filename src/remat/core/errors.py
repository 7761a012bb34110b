"""Errors shared by several layers (pure Python, no torch): the one error hierarchy that
``shared/architecture.md`` plans, rooted at :class:`RematError`.

Catch :class:`RematError` for anything remat refuses. Every error remat raises of its own is
one: those shared by several layers live here; a few that one module raises live with it
(:class:`remat.execute.graph.GraphExecutionError`, :class:`remat.guards.WrapOrderError`, ...)
and derive from :class:`RematError` too. Each keeps the builtin base it had (``ValueError``
here), so code that caught that before still catches it.

Example:
    >>> issubclass(InfeasibleScheduleError, RematError), issubclass(InfeasibleScheduleError, ValueError)
    (True, True)
"""

from __future__ import annotations

from remat.core.units import format_bytes

__all__ = [
    "RematError",
    "PlanError",
    "BudgetTooSmallError",
    "BUDGET_KINDS",
    "InfeasibleScheduleError",
    "UnsupportedModelError",
]

BUDGET_KINDS = ("activation", "whole-step")
"""What a budget bounds: the activation peak (:func:`remat.plan`'s ``activation_budget``) or
the whole training step (``budget=`` of :func:`remat.auto` and :func:`remat.fit`)."""


class RematError(Exception):
    """The root of remat's errors: the message names the cause and what to do."""


class PlanError(RematError, ValueError):
    """A plan that is malformed or does not fit its chain or graph (the one plan error:
    ``remat.graphs.GraphPlanError`` names it too)."""


class InfeasibleScheduleError(RematError, ValueError):
    """A schedule that cannot run (raised by :func:`remat.graphs.run_schedule`, the simulator):
    a read before compute, a use after free, a missing gradient; the message names the op and
    the tensor at fault."""


class UnsupportedModelError(RematError, ValueError):
    """The model cannot be cut into stages automatically (the message says what to do)."""


class BudgetTooSmallError(RematError, ValueError):
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
        self.detail = detail
        message = (
            f"{kind} budget {format_bytes(budget_bytes)} ({budget_bytes} B) is below the "
            f"minimum feasible {kind} peak {format_bytes(minimum_bytes)} ({minimum_bytes} B) for "
            f"planner {method!r}: raise the budget to at least {minimum_bytes} B"
        )
        if detail:
            message += f" ({detail})"
        super().__init__(message)
