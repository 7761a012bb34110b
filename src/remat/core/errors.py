"""Errors shared by several layers (pure Python, no torch): the one error hierarchy that
``shared/architecture.md`` plans, rooted at :class:`RematError`.

Catch :class:`RematError` for anything remat refuses. The errors here keep ``ValueError`` as a
second base, so code that caught ``ValueError`` before still catches them. Some errors still
live with the module that raises them (:class:`~remat.core.plan.PlanError`,
:class:`~remat.planners.BudgetTooSmallError`, ...) and join the hierarchy as they move here.

Example:
    >>> issubclass(InfeasibleScheduleError, RematError), issubclass(InfeasibleScheduleError, ValueError)
    (True, True)
"""

from __future__ import annotations

__all__ = ["RematError", "InfeasibleScheduleError", "UnsupportedModelError"]


class RematError(Exception):
    """The root of remat's errors: the message names the cause and what to do."""


class InfeasibleScheduleError(RematError, ValueError):
    """A schedule that cannot run (raised by :func:`remat.graphs.run_schedule`, the simulator):
    a read before compute, a use after free, a missing gradient; the message names the op and
    the tensor at fault."""


class UnsupportedModelError(RematError, ValueError):
    """The model cannot be cut into stages automatically (the message says what to do)."""
