"""Exact step memory and interleaved timing, for benchmarks and for checking plans.

Two measurements, both taken inside one process:

* :func:`step_peak_bytes`: the peak bytes of a whole training step, exact, counted from the
  allocator's own events (``torch.profiler(profile_memory=True)``): the persistent state at the
  step's start (parameters, gradients, buffers, optimizer state, inputs; unique storages) plus the
  running sum's maximum over the step's allocation/free events. Unlike MemTracker (a
  TorchDispatchMode), it also sees allocations inside ``torch.compile``d code, so compiled peers
  are measured the same way as eager ones (shared/peers.md, "How the figures were taken").
* :func:`interleaved_times`: several step functions timed in turn, A B C A B C ..., so that a
  drifting shared machine affects all alike; compare medians as ratios.

Known limitations: on CUDA use ``torch.cuda.max_memory_allocated`` instead (see
:func:`cuda_step_peak_bytes`); the profiler adds overhead, so never time a step while measuring
its memory.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from remat.guards import buffer_slots, own_hooks

__all__ = [
    "AllocatorWindow",
    "HeldPastStep",
    "storage_bytes",
    "output_tensors",
    "garbage_collected",
    "older_objects_frozen",
    "tracked_objects",
    "SCRATCH_MIN_BYTES",
    "CUDA_BLOCK_BYTES",
    "allocated_bytes",
    "scratch_bytes",
    "small_scratch_bytes",
    "unique_storage_bytes",
    "allocation_bytes",
    "expandable_segments",
    "UNSPLIT_BLOCKS_WARNING",
    "step_peak_bytes",
    "cuda_step_peak_bytes",
    "interleaved_times",
    "median_ratio",
]

KINETO_QUIET_LOG_LEVEL = "6"
"""Kineto's log level above its highest severity (USDT, 5; ERROR is 4): the profiler remat starts
to count the allocator's events prints nothing (no ``USDT ... profiler_start/stop`` per window,
no ``gpuGetDeviceCount failed`` on a machine without a GPU). Kineto reads ``KINETO_LOG_LEVEL``
once, when the first profiler of the process starts; a value the user set is kept."""

os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LOG_LEVEL)


@contextlib.contextmanager
def garbage_collected() -> Iterator[None]:
    """Collect garbage before the block.

    NOTE [ Collect before measuring ]: garbage from before a measurement (a reference cycle
    through an exception's traceback that holds a model output) freed by the cyclic collector
    inside an allocator window lowers the allocator's count there and hides kernel scratch
    memory (GPT-2's loss backward: 4 MiB, now and then, in a capture after a refused budget).
    The collector is not paused inside the block: cycles the measured code makes itself are
    part of what it measures."""
    gc.collect()
    yield


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """Collect garbage once, then let the collector skip every object alive now until the block
    ends (:func:`gc.freeze`, undone after it); a no-op where objects are frozen already (the
    caller's own :func:`gc.freeze`, or an enclosing block).

    Each measurement collects garbage first (NOTE [ Collect before measuring ]), and a full
    collection walks every object the process holds: 0.24 s with torch, transformers and timm
    imported (524,000 objects), 87 times in one compiled re-plan, 18 s of its 86 s. Inside the
    block it walks only what the block made, and frees the same garbage: what was garbage at the
    start is freed before the freeze, and what becomes garbage of the older objects inside the
    block (rare: a reference the block drops closed a cycle of them) stays until the block ends,
    unfreed inside any measurement. Around remat's entry points that measure (auto and its
    re-plans, fit, the captures, profile)."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def tracked_objects() -> list[Any]:
    """Every object the garbage collector tracks, those :func:`gc.freeze` moved aside included
    (:func:`gc.get_objects` leaves them out: a model's parameters, inside
    :func:`older_objects_frozen`). Frozen again after, with what was made since."""
    if not gc.get_freeze_count():
        return gc.get_objects()
    gc.unfreeze()
    try:
        return gc.get_objects()
    finally:
        gc.freeze()


class HeldPastStep:
    """The bytes of tensors made inside the block that are still alive after it: what the
    program keeps of a step past its end, whatever remat plans (a forward hook that keeps a
    layer's output in a dict for a feature loss holds it through the backward, and the last
    step's until the next overwrites it; a module caching a tensor as an attribute). Each
    storage once; parameters, buffers, their gradients and ``exclude`` left out; fake tensors
    only in a ``fake`` capture (torch.compile's tracing keeps thousands of its own, 6.9 MB for
    a tiny GPT-2). Read :attr:`bytes` after the block; the block's own frames must be gone by
    then (call it around a function, not inside it).

    Every live tensor is looked at (the garbage collector's objects: 0.1 s in a process of
    450,000) only where a hook can hold one: a module of the model, or every module, has
    hooks; otherwise the tensors held as attributes of the model's modules."""

    def __init__(self, model: torch.nn.Module, exclude: Any = (), fake: bool = False) -> None:
        self.model = model
        self.exclude = exclude
        self.fake = fake
        self.bytes = 0
        self._before: set[int] = set()
        self._everywhere = False

    def __enter__(self) -> HeldPastStep:
        self._everywhere = _hooked(self.model)
        self._before = {id(t) for t in self._tensors()}
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            return
        new = self._new()
        if not new:
            return
        if self._everywhere:
            gc.collect()  # (a tensor only a reference cycle holds is not the program's)
            new = self._new()
        known = [*self.model.parameters(), *self.model.buffers(), *_flatten(self.exclude)]
        known += [p.grad for p in self.model.parameters() if p.grad is not None]
        skip = set(storage_bytes(known))
        self.bytes = sum(b for k, b in storage_bytes(new).items() if k not in skip)

    def _tensors(self) -> list[torch.Tensor]:
        if self._everywhere:
            # (objects gc.freeze moved aside are older than this block: none of them is new)
            return _live_tensors(gc.get_objects())
        return _live_tensors(t for m in self.model.modules() for t in _flatten(vars(m)))

    def _new(self) -> list[torch.Tensor]:
        from torch._subclasses.fake_tensor import FakeTensor

        return [
            t
            for t in self._tensors()
            if id(t) not in self._before and (self.fake or not isinstance(t, FakeTensor))
        ]


def _hooked(model: torch.nn.Module) -> bool:
    """Whether a hook may keep a tensor: one of the model's modules has hooks, or every
    module has (``register_module_forward_hook``)."""
    from torch.nn.modules import module as nn_module

    every = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")
    if any(getattr(nn_module, name, None) for name in every):
        return True
    return any(own_hooks(m) for m in model.modules())


def _live_tensors(objects: Iterable[Any]) -> list[torch.Tensor]:
    """Of ``objects``, the strided tensors (plain and fake, parameters) with a storage of
    their own."""
    # type(), not isinstance(): the latter reads __class__, which a dead weak proxy (dynamo
    # keeps some) raises on, and a deprecated module attribute warns on
    out = []
    for o in objects:
        if issubclass(type(o), torch.Tensor) and o.layout == torch.strided:
            try:
                o.untyped_storage()
            except (NotImplementedError, RuntimeError):
                continue  # no storage of its own (functorch's batched tensors, ...)
            out.append(o)
    return out


def output_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor a model output holds: pytree containers (tuples, lists, dicts, Hugging Face
    ``ModelOutput``s), and the fields of other objects (dataclasses, namespaces), so that what a
    training loop keeps by holding the output is found whatever its class."""
    from torch.utils._pytree import tree_leaves

    # iterative: a recursive closure is a reference cycle that would keep the tensors (the
    # model's output) alive until the next garbage collection, and change what is measured
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        value, depth = stack.pop()
        if id(value) in seen or depth > 8:
            continue
        seen.add(id(value))
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
            elif hasattr(leaf, "__dict__") and not isinstance(leaf, type | torch.nn.Module):
                stack.append((vars(leaf), depth + 1))
    return found


CUDA_BLOCK_BYTES = 512
"""The CUDA caching allocator's smallest block: every allocation takes a multiple of it."""


def allocation_bytes(t: torch.Tensor) -> int:
    """Bytes the allocator takes for a new tensor shaped like ``t`` on ``t``'s device (its
    gradient, an optimizer state copy): on CUDA rounded up to the 512-byte block, which
    ``max_memory_allocated`` counts (a 64-channel batch norm's 256-byte gradient takes 512)."""
    return allocated_bytes(t.numel() * t.element_size(), t.device)


def criterion_input_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` as a loop's criterion reads it: a half-precision floating tensor at
    float32 (criteria upcast low-precision logits: Hugging Face's losses call ``.float()``,
    autocast runs ``cross_entropy`` in float32), any other as it is. The unit of
    :func:`remat.core.step.criterion_costs`."""
    if t.is_floating_point() and t.element_size() < 4:
        return t.numel() * 4
    return t.numel() * t.element_size()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Bytes per storage behind ``tensors`` (keyed by storage identity, each storage once; fake
    tensors too, whose storages have no address)."""
    out: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        out[storage._cdata] = storage.nbytes()
    return out


def unique_storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (non-tensors are ignored)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr() or id(storage)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def device_library_bytes(device: torch.device | None) -> int:
    """Bytes the CUDA caching allocator holds on ``device`` that no live tensor owns: the
    workspaces that cuBLAS, cuBLASLt and cuDNN keep for the rest of the process once used
    (66 MiB on an H100 with torch 2.11: every training step's peak there includes them), and
    the rounding of live tensors to the allocator's 512-byte blocks. Measured now: the
    allocator's count minus the storages of every tensor the garbage collector can see. 0 on
    any other device, and before the libraries' first use (e.g. planned with ``fake=True`` in a
    process that has not yet run a matrix product on the device)."""
    if device is None or device.type != "cuda" or not torch.cuda.is_initialized():
        return 0
    if not expandable_segments():
        warnings.warn(UNSPLIT_BLOCKS_WARNING, stacklevel=2)
    _warm_libraries(device)
    gc.collect()
    torch.cuda.synchronize(device)
    owned: dict[int, int] = {}
    for obj in tracked_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # fake tensors a compile left behind
                continue
            if ptr and (obj.device == device or device.index is None):
                owned[ptr] = storage.nbytes()
    return max(0, torch.cuda.memory_allocated(device) - sum(owned.values()))


UNSPLIT_BLOCKS_WARNING = (
    "planning for CUDA without expandable segments: the caching allocator may give a tensor a "
    "larger free block without splitting it (up to 1 MiB more per block), which "
    "max_memory_allocated counts and remat cannot predict (an H100 step measured 657,376 B over "
    "its prediction on ResNet-18, 9.7 MB on a compiled GPT-2 124M). Set "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA starts: the same steps then "
    "measured 760 B and 1.06 MB under their predictions (docs/results/gpu)"
)


def expandable_segments() -> bool:
    """Whether the CUDA caching allocator was configured with expandable segments (which split
    every block, so a tensor takes its own size rounded to 512 bytes)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for option in os.environ.get(name, "").replace(" ", "").split(","):
            key, _, value = option.partition(":")
            if key == "expandable_segments" and value.lower() == "true":
                return True
    return False


def _warm_libraries(device: torch.device) -> None:
    """One small checkpointed linear layer forward and backward on ``device``: cuBLAS keeps a
    workspace per thread's handle, and a recomputation runs its forward on the autograd
    engine's thread, where the step's first recomputation would otherwise allocate one more
    (suspected cause of an mlp-chain step 1,047,296 B over its prediction on an H100, and of a
    least budget that rose by 1,048,576 B between two captures of ResNet-50)."""
    x = torch.ones(8, 8, device=device, requires_grad=True)
    w = torch.ones(8, 8, device=device, requires_grad=True)
    b = torch.ones(8, device=device, requires_grad=True)
    with torch.autocast(device.type, enabled=False):
        y = checkpoint(torch.nn.functional.linear, x, w, b, use_reentrant=False)
        torch.nn.functional.linear(y, w, b).sum().backward()


def _state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, inputs: Any
) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for p in model.parameters():
        tensors.append(p)
        if p.grad is not None:
            tensors.append(p.grad)
    tensors.extend(model.buffers())
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    tensors.extend(_flatten(inputs))
    return tensors


def _flatten(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _flatten(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _flatten(v)]
    return []


def step_peak_bytes(
    step: Callable[[], Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    inputs: Any = None,
    warmup: int = 1,
) -> int:
    """Exact peak bytes (CPU) of one call of ``step`` after ``warmup`` calls.

    ``step`` runs a whole training step (forward, backward, optimizer step, zero_grad). The
    persistent state at the step's start is counted from ``model``, ``optimizer`` and
    ``inputs``; everything the step allocates is counted from the allocator's events.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    before = buffer_slots(model)
    for _ in range(warmup):
        step()
    # a buffer the forward assigns anew each step (``self.avg = 0.9 * self.avg + ...``): the
    # profiler reports no free of a tensor allocated before it started, so the old buffer the
    # step drops was counted live to the end (8 blocks reassigning a weight-sized average
    # measured 1,048,568 B above their unplanned step). Such buffers (replaced during the
    # warm-up) are copied inside the profiler's window, before the step: their frees are seen
    reassigned = [
        (m, name) for (m, name), b in buffer_slots(model).items() if before.get((m, name)) is not b
    ]
    persistent = unique_storage_bytes(_state_tensors(model, optimizer, inputs))
    # NOTE [ Collect before measuring ]: garbage from before (a refused budget's traceback
    # holding a model's tensors) freed inside the step lowered an every-block step's measured
    # peak of Llama from 513888 B to 497504 B, now and then
    with (
        garbage_collected(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        copies: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for m, name in reassigned:
                b = m._buffers[name]
                m._buffers[name] = copies.setdefault(id(b), b.clone())  # type: ignore[union-attr]
        del copies
        with record_function(_MEASURED_STEP):
            step()
    return persistent + _running_peak(prof, _MEASURED_STEP)


class AllocatorWindow:
    """The highest bytes allocated, above the level at its start, while the ``with`` body runs.

    Counted from the allocator itself, so it sees what a TorchDispatchMode (MemTracker) cannot:
    scratch memory that kernels allocate internally, such as oneDNN's convolution and batch-norm
    workspaces on the CPU. On the CPU from the profiler's memory events, on CUDA from
    ``torch.cuda.max_memory_allocated``. ``peak_bytes`` is ``None`` on other devices and when a
    profiler is already running (a second one would end the user's session).

    Example:
        >>> with AllocatorWindow(torch.device("cpu")) as window:
        ...     y = torch.ones(1024) * 2
        >>> window.peak_bytes >= 4096
        True
    """

    def __init__(self, device: torch.device | None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self.peak_bytes: int | None = None
        self._profiler: Any = None
        self._start = 0

    def __enter__(self) -> AllocatorWindow:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu" and not torch.autograd.profiler._is_profiler_enabled:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        elif self._profiler is not None:
            self._profiler.__exit__(*exc)
            if exc[0] is None:
                self.peak_bytes = _running_peak(self._profiler)
            self._profiler = None

    def excess(self, tracked: int) -> tuple[int, int]:
        """``(scratch, small scratch)``: what the window saw above ``tracked`` bytes of tensors
        over the same span (:func:`scratch_bytes`, :func:`small_scratch_bytes`); (0, 0) when
        it could not count."""
        peak = self.peak_bytes or 0
        return scratch_bytes(peak, tracked), small_scratch_bytes(peak, tracked)


def allocated_bytes(nbytes: int, device: torch.device | None) -> int:
    """What a tensor of ``nbytes`` takes from the allocator of ``device``: a multiple of
    :data:`CUDA_BLOCK_BYTES` on CUDA (a 4-byte loss takes 512 B), ``nbytes`` elsewhere."""
    if device is not None and device.type == "cuda" and nbytes > 0:
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


SCRATCH_MIN_BYTES = 1024
"""Allocator-only bytes below this are not kernel scratch: they are the wrapped scalars that C++
kernels make for a Python number (``x.mean()`` divides by an 8-byte double and its 4-byte float
copy). Ignoring them keeps real and fake captures byte-identical where no kernel allocates
real scratch memory."""


def scratch_bytes(allocator_peak: int, tracked_peak: int) -> int:
    """What the allocator saw above a tensor tracker's peak over the same window (kernel scratch
    memory), 0 below :data:`SCRATCH_MIN_BYTES`."""
    extra = allocator_peak - tracked_peak
    return extra if extra >= SCRATCH_MIN_BYTES else 0


def small_scratch_bytes(allocator_peak: int, tracked_peak: int) -> int:
    """The rest of it: what the allocator saw above the tracker's peak when it is below
    :data:`SCRATCH_MIN_BYTES` (left out of a capture's overheads, so that real and fake
    captures agree, and counted at its own stage or node instead:
    :attr:`remat.core.step.StepCosts.op_scratch_bytes`), else 0; 0 when the allocator saw
    nothing (``allocator_peak`` 0: no window)."""
    extra = allocator_peak - tracked_peak
    return extra if 0 < extra < SCRATCH_MIN_BYTES and allocator_peak > 0 else 0


_MEASURED_STEP = "remat::measured_step"


def _running_peak(prof: Any, within: str | None = None) -> int:
    """Highest running sum of a finished profiler's allocation/free events (from 0); with
    ``within``, of those inside the ``record_function`` of that name only."""
    results = prof.profiler.kineto_results.events()
    events = [e for e in results if e.name() == "[memory]"]
    if within is not None:
        (mark,) = [e for e in results if e.name() == within]
        events = [e for e in events if mark.start_ns() <= e.start_ns() <= mark.end_ns()]
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for event in events:
        running += event.nbytes()
        peak = max(peak, running)
    return peak


def cuda_step_peak_bytes(step: Callable[[], Any], warmup: int = 1) -> int:
    """Peak bytes of one step on the current CUDA device (``max_memory_allocated``)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def interleaved_times(
    steps: Mapping[str, Callable[[], Any]], repeats: int = 5, warmup: int = 1
) -> dict[str, list[float]]:
    """Time each step ``repeats`` times, interleaved in rounds whose order alternates (A B C,
    C B A, A B C, ...); returns seconds per call, round by round.

    Each step runs first as often as last, so that a place in the round (a cache the step
    before warmed or cooled, memory it freed) cannot favour one of them. No such edge was
    measured on the CPU (two copies of one MLP step, 61 rounds, three runs each: second over
    first 0.992-1.005 in a fixed order, 0.990-1.013 alternating, every 95 % interval holding
    1); the paired verdicts of ``remat bench compile`` are decided within a percent, where
    counterbalancing costs nothing."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps.items())
    for r in range(repeats):
        for name, step in order if r % 2 == 0 else reversed(order):
            sync()
            start = time.perf_counter()
            step()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def median_ratio(times: Mapping[str, list[float]], name: str, baseline: str) -> float:
    """median(times[name]) / median(times[baseline])."""
    return statistics.median(times[name]) / statistics.median(times[baseline])


def median_ratio_interval(
    times: Mapping[str, list[float]], name: str, baseline: str, level: float = 0.95
) -> tuple[float, float]:
    """A ``level`` confidence interval of :func:`median_ratio` for one interleaved loop
    (:func:`interleaved_times`): SciPy's percentile bootstrap, the loop's rounds resampled
    whole (round ``i`` of ``name`` with round ``i`` of ``baseline``: they ran side by side, so
    drift on a shared machine moves both). Seeded: the same times give the same interval."""
    import numpy as np
    from scipy.stats import bootstrap

    def ratio(a: np.ndarray, b: np.ndarray, axis: int) -> np.ndarray:
        return np.median(a, axis=axis) / np.median(b, axis=axis)

    result = bootstrap(
        (np.asarray(times[name]), np.asarray(times[baseline])),
        ratio,
        paired=True,
        vectorized=True,
        n_resamples=2000,
        confidence_level=level,
        method="percentile",
        rng=np.random.default_rng(0),
    )
    return float(result.confidence_interval.low), float(result.confidence_interval.high)
