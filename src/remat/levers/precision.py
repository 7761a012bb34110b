"""Low precision: autocast compute, compressed saved activations, loss scaling, and the
gradient error they cost (the "low precision" lever of Sohoni et al. 2019).

Three independent knobs, one frozen record (:class:`Precision`):

* **compute** — run matmuls and convolutions under ``torch.autocast`` in bf16 or fp16. Saved
  activations of autocast ops are then 16-bit as a side effect.
* **saved** — store every floating saved activation in bf16, fp16 or int8 (symmetric, one fp32
  scale per tensor) through ``torch.autograd.graph.saved_tensors_hooks``; unpacking restores the
  original dtype, so the backward pass computes in the original precision from rounded values.
* **loss scaling** — with fp16 compute, multiply the loss before backward so small gradients do
  not underflow (``torch.amp.GradScaler``); :func:`make_grad_scaler`, :func:`scaled_backward`,
  :func:`scaled_step`.

:func:`count_saved_tensors` measures what autograd keeps for backward (exact bytes, unique
storages, live and peak); :func:`compress_saved_activations` reports the same figures for what it
stores instead; :func:`gradient_error` measures the relative L2 error of a precision's gradients
against the fp32 reference.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from remat.levers import Precision, precision_context
    >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    >>> with precision_context(Precision(compute="bf16", saved="int8"), "cpu", model) as stats:
    ...     loss = model(torch.randn(32, 64)).square().mean()
    >>> loss.backward()
    >>> stats.stored_bytes < stats.original_bytes
    True

Which saved tensors are compressed (NOTE [ What compress_saved_activations touches ]):

* **parameters and buffers are never touched**: a saved tensor that is an ``nn.Parameter``, a
  leaf requiring grad (a parameter, or an input you differentiate with respect to), or a
  *view* of one (``weight.t()`` saved by ``linear``) is kept by reference — it costs no
  memory beyond the parameter itself (frozen ``nn.Parameter`` objects included). Buffers
  (batch norm's running statistics) and parameters held as plain tensors cannot be told from
  activations by looking at the tensor: pass ``module=model`` and every tensor sharing storage
  with one of its parameters or buffers is kept by reference too.
* **integer and bool tensors** (max-pool indices, token ids, bool dropout masks on CUDA) and
  complex, sparse or subclass tensors (DTensor, FakeTensor) are kept by reference, unchanged.
* autocast's low-precision copies of weights (a dtype cast of a parameter, or a view of one)
  are kept by reference, not compressed further: they are weights, not activations. They do
  cost memory while the graph lives, so their bytes are counted.
* floating tensors with fewer than ``min_numel`` elements (batch-norm's per-channel statistics)
  are kept by reference: compressing them saves nothing worth the error, and an int8 scale costs
  4 bytes.
* a floating tensor is converted only when that saves bytes: fp32/fp64 to 16 bits; any float
  wider than one byte to int8. Under bf16 autocast most activations are already 16-bit, so
  ``saved="bf16"`` changes little there and ``"int8"`` halves them.
* the same tensor saved by two ops (a ReLU's output, saved by the ReLU and by the next Linear)
  is compressed once; two *different views* of one storage are compressed separately (the
  figures count that honestly).

Known limitations:
    * fp16 storage turns values beyond ±65504 into ±inf; int8 assumes finite activations (one
      inf makes the scale infinite, and the tensor unpacks as ±inf and NaN). bf16 has fp32's
      range.
    * The model's input, when an op saves it, is compressed like any activation. If you keep the
      input alive yourself for the whole step, its compressed copy costs bytes on top: pass it
      as ``exclude``.
    * Saved-tensor hooks do not stack: inside a region with its own hooks (a non-reentrant
      checkpoint's forward, :func:`~remat.levers.offload.offload_saved_activations`) the
      innermost hooks win. Under a checkpoint, what the outer hooks see and compress is
      exactly the checkpoint's kept inputs; the recomputed tensors live only during backward.
    * Eager mode only; not tested under ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.levers.microbatch import compute_loss

__all__ = [
    "Precision",
    "SavedTensorStats",
    "GradientError",
    "precision_context",
    "compress_saved_activations",
    "count_saved_tensors",
    "make_grad_scaler",
    "scaled_backward",
    "scaled_step",
    "gradient_error",
    "DEFAULT_MIN_NUMEL",
]

_COMPUTE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
}
_INT8_MAX = 127.0

#: Floating saved tensors with fewer elements than this are kept as they are (batch-norm
#: statistics and other per-channel vectors): nothing to gain, and per-tensor int8 would cost
#: them the most accuracy.
DEFAULT_MIN_NUMEL = 1024


# ---------------------------------------------------------------------- public records
@dataclass(frozen=True)
class Precision:
    """How a training step uses low precision.

    Attributes:
        compute: autocast dtype for the forward: ``None`` (full precision), ``"bf16"`` or
            ``"fp16"``.
        saved: storage dtype of floating saved activations: ``None`` (as produced), ``"bf16"``,
            ``"fp16"`` or ``"int8"`` (symmetric, one fp32 scale per tensor).
        loss_scaling: scale the loss before backward (GradScaler). ``None`` means "on for fp16
            compute, off otherwise"; ``True`` is only valid with fp16 compute.
        init_scale: the first loss scale (GradScaler's ``init_scale``), a power of two.
        min_numel: floating saved tensors with fewer elements are not compressed.
    """

    compute: str | None = None
    saved: str | None = None
    loss_scaling: bool | None = None
    init_scale: float = 2.0**16
    min_numel: int = DEFAULT_MIN_NUMEL

    def __post_init__(self) -> None:
        if self.compute is not None and self.compute not in _COMPUTE_DTYPES:
            raise ValueError(f"compute must be None, 'bf16' or 'fp16', got {self.compute!r}")
        if self.saved is not None and self.saved not in _STORAGE_DTYPES:
            raise ValueError(f"saved must be None, 'bf16', 'fp16' or 'int8', got {self.saved!r}")
        if self.loss_scaling and self.compute != "fp16":
            raise ValueError(
                "loss scaling protects fp16 gradients from underflow; it is only valid with "
                f"compute='fp16' (got compute={self.compute!r}). bf16 and fp32 have fp32's "
                "exponent range and need none."
            )
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale}")
        if self.min_numel < 0:
            raise ValueError(f"min_numel must be >= 0, got {self.min_numel}")

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast dtype, or None."""
        return None if self.compute is None else _COMPUTE_DTYPES[self.compute]

    @property
    def saved_dtype(self) -> torch.dtype | None:
        """The storage dtype of compressed saved activations, or None."""
        return None if self.saved is None else _STORAGE_DTYPES[self.saved]

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled before backward."""
        if self.loss_scaling is None:
            return self.compute == "fp16"
        return self.loss_scaling


@dataclass
class SavedTensorStats:
    """What a saved-tensor hook kept for backward; updated while its context is open and while
    the graphs it saw are alive (``live_bytes`` falls as autograd frees saved tensors).

    Parameters, buffers, their views and the tensors passed as ``exclude`` are kept by
    reference and counted only in ``excluded_tensors``: they cost nothing beyond the model and
    the inputs the caller holds anyway. Bytes are exact: unique storages
    for tensors kept by reference, data plus int8 scale for compressed copies.

    Attributes:
        saved_tensors: pack calls (one per tensor an op saved for backward).
        excluded_tensors: of those, parameters, buffers, views of them, or tensors sharing
            storage with ``exclude`` (kept by reference, not counted).
        compressed_tensors: compressed copies made (a tensor saved twice is compressed once).
        referenced_tensors: other saved tensors kept by reference (non-float, small, already
            narrow, or every tensor when nothing is compressed).
        original_bytes: bytes the saved non-parameter tensors hold without this hook: each
            distinct storage once while it is alive, summed over the context.
        stored_bytes: bytes this hook holds instead (compressed copies and the storages kept by
            reference), summed over the context.
        live_bytes: bytes held now.
        peak_bytes: the most bytes held at once: the saved-activation peak of the steps run
            inside the context.
    """

    saved_tensors: int = 0
    excluded_tensors: int = 0
    compressed_tensors: int = 0
    referenced_tensors: int = 0
    original_bytes: int = 0
    stored_bytes: int = 0
    live_bytes: int = 0
    peak_bytes: int = 0


@dataclass(frozen=True)
class GradientError:
    """Gradient error of a low-precision step against the full-precision reference.

    Attributes:
        relative_l2: ``||g - g_ref|| / ||g_ref||`` over all parameter gradients concatenated
            (computed in float64).
        per_parameter: ``(name, relative L2 error)`` for each parameter with a gradient.
        loss: the low-precision loss (unscaled), as a float.
        reference_loss: the reference loss, as a float.
    """

    relative_l2: float
    per_parameter: tuple[tuple[str, float], ...]
    loss: float
    reference_loss: float

    @property
    def max_parameter(self) -> float:
        """The largest per-parameter relative error."""
        return max((e for _, e in self.per_parameter), default=0.0)


# ---------------------------------------------------------------------- public API
@contextlib.contextmanager
def precision_context(
    precision: Precision,
    device_type: str = "cpu",
    module: nn.Module | None = None,
    exclude: Iterable[torch.Tensor] = (),
) -> Iterator[SavedTensorStats | None]:
    """Run a forward pass under ``precision``: autocast (if ``precision.compute``) and saved
    activation compression (if ``precision.saved``).

    Wrap the forward and the loss; call backward outside (or inside: both work). Loss scaling
    is separate: :func:`make_grad_scaler`. Yields the compression's :class:`SavedTensorStats`,
    or None when ``precision.saved`` is None.

    Args:
        precision: the settings.
        device_type: ``"cpu"`` or ``"cuda"``: the autocast device type of the model.
        module: the model, so that its buffers are never compressed.
        exclude: tensors never compressed (the batch you hold anyway).
    """
    with contextlib.ExitStack() as stack:
        if precision.compute_dtype is not None:
            stack.enter_context(torch.autocast(device_type, dtype=precision.compute_dtype))
        stats = None
        if precision.saved is not None:
            stats = stack.enter_context(
                compress_saved_activations(precision.saved, module, precision.min_numel, exclude)
            )
        yield stats


@contextlib.contextmanager
def compress_saved_activations(
    dtype: str,
    module: nn.Module | Sequence[nn.Module] | None = None,
    min_numel: int = DEFAULT_MIN_NUMEL,
    exclude: Iterable[torch.Tensor] = (),
) -> Iterator[SavedTensorStats]:
    """Store floating saved activations in ``dtype`` (``"bf16"``, ``"fp16"`` or ``"int8"``).

    A ``saved_tensors_hooks`` context: each floating tensor an op saves for backward is
    replaced by a 16-bit copy or an int8 copy with one fp32 scale (``scale = max|x| / 127``,
    ``q = round(x / scale)``, except that a non-zero value never becomes zero: it keeps its sign
    as ``q = ±1``; error at most ``scale / 2`` per element, ``scale`` for the smallest values);
    the backward pass gets the original dtype back. Keeping signs matters: ReLU's backward
    recomputes its mask from the saved output, and plain rounding would zero the gradient of
    every small positive activation (on the test MLP, relative gradient error 8 % → 1 %).
    What is left alone: NOTE [ What compress_saved_activations touches ] in this module's
    docstring. Yields live :class:`SavedTensorStats`.

    Args:
        dtype: ``"bf16"``, ``"fp16"`` or ``"int8"``.
        module: the model (or models): its parameters and buffers are never compressed.
        min_numel: floating tensors with fewer elements are kept as they are.
        exclude: tensors whose storage is kept as it is and not counted, typically the batch
            you hold anyway for the whole step (compressing it would add its copy).
    """
    if dtype not in _STORAGE_DTYPES:
        raise ValueError(f"dtype must be 'bf16', 'fp16' or 'int8', got {dtype!r}")
    hooks = _SavedTensorHooks(_state_storages(module, exclude), min_numel, _STORAGE_DTYPES[dtype])
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        yield hooks.stats


@contextlib.contextmanager
def count_saved_tensors(
    module: nn.Module | Sequence[nn.Module] | None = None,
    exclude: Iterable[torch.Tensor] = (),
) -> Iterator[SavedTensorStats]:
    """Count exactly what autograd saves for backward inside the context; change nothing.

    Tensors are kept by reference as autograd would keep them; ``stored_bytes`` equals
    ``original_bytes`` (unique storages: a saved view counts its whole storage, which it keeps
    alive), and ``peak_bytes`` is the most saved-activation bytes alive at once. Parameters
    and their views are never counted; pass ``module`` to leave out its buffers (and
    parameters held as plain tensors) too, and ``exclude`` to leave out tensors you hold
    anyway (the batch: a microbatch is a view of it).
    """
    hooks = _SavedTensorHooks(_state_storages(module, exclude), min_numel=0, storage_dtype=None)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        yield hooks.stats


def make_grad_scaler(precision: Precision, device_type: str = "cpu") -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler`` for ``precision``: enabled only when it scales the loss."""
    return torch.amp.GradScaler(
        device_type, init_scale=precision.init_scale, enabled=precision.scales_loss
    )


def scaled_backward(loss: torch.Tensor, scaler: torch.amp.GradScaler | None = None) -> None:
    """``loss.backward()``, through the scaler when one is given (gradients then carry the
    scale until :func:`scaled_step` unscales them)."""
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()


def scaled_step(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None
) -> bool:
    """Unscale, step and update the scale; return whether the optimizer stepped.

    With a scaler, a step whose gradients hold inf/NaN is skipped and the scale falls (so the
    return value is False); without one, ``optimizer.step()`` always runs.
    """
    if scaler is None or not scaler.is_enabled():
        optimizer.step()
        return True
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return not scaler.get_scale() < before


def gradient_error(
    model: nn.Module,
    batch: Any,
    precision: Precision,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    device_type: str | None = None,
    seed: int = 0,
) -> GradientError:
    """Relative L2 error of ``precision``'s gradients against the full-precision reference.

    Runs one forward and backward on a copy of ``model`` without any lever (the reference: the
    model's own dtype, fp32 for a usual model) and one on another copy under
    :func:`precision_context`; ``model`` itself is not changed. Both runs start from the same
    random state (dropout masks agree). With loss scaling, the loss is multiplied by
    ``precision.init_scale`` and the gradients divided by it (static scaling: the same
    arithmetic as one GradScaler step that finds no overflow).

    Args:
        loss_fn: ``loss_fn(model, batch) -> scalar``; ``None``: see
            :func:`remat.levers.microbatch.compute_loss`.
    """

    device_type = device_type or _device_type_of(model)
    devices = [torch.cuda.current_device()] if device_type == "cuda" else []

    def run(use: Precision | None) -> tuple[float, dict[str, torch.Tensor]]:
        clone = copy.deepcopy(model)
        clone.zero_grad(set_to_none=True)
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            if use is None:
                loss = compute_loss(clone, batch, loss_fn)
                loss.backward()
                scale = 1.0
            else:
                with precision_context(use, device_type, clone):
                    loss = compute_loss(clone, batch, loss_fn)
                scale = use.init_scale if use.scales_loss else 1.0
                (loss.float() * scale).backward()
        grads = {
            name: p.grad.detach().double() / scale
            for name, p in clone.named_parameters()
            if p.grad is not None
        }
        return float(loss.detach().float()), grads

    ref_loss, ref = run(None)
    loss, got = run(precision)
    if ref.keys() != got.keys():
        raise RuntimeError(
            "the reference and the low-precision step produced gradients for different "
            f"parameters: {sorted(ref.keys() ^ got.keys())}"
        )
    if not ref:
        raise ValueError("the model produced no parameter gradients: nothing to compare")
    per = tuple((name, _relative_l2(got[name], ref[name])) for name in ref)
    num = sum(float((got[n] - ref[n]).square().sum()) for n in ref)
    den = sum(float(ref[n].square().sum()) for n in ref)
    total = (num**0.5) / (den**0.5) if den > 0 else (0.0 if num == 0 else float("inf"))
    return GradientError(total, per, loss, ref_loss)


# ---------------------------------------------------------------------- implementation
def _relative_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    den = float(ref.norm())
    num = float((got - ref).norm())
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return num / den


def _device_type_of(model: nn.Module) -> str:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device.type
    return "cpu"


def _state_storages(
    module: nn.Module | Sequence[nn.Module] | None, exclude: Iterable[torch.Tensor] = ()
) -> frozenset[int]:
    """Storage addresses of the parameters and buffers of ``module`` and of ``exclude``."""
    tensors: list[torch.Tensor] = list(exclude)
    if module is not None:
        for m in [module] if isinstance(module, nn.Module) else list(module):
            tensors += list(m.parameters()) + list(m.buffers())
    ptrs = {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}
    ptrs.discard(0)
    return frozenset(ptrs)


def _is_plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided


def _is_state(t: torch.Tensor, state_ptrs: frozenset[int]) -> bool:
    """A parameter, a leaf requiring grad, a view of one, or storage of ``module``'s state."""
    if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
        return True
    base = t._base
    if base is not None and (
        isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)
    ):
        return True
    return bool(state_ptrs) and t.untyped_storage().data_ptr() in state_ptrs


def _is_parameter_copy(t: torch.Tensor) -> bool:
    """A dtype cast of a leaf requiring grad, or a view of one: autocast's low-precision copy of
    a weight (``ToCopyBackward0`` straight into ``AccumulateGrad``)."""
    u = t._base if t._base is not None else t
    fn = u.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    return any(
        nxt is not None and type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions
    )


class _Held:
    """A saved tensor kept by reference (its death releases its bytes in the ledger)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _Packed:
    """A compressed saved tensor: data in the storage dtype, an int8 scale, the original
    dtype."""

    __slots__ = ("data", "scale", "dtype", "__weakref__")

    def __init__(self, t: torch.Tensor, storage_dtype: torch.dtype) -> None:
        self.dtype = t.dtype
        with torch.no_grad():
            if storage_dtype == torch.int8:
                x = t.detach()
                scale = x.abs().amax().float() / _INT8_MAX
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
                # one fp32 temporary of the tensor's size; the rest works on 1-byte tensors
                q = (x.float() / scale).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
                # NOTE [ int8 keeps signs ]: a non-zero value never rounds to zero, so masks
                # that backward derives from saved outputs (ReLU's ``result > 0``) are exact.
                sign = (x > 0).to(torch.int8).mul_(2).sub_(1)
                self.data = torch.where((q == 0) & (x != 0), sign, q)
                self.scale: torch.Tensor | None = scale
            else:
                self.data = t.detach().to(storage_dtype)
                self.scale = None

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)

    def unpack(self) -> torch.Tensor:
        with torch.no_grad():
            if self.scale is None:
                return self.data.to(self.dtype)
            return (self.data.float() * self.scale).to(self.dtype)


class _SavedTensorHooks:
    """Pack/unpack hooks with exact accounting; compress when ``storage_dtype`` is set."""

    def __init__(
        self, state_ptrs: frozenset[int], min_numel: int, storage_dtype: torch.dtype | None
    ) -> None:
        self.stats = SavedTensorStats()
        self.state_ptrs = state_ptrs
        self.min_numel = min_numel
        self.storage_dtype = storage_dtype
        self.itemsize = None if storage_dtype is None else storage_dtype.itemsize
        # storage key -> [saves holding it, bytes] for tensors kept by reference
        self._held: dict[int, list[int]] = {}
        # id(storage) -> weak reference to the storage, to count each one once while alive
        self._seen: dict[int, weakref.ref] = {}
        # (id(storage), offset, shape, stride, dtype, version) -> (storage ref, packed ref)
        self._packed: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}

    # ------------------------------------------------------------------ hooks
    def pack(self, t: torch.Tensor) -> Any:
        stats = self.stats
        stats.saved_tensors += 1
        if not _is_plain(t):
            stats.referenced_tensors += 1
            return t
        if _is_state(t, self.state_ptrs):
            stats.excluded_tensors += 1
            return t
        storage = t.untyped_storage()
        self._count_original(storage)
        if self._compresses(t):
            return self._compress(t, storage)
        stats.referenced_tensors += 1
        held = _Held(t)
        key = id(storage)
        entry = self._held.get(key)
        if entry is None:
            entry = self._held[key] = [0, storage.nbytes()]
            self._add(entry[1])
        entry[0] += 1
        weakref.finalize(held, self._release_held, key)
        return held

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Held):
            return packed.tensor
        if isinstance(packed, _Packed):
            return packed.unpack()
        return packed

    # ------------------------------------------------------------------ helpers
    def _compresses(self, t: torch.Tensor) -> bool:
        return (
            self.itemsize is not None
            and t.is_floating_point()
            and t.numel() >= max(self.min_numel, 1)
            and t.element_size() > self.itemsize
            and not _is_parameter_copy(t)
        )

    def _compress(self, t: torch.Tensor, storage: Any) -> _Packed:
        key = (id(storage), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        cached = self._packed.get(key)
        if cached is not None:
            storage_ref, packed_ref = cached
            packed = packed_ref()
            if storage_ref() is storage and packed is not None:
                return packed
        assert self.storage_dtype is not None
        packed = _Packed(t, self.storage_dtype)
        self.stats.compressed_tensors += 1
        nbytes = packed.nbytes
        self._add(nbytes)
        packed_ref = weakref.ref(packed)
        self._packed[key] = (weakref.ref(storage), packed_ref)
        weakref.finalize(packed, self._release_packed, key, packed_ref, nbytes)
        return packed

    def _count_original(self, storage: Any) -> None:
        key = id(storage)
        ref = self._seen.get(key)
        if ref is not None and ref() is storage:
            return
        self._seen[key] = weakref.ref(storage, lambda _r, k=key: self._forget(k, _r))
        self.stats.original_bytes += storage.nbytes()

    def _forget(self, key: int, ref: weakref.ref) -> None:
        if self._seen.get(key) is ref:
            del self._seen[key]

    def _add(self, nbytes: int) -> None:
        stats = self.stats
        stats.stored_bytes += nbytes
        stats.live_bytes += nbytes
        stats.peak_bytes = max(stats.peak_bytes, stats.live_bytes)

    def _release_held(self, key: int) -> None:
        entry = self._held[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.stats.live_bytes -= entry[1]
            del self._held[key]

    def _release_packed(self, key: tuple, packed_ref: weakref.ref, nbytes: int) -> None:
        self.stats.live_bytes -= nbytes
        cached = self._packed.get(key)
        if cached is not None and cached[1] is packed_ref:
            del self._packed[key]
