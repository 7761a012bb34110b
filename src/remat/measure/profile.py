"""Exact memory of one training step, by category, per module and over time: :func:`profile`.

A training step everywhere in remat is::

    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step(); optimizer.zero_grad(set_to_none=True)     # when an optimizer is given

(:func:`training_step`; the default loss is :func:`default_loss_fn`). :func:`profile` runs one
such step under a tracker built on ``torch.distributed._tools.mem_tracker.MemTracker`` (a
``TorchDispatchMode`` that sees every tensor storage created, tags it, and sees it die) and
returns a :class:`MemoryReport`:

* ``peak_bytes``: the highest live bytes of the step, exact (the CPU allocator does not round;
  on CUDA storages are counted in 512-byte blocks, as the caching allocator allocates them);
* ``categories``: what the live bytes at that moment are made of, six keys that add up to
  ``peak_bytes``: ``parameters``, ``buffers``, ``gradients`` (of parameters), ``optimizer``
  (optimizer state as it stood at the step's start), ``activations`` (the batch and every tensor
  the forward created that is still alive: saved tensors, outputs) and ``temporaries``
  (everything else: activation gradients, workspaces, the optimizer's scratch tensors);
* ``activation_peak_bytes``: the highest bytes of activations + temporaries during the forward
  and backward: what remat's cost model (:class:`~remat.core.chain.Chain`, :func:`~remat.simulate`)
  predicts. Parameter gradients are excluded from it from the operation that computes them on
  (see the note on :class:`StepTracker`);
* ``module_peaks``: per module FQN, the highest live bytes while inside its forward and while
  inside its backward;
* ``timeline``: ``(label, live_bytes)`` after every operation, labels ``phase:module``;
* on CUDA, ``cuda_max_allocated_bytes``: ``torch.cuda.max_memory_allocated()`` over the step;
  on the CPU (real tensors), ``allocator_peak_bytes``: the start bytes plus the peak of the
  allocator's own events over the same step (the profiler's memory events). It is the device's
  real peak: it also counts the scratch memory kernels allocate that is not a tensor, which
  MemTracker (and so ``peak_bytes``) cannot see — oneDNN convolutions, batch norms and LSTMs on
  the CPU (:attr:`MemoryReport.scratch_bytes`; docs/cost-model.md).

**Steady state.** When an optimizer is given and has no state yet, one warm-up step runs first
(not measured) so that the measured step holds the optimizer state, as every later step does
(shared/peers.md counts the same way). Parameter gradients are ``None`` when the measured step
starts (as after ``zero_grad(set_to_none=True)``); without an optimizer they are put back as
they were afterwards. ``profile`` trains: with an optimizer the parameters change, and batch
norm statistics are updated as in any training step. The step runs on a copy of the batch
(:class:`remat.guards.BatchCopy`): a model that writes into its input leaves the caller's batch as it was.

**Fake tensors.** ``fake=True`` runs the same step under ``FakeTensorMode``: parameters,
buffers, optimizer state and batch are swapped for fake tensors of the same shapes, dtypes and
devices, so nothing is allocated and a model far larger than the machine is measured in
seconds. The bytes equal the real step's to the byte (tests/test_profile.py). The model's own
tensors are put back afterwards; no real step runs.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    >>> report = profile(model, torch.randn(4, 8), fake=True)
    >>> sum(report.categories.values()) == report.peak_bytes
    True

Known limitations: memory that is not a tensor storage (convolution scratch, allocator caches)
is not seen (~2.6 MB on a ResNet, shared/peers.md); a ``torch.compile``d model runs eagerly
under the tracker, so its compiled memory is not what is measured (use
:func:`remat.measure.events.step_peak_bytes`); the categories sum every device.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_flatten, tree_map_only

from remat.core.errors import UnsupportedModelError
from remat.core.schema import read_schema
from remat.core.units import format_bytes
from remat.guards import BatchCopy
from remat.measure.events import AllocatorWindow, older_objects_frozen

__all__ = [
    "CATEGORIES",
    "MemoryReport",
    "profile",
    "training_step",
    "default_loss_fn",
    "loss_from_output",
    "StepTracker",
    "fake_step",
    "optimizer_costs",
    "OPTIMIZER_SCALAR_BYTES",
    "BatchCopy",
    "MEMORY_REPORT_SCHEMA_VERSION",
    "format_memory_report",
]

MEMORY_REPORT_SCHEMA_VERSION = 1
CATEGORIES = ("parameters", "buffers", "gradients", "optimizer", "activations", "temporaries")
"""The keys of :attr:`MemoryReport.categories`, in display order."""

LossFn = Callable[[nn.Module, Any], torch.Tensor]

ONE_MODEL_CALL = (
    "loss_fn(model, batch) must call the model exactly once per step: remat measures and plans "
    "one forward of the model (a second call would run outside the plan, and its activations "
    "would not be counted). Call the model once (e.g. on the two inputs concatenated along "
    "the batch dimension) and compute every loss term from its output"
)
"""The error when ``loss_fn`` calls the model twice (chain and graph captures)."""


# ---------------------------------------------------------------------- the training step
def default_loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(*batch)`` for a tuple/list, ``model(**batch)`` for a dict, ``model(batch)``
    otherwise; then :func:`loss_from_output`."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, tuple | list):
        out = model(*batch)
    else:
        out = model(batch)
    return loss_from_output(out)


def loss_from_output(out: Any) -> torch.Tensor:
    """The output's ``.loss`` if it has one (Hugging Face), else ``.sum()`` of the output (of
    its first element if it is a tuple or a model output without a loss)."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()[0]
    elif isinstance(out, tuple | list) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"cannot make a loss from a model output of type {type(out).__name__}: pass "
            "loss_fn(model, batch) -> scalar tensor"
        )
    return out.sum()


def training_step(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.Tensor:
    """One training step (see the module docstring); returns the loss, detached."""
    return _run_step(model, batch, loss_fn or default_loss_fn, optimizer, None)


def _run_step(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    tracker: StepTracker | None,
) -> torch.Tensor:
    def phase(name: str) -> None:
        if tracker is not None:
            tracker.set_phase(name)

    phase("forward")
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            "loss_fn(model, batch) must return a scalar tensor, got "
            + (
                f"a tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
        )
    phase("backward")
    loss.backward()
    if optimizer is not None:
        phase("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    phase("end")
    return loss.detach()


# ---------------------------------------------------------------------- the report
@dataclass(frozen=True)
class MemoryReport:
    """Exact memory of one training step (see the module docstring)."""

    peak_bytes: int
    """Highest live bytes during the step (every category)."""
    categories: dict[str, int]
    """Live bytes at the moment of the peak by category (keys :data:`CATEGORIES`); they add up
    to ``peak_bytes``."""
    activation_peak_bytes: int
    """Highest bytes of activations + temporaries (batch, saved tensors, outputs, activation
    gradients, transients; no parameter gradients) during forward and backward."""
    start_bytes: int
    """Live bytes when the step starts: parameters, buffers, optimizer state, the batch."""
    peak_label: str
    """Where the peak happened, ``phase:module`` (e.g. ``backward:layer4.1.conv2``)."""
    module_peaks: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Module FQN (the root is its class name) -> (highest live bytes while inside its
    forward, while inside its backward); 0 where it never ran."""
    timeline: tuple[tuple[str, int], ...] = ()
    """``(phase:module, live bytes)`` after every operation and at every phase change."""
    device: str = "cpu"
    """The device of the model's parameters."""
    fake: bool = False
    """Measured under ``FakeTensorMode`` (nothing allocated)."""
    warmup_steps: int = 0
    """Unmeasured steps run first so that the optimizer state exists (0 or 1)."""
    cuda_max_allocated_bytes: int | None = None
    """``torch.cuda.max_memory_allocated()`` over the step (real CUDA runs only)."""
    model_name: str = ""
    """The model's class name (or zoo name)."""
    allocator_peak_bytes: int | None = None
    """The step's peak counted from the allocator's events (real CPU runs only): includes
    kernels' scratch memory that is not a tensor."""

    def __post_init__(self) -> None:
        if set(self.categories) != set(CATEGORIES):
            raise ValueError(f"categories must have exactly the keys {CATEGORIES}")
        object.__setattr__(self, "categories", {k: int(self.categories[k]) for k in CATEGORIES})
        object.__setattr__(
            self,
            "module_peaks",
            {k: (int(v[0]), int(v[1])) for k, v in self.module_peaks.items()},
        )
        object.__setattr__(self, "timeline", tuple((str(a), int(b)) for a, b in self.timeline))

    @property
    def by_category(self) -> dict[str, int]:
        """Bytes at the step's peak by category (the same dict as :attr:`categories`)."""
        return self.categories

    @property
    def scratch_bytes(self) -> int | None:
        """How far the allocator's peak is above ``peak_bytes`` (kernel scratch memory that
        MemTracker cannot see; on CUDA from ``max_memory_allocated``); ``None`` when unknown."""
        real = self.allocator_peak_bytes or self.cuda_max_allocated_bytes
        return None if real is None else max(0, real - self.peak_bytes)

    @property
    def fixed_bytes(self) -> int:
        """Parameters + buffers + gradients + optimizer state at the peak."""
        c = self.categories
        return c["parameters"] + c["buffers"] + c["gradients"] + c["optimizer"]

    def table(self) -> str:
        """The breakdown as a text table (bytes through :func:`remat.core.units.format_bytes`)."""
        return format_memory_report(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "remat.memory_report",
            "version": MEMORY_REPORT_SCHEMA_VERSION,
            "model_name": self.model_name,
            "device": self.device,
            "fake": self.fake,
            "warmup_steps": self.warmup_steps,
            "peak_bytes": self.peak_bytes,
            "categories": dict(self.categories),
            "activation_peak_bytes": self.activation_peak_bytes,
            "start_bytes": self.start_bytes,
            "peak_label": self.peak_label,
            "cuda_max_allocated_bytes": self.cuda_max_allocated_bytes,
            "allocator_peak_bytes": self.allocator_peak_bytes,
            "module_peaks": {k: list(v) for k, v in self.module_peaks.items()},
            "timeline": [list(p) for p in self.timeline],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> MemoryReport:
        """Read a report written by :meth:`to_json` (checks the schema and its version)."""

        data = read_schema(
            text,
            "remat.memory_report",
            MEMORY_REPORT_SCHEMA_VERSION,
            "remat memory report",
            ValueError,
        )
        data.pop("schema")
        data.pop("version")
        data["module_peaks"] = {k: tuple(v) for k, v in data.get("module_peaks", {}).items()}
        data["timeline"] = tuple(tuple(p) for p in data.get("timeline", []))
        return cls(**data)


_CATEGORY_HELP = {
    "parameters": "model weights",
    "buffers": "batch-norm statistics and other buffers",
    "gradients": "parameter gradients",
    "optimizer": "optimizer state (e.g. Adam moments)",
    "activations": "batch, saved tensors and outputs of the forward",
    "temporaries": "activation gradients and transient buffers",
}


def format_memory_report(report: MemoryReport) -> str:
    """The category breakdown at the peak, then the activation peak and the CUDA figure."""
    mode = "fake tensors" if report.fake else report.device
    lines = [
        f"memory of one training step: {report.model_name or 'model'} on {mode}"
        + (f" (after {report.warmup_steps} warm-up step)" if report.warmup_steps else ""),
        f"{'category':<12} {'bytes':>12} {'share':>7}  what",
    ]
    for key in CATEGORIES:
        value = report.categories[key]
        share = value / report.peak_bytes if report.peak_bytes else 0.0
        lines.append(f"{key:<12} {format_bytes(value):>12} {share:>7.1%}  {_CATEGORY_HELP[key]}")
    lines.append(
        f"{'peak':<12} {format_bytes(report.peak_bytes):>12} {1:>7.0%}  at {report.peak_label}"
    )
    lines.append(
        f"activation peak (forward + backward, no parameter state): "
        f"{format_bytes(report.activation_peak_bytes)}"
    )
    lines.append(f"live at the step's start: {format_bytes(report.start_bytes)}")
    if report.cuda_max_allocated_bytes is not None:
        lines.append(
            f"torch.cuda.max_memory_allocated: {format_bytes(report.cuda_max_allocated_bytes)}"
        )
    if report.allocator_peak_bytes is not None:
        lines.append(
            f"allocator peak: {format_bytes(report.allocator_peak_bytes)} (includes "
            f"{format_bytes(report.scratch_bytes or 0)} of kernel scratch memory that is not a "
            "tensor)"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- entry point
@older_objects_frozen()
def profile(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: str | torch.device | None = None,
    fake: bool = False,
    timeline: bool = True,
) -> MemoryReport:
    """Measure one training step of ``model`` on ``batch`` exactly (module docstring).

    ``device`` moves the model and batch there first (``model.to(device)``); by default they
    stay where they are. ``fake=True`` measures under ``FakeTensorMode`` without allocating.
    ``timeline=False`` skips the per-operation timeline (faster on very deep models).
    """
    loss_fn = loss_fn or default_loss_fn
    if device is not None:
        model.to(device)
        batch = tree_map_only(torch.Tensor, lambda t: t.to(device), batch)
    if fake:
        with fake_step(model, batch, optimizer) as (mode, fake_batch, fake_opt), mode:
            return _measure(model, fake_batch, loss_fn, fake_opt, fake=True, timeline=timeline)
    return _measure(model, batch, loss_fn, optimizer, fake=False, timeline=timeline)


def _model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _measure(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    fake: bool,
    timeline: bool,
) -> MemoryReport:
    private = BatchCopy(batch) if not fake else None  # the model may write into its input
    if private is not None:
        batch = private.batch
    warmup = 0
    if optimizer is not None and not optimizer.state:
        _run_step(model, batch, loss_fn, optimizer, None)
        warmup = 1
        if private is not None:
            private.restore()
    grads = {p: p.grad for p in model.parameters()}
    for p in grads:
        p.grad = None
    device = _model_device(model)
    on_cuda = device.type == "cuda" and not fake
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    tracker = StepTracker(root=model, timeline=timeline)
    tracker.track_external(model, *([optimizer] if optimizer is not None else []), batch)
    on_cpu = device.type == "cpu" and not fake
    window: Any = contextlib.nullcontext()
    if on_cpu:
        window = AllocatorWindow(device)
    try:
        with tracker:
            tracker.start()
            with window:
                _run_step(model, batch, loss_fn, optimizer, tracker)
    finally:
        if optimizer is None:
            for p, g in grads.items():
                p.grad = g
    cuda_peak = None
    if on_cuda:
        torch.cuda.synchronize(device)
        cuda_peak = int(torch.cuda.max_memory_allocated(device))
    return MemoryReport(
        peak_bytes=tracker.peak_bytes,
        categories=tracker.peak_categories(),
        activation_peak_bytes=tracker.activation_peak_bytes,
        start_bytes=tracker.start_bytes,
        peak_label=tracker.peak_label,
        module_peaks=tracker.module_peaks(),
        timeline=tuple(tracker.timeline),
        device=str(device),
        fake=fake,
        warmup_steps=warmup,
        cuda_max_allocated_bytes=cuda_peak,
        model_name=type(model).__name__,
        allocator_peak_bytes=(
            tracker.start_bytes + window.peak_bytes
            if on_cpu and window.peak_bytes is not None
            else None
        ),
    )


# ---------------------------------------------------------------------- the tracker
_ACTIVATION_TAGS = (_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.OTH)
_FIXED_TAGS = (_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD, _MemRefType.OPT)


_PLAIN_VALUES = (bool, int, float, complex, str, bytes)


def _unmeasurable(t: torch.Tensor, modules: Sequence[str]) -> str:
    """Why a step that makes ``t``, a tensor not in the strided layout, cannot be measured
    (inside ``modules``, the tracker's modules running then)."""
    where = [
        m for m in modules if m != "Global" and not any(o.startswith(f"{m}.") for o in modules)
    ]
    inside = f" (inside {', '.join(where)})" if where else ""
    return (
        f"the step makes a tensor of layout {t.layout}{inside}, which remat cannot measure: its "
        "memory tracker counts tensors by their storage, and a sparse tensor has none. A sparse "
        "gradient comes from nn.Embedding or nn.EmbeddingBag with sparse=True (or "
        "F.embedding(..., sparse=True)): use sparse=False, a dense gradient, which remat "
        "measures and plans for"
    )


class StepTracker(MemTracker):
    """``MemTracker`` that also keeps remat's measures, sampled after every operation:

    * the peak of all live bytes and its breakdown (summed over devices);
    * the peak of *activation-side* bytes (everything but parameters, buffers, parameter
      gradients and optimizer state) in the forward and backward phases, and the peak of the
      same quantity since :meth:`reset_window` (for per-stage measurements);
    * each module's highest live bytes in forward and in backward (only the active modules are
      visited: MemTracker's own per-module bookkeeping visits every module on every operation,
      which is quadratic on a 1000-layer network);
    * the timeline ``(phase:module, live bytes)``.

    Phases are set by the caller with :meth:`set_phase`; only ``"forward"`` and ``"backward"``
    count towards :attr:`activation_peak_bytes`.

    NB (parameter gradients): the operation that computes a parameter's gradient makes a new
    storage that MemTracker tags as a temporary until the autograd engine hands it to the
    parameter, a few operations later (its gradient hook re-tags it). Counted as it is tagged,
    the 411 MB gradient of VGG's first classifier layer would be "activation" memory for those
    few operations. So every storage that becomes a parameter gradient is counted as a
    gradient from its creation: the samples taken in between are corrected when it is
    re-tagged.
    """

    def track_external(self, *external: Any) -> None:
        """Like ``MemTracker.track_external``; leaves that hold no memory (the floats, ints,
        bools and strings of a batch such as ``{"x": x, "temperature": 0.7}``) are skipped
        (MemTracker raises on them)."""
        leaves = tree_flatten(external)[0]
        super().track_external(*(x for x in leaves if not isinstance(x, _PLAIN_VALUES)))

    def __init__(self, root: nn.Module | None = None, timeline: bool = True) -> None:
        super().__init__()
        self._mod_tracker = _HookReturningModTracker()
        self.phase = "start"
        self.record_timeline = timeline
        self.timeline: list[tuple[str, int]] = []
        self.peak_bytes = 0
        self.peak_label = ""
        self.start_bytes = 0
        self._peak_index = -1
        self._peak_snapshot: dict[Any, int] = {}
        self._opt_state_bytes = 0
        self._module_peaks: dict[str, list[int]] = {}
        self._root_prefix = f"{type(root).__name__}." if root is not None else ""
        # activation-side bytes and phase of every sample; storages created (sample index, tag)
        self._activation: list[int] = []
        self._with_grads: list[int] = []  # activation-side + parameter gradients
        self._counts: list[bool] = []
        self._created: dict[Any, tuple[int, Any]] = {}
        # (first sample, end sample, bytes, tag at creation) of storages that became gradients
        self._regraded: list[tuple[int, int, int, Any]] = []
        self._window_start = 0

    # -- public measures
    @property
    def activation_peak_bytes(self) -> int:
        """Highest activation-side bytes in the forward and backward phases."""
        return self._corrected_max(0, len(self._activation), phases_only=True)

    @property
    def window_peak(self) -> int:
        """Highest activation-side bytes since :meth:`reset_window`."""
        return self._corrected_max(self._window_start, len(self._activation), phases_only=False)

    @property
    def window_peak_with_grads(self) -> int:
        """Highest activation-side plus parameter-gradient bytes since :meth:`reset_window`."""
        return max(self._with_grads[self._window_start :], default=0)

    def live_bytes(self) -> int:
        """All live tracked bytes now."""
        return sum(snap[_TOTAL_KEY] for snap in self._curr_mem_snap.values())

    def activation_bytes(self) -> int:
        """Live bytes now that are not parameters, buffers, parameter gradients or optimizer
        state."""
        return sum(
            snap[_TOTAL_KEY] - sum(snap[tag] for tag in _FIXED_TAGS)
            for snap in self._curr_mem_snap.values()
        )

    def start(self) -> None:
        """Call inside the context when the step starts: records the starting state."""
        self._opt_state_bytes = self._tag_bytes(_MemRefType.OPT)
        self.start_bytes = self.live_bytes()
        self.reset_window()

    def set_phase(self, phase: str) -> None:
        """Enter a phase (``forward``, ``backward``, ``optimizer``, ...); records a point."""
        self.phase = phase
        self._sample()

    def reset_window(self) -> None:
        """Restart the window peak from the activation-side bytes live now."""
        self._window_start = len(self._activation)
        self._sample()

    def peak_categories(self) -> dict[str, int]:
        """The six categories at the peak; optimizer scratch beyond the starting optimizer
        state counts as temporaries."""
        snap = dict(self._peak_snapshot)
        for first, end, nbytes, tag in self._regraded:
            if first <= self._peak_index < end:
                snap[tag] -= nbytes
                snap[_MemRefType.GRAD] += nbytes
        opt = snap.get(_MemRefType.OPT, 0)
        state = min(opt, self._opt_state_bytes)
        return {
            "parameters": snap.get(_MemRefType.PARAM, 0),
            "buffers": snap.get(_MemRefType.BUFFER, 0),
            "gradients": snap.get(_MemRefType.GRAD, 0),
            "optimizer": state,
            "activations": snap.get(_MemRefType.ACT, 0) + snap.get(_MemRefType.OTH, 0),
            "temporaries": snap.get(_MemRefType.TEMP, 0) + opt - state,
        }

    def module_peaks(self) -> dict[str, tuple[int, int]]:
        return {self._name(k): (v[0], v[1]) for k, v in self._module_peaks.items()}

    # -- MemTracker overrides
    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        # MemTracker counts a tensor by its storage, and a sparse tensor has none (it raised
        # torch's "Cannot access storage of SparseTensorImpl" from inside the backward)
        if t.layout is not torch.strided:
            raise UnsupportedModelError(_unmeasurable(t, sorted(self._mod_tracker.parents)))
        super()._track(reftype, t)

    def _pre_bw_hook(self, module: nn.Module | None, args: Any) -> None:
        # a module gone before the backward (one a forward makes and drops) has nothing left
        # to attribute: MemTracker's warning ("Module is None. Skipping PRE_BW hook.") reached
        # the user of remat.auto on Hugging Face's ALBERT
        if module is not None:
            super()._pre_bw_hook(module, args)

    def _post_bw_hook(self, module: nn.Module | None, args: Any) -> None:
        if module is not None:
            super()._post_bw_hook(module, args)

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        # MemTracker hooks every parameter to tag its gradient; a frozen parameter (fine-tuning,
        # LoRA) has no gradient and refuses hooks ("cannot register a hook on a tensor that
        # doesn't require gradient"): hook only the parameters that require grad
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and param not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._tag_gradient),
                        param.register_post_accumulate_grad_hook(
                            lambda p: self._tag_gradient(p.grad)
                        ),
                    )
        return sizes

    def _tag_gradient(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # called after every operation
        self._sample()

    def _update_snap(self, u_type: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
        super()._update_snap(u_type, winfo, *args, **kwargs)
        if u_type.name == "ADD":
            if winfo.reftype != _MemRefType.GRAD:
                self._created[winfo] = (len(self._activation), winfo.reftype)
        elif u_type.name == "REF" and winfo.reftype == _MemRefType.GRAD:
            created = self._created.pop(winfo, None)
            if created is not None:
                first, tag = created
                self._regraded.append((first, len(self._activation), winfo.mem_consumed, tag))
        elif u_type.name == "DEL":
            self._created.pop(winfo, None)

    # -- implementation
    def _tag_bytes(self, tag: Any) -> int:
        return sum(snap.get(tag, 0) for snap in self._curr_mem_snap.values())

    def _name(self, fqn: str) -> str:
        if self._root_prefix and fqn.startswith(self._root_prefix):
            return fqn[len(self._root_prefix) :]
        return fqn

    def _sample(self) -> None:
        total = self.live_bytes()
        parents = self._mod_tracker.parents
        if total > self.peak_bytes or self._peak_index < 0:
            self.peak_bytes = total
            self.peak_label = self._label(parents)
            self._peak_index = len(self._activation)
            self._peak_snapshot = {tag: self._tag_bytes(tag) for tag in _MemRefType}
        index = 1 if self._mod_tracker.is_bw else 0
        for fqn in parents:
            if fqn == "Global":
                continue
            entry = self._module_peaks.get(fqn)
            if entry is None:
                entry = self._module_peaks[fqn] = [0, 0]
            if total > entry[index]:
                entry[index] = total
        if self.record_timeline:
            self.timeline.append((self._label(parents), total))
        self._activation.append(self.activation_bytes())
        self._with_grads.append(self._activation[-1] + self._tag_bytes(_MemRefType.GRAD))
        self._counts.append(self.phase in ("forward", "backward"))

    def _corrected_max(self, lo: int, hi: int, phases_only: bool) -> int:
        """Highest activation-side sample in ``[lo, hi)``, gradients counted as gradients."""
        if hi <= lo:
            return 0
        diff = [0] * (hi - lo + 1)
        for first, end, nbytes, _ in self._regraded:
            a, b = max(first, lo), min(end, hi)
            if a < b:
                diff[a - lo] += nbytes
                diff[b - lo] -= nbytes
        best = 0
        running = 0
        for k in range(lo, hi):
            running += diff[k - lo]
            if phases_only and not self._counts[k]:
                continue
            best = max(best, self._activation[k] - running)
        return best

    def _label(self, parents: set[str]) -> str:
        inner = [p for p in parents if p != "Global"]
        if not inner:
            return self.phase
        deepest = max(inner, key=lambda p: (p.count("."), len(p)))
        return f"{self.phase}:{self._name(deepest)}"


class _HookReturningModTracker(ModTracker):
    """``ModTracker`` that removes, when it exits, the gradient hooks it put on the tensors
    going into and out of modules (``register_multi_grad_hook``, whose handles it drops).

    Left in place, such a hook keeps memory alive for ever: its closure holds the autograd
    nodes of the tensors it watches (a leaf's ``AccumulateGrad`` node, which holds the leaf;
    an activation's ``grad_fn``, which holds the hook in turn), a cycle through C++ that the
    garbage collector cannot see. :func:`remat.capture` runs every stage on a leaf copy of its
    input, so each call leaked one activation per stage; :func:`profile` and the graph capture
    kept every parameter of the model alive after the model was gone. The hooks live in each
    tensor's hook dictionary, which its autograd node shares: emptied, the cycle is broken."""

    def __init__(self) -> None:
        super().__init__()
        self._hooked: list[tuple[dict[int, Any], list[int]]] = []

    # (the hooks run with torch-function modes off: registering a gradient hook on a leaf
    # calls ``view_as``, which the graph capture's recorder would count as the model's)
    def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
        before = _hook_keys(input)
        with torch._C.DisableTorchFunction(), _input_hooks_hold_no_gradient():
            super()._fw_pre_hook(mod, input)
        self._note_new_hooks(before)

    def _fw_post_hook(self, mod: nn.Module, input: Any, output: Any) -> None:
        before = _hook_keys(output)
        with torch._C.DisableTorchFunction():
            super()._fw_post_hook(mod, input, output)
        self._note_new_hooks(before)

    def _note_new_hooks(self, before: list[tuple[torch.Tensor, set[int]]]) -> None:
        for t, keys in before:
            hooks = t._backward_hooks
            added = [k for k in (hooks or {}) if k not in keys]
            if added:
                self._hooked.append((hooks, added))

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        for hooks, keys in self._hooked:
            for k in keys:
                hooks.pop(k, None)
        self._hooked.clear()


# NOTE [ Module input hooks that hold no gradient ]: ModTracker learns that a module's backward
# ended from a hook on the module's inputs (torch.autograd.graph.register_multi_grad_hook, mode
# "all"), which keeps each input's gradient until the last one is computed. In a module with
# two inputs that kept the first input gradient alive through the rest of the backward: Hugging
# Face ViT's ViTOutput(hidden_states, input_tensor) held the residual's gradient (one block
# output, 16,640 B) through the attention's backward, which a plain step frees. Every stage
# remat captured, and every step it profiled, peaked that much above the step the user runs
# (HF ViT's chain: predicted 1,074,044 B, measured 1,057,404 B; measured 1,074,044 B with a
# ModTracker around the plain step). So the input hooks count the gradients, and keep none.
@contextlib.contextmanager
def _input_hooks_hold_no_gradient() -> Iterator[None]:
    """ModTracker's input hooks registered with :func:`_after_every_gradient` inside."""
    from torch.distributed._tools import mod_tracker

    torch_own = mod_tracker.register_multi_grad_hook
    mod_tracker.register_multi_grad_hook = _after_every_gradient  # type: ignore[assignment]
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = torch_own


def _after_every_gradient(
    tensors: Sequence[torch.Tensor], fn: Callable[..., None], *, mode: str = "all"
) -> Any:
    """``register_multi_grad_hook(tensors, fn, mode="all")`` that keeps no gradient: in each
    backward, ``fn`` runs (with ``None`` for every gradient) once the last of ``tensors``'
    gradients that the backward computes is ready. Mode ``"any"`` is torch's own."""
    from torch.autograd.graph import _get_grad_fn_or_grad_acc, register_multi_grad_hook

    if mode != "all":
        return register_multi_grad_hook(tensors, fn, mode=mode)
    nodes = [_get_grad_fn_or_grad_acc(t) for t in tensors]
    count = len(tensors)  # (the hook holds no tensor: it would keep the activations alive)
    runs: dict[int, list[int]] = {}  # per backward (graph task): [hooks run, hooks expected]
    lock = threading.Lock()

    def hook(_grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        with lock:
            if task not in runs:
                runs[task] = [0, sum(map(torch._C._will_engine_execute_node, nodes))]
            runs[task][0] += 1
            last = runs[task][0] == runs[task][1]
            if last:
                del runs[task]
        if last:
            fn([None] * count)

    handles = [t.register_hook(hook) for t in tensors]
    return _Handles(handles)


class _Handles:
    """The handles of :func:`_after_every_gradient`'s hooks, removed together."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _hook_keys(obj: Any) -> list[tuple[torch.Tensor, set[int]]]:
    """The tensors in ``obj`` that require grad, with the keys of their backward hooks."""
    return [
        (t, set(t._backward_hooks or {}))
        for t in tree_flatten(obj)[0]
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]


# ---------------------------------------------------------------------- fake tensors
@contextlib.contextmanager
def fake_step(
    model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None = None
) -> Iterator[tuple[Any, Any, torch.optim.Optimizer | None]]:
    """Swap ``model``'s parameters and buffers for fake tensors while inside; yields
    ``(fake_mode, fake_batch, fake_optimizer)``. Enter ``fake_mode`` to run a step on them.

    The fake optimizer is a new instance of the optimizer's class over the fake parameters
    with the same parameter groups and (faked) state. The model's own tensors are put back on
    exit.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, module in model.named_modules():
        if not isinstance(module, nn.RNNBase):
            continue
        if next((p.device.type for p in module.parameters()), "cpu") != "cuda":
            raise ValueError(
                f"fake tensors cannot count {name or 'the model'}'s memory "
                f"({type(module).__name__}): on the CPU its oneDNN kernel saves a workspace for "
                "the backward (2 MB per layer for a 2-layer LSTM of 64 units over 8 x 64 "
                "steps) that its fake kernel leaves out; capture the model with fake=False"
            )
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}
    originals: list[tuple[dict[str, Any], str, torch.Tensor]] = []

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        key = id(t)
        if key not in fakes:
            with torch.no_grad():
                f = mode.from_tensor(t)
            if isinstance(t, nn.Parameter):
                f = nn.Parameter(f, requires_grad=t.requires_grad)
            fakes[key] = f
        return fakes[key]

    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    originals.append((table, name, t))
                    table[name] = fake_of(t)
        fake_batch = tree_map_only(torch.Tensor, fake_of, batch)
        yield mode, fake_batch, _fake_optimizer(optimizer, fake_of, mode)
    finally:
        for table, name, t in reversed(originals):
            table[name] = t


def _fake_optimizer(
    optimizer: torch.optim.Optimizer | None,
    fake_of: Callable[[torch.Tensor], torch.Tensor],
    mode: Any,
) -> torch.optim.Optimizer | None:
    if optimizer is None:
        return None
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            **_implementation(optimizer, g),
            "params": [fake_of(p) for p in g["params"]],
        }
        for g in optimizer.param_groups
    ]
    try:
        new = type(optimizer)(groups)
    except TypeError as err:
        raise TypeError(
            f"cannot rebuild {type(optimizer).__name__} over fake parameters ({err}); profile "
            "with fake=False or without the optimizer"
        ) from err

    def scalar(v: torch.Tensor) -> torch.Tensor:
        # made inside the mode, a 0-d tensor is a fake that knows its value, so the step can
        # read it with .item() (Adam's `step` counter); from_tensor would forget the value
        value = v.item()
        with mode:
            return torch.tensor(value, dtype=v.dtype, device=v.device)

    for p, state in optimizer.state.items():
        new.state[fake_of(p)] = {
            k: (fake_of(v) if v.dim() > 0 else scalar(v))
            if isinstance(v, torch.Tensor)
            else deepcopy(v)
            for k, v in state.items()
        }
    return new


def _implementation(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    """The ``foreach`` choice the real optimizer makes for ``group``, made explicit.

    An optimizer left at ``foreach=None`` picks its implementation from its parameters' type and
    device: the ``foreach`` one (temporaries for every parameter at once) for plain CUDA
    tensors, the for-loop one (one parameter's temporaries at a time) otherwise. Fake tensors
    are not plain tensors, so a fake optimizer would always loop; fixing the real choice in
    its groups makes the fake step allocate what the real one does."""
    if "foreach" not in group or group["foreach"] is not None or group.get("fused"):
        return {}
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # pragma: no cover - private API moved: keep the optimizer's default
        return {}
    params = [p for p in group["params"] if p.requires_grad]
    _, foreach = _default_to_fused_or_foreach(
        params, differentiable=bool(group.get("differentiable")), use_fused=False
    )
    return {"foreach": bool(foreach)}


def optimizer_costs(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
    """``(state bytes, transient bytes of one step)`` of ``optimizer``, measured exactly on
    fake tensors (nothing is allocated, the optimizer and model are untouched): the state as
    it is after a first step, and the peak of the temporaries one steady-state step allocates
    beyond the parameters, their gradients and that state (Adam's ``sqrt`` and division: the
    largest parameter's worth twice with the for-loop implementation, every parameter's worth
    with ``foreach``, which CUDA optimizers use by default)."""
    if optimizer is None:
        return 0, 0
    with fake_step(model, None, optimizer) as (mode, _, fake_opt), mode:
        assert fake_opt is not None
        params = [p for g in fake_opt.param_groups for p in g["params"] if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        if not fake_opt.state:
            fake_opt.step()
        state = [v for s in fake_opt.state.values() for v in s.values() if torch.is_tensor(v)]
        state_bytes = sum(t.untyped_storage().nbytes() for t in state)
        tracker = StepTracker(timeline=False)
        tracker.track_external(model, fake_opt)
        with tracker:
            tracker.start()
            before = tracker.live_bytes()
            fake_opt.step()
            transient = max(0, tracker.peak_bytes - before)
        for p in params:
            p.grad = None
    if params and params[0].device.type == "cpu":
        transient += OPTIMIZER_SCALAR_BYTES + max(p.element_size() for p in params)
    return state_bytes, transient


OPTIMIZER_SCALAR_BYTES = 8
"""The wrapped scalar (an 8-byte double) a CPU optimizer step's operation makes of a Python
number (``lr``, a momentum, a bias correction) beside the copy of it in the parameters' dtype,
both live during that operation and seen by neither fake tensors nor a TorchDispatchMode (NOTE
[ Saved wrapped scalars ] in :mod:`remat.capture.chain`): :func:`optimizer_costs` adds the two
on the CPU. Measured with the allocator's events: 12 B above the tracked temporaries for SGD
with momentum, Adam and AdamW (for-loop and foreach) and Adagrad on float32, 0 for plain SGD
and RMSprop (counted anyway). On CUDA a scalar is a kernel argument: nothing is added."""
