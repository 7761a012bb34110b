"""The planning entry points' old home: :func:`plan`, :func:`pareto` and :func:`compare` live in
:mod:`remat.planning` (with the whole-step budget search :func:`remat.planning.plan_for_step`);
this module re-exports them so that ``from remat.api import plan`` keeps working."""

from __future__ import annotations

from remat.planning import Comparison, ParetoPoint, compare, pareto, plan

__all__ = ["plan", "pareto", "ParetoPoint", "compare", "Comparison"]
