"""remat: train networks that do not fit in memory.

Profile a training step, capture the model as a costed chain or graph, plan what to keep and
what to recompute, and apply the plan in one line. The planning core (``Chain``, ``Plan``,
``simulate``, ``plan``, ``pareto``) imports no torch.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from remat.core.chain import Chain
from remat.core.chain_simulate import Simulation, simulate
from remat.core.errors import RematError, UnsupportedModelError
from remat.core.plan import ChainSegment, Plan, PlanError, Segment
from remat.core.units import format_bytes, parse_bytes
from remat.planners import BudgetTooSmallError, available
from remat.planning import ParetoPoint, pareto, plan

__version__ = "0.1.0"

__all__ = [
    "Chain",
    "Plan",
    "Segment",
    "ChainSegment",
    "PlanError",
    "RematError",
    "UnsupportedModelError",
    "Simulation",
    "simulate",
    "plan",
    "pareto",
    "ParetoPoint",
    "BudgetTooSmallError",
    "available",
    "parse_bytes",
    "format_bytes",
]

# torch-side entry points, imported on first use so that `import remat` stays light.
_LAZY = {
    "profile": ("remat.measure.profile", "profile"),
    "capture_chain": ("remat.capture.chain", "capture_chain"),
    "apply": ("remat.execute.chain", "apply"),
    "auto": ("remat.auto", "auto"),
    "capture": ("remat.capture", None),
    "capture_graph": ("remat.capture.graph", "capture_graph"),
    "fit": ("remat.fit", "fit"),
    "zoo": ("remat.zoo", None),
    "distributed": ("remat.distributed", None),
    "levers": ("remat.levers", None),
    "graphs": ("remat.graphs", None),
    "measure": ("remat.measure", None),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'remat' has no attribute {name!r}")


class _RematModule(types.ModuleType):
    """``remat``'s module type: entry points named like their own submodule (``remat.profile``
    the function in ``remat/measure/profile.py``, ``remat.fit``) stay the functions.

    Python binds a submodule to its parent's attribute whenever the submodule is first imported
    (``from remat.measure.profile import StepTracker`` anywhere would turn ``remat.profile`` into the
    module); this refuses exactly those bindings, so ``remat.profile(model, batch)`` works
    whatever was imported before. Import the submodules by name: ``from remat.measure.profile import
    MemoryReport``.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name, ("", None))[1] is not None:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _RematModule
