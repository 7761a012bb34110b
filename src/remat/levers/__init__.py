"""The other memory levers of Sohoni et al. 2019, next to recomputation: low precision,
microbatching, sparsity and CPU offload.

Each lever is a small torch utility built on a standard PyTorch mechanism (``torch.autocast``,
``torch.autograd.graph.saved_tensors_hooks``, gradient accumulation, weight masks), so it
composes with any model, including one wrapped by ``remat.apply(model, plan)``, and with the
other levers. See ``docs/levers.md`` for what each saves, measured, and what it costs.

Example (bf16 compute, int8 saved activations, 4 microbatches, under a remat plan made for the
microbatch shape):

    >>> import torch, remat
    >>> from torch import nn
    >>> from remat.levers import MicroBatcher, Precision, precision_context
    >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)])
    >>> batch = torch.randn(32, 64)
    >>> planned = remat.apply(model, remat.Plan.every_stage(), example=batch[:8])
    >>> p = Precision(compute="bf16", saved="int8")
    >>> step = MicroBatcher(4, loss_fn=lambda m, x: m(x).float().square().mean(),
    ...                     forward_context=lambda: precision_context(p, "cpu", model))
    >>> loss = step(planned, batch)
"""

from __future__ import annotations

from remat.levers.microbatch import (
    MicroBatcher,
    accumulate_step,
    batch_size,
    compute_loss,
    split_batch,
    split_sizes,
)
from remat.levers.offload import (
    OffloadUnavailableError,
    offload_available,
    offload_saved_activations,
)
from remat.levers.precision import (
    GradientError,
    Precision,
    SavedTensorStats,
    compress_saved_activations,
    count_saved_tensors,
    gradient_error,
    make_grad_scaler,
    precision_context,
    scaled_backward,
    scaled_step,
)
from remat.levers.sparsity import (
    DynamicSparsity,
    SparseBytes,
    SparsityUpdate,
    WeightMasks,
    kept_count,
    magnitude_prune,
    predicted_sparse_bytes,
    prunable_parameters,
    sparse_storage_bytes,
)

__all__ = [
    # precision
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
    # microbatching
    "MicroBatcher",
    "accumulate_step",
    "split_batch",
    "split_sizes",
    "batch_size",
    "compute_loss",
    # sparsity
    "WeightMasks",
    "DynamicSparsity",
    "SparseBytes",
    "SparsityUpdate",
    "prunable_parameters",
    "magnitude_prune",
    "kept_count",
    "sparse_storage_bytes",
    "predicted_sparse_bytes",
    # offload
    "offload_saved_activations",
    "offload_available",
    "OffloadUnavailableError",
]
