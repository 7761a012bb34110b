"""User-named stage boundaries: ``split_stages(model, ["layer1", "layer2", ...])``.

The named submodules (``"a+b"`` groups several into one stage) are composed in order on the
model's single input; every parameter that requires grad must belong to a stage (refused at
once), and the composition is verified against ``model(x)`` on the first call
(:class:`~remat.capture.stages.StageMismatchError`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from remat.capture.stages.base import (
    SUPPORTED_HELP,
    StageMismatchError,
    Stages,
    _CompositionCheck,
    group,
    identity_finish,
    identity_prepare,
)
from remat.core.errors import UnsupportedModelError


def split_named(model: nn.Module, names: list[str]) -> Stages:
    if not names:
        raise UnsupportedModelError("stages=[] names no stage; " + SUPPORTED_HELP)
    known = dict(model.named_modules(remove_duplicate=False))  # every name of a shared module
    modules: list[nn.Module] = []
    seen: set[str] = set()
    for entry in names:
        if not isinstance(entry, str) or not entry:
            raise UnsupportedModelError(f"stage names must be non-empty strings, got {entry!r}")
        parts = []
        for fqn in entry.split("+"):
            fqn = fqn.strip()
            if fqn not in known or fqn == "":
                close = [k for k in known if k and (fqn in k or k in fqn)][:5]
                hint = f" (similar names: {close})" if close else ""
                raise UnsupportedModelError(
                    f"stage {entry!r}: the model has no submodule {fqn!r}{hint}; use names from "
                    "model.named_modules()"
                )
            if fqn in seen:
                raise UnsupportedModelError(f"stage {entry!r}: submodule {fqn!r} named twice")
            seen.add(fqn)
            parts.append(known[fqn])
        modules.append(group(parts))
    _check_parameters_covered(model, modules, names)
    stages_holder: list[Stages] = []
    check = _CompositionCheck(model, stages_holder)
    stages = Stages(
        tuple(modules),
        tuple(names),
        identity_prepare,
        identity_finish,
        kind="named",
        check=check,
    )
    stages_holder.append(stages)
    return stages


def _check_parameters_covered(
    model: nn.Module, modules: Sequence[nn.Module], names: Sequence[str]
) -> None:
    """Every parameter that requires grad belongs to a named stage, or the stages are refused.

    The first call's output check cannot see a parameter the model's forward uses outside the
    named submodules (``self.head(self.body(x) * self.scale)``) while it leaves the output
    unchanged (``scale`` is 1 at initialisation): the stages would never use it, and it would
    never get a gradient.
    """
    covered = {id(p) for m in modules for p in m.parameters()}
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
    if not outside:
        return
    owners = sorted({n.rpartition(".")[0] for n in outside})
    where = ", ".join(repr(o) if o else "the model itself" for o in owners)
    shown = outside[:8] + ([f"... {len(outside) - 8} more"] if len(outside) > 8 else [])
    raise StageMismatchError(
        f"the named stages {list(names)} do not contain the parameter(s) {shown}, which "
        "require grad: the stages would run without them and they would get no gradient. "
        f"Include the submodule that owns them ({where}) in a stage (join submodules with "
        "'+'; a parameter of the model itself needs its code moved into a submodule), or "
        "freeze them (p.requires_grad_(False))"
    )
