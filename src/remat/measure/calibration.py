"""Seconds without running the model: a cost model calibrated once per device.

A fake-tensor capture (``capture(..., fake=True)``, ``trace_graph(..., fake=True)``) allocates
nothing and runs no kernel, so it cannot time one. It counts the work instead
(:class:`WorkCounter`): for every ATen op, the FLOPs of torch's own formulas
(``torch.utils.flop_counter``), the bytes it reads and writes, and the op itself. A
:class:`TimeModel` turns that work into seconds, op by op summed per stage or node::

    seconds = seconds_per_flop * FLOPs + seconds_per_byte * bytes moved + seconds_per_op * ops

Its three numbers are measured once per device and dtype by :func:`calibrate` (a micro-benchmark
of tiny ops, large elementwise ops and large matrix products, about a second) and kept as JSON
(schema ``remat.time-model``, version :data:`VERSION`) under ``$REMAT_CACHE_DIR`` or
``~/.cache/remat``; :func:`time_model_for` reads the cache or calibrates. A cache file that
cannot be read (corrupt, another schema version, another device) is calibrated again and
rewritten, with a warning naming the file and why.

Example:
    >>> import torch
    >>> model = TimeModel("cpu", "torch.float32", 1e-11, 1e-10, 5e-6)
    >>> with WorkCounter(model) as work:
    ...     y = torch.ones(64, 64) @ torch.ones(64, 64)
    >>> work.work.flops, work.work.ops
    (524288, 3)

Known limitations: the sum is linear per op (a roofline would take the larger of the compute
and memory terms), so it is a ranking of stages by cost rather than a stopwatch; fused or
compiled kernels, kernel choice by shape, and a machine busy with other work are not modelled;
the calibration runs in the model's parameter dtype at fixed sizes on the device it is asked
for (the CUDA device of a model built on ``torch.device("meta")`` when there is one, else the
CPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat.core.schema import read_schema

__all__ = [
    "SCHEMA",
    "VERSION",
    "CACHE_ENV",
    "TimeModel",
    "Work",
    "WorkCounter",
    "calibrate",
    "cache_dir",
    "planning_device",
    "time_model_for",
]

SCHEMA = "remat.time-model"
"""The ``schema`` name of a calibration file."""

VERSION = 1
"""The calibration file version this remat reads and writes."""

CACHE_ENV = "REMAT_CACHE_DIR"
"""The environment variable naming the cache directory (default ``~/.cache/remat``)."""


@dataclass(frozen=True)
class Work:
    """What a piece of a training step asks of the device."""

    flops: int
    """Floating-point operations (torch's ``flop_counter`` formulas: matrix products,
    convolutions, attention; elementwise ops count 0)."""
    bytes_moved: int
    """Bytes the ops read (tensor arguments) and write (tensor results), views excluded."""
    ops: int
    """ATen ops run (each costs a launch / dispatch)."""


@dataclass(frozen=True)
class TimeModel:
    """Seconds of an op from its work (module docstring), for one device and dtype."""

    device: str
    """The device it was measured on, as :func:`_describe_device` writes it."""
    dtype: str
    """The dtype of the benchmark tensors (``"torch.float32"``)."""
    seconds_per_flop: float
    """Seconds per FLOP of a large matrix product."""
    seconds_per_byte: float
    """Seconds per byte read or written by a large elementwise op."""
    seconds_per_op: float
    """Seconds of a tiny op: dispatch, launch."""

    def __post_init__(self) -> None:
        for name in ("seconds_per_flop", "seconds_per_byte", "seconds_per_op"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0 or value == float("inf"):
                raise ValueError(f"TimeModel.{name} must be a finite number >= 0, got {value!r}")

    def seconds(self, work: Work) -> float:
        """Predicted seconds of ``work``."""
        return (
            self.seconds_per_flop * work.flops
            + self.seconds_per_byte * work.bytes_moved
            + self.seconds_per_op * work.ops
        )

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, "version": VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TimeModel:
        """The model a :meth:`to_json` text holds; ``ValueError`` saying what is wrong."""
        data = read_schema(text, SCHEMA, VERSION, "remat time-model calibration")
        try:
            return cls(
                device=str(data["device"]),
                dtype=str(data["dtype"]),
                seconds_per_flop=data["seconds_per_flop"],
                seconds_per_byte=data["seconds_per_byte"],
                seconds_per_op=data["seconds_per_op"],
            )
        except KeyError as err:
            raise ValueError(f"remat time-model calibration lacks the field {err}") from None


class WorkCounter:
    """Counts the :class:`Work` of every ATen op run inside (fake tensors too); with a
    :class:`TimeModel`, :meth:`cost` is seconds, else FLOPs.

    Enter it once; read :attr:`work` or :meth:`cost` at any time (differences of two readings
    give the work in between).
    """

    def __init__(self, time_model: TimeModel | None = None) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self.time_model = time_model
        self._flops = FlopCounterMode(display=False)
        self._traffic = _TrafficMode()

    def __enter__(self) -> WorkCounter:
        self._flops.__enter__()
        self._traffic.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._traffic.__exit__(*exc)
        self._flops.__exit__(*exc)

    @property
    def work(self) -> Work:
        """The work counted so far."""
        return Work(self._flops.get_total_flops(), self._traffic.bytes_moved, self._traffic.ops)

    def cost(self) -> float:
        """Seconds under the time model, else FLOPs, counted so far."""
        if self.time_model is None:
            return float(self._flops.get_total_flops())
        return self.time_model.seconds(self.work)


def cache_dir() -> Path:
    """Where calibrations are kept: ``$REMAT_CACHE_DIR``, else ``~/.cache/remat``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "remat"


def planning_device(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device and dtype a model's step is timed for: those of its first floating-point
    parameter; a model on ``torch.device("meta")`` (built without memory) is planned for the
    current CUDA device when there is one, else the CPU."""
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else torch.get_default_dtype()
    if device.type == "meta":
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return device, dtype


def time_model_for(
    device: torch.device | str, dtype: torch.dtype = torch.float32, directory: Path | None = None
) -> TimeModel:
    """The calibrated :class:`TimeModel` of ``device`` and ``dtype``: from the cache file when
    it holds one for this device, else :func:`calibrate` (and the file is written)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    described = _describe_device(device)
    path = (directory or cache_dir()) / f"time-model-{_slug(described, dtype)}.json"
    if path.is_file():
        try:
            model = TimeModel.from_json(path.read_text())
            if model.device != described or model.dtype != str(dtype):
                raise ValueError(f"it was measured on {model.device!r} in {model.dtype}")
            return model
        except (ValueError, OSError, UnicodeDecodeError) as err:
            warnings.warn(
                f"remat: cannot use the time-model calibration {path} ({err}); calibrating "
                "again and rewriting it",
                stacklevel=2,
            )
    model = calibrate(device, dtype)
    with contextlib.suppress(OSError):  # a read-only home still plans (calibrating each time)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(model.to_json())
        tmp.replace(path)
    return model


def calibrate(device: torch.device | str, dtype: torch.dtype = torch.float32) -> TimeModel:
    """Measure a :class:`TimeModel` on ``device`` (about 0.1 s once torch's fake tensors are
    warm; allocates at most 48 MiB on the CPU, 384 MiB on a GPU).

    ``seconds_per_op`` is the time of a one-element add (the least of a few runs); ``seconds_per_byte`` the
    median over large elementwise ops of their time less the op cost, per byte moved;
    ``seconds_per_flop`` the same over large matrix products, less the op and byte costs.
    """
    device = torch.device(device)
    big = device.type != "cpu"
    # above the caches (an H100's L2 is 50 MB), at most 3 x 128 MiB on a GPU, 3 x 16 MiB here
    elementwise = [2**24, 2**25] if big else [2**20, 2**22]
    matmul = [2048, 4096] if big else [256, 512]

    def tiny() -> Callable[[], Any]:
        a = torch.ones(1, device=device, dtype=dtype)
        return lambda: a + a

    def add(n: int) -> Callable[[], Any]:
        a = torch.ones(n, device=device, dtype=dtype)
        return lambda: a + a

    def mm(n: int) -> Callable[[], Any]:
        a = torch.randn(n, n, device=device).to(dtype)
        return lambda: a @ a

    op_work, op_time = _measure(tiny, device)
    per_op = op_time / max(1, op_work.ops)
    per_byte = statistics.median(
        max(t - per_op * w.ops, 0.0) / max(1, w.bytes_moved)
        for w, t in (_measure(lambda n=n: add(n), device) for n in elementwise)
    )
    per_flop = statistics.median(
        max(t - per_op * w.ops - per_byte * w.bytes_moved, 0.1 * t) / max(1, w.flops)
        for w, t in (_measure(lambda n=n: mm(n), device) for n in matmul)
    )
    return TimeModel(_describe_device(device), str(dtype), per_flop, per_byte, per_op)


# ---------------------------------------------------------------------- implementation
class _TrafficMode(TorchDispatchMode):
    """Bytes read and written, and ops, of the ATen ops run inside (views move nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_moved = 0
        self.ops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outs and not _is_view(func):
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.ops += 1
            self.bytes_moved += sum(t.numel() * t.element_size() for t in (*ins, *outs))
        return out


_VIEWS_WITHOUT_ALIAS_INFO = frozenset({"_unsafe_view", "lift_fresh"})


def _is_view(func: Any) -> bool:
    """An op whose results alias its inputs without writing them (``view``, ``t``, ``detach``)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    if schema.name.split("::")[-1] in _VIEWS_WITHOUT_ALIAS_INFO:
        return True
    aliases = [r.alias_info for r in schema.returns]
    return bool(aliases) and all(a is not None and not a.is_write for a in aliases)


def _measure(make: Callable[[], Callable[[], Any]], device: torch.device) -> tuple[Work, float]:
    """The work of one call of the benchmark ``make()`` (counted on fake tensors) and its
    least seconds on ``device`` over a few calls (after a warm-up)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake_run = make()
        with WorkCounter() as counter:
            fake_run()
    work = counter.work
    run = make()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    run()
    times = []
    for _ in range(7):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return work, min(times)  # the least: other work on the machine only ever adds


def _describe_device(device: torch.device) -> str:
    """``"cuda:NVIDIA H100 80GB HBM3"``, or the CPU with the threads torch uses."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        cpu = platform.processor() or platform.machine()
        return f"cpu:{cpu}:{torch.get_num_threads()} threads"
    return device.type


def _slug(described: str, dtype: torch.dtype) -> str:
    text = f"{described}-{str(dtype).removeprefix('torch.')}"
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()
