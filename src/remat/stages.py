"""A PyTorch model as a sequential program of stages: what a chain :class:`~remat.plans.Plan`
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
* Hugging Face ``LlamaForCausalLM``: embedding stage (``embed_tokens`` + causal mask + rotary
  position embeddings, which travel in the activation tuple), each decoder layer, final
  ``norm`` + ``lm_head``.
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
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from remat.errors import UnsupportedModelError
from remat.guards import BatchCopy, check_no_own_checkpointing

__all__ = [
    "Stages",
    "split_stages",
    "run_stages",
    "UnsupportedModelError",
    "StageMismatchError",
    "StageWatch",
    "SUPPORTED_HELP",
    "check_no_own_checkpointing",
]

SUPPORTED_HELP = (
    "remat can cut these models into stages automatically: any nn.Sequential (forward not "
    "overridden), torchvision ResNet / VGG / AlexNet / MobileNetV2 / MobileNetV3, Hugging Face "
    "GPT2LMHeadModel and LlamaForCausalLM. For another model, name the stage boundaries: "
    "split_stages(model, stages=['layer1', 'layer2', ...]) (or remat.apply(..., stages=[...])) "
    "with the fully-qualified names (model.named_modules()) of submodules that, applied in "
    "order to the model's single input, compute exactly model(x); join several submodules into "
    "one stage with '+', e.g. 'conv1+bn1+relu'. The composition is checked against the model "
    "on the first call."
)


class StageMismatchError(UnsupportedModelError):
    """User-named stages whose composition does not compute what the model computes."""


@dataclass(frozen=True)
class Stages:
    """A model as a sequential program (see the module docstring)."""

    modules: tuple[nn.Module, ...]
    """Stage ``i`` (1-based) is ``modules[i-1]``: ``a[i] = modules[i-1](a[i-1])``."""
    names: tuple[str, ...]
    """Module FQNs (``"a+b"`` for groups) or descriptive names, for reports."""
    prepare: Callable[..., Any]
    """``prepare(*args, **kwargs) -> a[0]`` from what ``model(...)`` is called with."""
    finish: Callable[..., Any]
    """``finish(a[n], *args, **kwargs)`` -> what ``model(*args, **kwargs)`` returns."""
    kind: str = "custom"
    """Which structure was recognised: ``"sequential"``, ``"resnet"``, ``"gpt2"``, ``"named"``..."""
    check: Callable[..., None] | None = field(default=None, compare=False, repr=False)
    """Called with the model's arguments before a run; verifies user-named stages once."""
    split_again: Callable[[], Stages] | None = field(default=None, compare=False, repr=False)
    """Cuts the model again the same way (automatic or by the same names), after one of its
    submodules was replaced; None for hand-made stages."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "names", tuple(self.names))
        if len(self.modules) != len(self.names):
            raise ValueError(f"{len(self.modules)} stage modules but {len(self.names)} names")
        if not self.modules:
            raise UnsupportedModelError("a model needs at least one stage")

    @property
    def n(self) -> int:
        """Number of stages."""
        return len(self.modules)

    def describe(self) -> str:
        return f"{self.kind}: {self.n} stages: " + ", ".join(self.names)

    @property
    def fingerprint(self) -> str:
        """A short hash of the stages' structure: their count and, per stage, the types of its
        modules and the shapes of its parameters (not values, dtypes or devices). Plans made
        from a captured chain record it, and :func:`remat.apply` refuses a plan made for other
        stages."""
        parts = []
        for module in self.modules:
            mods = [type(m).__qualname__ for m in module.modules()]
            shapes = [tuple(p.shape) for p in module.parameters()]
            parts.append(f"{mods}{shapes}")
        text = f"{self.n}|" + "|".join(parts)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_stages(stages: Stages, *args: Any, **kwargs: Any) -> Any:
    """Run the stages plainly in order: equals ``model(*args, **kwargs)``."""
    if stages.check is not None:
        stages.check(*args, **kwargs)
    return _run_plain(stages, args, kwargs)


def _run_plain(stages: Stages, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = stages.prepare(*args, **kwargs)
    for module in stages.modules:
        a = module(a)
    return stages.finish(a, *args, **kwargs)


# ---------------------------------------------------------------------- entry point
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
        result = _split_named(model, names)
        return replace(result, split_again=lambda: split_stages(model, names))
    for splitter in (_split_sequential, _split_torchvision, _split_hf):
        result = splitter(model)
        if result is not None:
            return replace(result, split_again=lambda: split_stages(model))
    raise UnsupportedModelError(
        f"remat does not know how to cut a {type(model).__module__}.{type(model).__qualname__} "
        f"into stages. {SUPPORTED_HELP}"
    )


# ---------------------------------------------------------------------- helpers
def _items(sequence: nn.Module) -> list[tuple[str, nn.Module]]:
    """A ``Sequential``'s (or ``ModuleList``'s) children in the order its ``forward`` runs
    them, one entry per occurrence: ``named_children()`` lists a module object that appears
    twice only once."""
    return [(name, m) for name, m in sequence._modules.items() if m is not None]


def _identity_prepare(*args: Any, **kwargs: Any) -> Any:
    if len(args) != 1 or kwargs:
        raise TypeError(
            "this model's stages take exactly one positional input (called as model(x)); got "
            f"{len(args)} positional and {sorted(kwargs)} keyword arguments"
        )
    return args[0]


def _identity_finish(a: Any, *args: Any, **kwargs: Any) -> Any:
    return a


def _same_forward(model: nn.Module, cls: type, *methods: str) -> bool:
    """``model`` is a ``cls`` whose listed methods are not overridden by a subclass."""
    if not isinstance(model, cls):
        return False
    return all(getattr(type(model), m) is getattr(cls, m) for m in methods)


def _is_inplace(module: nn.Module) -> bool:
    return getattr(module, "inplace", False) is True


def _group(modules: Sequence[nn.Module]) -> nn.Module:
    """One stage made of several modules applied in order (shares them, copies nothing)."""
    return modules[0] if len(modules) == 1 else nn.Sequential(*modules)


def _children_stages(
    children: Sequence[tuple[str, nn.Module]],
) -> tuple[list[nn.Module], list[str]]:
    """Children as stages; in-place children join the stage before them."""
    groups: list[list[tuple[str, nn.Module]]] = []
    for name, child in children:
        if groups and _is_inplace(child):
            groups[-1].append((name, child))
        else:
            groups.append([(name, child)])
    modules = [_group([m for _, m in g]) for g in groups]
    names = ["+".join(n for n, _ in g) for g in groups]
    return modules, names


# ---------------------------------------------------------------------- nn.Sequential
def _split_sequential(model: nn.Module) -> Stages | None:
    if not _same_forward(model, nn.Sequential, "forward"):
        return None
    if len(model) == 0:
        raise UnsupportedModelError("an empty nn.Sequential has no stages")
    modules, names = _children_stages(_items(model))
    return Stages(
        tuple(modules), tuple(names), _identity_prepare, _identity_finish, kind="sequential"
    )


# ---------------------------------------------------------------------- torchvision
def _split_torchvision(model: nn.Module) -> Stages | None:
    try:
        from torchvision.models import VGG, AlexNet, MobileNetV2, MobileNetV3, ResNet
    except ImportError:  # pragma: no cover
        return None

    if _same_forward(model, ResNet, "forward", "_forward_impl"):
        modules: list[nn.Module] = [_group([model.conv1, model.bn1, model.relu, model.maxpool])]
        names = ["conv1+bn1+relu+maxpool"]
        for layer_name in ("layer1", "layer2", "layer3", "layer4"):
            for block_name, block in _items(getattr(model, layer_name)):
                modules.append(block)
                names.append(f"{layer_name}.{block_name}")
        modules.append(nn.Sequential(model.avgpool, nn.Flatten(1), model.fc))
        names.append("avgpool+flatten+fc")
        return Stages(
            tuple(modules), tuple(names), _identity_prepare, _identity_finish, kind="resnet"
        )

    head_pool: nn.Module | None = None
    kind = None
    if _same_forward(model, VGG, "forward"):
        head_pool, kind = model.avgpool, "vgg"
    elif _same_forward(model, AlexNet, "forward"):
        head_pool, kind = model.avgpool, "alexnet"
    elif _same_forward(model, MobileNetV3, "forward", "_forward_impl"):
        head_pool, kind = model.avgpool, "mobilenet_v3"
    elif _same_forward(model, MobileNetV2, "forward", "_forward_impl"):
        # MobileNetV2 pools with F.adaptive_avg_pool2d(x, (1, 1)): the same as this module.
        head_pool, kind = nn.AdaptiveAvgPool2d((1, 1)), "mobilenet_v2"
    if kind is None:
        return None
    modules, names = _children_stages([(f"features.{n}", m) for n, m in _items(model.features)])
    modules.append(nn.Sequential(head_pool, nn.Flatten(1), model.classifier))
    names.append("avgpool+flatten+classifier")
    return Stages(tuple(modules), tuple(names), _identity_prepare, _identity_finish, kind=kind)


# ---------------------------------------------------------------------- Hugging Face
def _split_hf(model: nn.Module) -> Stages | None:
    cls_name = type(model).__name__
    if cls_name not in ("GPT2LMHeadModel", "LlamaForCausalLM"):
        return None
    try:
        if cls_name == "GPT2LMHeadModel":
            from transformers.models.gpt2.modeling_gpt2 import GPT2LMHeadModel, GPT2Model

            if not (
                _same_forward(model, GPT2LMHeadModel, "forward")
                and _same_forward(model.transformer, GPT2Model, "forward")
            ):
                return None
        else:
            from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel

            if not (
                _same_forward(model, LlamaForCausalLM, "forward")
                and _same_forward(model.model, LlamaModel, "forward")
            ):
                return None
    except ImportError:  # pragma: no cover
        return None
    if cls_name == "GPT2LMHeadModel":
        return _split_gpt2(model)
    return _split_llama(model)


_HF_COMMON_IGNORED = {"return_dict", "use_cache", "output_attentions", "output_hidden_states"}


def _hf_check_kwargs(model: nn.Module, kwargs: dict[str, Any], allowed: set[str]) -> None:
    for key, value in kwargs.items():
        if key in allowed or key in _HF_COMMON_IGNORED:
            continue
        if value is None:
            continue
        if key == "logits_to_keep" and isinstance(value, int) and value == 0:
            continue
        raise UnsupportedModelError(
            f"remat's stages for {type(model).__name__} do not support the argument {key}="
            f"{type(value).__name__}; supported: {sorted(allowed)} (training without a KV cache)"
        )
    for key in ("output_attentions", "output_hidden_states"):
        if kwargs.get(key):
            raise UnsupportedModelError(
                f"remat's stages for {type(model).__name__} do not return attentions or hidden "
                f"states ({key}=True); run the model without remat for that"
            )


def _hf_bind(names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict:
    """Positional arguments to keyword arguments, in the order of the HF forward signature."""
    if len(args) > len(names):
        raise UnsupportedModelError(
            f"too many positional arguments ({len(args)}); pass them by keyword"
        )
    bound = dict(kwargs)
    for name, value in zip(names, args, strict=False):
        if name in bound:
            raise TypeError(f"got multiple values for argument {name!r}")
        bound[name] = value
    return bound


def _empty_cache(config: Any) -> Any:
    """An empty KV cache, for the causal-mask decision only (the layers get no cache).

    The models themselves build their mask with a (fresh) ``DynamicCache``; with one, sdpa and
    flash attention get no explicit mask and use ``is_causal`` instead. Without it
    ``create_causal_mask`` returns an explicit B x 1 x T x T mask that every layer would save
    for its backward (4·B·T² bytes per layer): more memory than the model itself uses.
    """
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=config)


class _HFStage(nn.Module):
    """Base of the HF stage modules: references the model's submodules, owns nothing."""

    def __init__(self, **parts: Any) -> None:
        super().__init__()
        for key, value in parts.items():
            if isinstance(value, nn.Module):
                self.add_module(key, value)
            else:
                object.__setattr__(self, key, value)


# GPT-2 ------------------------------------------------------------------------------
_GPT2_POSITIONAL = (
    "input_ids",
    "past_key_values",
    "cache_position",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "head_mask",
    "inputs_embeds",
    "encoder_hidden_states",
    "encoder_attention_mask",
    "labels",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "logits_to_keep",
)
_GPT2_ALLOWED = {
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "inputs_embeds",
    "labels",
    "num_items_in_batch",
}


class _GPT2Embedding(_HFStage):
    """(input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids) ->
    (hidden, causal_mask, cache_position), exactly as GPT2Model.forward before its blocks."""

    def forward(self, a: tuple) -> tuple:
        from transformers.masking_utils import create_causal_mask

        input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids = a
        if input_ids is not None:
            input_shape = input_ids.size()
            input_ids = input_ids.view(-1, input_shape[-1])
            batch_size = input_ids.shape[0]
        else:
            input_shape = inputs_embeds.size()[:-1]
            batch_size = inputs_embeds.shape[0]
        if token_type_ids is not None:
            token_type_ids = token_type_ids.view(-1, input_shape[-1])
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        cache_position = torch.arange(0, inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        position_embeds = self.wpe(position_ids)
        hidden = inputs_embeds + position_embeds.to(inputs_embeds.device)
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(batch_size, -1)
        causal_mask = create_causal_mask(
            config=self.config,
            input_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache_position=cache_position,
            past_key_values=_empty_cache(self.config),
            position_ids=position_ids,
        )
        if token_type_ids is not None:
            hidden = hidden + self.wte(token_type_ids)
        hidden = self.drop(hidden)
        return hidden, causal_mask, cache_position


class _GPT2BlockStage(_HFStage):
    def forward(self, a: tuple) -> tuple:
        hidden, causal_mask, cache_position = a
        out = self.block(
            hidden,
            None,
            cache_position,
            causal_mask,
            None,
            None,
            encoder_attention_mask=None,
            use_cache=False,
            output_attentions=False,
        )
        return out[0], causal_mask, cache_position


class _GPT2Head(_HFStage):
    def forward(self, a: tuple) -> torch.Tensor:
        hidden = self.ln_f(a[0])
        return self.lm_head(hidden)


def _split_gpt2(model: nn.Module) -> Stages:
    tr = model.transformer
    if getattr(tr, "model_parallel", False):
        raise UnsupportedModelError("GPT-2 with model parallelism (parallelize()) is not supported")
    modules: list[nn.Module] = [
        _GPT2Embedding(config=tr.config, wte=tr.wte, wpe=tr.wpe, drop=tr.drop)
    ]
    names = ["transformer.wte+wpe+drop"]
    for i, block in enumerate(tr.h):
        modules.append(_GPT2BlockStage(block=block))
        names.append(f"transformer.h.{i}")
    modules.append(_GPT2Head(ln_f=tr.ln_f, lm_head=model.lm_head))
    names.append("transformer.ln_f+lm_head")

    def prepare(*args: Any, **kwargs: Any) -> tuple:
        kw = _hf_bind(_GPT2_POSITIONAL, args, kwargs)
        _hf_check_kwargs(model, kw, _GPT2_ALLOWED)
        ids, embeds = kw.get("input_ids"), kw.get("inputs_embeds")
        if (ids is None) == (embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if ids is not None:
            tr.warn_if_padding_and_no_attention_mask(ids, kw.get("attention_mask"))
        return (
            ids,
            embeds,
            kw.get("attention_mask"),
            kw.get("token_type_ids"),
            kw.get("position_ids"),
        )

    def finish(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

        kw = _hf_bind(_GPT2_POSITIONAL, args, kwargs)
        extra = {k: v for k, v in kw.items() if k not in _GPT2_POSITIONAL}
        loss = None
        labels = kw.get("labels")
        if labels is not None:
            loss = model.loss_function(logits, labels, vocab_size=model.config.vocab_size, **extra)
        return_dict = kw.get("return_dict")
        if return_dict is None:
            return_dict = model.config.use_return_dict
        if not return_dict:
            return (loss, logits) if loss is not None else (logits,)
        return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)

    return Stages(tuple(modules), tuple(names), prepare, finish, kind="gpt2")


# Llama ------------------------------------------------------------------------------
_LLAMA_POSITIONAL = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "past_key_values",
    "inputs_embeds",
    "labels",
    "use_cache",
    "cache_position",
    "logits_to_keep",
)
_LLAMA_ALLOWED = {
    "input_ids",
    "attention_mask",
    "position_ids",
    "inputs_embeds",
    "labels",
    "num_items_in_batch",
}


class _LlamaEmbedding(_HFStage):
    """(input_ids, inputs_embeds, attention_mask, position_ids) ->
    (hidden, causal_mask, position_ids, cache_position, cos, sin), as LlamaModel.forward."""

    def forward(self, a: tuple) -> tuple:
        from transformers.masking_utils import create_causal_mask

        input_ids, inputs_embeds, attention_mask, position_ids = a
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        cache_position = torch.arange(0, inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        causal_mask = create_causal_mask(
            config=self.config,
            input_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache_position=cache_position,
            past_key_values=_empty_cache(self.config),
            position_ids=position_ids,
        )
        cos, sin = self.rotary_emb(inputs_embeds, position_ids)
        return inputs_embeds, causal_mask, position_ids, cache_position, cos, sin


class _LlamaLayerStage(_HFStage):
    def forward(self, a: tuple) -> tuple:
        hidden, causal_mask, position_ids, cache_position, cos, sin = a
        out = self.layer(
            hidden,
            attention_mask=causal_mask,
            position_ids=position_ids,
            past_key_values=None,
            cache_position=cache_position,
            position_embeddings=(cos, sin),
        )
        if isinstance(out, tuple):
            out = out[0]
        return out, causal_mask, position_ids, cache_position, cos, sin


class _LlamaHead(_HFStage):
    def forward(self, a: tuple) -> torch.Tensor:
        return self.lm_head(self.norm(a[0]))


def _split_llama(model: nn.Module) -> Stages:
    m = model.model
    n_layers = m.config.num_hidden_layers
    modules: list[nn.Module] = [
        _LlamaEmbedding(config=m.config, embed_tokens=m.embed_tokens, rotary_emb=m.rotary_emb)
    ]
    names = ["model.embed_tokens+rotary_emb"]
    for i, layer in enumerate(m.layers[:n_layers]):
        modules.append(_LlamaLayerStage(layer=layer))
        names.append(f"model.layers.{i}")
    modules.append(_LlamaHead(norm=m.norm, lm_head=model.lm_head))
    names.append("model.norm+lm_head")

    def prepare(*args: Any, **kwargs: Any) -> tuple:
        kw = _hf_bind(_LLAMA_POSITIONAL, args, kwargs)
        _hf_check_kwargs(model, kw, _LLAMA_ALLOWED)
        ids, embeds = kw.get("input_ids"), kw.get("inputs_embeds")
        if (ids is None) == (embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        return ids, embeds, kw.get("attention_mask"), kw.get("position_ids")

    def finish(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kw = _hf_bind(_LLAMA_POSITIONAL, args, kwargs)
        extra = {k: v for k, v in kw.items() if k not in _LLAMA_POSITIONAL}
        extra = {k: v for k, v in extra.items() if k not in _HF_COMMON_IGNORED}
        loss = None
        labels = kw.get("labels")
        if labels is not None:
            loss = model.loss_function(
                logits=logits, labels=labels, vocab_size=model.config.vocab_size, **extra
            )
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        return_dict = kw.get("return_dict")
        if return_dict is None:
            return_dict = model.config.use_return_dict
        return out if return_dict else out.to_tuple()

    return Stages(tuple(modules), tuple(names), prepare, finish, kind="llama")


# ---------------------------------------------------------------------- user-named
def _split_named(model: nn.Module, names: list[str]) -> Stages:
    if not names:
        raise UnsupportedModelError("stages=[] names no stage; " + SUPPORTED_HELP)
    known = dict(model.named_modules(remove_duplicate=False))  # every name of a shared module
    modules: list[nn.Module] = []
    seen: set[str] = set()
    for entry in names:
        if not isinstance(entry, str) or not entry:
            raise UnsupportedModelError(f"stage names must be non-empty strings, got {entry!r}")
        parts = []
        for fqn in entry.split("+"):
            fqn = fqn.strip()
            if fqn not in known or fqn == "":
                close = [k for k in known if k and (fqn in k or k in fqn)][:5]
                hint = f" (similar names: {close})" if close else ""
                raise UnsupportedModelError(
                    f"stage {entry!r}: the model has no submodule {fqn!r}{hint}; use names from "
                    "model.named_modules()"
                )
            if fqn in seen:
                raise UnsupportedModelError(f"stage {entry!r}: submodule {fqn!r} named twice")
            seen.add(fqn)
            parts.append(known[fqn])
        modules.append(_group(parts))
    _check_parameters_covered(model, modules, names)
    stages_holder: list[Stages] = []
    check = _CompositionCheck(model, stages_holder)
    stages = Stages(
        tuple(modules),
        tuple(names),
        _identity_prepare,
        _identity_finish,
        kind="named",
        check=check,
    )
    stages_holder.append(stages)
    return stages


def _check_parameters_covered(
    model: nn.Module, modules: Sequence[nn.Module], names: Sequence[str]
) -> None:
    """Every parameter that requires grad belongs to a named stage, or the stages are refused.

    The first call's output check cannot see a parameter the model's forward uses outside the
    named submodules (``self.head(self.body(x) * self.scale)``) while it leaves the output
    unchanged (``scale`` is 1 at initialisation): the stages would never use it, and it would
    never get a gradient.
    """
    covered = {id(p) for m in modules for p in m.parameters()}
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
    if not outside:
        return
    owners = sorted({n.rpartition(".")[0] for n in outside})
    where = ", ".join(repr(o) if o else "the model itself" for o in owners)
    shown = outside[:8] + ([f"... {len(outside) - 8} more"] if len(outside) > 8 else [])
    raise StageMismatchError(
        f"the named stages {list(names)} do not contain the parameter(s) {shown}, which "
        "require grad: the stages would run without them and they would get no gradient. "
        f"Include the submodule that owns them ({where}) in a stage (join submodules with "
        "'+'; a parameter of the model itself needs its code moved into a submodule), or "
        "freeze them (p.requires_grad_(False))"
    )


class _CompositionCheck:
    """Verifies once, on the first inputs, that the named stages compute ``model(x)``.

    Runs both without grad, from the same RNG state and the same input values (a model may
    write into its input), and restores the RNG state, every buffer (batch-norm statistics)
    and the input values afterwards, so the check has no side effects.
    """

    def __init__(self, model: nn.Module, holder: list[Stages]) -> None:
        self.model = model
        self.holder = holder
        self.done = False

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.done:
            return
        inputs = BatchCopy((args, kwargs), snapshot=True)
        stages = self.holder[0]
        model = self.model
        buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
        devices = sorted({b.device for b in model.parameters() if b.device.type == "cuda"}, key=str)
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                state = torch.get_rng_state()
                cuda_states = [torch.cuda.get_rng_state(d) for d in devices]
                expected = model(*args, **kwargs)
                for k, b in model.named_buffers():
                    b.copy_(buffers[k])
                torch.set_rng_state(state)
                for d, s in zip(devices, cuda_states, strict=True):
                    torch.cuda.set_rng_state(s, d)
                inputs.restore()
                try:
                    got = _run_plain(stages, args, kwargs)
                except Exception as err:
                    raise StageMismatchError(
                        f"the named stages {list(stages.names)} cannot be run in order on the "
                        f"model's input: {type(err).__name__}: {err}. " + SUPPORTED_HELP
                    ) from err
        finally:
            with torch.no_grad():
                for k, b in model.named_buffers():
                    b.copy_(buffers[k])
            inputs.restore()
        problem = _compare_outputs(expected, got)
        if problem is not None:
            raise StageMismatchError(
                f"the named stages {list(stages.names)} do not compute what the model computes "
                f"({problem}): the model's forward does more than call these submodules in "
                "order (functional ops such as torch.flatten, residual additions, or several "
                "inputs). Name other boundaries (a parent module covering that code), or see: "
                + SUPPORTED_HELP
            )
        self.done = True


def _compare_outputs(expected: Any, got: Any, path: str = "output") -> str | None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: expected a tensor, got {type(got).__name__}"
        if expected.shape != got.shape or expected.dtype != got.dtype:
            return (
                f"{path}: expected {tuple(expected.shape)} {expected.dtype}, got "
                f"{tuple(got.shape)} {got.dtype}"
            )
        if expected.is_floating_point() or expected.is_complex():
            ok = torch.allclose(expected, got, rtol=1e-5, atol=1e-6, equal_nan=True)
        else:
            ok = torch.equal(expected, got)
        return None if ok else f"{path}: values differ"
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(expected) != set(got):
            return f"{path}: different keys"
        for k in expected:
            problem = _compare_outputs(expected[k], got[k], f"{path}[{k!r}]")
            if problem:
                return problem
        return None
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(expected) != len(got):
            return f"{path}: different structure"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            problem = _compare_outputs(e, g, f"{path}[{i}]")
            if problem:
                return problem
        return None
    with contextlib.suppress(Exception):
        if expected == got:
            return None
    return f"{path}: {expected!r} != {got!r}"


# ---------------------------------------------------------------------- replaced submodules
class StageWatch:
    """Tells when a submodule the stages run was replaced in the model after the split.

    Stage modules are the model's own submodules (or the splitter's wrappers and groups that
    hold them): ``model.fc = nn.Linear(...)`` afterwards leaves the stages running the old
    ``fc``. The watch records the model's submodules the stages hold and, for every module on
    their paths from the model, its children; :meth:`changed` compares those with the model's
    current children (a few identity checks). A change deeper inside a stage module
    (``model.layer1[0].conv1 = ...``) needs no watching: the stage module runs its new child.
    """

    def __init__(self, model: nn.Module, stages: Stages) -> None:
        paths: dict[int, list[str]] = {}
        by_name: dict[str, nn.Module] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(module), []).append(name)
            by_name[name] = module
        held: set[str] = set()

        def visit(module: nn.Module) -> None:
            if id(module) in paths:
                held.update(paths[id(module)])
            else:  # a wrapper or group made by the splitter: what it holds
                for child in module.children():
                    visit(child)

        for module in stages.modules:
            visit(module)
        parents = {".".join(p.split(".")[:k]) for p in held if p for k in range(p.count(".") + 1)}
        self._parents = [
            (prefix, by_name[prefix], tuple(by_name[prefix]._modules.items()))
            for prefix in sorted(parents)
        ]

    def changed(self) -> str | None:
        """None while the model holds the same submodules; else which one changed."""
        for prefix, parent, children in self._parents:
            now = parent._modules
            here = prefix + "." if prefix else ""
            for name, child in children:
                if now.get(name) is not child:
                    return f"{here + name!r} ({'replaced' if name in now else 'removed'})"
            if len(now) != len(children):
                added = [k for k in now if k not in dict(children)]
                return f"{here + (added[0] if added else '?')!r} (added)"
        return None
