"""Checks every entry point that plans or runs a model makes first (torch side, low layer).

* :func:`check_not_wrapped`: remat must see the bare model, not one already wrapped for data
  parallelism (DDP, DataParallel, FSDP1, FSDP2): :class:`WrapOrderError` names the order that
  works (:data:`ORDER_HELP`, ``docs/distributed.md``).
* :func:`check_no_own_checkpointing`: a model with Hugging Face's own gradient checkpointing
  enabled is refused (:class:`~remat.core.errors.UnsupportedModelError`).
* :class:`BatchCopy`: the private copy of the caller's batch that every measurement runs the
  model on (a model may write into its input; the caller's batch stays as it was).
* :class:`InPlaceInputError` (:func:`in_place_input_error`): a stage that writes into its input
  cannot start a checkpointed segment (the chain capture and the executor both check it).
* :func:`input_signature`: what a plan depends on in a call's inputs (shapes, dtypes,
  structure, plain values); the planned modules key their plans by it, the blocks family its
  composition check.

They live here, below the stage splitter, the executors, :func:`remat.auto`, :func:`remat.fit`
and :mod:`remat.distributed`, so that all of them can call them without importing each other.
Also importable from their former homes (``remat.distributed.check_not_wrapped``,
``remat.capture.stages.check_no_own_checkpointing``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from remat.core.errors import RematError, UnsupportedModelError

__all__ = [
    "BatchCopy",
    "InPlaceInputError",
    "in_place_input_error",
    "ORDER_HELP",
    "WrapOrderError",
    "check_not_wrapped",
    "check_no_own_checkpointing",
    "describe_signature",
    "input_signature",
]

ORDER_HELP = (
    "Apply remat to the bare model first, then wrap: planned = remat.apply(model, plan) (or "
    "remat.distributed.auto_distributed(model, batch, budget=...)); then "
    "DistributedDataParallel(planned), or for FSDP2 "
    "remat.distributed.fully_shard_planned(planned) (fully_shard on each block, then the "
    "root); then build the optimizer on the wrapped model's parameters."
)


class WrapOrderError(RematError, TypeError):
    """remat was given a model already wrapped for data parallelism (the message says the order)."""


def check_not_wrapped(model: nn.Module, what: str = "remat") -> None:
    """Raise :class:`WrapOrderError` if ``model`` is already DDP-, DP- or FSDP-wrapped/sharded.

    remat must see the bare model; wrap the planned model afterwards (:data:`ORDER_HELP`).
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    wrapper = None
    if isinstance(model, DistributedDataParallel | DataParallel):
        wrapper = type(model).__name__
    elif isinstance(model, FullyShardedDataParallel):
        wrapper = "FullyShardedDataParallel (FSDP1)"
    elif isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in model.parameters()):
        wrapper = "fully_shard (FSDP2; its parameters are sharded DTensors)"
    if wrapper is not None:
        raise WrapOrderError(f"{what} was given a model already wrapped by {wrapper}. {ORDER_HELP}")


def check_no_own_checkpointing(model: nn.Module) -> None:
    """Refuse a model with its library's own gradient checkpointing enabled: Hugging Face's (any
    submodule with ``gradient_checkpointing=True``, what ``model.gradient_checkpointing_enable()``
    sets) or timm's (``grad_checkpointing=True``, what ``model.set_grad_checkpointing()`` sets).

    Called by every entry point that plans or runs a model (chain capture and
    :func:`~remat.capture.stages.split_stages`, :func:`remat.apply`, :func:`remat.auto`, the graph
    path's ``trace_graph`` and ``apply_graph``): its checkpoints would run inside remat's plan,
    so the memory and time remat predicts would not be what runs (timm's made the graph
    capture's timed step differ from its recorded one, a crash that did not say why).
    """
    for name, module in model.named_modules():
        for attribute, library, off in _OWN_CHECKPOINTING:
            if getattr(module, attribute, False) is True:
                where = f"its submodule {name!r}" if name else "it"
                raise UnsupportedModelError(
                    f"this {type(model).__name__} has its own ({library}) gradient "
                    f"checkpointing enabled ({where} has {attribute}=True): disable it with "
                    f"{off}; remat plans the checkpointing itself"
                )


_OWN_CHECKPOINTING = (
    ("gradient_checkpointing", "Hugging Face", "model.gradient_checkpointing_disable()"),
    ("grad_checkpointing", "timm", "model.set_grad_checkpointing(False)"),
)
"""The attribute a library's gradient checkpointing sets on a module, the library and what
turns it off (:func:`check_no_own_checkpointing`)."""


class InPlaceInputError(UnsupportedModelError):
    """A stage writes into the tensor it receives: a checkpointed segment cannot start at it."""


def in_place_input_error(stage: int, name: str) -> InPlaceInputError:
    """The error for stage ``stage`` (1-based) writing into its input (capture and executor)."""
    return InPlaceInputError(
        f"stage {stage} ({name!r}) writes into its input in place (an in-place operation such as "
        "x.add_(1) or x.mul_(2) on the tensor it receives): a checkpointed segment starting at "
        "this stage could not be recomputed, because its input no longer holds the value the "
        "segment read. Make the operation out of place (x = x + 1), or join the stage with the "
        "one before it (stages=[..., 'previous+this', ...]) so that the write stays inside one "
        "stage"
    )


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter (in-place writes move it); 0 for an inference tensor, which has
    none (and cannot be written in place outside inference mode)."""
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors have no version counter
        return 0


def _versions(tensors: Sequence[torch.Tensor]) -> list[int]:
    return [tensor_version(t) for t in tensors]


class BatchCopy:
    """A private copy of a batch, for measurements that run the model on it (several times).

    A model may write into its input (``x.mul_(2)`` in ``forward``, an in-place ``ReLU`` or
    ``Dropout`` as its first layer). Measured on the copy, the caller's batch stays bit-identical,
    and :meth:`restore` puts the caller's values back into the copy between runs, so every run
    sees the same input however often an earlier one wrote into it.

    Tensors that share a storage in the batch (``labels`` that are ``input_ids``, views) share
    one in the copy, so the copy has the batch's bytes. Only plain strided tensors are copied;
    others (sparse, subclasses) and batches in containers that are not pytrees pass as they are.

    ``snapshot=True`` turns it around: :attr:`batch` is the batch itself and :meth:`restore`
    puts back the values it had when the snapshot was taken.
    """

    def __init__(self, batch: Any, snapshot: bool = False) -> None:
        # storage key -> (where values come from, where restore() writes them)
        self._storages: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self._tensors: list[tuple[torch.Tensor, int, int]] = []  # run-on tensor, storage, version
        memo: dict[int, torch.Tensor] = {}

        def copy(t: torch.Tensor) -> torch.Tensor:
            if id(t) in memo:
                return memo[id(t)]
            if type(t) is not torch.Tensor or t.layout != torch.strided:
                return t
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in self._storages:
                clone = storage.clone()
                self._storages[key] = (clone, storage) if snapshot else (storage, clone)
            if snapshot:
                new = t
            else:
                new = torch.empty(0, dtype=t.dtype, device=t.device)
                new.set_(self._storages[key][1], t.storage_offset(), t.size(), t.stride())
                new.requires_grad_(t.requires_grad)
            memo[id(t)] = new
            self._tensors.append((new, key, tensor_version(new)))
            return new

        self.batch: Any = tree_map_only(torch.Tensor, copy, batch)
        """What to run the model on (the copy; with ``snapshot=True`` the batch itself)."""

    def restore(self) -> Any:
        """Put the original values back where a run wrote into :attr:`batch`; returns it."""
        written = {key for t, key, version in self._tensors if tensor_version(t) != version}
        for key in written:
            source, target = self._storages[key]
            target.copy_(source)
        if written:
            self._tensors = [(t, key, tensor_version(t)) for t, key, _ in self._tensors]
        return self.batch


def buffer_slots(*modules: nn.Module) -> dict[tuple[nn.Module, str], torch.Tensor]:
    """Every buffer slot ``(owner module, name)`` of ``modules`` and their submodules, once
    each, with the tensor in it now."""
    return {
        (m, name): b
        for root in modules
        for m in root.modules()
        for name, b in m._buffers.items()
        if b is not None
    }


class BufferSnapshot:
    """A model's buffers now, to be put back after a measuring or checking run: each buffer
    slot's tensor and a copy of its values. A forward may update a buffer in place (batch
    norm's running statistics, a moving average) or assign a new tensor to its name
    (``self.calls = self.calls + 1``); :meth:`restore` undoes both (copying values back into
    the buffers alone missed the second: the capture's steps stayed counted). It writes only
    the buffers a run may have written (a new tensor, a moved version counter, or batch norm's
    running statistics, which the native kernel writes without moving it): writing every one
    back moved the version counters of buffers no forward writes (GPT-2's causal mask), and
    :class:`BufferWrites` then took them for written."""

    def __init__(self, model: nn.Module) -> None:
        self.slots = [
            (m, name, b, b.detach().clone(), tensor_version(b))
            for (m, name), b in buffer_slots(model).items()
        ]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [b for _, _, b, _, _ in self.slots]

    def restore(self) -> None:
        with torch.no_grad():
            for m, name, b, saved, version in self.slots:
                if m._buffers.get(name) is b and tensor_version(b) == version:
                    if not running_stat(m, name):
                        continue
                m._buffers[name] = b
                b.copy_(saved)
        self.slots = [(m, name, b, saved, tensor_version(b)) for m, name, b, saved, _ in self.slots]


class BufferWrites:
    """The buffers of each of ``modules`` (and their submodules) as they are now, to tell after
    a run which ones it wrote: a new tensor assigned to the name, or an in-place write (the
    version counter moved). Batch norm's running statistics are left out (:func:`running_stat`:
    the chain executor replays them apart)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.slots = [
            [
                (m, name, b, tensor_version(b))
                for (m, name), b in buffer_slots(module).items()
                if not running_stat(m, name)
            ]
            for module in modules
        ]

    def written_bytes(self) -> tuple[int, ...]:
        """Per module, the unique bytes of the buffers written since construction."""
        out = []
        for slots in self.slots:
            found: dict[int, int] = {}
            for m, name, b, version in slots:
                if m._buffers.get(name) is not b or tensor_version(b) != version:
                    found[id(b)] = b.numel() * b.element_size()
            out.append(sum(found.values()))
        return tuple(out)


RUNNING_STATS = frozenset({"running_mean", "running_var", "num_batches_tracked"})


def running_stat(m: nn.Module, name: str) -> bool:
    """Whether buffer ``name`` of ``m`` is a running statistic batch norm updates in training
    mode (what the chain executor's recomputation reads from throw-away copies)."""
    return (
        name in RUNNING_STATS
        and isinstance(m, nn.modules.batchnorm._NormBase)
        and m.track_running_stats
        and m.training
    )


HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
"""A module's own hook tables (``register_forward_hook`` and the like)."""


def own_hooks(m: nn.Module) -> list[str]:
    """The hook tables of ``m`` that hold a hook (:data:`HOOK_TABLES`)."""
    return [table for table in HOOK_TABLES if getattr(m, table, None)]


def pauses_update(m: nn.Module) -> bool:
    """Whether batch norm ``m`` can be recomputed on its own running statistics with their
    update paused: its forward is torch's, which reads the update's factor from
    ``m.momentum`` and counts the batch in ``m.num_batches_tracked`` (``momentum=None`` and no
    count make the factor 0: ``running = 1 * running + 0 * batch``, the same values, no copy).
    A subclass with its own forward may update them its own way: it gets copies."""
    return type(m).forward is nn.modules.batchnorm._BatchNorm.forward and running_stat(
        m, "running_mean"
    )


def running_stat_bytes(module: nn.Module, paused: bool = False) -> int:
    """Unique bytes of the running statistics (:func:`running_stat`) of ``module``'s
    submodules; with ``paused``, of those whose update a recomputation cannot pause
    (:func:`pauses_update`): the copies the chain executor's recomputation keeps."""
    found = {
        id(b): b.numel() * b.element_size()
        for (m, name), b in buffer_slots(module).items()
        if running_stat(m, name) and not (paused and pauses_update(m))
    }
    return sum(found.values())


def input_signature(*args: Any, **kwargs: Any) -> tuple:
    """What a plan depends on in the inputs: tensor shapes and dtypes, and the structure.

    Non-tensor leaves (flags, ``None``) are part of the signature by type and, for plain
    scalars and strings, by value.
    """
    # read on every training step: arguments that are plain tensors, scalars or None (the
    # common call) skip the pytree flatten, and their structure's string is made once
    sig: list[Any] = []
    for leaf in (*args, *kwargs.values()):
        kind = type(leaf)
        if kind is torch.Tensor or kind is nn.Parameter:
            sig.append(("tensor", tuple(leaf.shape), str(leaf.dtype)))
        elif leaf is None or kind in _PLAIN_VALUES:
            sig.append(("value", leaf))
        else:  # a container, a tensor subclass, another object: the general path
            return _flattened_signature(args, kwargs)
    key = (len(args), tuple(kwargs))
    spec = _PLAIN_SPECS.get(key)
    if spec is None:
        spec = _PLAIN_SPECS[key] = str(tree_flatten((args, kwargs))[1])
    return (spec, tuple(sig))


_PLAIN_VALUES = (bool, int, float, str)
_PLAIN_SPECS: dict[tuple[int, tuple[str, ...]], str] = {}
"""The structure's string of a call with only plain arguments, by their number and keywords."""


def _flattened_signature(args: tuple, kwargs: dict) -> tuple:
    """:func:`input_signature` of any arguments, through the pytree flatten."""
    leaves, spec = tree_flatten((args, kwargs))
    sig: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sig.append(("tensor", tuple(leaf.shape), str(leaf.dtype)))
        elif leaf is None or isinstance(leaf, _PLAIN_VALUES):
            sig.append(("value", leaf))
        else:
            sig.append(("object", type(leaf).__qualname__))
    return (str(spec), tuple(sig))


def signature_no_smaller(new: tuple, old: tuple) -> bool:
    """Whether the inputs of :func:`input_signature` ``new`` are those of ``old`` with no
    dimension smaller: the same structure, dtypes, ranks and values, each size at least."""
    if new[0] != old[0] or len(new[1]) != len(old[1]):
        return False
    for a, b in zip(new[1], old[1], strict=True):
        if a[0] == "tensor" == b[0]:
            if a[2] != b[2] or len(a[1]) != len(b[1]):
                return False
            if any(x < y for x, y in zip(a[1], b[1], strict=True)):
                return False
        elif a != b:
            return False
    return True


def describe_signature(sig: tuple) -> str:
    """:func:`input_signature` as the shapes, dtypes and values it holds, for a message."""
    parts = []
    for item in sig[1]:
        if item[0] == "tensor":
            parts.append(f"{list(item[1])} {item[2].replace('torch.', '')}")
        elif item[0] == "value":
            parts.append(repr(item[1]))
        else:
            parts.append(item[1])
    return "(" + ", ".join(parts) + ")"
