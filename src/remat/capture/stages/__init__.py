"""A PyTorch model as a sequential program of stages: what a chain :class:`~remat.core.plan.Plan`
is applied to.

:func:`split_stages` cuts a model into ``n`` stage modules so that::

    a[0] = stages.prepare(*args, **kwargs)          # what model(...) was called with
    a[i] = stages.modules[i - 1](a[i - 1])           # i = 1..n
    model(*args, **kwargs) == stages.finish(a[n], *args, **kwargs)

Activations ``a[i]`` are tensors or tuples of tensors (``None`` may appear inside a tuple, e.g.
an attention mask that a model does not need). :func:`run_stages` is the plain sequential run.

Supported structures (detected exactly; a subclass that overrides ``forward`` is not one):

* any ``nn.Sequential`` (its ``forward`` not overridden): each child is a stage, in the order
  ``forward`` runs them (a module object that appears twice, such as one shared ``nn.ReLU`` or
  a block repeated, is one stage per occurrence). Nested
  ``Sequential`` children are **not** flattened (one child, one stage); to cut finer, name the
  boundaries (below), e.g. ``["0", "1.0", "1.1", "2"]``. A child with ``inplace=True`` (an
  in-place ``ReLU``, ``Dropout``, ...) joins the stage before it, so an in-place op never starts a
  stage (in-place ops on a checkpointed segment's input break recomputation).
* torchvision ``ResNet``: stem (``conv1+bn1+relu+maxpool``), each residual block
  (``layer1.0``, ...), head (``avgpool`` + flatten + ``fc``).
* torchvision ``VGG``, ``AlexNet``, ``MobileNetV2``, ``MobileNetV3``: each child of ``features``
  (in-place activations joined to the stage before), then one head stage (pool + flatten +
  ``classifier``).
* Hugging Face ``GPT2LMHeadModel``: embedding stage (``wte`` + ``wpe`` + causal mask + ``drop``),
  each ``GPT2Block``, final ``ln_f`` + ``lm_head``; ``finish`` computes the loss from ``labels``
  with the model's own loss function and returns the same output class as the model (``.loss``,
  ``.logits``; ``past_key_values`` is ``None``: no KV cache while training).
* Hugging Face ``LlamaForCausalLM`` and ``MistralForCausalLM``: embedding stage
  (``embed_tokens`` + causal mask, Mistral's sliding-window one when configured + rotary
  position embeddings, which travel in the activation tuple), each decoder layer, final
  ``norm`` + ``lm_head``; ``finish`` as for GPT-2 (one adapter serves the three).
* any other model whose forward runs the blocks of a ``ModuleList`` or ``Sequential`` one
  after another (:mod:`~remat.capture.stages.families.blocks`, tried last): a prefix stage (the forward
  up to the first block), one stage per block (plain ``Sequential`` children flattened: stages
  of stages), a suffix stage (the forward after the last block); the extra arguments of the
  blocks (masks, position embeddings) travel with the hidden state, non-tensor ones that
  differ block to block (Swin's dimensions) recorded per block. Hugging Face BERT, Qwen2,
  OPT, ViT, Swin, timm's ViT and ResNet (stages called as attributes ``layer1..layer4``),
  torchvision's ConvNeXt, Swin, RegNet, EfficientNet, an ``nn.Sequential`` subclass with its
  own forward... That the forward is such a chain is checked
  on the first call and on every run (:class:`StageMismatchError` otherwise).
* user-named boundaries: ``split_stages(model, ["layer1", "layer2", ...])`` with the FQNs of
  submodules whose composition in order equals the model (``"a+b"`` groups several submodules
  into one stage). The model is called with one tensor; the composition is **verified** on the
  first run (:class:`StageMismatchError` if it differs from ``model(x)``), and every parameter
  that requires grad must belong to a stage (refused at once otherwise: a parameter the
  forward uses outside the stages would get no gradient).

Anything else raises :class:`UnsupportedModelError` saying what to do. A model with Hugging
Face's own gradient checkpointing enabled is refused by every entry point
(:func:`check_no_own_checkpointing`).

:attr:`Stages.fingerprint` is the stages' structure (module types and parameter shapes), which
plans made from a captured chain record; :class:`StageWatch` tells when a submodule the stages
use was replaced in the model.

The package: :mod:`~remat.capture.stages.base` (the generic types and helpers, the ``nn.Sequential``
splitter), :mod:`~remat.capture.stages.named` (user-named boundaries), :mod:`~remat.capture.stages.watch`,
and :mod:`~remat.capture.stages.families` (:mod:`~remat.capture.stages.families.torchvision`,
:mod:`~remat.capture.stages.families.hf`, :mod:`~remat.capture.stages.families.blocks`; the :data:`FAMILIES`
tried in order).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from remat.capture.stages.base import (
    SUPPORTED_HELP,
    StageMismatchError,
    Stages,
    around,
    run_stages,
    traceable,
)
from remat.capture.stages.base import _run_plain as _run_plain  # the executor's plain run
from remat.capture.stages.families import FAMILIES
from remat.capture.stages.named import split_named
from remat.capture.stages.watch import StageWatch
from remat.core.errors import UnsupportedModelError
from remat.guards import check_no_own_checkpointing, own_hooks

__all__ = [
    "Stages",
    "split_stages",
    "run_stages",
    "UnsupportedModelError",
    "StageMismatchError",
    "StageWatch",
    "SUPPORTED_HELP",
    "check_no_own_checkpointing",
    "FAMILIES",
    "traceable",
    "around",
]


def split_stages(model: nn.Module, stages: Sequence[str] | None = None) -> Stages:
    """Cut ``model`` into stages: automatically, or at the user-named submodules ``stages``.

    Raises :class:`UnsupportedModelError` (with instructions) for a model it cannot cut.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"expected an nn.Module, got {type(model).__name__}")
    check_no_own_checkpointing(model)
    if stages is not None:
        if isinstance(stages, str):
            raise UnsupportedModelError(
                "stages must be a list of submodule names, e.g. ['layer1', 'layer2'], "
                f"not the string {stages!r}"
            )
        names = list(stages)
        result = split_named(model, names)
        _check_hooks_run(model, result)
        return replace(result, split_again=functools.partial(split_stages, model, names))
    for splitter in FAMILIES:
        result = splitter(model)
        if result is not None:
            _check_hooks_run(model, result)
            return replace(result, split_again=functools.partial(split_stages, model))
    raise UnsupportedModelError(
        f"remat does not know how to cut a {type(model).__module__}.{type(model).__qualname__} "
        f"into stages. {SUPPORTED_HELP}"
    )


def _check_hooks_run(model: nn.Module, stages: Stages) -> None:
    """Refuse stages that would skip a module's hooks: the stages run the modules they hold
    (and ``prepare``/``finish`` call theirs), not the containers around them. A container
    whose forward the model runs (the model itself, torchvision's ``layer2`` around its
    residual blocks) and that has hooks of its own would not fire them: a forward hook
    that keeps ``layer2``'s output for a feature loss raised ``KeyError`` in the loss (and
    would have kept a stale tensor silently). Raises :class:`UnsupportedModelError` (``auto``
    then plans the module graph, which runs the model's own forward)."""
    inside = {id(m) for stage in stages.modules for m in stage.modules()}
    for name, module in model.named_modules():
        if id(module) in inside or isinstance(module, nn.ModuleList | nn.ModuleDict):
            continue  # run by a stage; or no forward at all (its hooks never fire)
        hooks = own_hooks(module)
        if hooks and any(id(m) in inside for m in module.modules()):
            raise UnsupportedModelError(
                f"{name or 'the model'} ({type(module).__name__}) has hooks of its own "
                f"({', '.join(h.strip('_') for h in hooks)}), but remat's {stages.kind} stages "
                "run the modules inside it, not its forward, so they would not fire: register "
                "them on a stage module or a module inside one, or let remat plan the module "
                "graph (remat.auto does when the stages cannot be used)"
            )
