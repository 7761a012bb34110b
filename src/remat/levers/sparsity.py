"""Sparsity: weight masks by magnitude, dynamic sparse training, and what sparse storage would
really save (the "sparsity" lever of Sohoni et al. 2019).

* :func:`magnitude_prune` keeps the ``round(density * numel)`` largest-magnitude entries of each
  prunable weight (``scope="layer"``) or of all of them together (``scope="global"``) and returns
  :class:`WeightMasks`: bool masks applied in place. :meth:`WeightMasks.attach` re-applies them
  after every ``optimizer.step()`` (an optimizer step post-hook) and masks the gradients, so
  masked weights stay exactly zero under any optimizer (momentum, Adam, weight decay).
* :class:`DynamicSparsity` is dynamic-sparse-reparameterisation-style training: every ``every``
  steps each masked weight drops its smallest active entries and regrows as many elsewhere
  (randomly or where the gradient is largest), so the density stays exactly fixed; regrown
  weights start at zero with their optimizer state reset (Sohoni et al. reset the optimizer
  state to stay consistent with the sparsity, shared/papers/notes.md §2.1).
* :func:`sparse_storage_bytes` measures what the weight would take in torch's CSR or COO
  storage (values plus indices, exact bytes of real sparse tensors).

**Memory, honestly** (NOTE [ Masks save no memory ]): a masked weight is still a dense tensor.
Its parameter, gradient and optimizer state keep their dense bytes, and the bool mask adds one
byte per element: masking *costs* memory in PyTorch. Only a sparse storage saves, and only below
a break-even density: CSR with int64 indices needs ``nnz * (itemsize + 8) + (rows + 1) * 8``
bytes, i.e. fp32 weights must be under ~1/3 dense to gain anything (int32 indices: ~1/2).
PyTorch's optimizers and most kernels need dense weights and gradients, so remat only *counts*
the sparse bytes; the saving is real only with sparse kernels and sparse optimizer state.
``torch.nn.utils.prune`` is worse still: it keeps ``weight_orig`` plus a mask of the weight's own
dtype and recomputes ``weight`` at every forward.

Known limitations:
    * Per-tensor densities are fixed by :class:`DynamicSparsity` (SET/RigL-style); DSR's
      reallocation of free parameters across layers (Mostafa & Wang 2019) is not implemented.
    * Adam's step count is per parameter tensor in torch, so a regrown entry's moments restart
      from zero without a fresh bias correction.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "WeightMasks",
    "DynamicSparsity",
    "SparseBytes",
    "SparsityUpdate",
    "prunable_parameters",
    "magnitude_prune",
    "kept_count",
    "sparse_storage_bytes",
    "predicted_sparse_bytes",
]

_PRUNABLE = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)


# ---------------------------------------------------------------------- records
@dataclass(frozen=True)
class SparseBytes:
    """Exact bytes of one weight in dense and in sparse storage.

    Attributes:
        layout: ``"csr"`` or ``"coo"``.
        shape: the weight's shape (CSR stores it as ``(shape[0], prod(shape[1:]))``).
        nnz: stored (non-zero) entries.
        dense_bytes: ``numel * itemsize`` of the dense weight.
        values_bytes: bytes of the stored values.
        index_bytes: bytes of the indices (CSR: row pointers and column indices; COO: one
            index per dimension per entry).
    """

    layout: str
    shape: tuple[int, ...]
    nnz: int
    dense_bytes: int
    values_bytes: int
    index_bytes: int

    @property
    def sparse_bytes(self) -> int:
        """Values plus indices."""
        return self.values_bytes + self.index_bytes

    @property
    def ratio(self) -> float:
        """``sparse_bytes / dense_bytes``: below 1 the sparse storage saves memory."""
        return self.sparse_bytes / self.dense_bytes if self.dense_bytes else math.inf


@dataclass(frozen=True)
class SparsityUpdate:
    """One prune-and-regrow update of :class:`DynamicSparsity`.

    Attributes:
        step: the optimizer step count at which it ran.
        pruned: entries switched off, per weight name.
        regrown: entries switched on, per weight name (equal to ``pruned``: density is fixed).
    """

    step: int
    pruned: tuple[tuple[str, int], ...]
    regrown: tuple[tuple[str, int], ...]


# ---------------------------------------------------------------------- masks
class WeightMasks:
    """Bool masks over some parameters of a model (``True`` = kept).

    Args:
        parameters: ``{name: parameter}``.
        masks: ``{name: bool tensor of the parameter's shape}``.
    """

    def __init__(
        self, parameters: Mapping[str, nn.Parameter], masks: Mapping[str, torch.Tensor]
    ) -> None:
        if parameters.keys() != masks.keys():
            raise ValueError("parameters and masks must have the same names")
        for name, mask in masks.items():
            p = parameters[name]
            if mask.shape != p.shape or mask.dtype != torch.bool:
                raise ValueError(
                    f"mask {name!r} must be a bool tensor of shape {list(p.shape)}, got "
                    f"{mask.dtype} {list(mask.shape)}"
                )
        self.parameters = dict(parameters)
        self.masks = {name: m.to(parameters[name].device) for name, m in masks.items()}
        self._handles: list[Any] = []
        # called with (name, gradient) before the gradient is masked (gradient regrowth)
        self.gradient_observer: Any = None

    # -------------------------------------------------------------- queries
    def kept(self) -> dict[str, int]:
        """Kept entries per weight."""
        return {name: int(m.sum()) for name, m in self.masks.items()}

    def density(self) -> float:
        """Kept entries over all masked entries."""
        total = sum(m.numel() for m in self.masks.values())
        return sum(self.kept().values()) / total if total else 1.0

    def mask_bytes(self) -> int:
        """Bytes of the masks themselves (one per element: what masking adds)."""
        return sum(m.nbytes for m in self.masks.values())

    # -------------------------------------------------------------- actions
    @torch.no_grad()
    def apply(self) -> None:
        """Zero the masked-off entries of every weight, in place."""
        for name, p in self.parameters.items():
            p.mul_(self.masks[name])

    def attach(
        self, optimizer: torch.optim.Optimizer | None = None, mask_gradients: bool = True
    ) -> WeightMasks:
        """Keep masked weights at zero: re-apply the masks after every ``optimizer.step()``
        and (``mask_gradients``) zero the gradients of masked entries as they are computed,
        so optimizer state of masked entries stays zero too. Returns ``self``."""
        if optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(lambda *_: self.apply()))
        if mask_gradients:
            for name, p in self.parameters.items():
                self._handles.append(p.register_hook(self._gradient_hook(name)))
        self.apply()
        return self

    def detach(self) -> None:
        """Remove the hooks installed by :meth:`attach`."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _gradient_hook(self, name: str) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if self.gradient_observer is not None:
                self.gradient_observer(name, grad)
            return grad * self.masks[name]

        return hook


def prunable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The weights of Linear, Bilinear and Conv layers, and of Hugging Face's ``Conv1D`` (GPT-2's
    attention and MLP projections); biases and norms are left dense."""
    found: dict[str, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        prunable = isinstance(module, _PRUNABLE) or type(module).__name__ == "Conv1D"
        if prunable and isinstance(getattr(module, "weight", None), nn.Parameter):
            found[f"{module_name}.weight" if module_name else "weight"] = module.weight
    return found


def kept_count(numel: int, density: float) -> int:
    """Entries kept at ``density``: ``round(density * numel)`` (half to even)."""
    return round(density * numel)


def magnitude_prune(
    model: nn.Module | Mapping[str, nn.Parameter],
    density: float,
    scope: str = "layer",
) -> WeightMasks:
    """Keep the largest-magnitude entries and zero the rest, in place.

    Args:
        model: a model (its :func:`prunable_parameters`) or ``{name: parameter}``.
        density: fraction kept, in [0, 1]. ``scope="layer"``: each weight keeps exactly
            :func:`kept_count` ``(numel, density)`` entries; ``"global"``: the weights together
            keep exactly ``kept_count(total, density)``, the largest over all of them.
        scope: ``"layer"`` or ``"global"``.

    Ties are broken by ``torch.topk``, so the count is exact even when magnitudes repeat.
    Returns the masks, not yet attached to an optimizer (:meth:`WeightMasks.attach`).
    """
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    if scope not in ("layer", "global"):
        raise ValueError(f"scope must be 'layer' or 'global', got {scope!r}")
    params = dict(model) if isinstance(model, Mapping) else prunable_parameters(model)
    if not params:
        raise ValueError("nothing to prune: no Linear/Conv weights found")
    masks: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if scope == "layer":
            for name, p in params.items():
                masks[name] = _top_mask(
                    p.detach().abs().flatten(), kept_count(p.numel(), density)
                ).view_as(p)
        else:
            flat = torch.cat([p.detach().abs().flatten().float() for p in params.values()])
            keep = _top_mask(flat, kept_count(flat.numel(), density))
            offset = 0
            for name, p in params.items():
                masks[name] = keep[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
    result = WeightMasks(params, masks)
    result.apply()
    return result


# ---------------------------------------------------------------------- dynamic sparsity
class DynamicSparsity:
    """Prune-and-regrow training at a fixed density (dynamic sparse reparameterisation style).

    Call :meth:`step` after every ``optimizer.step()``. Every ``every`` steps, each masked weight
    switches off ``round(prune_fraction * kept)`` of its active entries (smallest magnitude)
    and switches on as many inactive ones (``regrow="random"``: uniformly, from ``generator``;
    ``"gradient"``: largest gradient magnitude at the last backward), preferring entries that
    were not just pruned. Regrown weights are set to zero, and the optimizer state of every
    entry that changed (pruned or regrown) is reset to zero, so a regrown weight starts fresh.

    Args:
        masks: the masks to evolve (attached here to ``optimizer``; gradients are masked).
        optimizer: the optimizer whose state is reset.
        every: steps between updates.
        prune_fraction: fraction of each weight's active entries replaced per update.
        regrow: ``"random"`` or ``"gradient"``.
        generator: random generator for ``"random"`` regrowth (reproducible runs).
    """

    def __init__(
        self,
        masks: WeightMasks,
        optimizer: torch.optim.Optimizer,
        every: int = 100,
        prune_fraction: float = 0.2,
        regrow: str = "random",
        generator: torch.Generator | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if not 0.0 <= prune_fraction <= 1.0:
            raise ValueError(f"prune_fraction must be in [0, 1], got {prune_fraction}")
        if regrow not in ("random", "gradient"):
            raise ValueError(f"regrow must be 'random' or 'gradient', got {regrow!r}")
        self.masks = masks
        self.optimizer = optimizer
        self.every = every
        self.prune_fraction = prune_fraction
        self.regrow = regrow
        self.generator = generator
        self.steps = 0
        self.history: list[SparsityUpdate] = []
        self._gradients: dict[str, torch.Tensor] = {}
        if regrow == "gradient":
            masks.gradient_observer = self._observe
        masks.attach(optimizer, mask_gradients=True)

    def step(self) -> SparsityUpdate | None:
        """Count one optimizer step; run an update every ``every`` steps (returned)."""
        self.steps += 1
        if self.steps % self.every:
            return None
        return self.update()

    @torch.no_grad()
    def update(self) -> SparsityUpdate:
        """Prune and regrow now (see the class docstring)."""
        pruned: list[tuple[str, int]] = []
        regrown: list[tuple[str, int]] = []
        for name, p in self.masks.parameters.items():
            mask = self.masks.masks[name]
            flat_mask = mask.view(-1)
            active = flat_mask.nonzero().squeeze(1)
            n_change = round(self.prune_fraction * active.numel())
            inactive_before = (~flat_mask).nonzero().squeeze(1)
            if n_change == 0:
                pruned.append((name, 0))
                regrown.append((name, 0))
                continue
            magnitudes = p.detach().reshape(-1)[active].abs()
            drop = active[torch.topk(magnitudes, n_change, largest=False, sorted=False).indices]
            flat_mask[drop] = False
            # regrow among entries inactive before this update; fall back to the just-pruned
            candidates = inactive_before
            if candidates.numel() < n_change:
                candidates = torch.cat([inactive_before, drop])
            grow = self._choose(name, candidates, n_change)
            flat_mask[grow] = True
            p.view(-1)[drop] = 0
            p.view(-1)[grow] = 0
            self._reset_state(p, torch.cat([drop, grow]))
            pruned.append((name, int(drop.numel())))
            regrown.append((name, int(grow.numel())))
        self._gradients.clear()
        self.masks.apply()
        update = SparsityUpdate(self.steps, tuple(pruned), tuple(regrown))
        self.history.append(update)
        return update

    # -------------------------------------------------------------- implementation
    def _observe(self, name: str, grad: torch.Tensor) -> None:
        if (self.steps + 1) % self.every == 0:  # the next step() updates
            self._gradients[name] = grad.detach().abs().clone()

    def _choose(self, name: str, candidates: torch.Tensor, n: int) -> torch.Tensor:
        if self.regrow == "gradient":
            grad = self._gradients.get(name)
            if grad is None:
                raise RuntimeError(
                    f"regrow='gradient' needs the gradient of {name!r} from the backward just "
                    "before the update; call step() after each optimizer.step(), with a "
                    "backward in between"
                )
            scores = grad.reshape(-1)[candidates]
            return candidates[torch.topk(scores, n, sorted=False).indices]
        order = torch.randperm(candidates.numel(), generator=self.generator)
        return candidates[order[:n].to(candidates.device)]

    def _reset_state(self, p: nn.Parameter, flat_index: torch.Tensor) -> None:
        state = self.optimizer.state.get(p)
        if not state:
            return
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                value.view(-1)[flat_index] = 0


# ---------------------------------------------------------------------- memory accounting
def sparse_storage_bytes(
    weight: torch.Tensor, layout: str = "csr", index_dtype: torch.dtype = torch.int64
) -> SparseBytes:
    """Exact bytes of ``weight`` stored as a real torch sparse tensor (its non-zeros).

    CSR views the weight as a matrix ``(shape[0], prod(shape[1:]))`` (conv weights too) and may
    use int32 or int64 indices; COO keeps the shape and always int64 indices. The bytes are read
    from the sparse tensor's own ``values`` and index tensors.
    """
    with warnings.catch_warnings():
        # torch warns that CSR support is "beta": only storage is used here
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return _sparse_storage_bytes(weight.detach(), layout, index_dtype)


def _sparse_storage_bytes(w: torch.Tensor, layout: str, index_dtype: torch.dtype) -> SparseBytes:
    shape = tuple(w.shape)
    dense_bytes = w.numel() * w.element_size()
    if layout == "csr":
        matrix = w.reshape(shape[0], -1) if w.dim() != 2 else w
        csr = matrix.to_sparse_csr()
        if index_dtype != csr.crow_indices().dtype:
            csr = torch.sparse_csr_tensor(
                csr.crow_indices().to(index_dtype),
                csr.col_indices().to(index_dtype),
                csr.values(),
                matrix.shape,
                check_invariants=True,
            )
        crow, col, values = csr.crow_indices(), csr.col_indices(), csr.values()
        return SparseBytes(
            "csr", shape, values.numel(), dense_bytes, values.nbytes, crow.nbytes + col.nbytes
        )
    if layout == "coo":
        if index_dtype != torch.int64:
            raise ValueError("torch's COO tensors have int64 indices only")
        coo = w.to_sparse().coalesce()
        values, indices = coo.values(), coo.indices()
        return SparseBytes("coo", shape, values.numel(), dense_bytes, values.nbytes, indices.nbytes)
    raise ValueError(f"layout must be 'csr' or 'coo', got {layout!r}")


def predicted_sparse_bytes(
    shape: Iterable[int],
    nnz: int,
    dtype: torch.dtype = torch.float32,
    layout: str = "csr",
    index_dtype: torch.dtype = torch.int64,
) -> SparseBytes:
    """Bytes of a weight of ``shape`` with ``nnz`` stored entries, from the formula:
    CSR ``nnz * (itemsize + index) + (rows + 1) * index``; COO ``nnz * (itemsize + 8 * ndim)``.
    """
    shape = tuple(shape)
    numel = math.prod(shape)
    item = dtype.itemsize
    if layout == "csr":
        idx = index_dtype.itemsize
        index_bytes = nnz * idx + (shape[0] + 1) * idx
    elif layout == "coo":
        index_bytes = nnz * 8 * len(shape)
    else:
        raise ValueError(f"layout must be 'csr' or 'coo', got {layout!r}")
    return SparseBytes(layout, shape, nnz, numel * item, nnz * item, index_bytes)


def _top_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if k > 0:
        mask[torch.topk(scores, k, sorted=False).indices] = True
    return mask
