"""Errors shared by several layers (pure Python, no torch).

The first piece of the one error hierarchy that ``shared/architecture.md`` plans; the other
errors still live with the module that raises them (:class:`~remat.plans.PlanError`,
:class:`~remat.planners.BudgetTooSmallError`, ...).
"""

from __future__ import annotations

__all__ = ["UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The model cannot be cut into stages automatically (the message says what to do)."""
