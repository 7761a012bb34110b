"""One error hierarchy: every exception remat defines derives from ``remat.RematError`` and keeps
the builtin base it had, so ``except remat.RematError`` catches anything remat refuses."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import remat
from remat.core.errors import BudgetTooSmallError, PlanError, RematError


def _remat_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(remat.__path__, "remat."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__.startswith("remat.")
            ):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


def test_every_remat_exception_is_a_remat_error() -> None:
    found = _remat_exceptions()
    # the ones this test was written for, so that a walk finding nothing cannot pass
    for name in (
        "remat.core.errors.PlanError",
        "remat.core.errors.BudgetTooSmallError",
        "remat.execute.graph.GraphExecutionError",
        "remat.guards.WrapOrderError",
        "remat.planners.checkmate_milp.PlannerTimeoutError",
        "remat.fit.FitBudgetError",
    ):
        assert name in found, name
    # private ones (_Stop, _GiveUp, ...) are control flow caught where they are raised
    public = {name: cls for name, cls in found.items() if not cls.__name__.startswith("_")}
    outside = sorted(name for name, cls in public.items() if not issubclass(cls, RematError))
    assert outside == [], f"exceptions outside the hierarchy: {outside}"


def test_errors_keep_their_builtin_bases_and_old_names() -> None:
    from remat.graphs import GraphPlanError
    from remat.guards import WrapOrderError
    from remat.planners import BudgetTooSmallError as FromPlanners

    assert GraphPlanError is PlanError is remat.PlanError and issubclass(PlanError, ValueError)
    assert FromPlanners is BudgetTooSmallError is remat.BudgetTooSmallError
    assert issubclass(BudgetTooSmallError, ValueError) and issubclass(WrapOrderError, TypeError)
    with pytest.raises(RematError, match="at least 65 B"):
        remat.plan(remat.Chain.homogeneous(2, out_bytes=13), "none", 60)
