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

from remat.levers import microbatch, offload, precision, sparsity
from remat.levers.microbatch import *  # noqa: F403 - each lever's __all__
from remat.levers.offload import *  # noqa: F403
from remat.levers.precision import *  # noqa: F403
from remat.levers.sparsity import *  # noqa: F403

__all__ = [*precision.__all__, *microbatch.__all__, *sparsity.__all__, *offload.__all__]
