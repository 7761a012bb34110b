"""Kernel scratch memory under fake tensors: measured once per op and shape by running it.

A fake tensor allocates nothing, and a TorchDispatchMode sees an op's inputs and outputs only:
the workspace a kernel takes from the allocator inside itself (oneDNN's reorders in a CPU
convolution and its backward, batch norm's backward) is invisible to a fake capture. A real
capture sees it through the allocator's events (:class:`~remat.measure.events.AllocatorWindow`);
without it, ``remat.auto(..., fake=True)`` planned torchvision's ResNet-10 (8 x 64²) at a
68,537,060 B budget for a step that then measured 69,369,632 B.

:class:`ScratchProbe`, a TorchDispatchMode entered inside the capture's FakeTensorMode, runs
each op it has not seen with these shapes, strides and dtypes once more for real, on zeroed
tensors of the planning device (a warm-up run, then one under the allocator's count), and
notes its scratch: the allocator's peak above the op's new outputs, measured once per process
(:data:`_SCRATCH`). A :class:`ScratchWindow` over a stage's or a node's forward or backward
rises, at each op that takes scratch, to the tracked bytes before the op plus its new outputs
plus its scratch, where the allocator would have peaked: the capture counts what that rise
has above the tracked rise as it counts a real allocator's
(:func:`remat.measure.events.scratch_bytes`).

Not probed (counted as none): views, pointwise ops and reductions (no kernel workspace), matrix
products and copies (:data:`_NO_SCRATCH`), random ops (a real run would move the caller's random number generator), ops whose output
shape depends on values, ops that fail on zeroed inputs, ops of more than
:data:`PROBE_MAX_BYTES` of inputs and outputs and ops on a device this process cannot run (a
CUDA model planned on a machine without one, a model on ``meta``): :attr:`ScratchProbe.
unmeasured` names the last two, and the probe warns of them on leaving.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from remat.measure.events import (
    AllocatorWindow,
    scratch_bytes,
    small_scratch_bytes,
    storage_bytes,
)

__all__ = ["PROBE_MAX_BYTES", "ScratchProbe", "ScratchWindow"]

PROBE_MAX_BYTES = 1 << 30
"""Ops with more bytes of inputs and outputs than this are not run for real (no scratch
counted): the planning process stays far below the step it plans."""

_SKIPPED_TAGS = (
    torch.Tag.pointwise,
    torch.Tag.reduction,
    torch.Tag.nondeterministic_seeded,
    torch.Tag.dynamic_output_shape,
    torch.Tag.data_dependent_output,
)

_NO_SCRATCH = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::mv",
        "aten::addmv",
        "aten::dot",
        "aten::_addmm_activation",
        "aten::_to_copy",
        "aten::clone",
        "aten::cat",
        "aten::stack",
        "aten::embedding",
        "aten::fill_.Scalar",
        "aten::fill_.Tensor",
    }
)
"""Ops not probed: matrix products (BLAS and cuBLAS keep their workspace outside the step, or
allocate none: GPT-2's CPU step has no scratch), copies and fills (the capture's gradients of
ones, laid out as their outputs). The largest ops of a transformer:
probing them would hold their inputs and outputs once more while planning."""

_WORKSPACE_READERS = ("rnn", "lstm", "gru")
"""Backward ops whose name holds one of these read a workspace their forward kernel wrote:
run on zeros (or on the fake forward's workspace shape) they may read out of bounds (oneDNN's
LSTM backward, ``aten.mkldnn_rnn_layer_backward``, crashed the process). Not probed."""

_SCRATCH: dict[tuple[Any, ...], int] = {}
"""Measured scratch bytes per op and argument metadata (this process)."""


class ScratchWindow:
    """What the allocator would have seen over a span of a fake capture: :attr:`rise` is the
    highest ``level() + new outputs + scratch`` at an op of a :class:`ScratchProbe` run inside
    it (``level()`` read before the op: the capture's tracked bytes, which the allocator also
    counts), above ``level()`` at the window's start; 0 when no op inside took scratch.
    :meth:`excess` reads it as :meth:`remat.measure.events.AllocatorWindow.excess` reads the
    allocator's peak. Without a probe it sees nothing."""

    def __init__(self, probe: ScratchProbe | None, level: Callable[[], int]) -> None:
        self.probe = probe
        self.level = level
        self.base = 0
        self.rise = 0

    def __enter__(self) -> ScratchWindow:
        if self.probe is not None:
            self.base = self.level()
            self.probe.open.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.probe is not None:
            self.probe.open.remove(self)

    def excess(self, tracked: int) -> tuple[int, int]:
        """``(scratch, small scratch)``: the bytes above ``tracked`` (the window's tracked rise)
        that the allocator would have seen, as a real capture splits them
        (:func:`remat.measure.events.scratch_bytes`, :func:`~remat.measure.events.
        small_scratch_bytes`)."""
        return scratch_bytes(self.rise, tracked), small_scratch_bytes(self.rise, tracked)


class ScratchProbe(TorchDispatchMode):
    """Measures the kernel scratch of the ops run under it while a window is open and notes
    it there (:class:`ScratchWindow`, the module docstring); enter it inside a FakeTensorMode."""

    active: list[ScratchProbe] = []

    def __init__(self) -> None:
        super().__init__()
        self.open: list[ScratchWindow] = []
        self.unmeasured: set[str] = set()
        """The ops not run for their size or their device (their scratch is unknown)."""

    def __enter__(self) -> ScratchProbe:
        ScratchProbe.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        ScratchProbe.active.remove(self)
        super().__exit__(*exc)
        if self.unmeasured and exc[0] is None:
            warnings.warn(
                "fake capture: the kernel scratch memory of "
                f"{', '.join(sorted(self.unmeasured)[:5])} was not measured (over "
                f"{PROBE_MAX_BYTES >> 30} GiB of inputs and outputs, on a device this process "
                "cannot run, inside a torch.profiler session, or a backward that reads its "
                "forward kernel's workspace): a convolution's or a batch "
                "norm's workspace may make the step peak above the prediction; plan on the "
                "device the model trains on, outside the profiler",
                stacklevel=2,
            )

    @staticmethod
    def current() -> ScratchProbe | None:
        """The innermost probe entered, or None."""
        return ScratchProbe.active[-1] if ScratchProbe.active else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.open:
            return func(*args, **kwargs)
        before = [w.level() for w in self.open]
        out = func(*args, **kwargs)
        scratch = self._scratch(func, args, kwargs, out)
        if not scratch:
            return out
        inputs = _storages((args, kwargs))
        new = sum(n for k, n in _storages(out).items() if k not in inputs)
        for w, level in zip(self.open, before, strict=True):
            w.rise = max(w.rise, level + new + scratch - w.base)
        return out

    # ------------------------------------------------------------------ one op
    def _scratch(self, func: Any, args: Any, kwargs: Any, out: Any) -> int:
        if (
            func.is_view
            or any(tag in func.tags for tag in _SKIPPED_TAGS)
            or func.name() in _NO_SCRATCH
        ):
            return 0
        name = func.name()
        if "backward" in name and any(w in name for w in _WORKSPACE_READERS):
            self.unmeasured.add(name)
            return 0
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if not tensors:
            return 0  # a factory (empty, zeros): nothing but its output
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs:
            return 0  # a question about the tensors (device, sizes), no kernel
        if any(t.layout is not torch.strided for t in (*tensors, *outs)):
            return 0  # (sparse: no storage to copy; the step tracker refuses it, saying why)
        if sum(_nbytes(t) for t in (*tensors, *outs)) > PROBE_MAX_BYTES or not _runnable(
            tensors[0].device
        ):
            self.unmeasured.add(func.name())
            return 0
        key = (func, *(_describe(a) for a in flat))
        if key not in _SCRATCH:
            measured = _run(func, args, kwargs)
            if measured is None:  # a profiler is running: it cannot be counted now
                self.unmeasured.add(func.name())
                return 0
            _SCRATCH[key] = measured
        return _SCRATCH[key]


def _storages(obj: Any) -> dict[int, int]:
    """Bytes per storage of the tensors in ``obj``."""
    return storage_bytes(t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor))


def _describe(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), tuple(a.stride()), a.dtype, a.device.type)
    if isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool):
        return repr(a)
    return a if isinstance(a, int | float | bool | str | type(None)) else repr(a)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _runnable(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available()
    return False


def _run(func: Any, args: Any, kwargs: Any) -> int | None:
    """The scratch of ``func`` on real zeroed copies of its arguments' metadata (0 when the op
    cannot be run so: an error is not the capture's to raise; None when the allocator cannot
    be watched now, inside a user's profiler session)."""
    with _outside_modes():

        def real(a: Any) -> Any:
            if not isinstance(a, torch.Tensor):
                return a
            t = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
            return t.zero_() if t.numel() else t

        flat, spec = tree_flatten((args, kwargs))
        device = next(a.device for a in flat if isinstance(a, torch.Tensor))
        try:
            real_args, real_kwargs = spec.unflatten([real(a) for a in flat])
            inputs = {
                t.untyped_storage().data_ptr()
                for t in tree_flatten((real_args, real_kwargs))[0]
                if isinstance(t, torch.Tensor)
            }
            func(*real_args, **real_kwargs)  # warm-up: one-time caches (oneDNN primitives)
            with AllocatorWindow(device) as window:
                out = func(*real_args, **real_kwargs)
        except Exception:  # noqa: BLE001 (an op that needs real values: no scratch known)
            return 0
        if window.peak_bytes is None:
            return None
        new = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
        }
        return max(0, window.peak_bytes - sum(new.values()))


@contextmanager
def _outside_modes() -> Iterator[None]:
    """No dispatch mode (fake tensors, trackers, counters), no torch-function mode, no grad."""
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        yield
