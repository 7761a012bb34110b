"""User-named stage boundaries: ``split_stages(model, ["layer1", "layer2", ...])``.

The named submodules (``"a+b"`` groups several into one stage) are composed in order on the
model's single input; every parameter that requires grad must belong to a stage (refused at
once), and the composition is verified against ``model(x)`` on the first call
(:class:`~remat.stages.StageMismatchError`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat.errors import UnsupportedModelError
from remat.guards import BatchCopy
from remat.stages.base import (
    SUPPORTED_HELP,
    StageMismatchError,
    Stages,
    _run_plain,
    group,
    identity_finish,
    identity_prepare,
)


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


class _CompositionCheck:
    """Verifies once, on the first inputs, that the named stages compute ``model(x)``.

    Runs both without grad, from the same RNG state and the same input values (a model may
    write into its input), and restores the RNG state, every buffer (batch-norm statistics)
    and the input values afterwards, so the check has no side effects.
    """

    def __init__(self, model: nn.Module, holder: list[Stages], what: str | None = None) -> None:
        self.model = model
        self.holder = holder
        self.what = what  # how the errors name the stages (default: the named stages)
        self.done = False

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.done:
            return
        inputs = BatchCopy((args, kwargs), snapshot=True)
        stages = self.holder[0]
        what = self.what or f"the named stages {list(stages.names)}"
        model = self.model
        buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
        devices = sorted({b.device for b in model.parameters() if b.device.type == "cuda"}, key=str)
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                state = torch.get_rng_state()
                cuda_states = [torch.cuda.get_rng_state(d) for d in devices]
                expected = model(*args, **kwargs)
                for k, b in model.named_buffers():
                    b.copy_(buffers[k])
                torch.set_rng_state(state)
                for d, s in zip(devices, cuda_states, strict=True):
                    torch.cuda.set_rng_state(s, d)
                inputs.restore()
                try:
                    got = _run_plain(stages, args, kwargs)
                except Exception as err:
                    raise StageMismatchError(
                        f"{what} cannot be run in order on the "
                        f"model's input: {type(err).__name__}: {err}. " + SUPPORTED_HELP
                    ) from err
        finally:
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(buffers[k])
            inputs.restore()
        problem = _compare_outputs(expected, got)
        if problem is not None:
            raise StageMismatchError(
                f"{what} do not compute what the model computes "
                f"({problem}): the model's forward does more than call these submodules in "
                "order (functional ops such as torch.flatten, residual additions, or several "
                "inputs). Name other boundaries (a parent module covering that code), or see: "
                + SUPPORTED_HELP
            )
        self.done = True


def _compare_outputs(expected: Any, got: Any, path: str = "output") -> str | None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: expected a tensor, got {type(got).__name__}"
        if expected.shape != got.shape or expected.dtype != got.dtype:
            return (
                f"{path}: expected {tuple(expected.shape)} {expected.dtype}, got "
                f"{tuple(got.shape)} {got.dtype}"
            )
        if expected.is_floating_point() or expected.is_complex():
            ok = torch.allclose(expected, got, rtol=1e-5, atol=1e-6, equal_nan=True)
        else:
            ok = torch.equal(expected, got)
        return None if ok else f"{path}: values differ"
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(expected) != set(got):
            return f"{path}: different keys"
        for k in expected:
            problem = _compare_outputs(expected[k], got[k], f"{path}[{k!r}]")
            if problem:
                return problem
        return None
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(expected) != len(got):
            return f"{path}: different structure"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            problem = _compare_outputs(e, g, f"{path}[{i}]")
            if problem:
                return problem
        return None
    with contextlib.suppress(Exception):
        if expected == got:
            return None
    return f"{path}: {expected!r} != {got!r}"
