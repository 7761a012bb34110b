"""The model families :func:`remat.capture.stages.split_stages` recognises, in the order it tries them.

Each family is a module with ``split(model) -> Stages | None``: the model's stages when it is
one of the family's models (recognised exactly: a subclass that overrides ``forward`` is not),
else None; it raises :class:`~remat.core.errors.UnsupportedModelError` for a model of the family it
cannot cut (e.g. an unsupported argument or mode). A family imports only the generic
:mod:`remat.capture.stages.base`; a new one is a module here and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from remat.capture.stages.base import Stages, split_sequential
from remat.capture.stages.families import blocks, hf, torchvision

__all__ = ["FAMILIES"]

FAMILIES: tuple[Callable[[nn.Module], Stages | None], ...] = (
    split_sequential,
    torchvision.split,
    hf.split,
    blocks.split,  # generic: any forward over a list of blocks (last: the others are exact)
)
"""Tried in order; the first that returns stages wins."""
