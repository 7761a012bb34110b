"""Hugging Face decoder-only causal language models as stages: one adapter for every family.

GPT-2, Llama and Mistral share a layout: an embedding stage (token embeddings, positions, the
causal mask), two stages per decoder block (its attention half, ``x + attn(norm(x))``, and its
MLP half, ``x + mlp(norm(x))``: NOTE [ Half blocks ]), and a head stage (final norm +
``lm_head``);
``prepare`` binds and checks the arguments ``model(...)`` was called with, ``finish`` computes
the loss from ``labels`` with the model's own loss function and returns the model's output
class (``.loss``, ``.logits``; no KV cache while training). A :class:`Decoder` record holds the
few things a family changes:

* how embeddings and positions are made: GPT-2 ``wte`` + ``wpe`` (+ token types) + ``drop``;
  Llama and Mistral ``embed_tokens`` and rotary position embeddings (``cos``, ``sin``), which
  travel in the activation tuple to every block; Mistral's mask is a sliding-window one when
  its config has ``sliding_window``;
* how a block is called (GPT-2 positionally, the rotary families with keywords);
* the names of the base model, its blocks and its final norm;
* the forward signature (positional order, supported arguments) and the output class.

A model is recognised by its class name and only if neither it nor its base model overrides
``forward``; the model's own gradient checkpointing is refused by :func:`remat.capture.stages.split_stages`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from remat.capture.stages.base import Stages, same_forward
from remat.core.errors import UnsupportedModelError

_COMMON_IGNORED = {"return_dict", "use_cache", "output_attentions", "output_hidden_states"}


# ---------------------------------------------------------------------- shared
def _check_kwargs(model: nn.Module, kwargs: dict[str, Any], allowed: frozenset[str]) -> None:
    for key, value in kwargs.items():
        if key in allowed or key in _COMMON_IGNORED:
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


def _bind(names: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict:
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


def _causal_mask(config: Any) -> Callable[..., Any]:
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask


def _causal_or_sliding_mask(config: Any) -> Callable[..., Any]:
    """Mistral's choice: a sliding-window mask when the config has a window."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    if getattr(config, "sliding_window", None) is None:
        return create_causal_mask
    return create_sliding_window_causal_mask


def _positions(
    config: Any,
    mask: Callable[[Any], Callable[..., Any]],
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(cache_position, position_ids, causal_mask)`` as the base models make them before
    their blocks (no cache: positions ``0..T-1``)."""
    cache_position = torch.arange(0, inputs_embeds.shape[1], device=inputs_embeds.device)
    if position_ids is None:
        position_ids = cache_position.unsqueeze(0)
    causal_mask = mask(config)(
        config=config,
        input_embeds=inputs_embeds,
        attention_mask=attention_mask,
        cache_position=cache_position,
        past_key_values=_empty_cache(config),
        position_ids=position_ids,
    )
    return cache_position, position_ids, causal_mask


class _HFStage(nn.Module):
    """Base of the HF stage modules: references the model's submodules, owns nothing."""

    def __init__(self, **parts: Any) -> None:
        super().__init__()
        for key, value in parts.items():
            if isinstance(value, nn.Module):
                self.add_module(key, value)
            else:
                object.__setattr__(self, key, value)


class _BlockStage(_HFStage):
    """A decoder block, or half of one (NOTE [ Half blocks ]: then only that half's submodules,
    so that a parameter's gradient is made by the stage that owns it): ``call(stage, a)`` runs
    it on the stage's submodules as the block's forward would; the rest of the activation
    tuple (mask, positions) passes through unchanged."""

    def forward(self, a: tuple) -> tuple:
        return (self.call(self, a), *a[1:])


# NOTE [ Half blocks ]: a decoder block is two residual halves, attention then MLP, and a
# plan at block granularity recomputes both to get at either: checkpointing the block, its
# backward holds the whole block's saved tensors at once. Cut at the residual between them,
# a plan can recompute the MLP half alone (its 4x-wide intermediate is most of a block's
# activations) or checkpoint each half in its own segment, which holds half a block at a time:
# the least peak falls below what checkpointing every block reaches. The halves call the
# block's own submodules in the order its forward does (same results, bit for bit); a block
# whose class overrides the stock forward, or that has forward hooks of its own (they would
# not run), stays one stage.
@dataclass(frozen=True)
class _Halves:
    """How a family's block splits: its class, and each half's submodules and call."""

    block_class: str
    """The stock block class (``GPT2Block``), compared by forward."""
    attention: tuple[str, ...]
    """The attention half's submodules of the block (``("ln_1", "attn")``)."""
    call_attention: Callable[[nn.Module, tuple], torch.Tensor]
    """``call_attention(stage, a)``: ``a[0] + attn(norm(a[0]))`` with the stage's submodules."""
    mlp: tuple[str, ...]
    """The MLP half's submodules (``("ln_2", "mlp")``)."""
    call_mlp: Callable[[nn.Module, tuple], torch.Tensor]
    """``call_mlp(stage, a)``: ``a[0] + mlp(norm(a[0]))``."""

    def stages(self, block: nn.Module, name: str) -> list[tuple[nn.Module, str]]:
        """The two stages of ``block`` and their names after the block's (``name``)."""
        return [
            (
                _BlockStage(call=call, **{part: getattr(block, part) for part in parts}),
                f"{name}.{'+'.join(parts)}",
            )
            for parts, call in ((self.attention, self.call_attention), (self.mlp, self.call_mlp))
        ]


def _halves_of(block: nn.Module, halves: _Halves | None, classes: Any) -> _Halves | None:
    """``halves`` when ``block`` runs the stock forward with no hooks of its own, else None."""
    if halves is None:
        return None
    stock = getattr(classes, halves.block_class, None)
    if stock is None or not same_forward(block, stock, "forward"):
        return None
    if block._forward_hooks or block._forward_pre_hooks:
        return None
    return halves


class _Head(_HFStage):
    """Final norm + ``lm_head``: the logits."""

    def forward(self, a: tuple) -> torch.Tensor:
        return self.lm_head(self.norm(a[0]))


# ---------------------------------------------------------------------- GPT-2
class _GPT2Embedding(_HFStage):
    """(input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids) ->
    (hidden, causal_mask, cache_position), exactly as GPT2Model.forward before its blocks."""

    def forward(self, a: tuple) -> tuple:
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
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(batch_size, -1)
        cache_position, position_ids, causal_mask = _positions(
            self.config, _causal_mask, inputs_embeds, attention_mask, position_ids
        )
        hidden = inputs_embeds + self.wpe(position_ids).to(inputs_embeds.device)
        if token_type_ids is not None:
            hidden = hidden + self.wte(token_type_ids)
        hidden = self.drop(hidden)
        return hidden, causal_mask, cache_position


def _gpt2_embedding(base: nn.Module) -> tuple[nn.Module, str]:
    return _GPT2Embedding(config=base.config, wte=base.wte, wpe=base.wpe, drop=base.drop), (
        "wte+wpe+drop"
    )


def _gpt2_block(stage: nn.Module, a: tuple) -> torch.Tensor:
    hidden, causal_mask, cache_position = a
    out = stage.block(
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
    return out[0]


def _gpt2_attention(block: nn.Module, a: tuple) -> torch.Tensor:  # block: the half's stage
    hidden, causal_mask, cache_position = a
    attn_output, _ = block.attn(
        block.ln_1(hidden),
        past_key_values=None,
        cache_position=cache_position,
        attention_mask=causal_mask,
        head_mask=None,
        use_cache=False,
        output_attentions=False,
    )
    return attn_output + hidden


def _gpt2_mlp(block: nn.Module, a: tuple) -> torch.Tensor:
    hidden = a[0]
    return hidden + block.mlp(block.ln_2(hidden))


def _gpt2_inputs(model: nn.Module, kw: dict[str, Any]) -> tuple:
    ids = kw.get("input_ids")
    if ids is not None:
        model.transformer.warn_if_padding_and_no_attention_mask(ids, kw.get("attention_mask"))
    return (
        ids,
        kw.get("inputs_embeds"),
        kw.get("attention_mask"),
        kw.get("token_type_ids"),
        kw.get("position_ids"),
    )


# ---------------------------------------------------------------------- rotary (Llama, Mistral)
class _RotaryEmbedding(_HFStage):
    """(input_ids, inputs_embeds, attention_mask, position_ids) ->
    (hidden, causal_mask, position_ids, cache_position, cos, sin), as LlamaModel.forward (and
    MistralModel.forward, with its mask) before the decoder layers."""

    def forward(self, a: tuple) -> tuple:
        input_ids, inputs_embeds, attention_mask, position_ids = a
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        cache_position, position_ids, causal_mask = _positions(
            self.config, self.mask, inputs_embeds, attention_mask, position_ids
        )
        cos, sin = self.rotary_emb(inputs_embeds, position_ids)
        return inputs_embeds, causal_mask, position_ids, cache_position, cos, sin


def _rotary_embedding(
    mask: Callable[[Any], Callable[..., Any]],
) -> Callable[[nn.Module], tuple[nn.Module, str]]:
    def make(base: nn.Module) -> tuple[nn.Module, str]:
        stage = _RotaryEmbedding(
            config=base.config,
            embed_tokens=base.embed_tokens,
            rotary_emb=base.rotary_emb,
            mask=mask,
        )
        return stage, "embed_tokens+rotary_emb"

    return make


def _rotary_block(stage: nn.Module, a: tuple) -> torch.Tensor:
    hidden, causal_mask, position_ids, cache_position, cos, sin = a
    out = stage.block(
        hidden,
        attention_mask=causal_mask,
        position_ids=position_ids,
        past_key_values=None,
        cache_position=cache_position,
        position_embeddings=(cos, sin),
    )
    return out[0] if isinstance(out, tuple) else out


def _rotary_attention(layer: nn.Module, a: tuple) -> torch.Tensor:  # layer: the half's stage
    hidden, causal_mask, position_ids, cache_position, cos, sin = a
    out, _ = layer.self_attn(
        hidden_states=layer.input_layernorm(hidden),
        attention_mask=causal_mask,
        position_ids=position_ids,
        past_key_values=None,
        use_cache=False,
        cache_position=cache_position,
        position_embeddings=(cos, sin),
    )
    return hidden + out


def _rotary_mlp(layer: nn.Module, a: tuple) -> torch.Tensor:
    hidden = a[0]
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _rotary_inputs(model: nn.Module, kw: dict[str, Any]) -> tuple:
    return (
        kw.get("input_ids"),
        kw.get("inputs_embeds"),
        kw.get("attention_mask"),
        kw.get("position_ids"),
    )


# ---------------------------------------------------------------------- the families
@dataclass(frozen=True)
class Decoder:
    """What a decoder-only family changes in the shared adapter."""

    kind: str
    """:attr:`Stages.kind`, e.g. ``"gpt2"``."""
    module: str
    """The transformers module defining the two classes below."""
    lm_class: str
    """The causal-LM class (``GPT2LMHeadModel``): recognised by name, forward not overridden."""
    base_class: str
    """The base model's class (``GPT2Model``), forward not overridden either."""
    base: str
    """The causal-LM's attribute holding the base model (``"transformer"``)."""
    blocks: str
    """The base model's list of blocks (``"h"``)."""
    norm: str
    """The base model's final norm (``"ln_f"``)."""
    embedding: Callable[[nn.Module], tuple[nn.Module, str]]
    """The embedding stage made from the base model, and its name after ``base + "."``."""
    call_block: Callable[[nn.Module, tuple], torch.Tensor]
    """``call_block(stage, a)``: the output hidden states of ``stage.block`` from the activation
    tuple."""
    inputs: Callable[[nn.Module, dict[str, Any]], tuple]
    """``a[0]`` (the embedding stage's input) from the bound arguments."""
    positional: tuple[str, ...]
    """The causal-LM's forward parameters in order (to bind positional arguments)."""
    allowed: frozenset[str]
    """The arguments the stages support (besides None, the defaults and the ignored flags)."""
    output: str
    """The output class in ``transformers.modeling_outputs``."""
    blocks_in_config: bool = True
    """Only the first ``config.num_hidden_layers`` blocks run (GPT-2 runs all of ``h``)."""
    halves: _Halves | None = None
    """How a stock block splits into two stages (NOTE [ Half blocks ]); None: whole blocks."""


_ALLOWED = frozenset(
    {"input_ids", "attention_mask", "position_ids", "inputs_embeds", "labels", "num_items_in_batch"}
)
_ROTARY_POSITIONAL = (
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

GPT2 = Decoder(
    kind="gpt2",
    module="transformers.models.gpt2.modeling_gpt2",
    lm_class="GPT2LMHeadModel",
    base_class="GPT2Model",
    base="transformer",
    blocks="h",
    norm="ln_f",
    embedding=_gpt2_embedding,
    call_block=_gpt2_block,
    inputs=_gpt2_inputs,
    positional=(
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
    ),
    allowed=_ALLOWED | {"token_type_ids"},
    output="CausalLMOutputWithCrossAttentions",
    blocks_in_config=False,
    halves=_Halves("GPT2Block", ("ln_1", "attn"), _gpt2_attention, ("ln_2", "mlp"), _gpt2_mlp),
)

LLAMA = Decoder(
    kind="llama",
    module="transformers.models.llama.modeling_llama",
    lm_class="LlamaForCausalLM",
    base_class="LlamaModel",
    base="model",
    blocks="layers",
    norm="norm",
    embedding=_rotary_embedding(_causal_mask),
    call_block=_rotary_block,
    inputs=_rotary_inputs,
    positional=_ROTARY_POSITIONAL,
    allowed=_ALLOWED,
    output="CausalLMOutputWithPast",
    halves=_Halves(
        "LlamaDecoderLayer",
        ("input_layernorm", "self_attn"),
        _rotary_attention,
        ("post_attention_layernorm", "mlp"),
        _rotary_mlp,
    ),
)

MISTRAL = replace(
    LLAMA,
    kind="mistral",
    module="transformers.models.mistral.modeling_mistral",
    lm_class="MistralForCausalLM",
    base_class="MistralModel",
    embedding=_rotary_embedding(_causal_or_sliding_mask),
    halves=replace(LLAMA.halves, block_class="MistralDecoderLayer"),  # type: ignore[arg-type]
)

DECODERS: tuple[Decoder, ...] = (GPT2, LLAMA, MISTRAL)
"""The decoder-only families :func:`split` recognises."""


# ---------------------------------------------------------------------- the adapter
def split(model: nn.Module) -> Stages | None:
    """The stages of a recognised decoder-only causal LM, else None."""
    family = next((f for f in DECODERS if type(model).__name__ == f.lm_class), None)
    if family is None:
        return None
    try:
        classes = importlib.import_module(family.module)
    except ImportError:  # pragma: no cover
        return None
    if not (
        same_forward(model, getattr(classes, family.lm_class), "forward")
        and same_forward(
            getattr(model, family.base), getattr(classes, family.base_class), "forward"
        )
    ):
        return None
    return _split_decoder(model, family, classes)


def _split_decoder(model: nn.Module, family: Decoder, classes: Any) -> Stages:
    base = getattr(model, family.base)
    if getattr(base, "model_parallel", False):
        raise UnsupportedModelError(
            f"{family.lm_class} with model parallelism (parallelize()) is not supported"
        )
    embedding, embedding_name = family.embedding(base)
    modules: list[nn.Module] = [embedding]
    names = [f"{family.base}.{embedding_name}"]
    blocks = getattr(base, family.blocks)
    if family.blocks_in_config:
        blocks = blocks[: base.config.num_hidden_layers]
    for i, block in enumerate(blocks):
        name = f"{family.base}.{family.blocks}.{i}"
        halves = _halves_of(block, family.halves, classes)
        if halves is None:
            modules.append(_BlockStage(block=block, call=family.call_block))
            names.append(name)
            continue
        for stage, stage_name in halves.stages(block, name):
            modules.append(stage)
            names.append(stage_name)
    modules.append(_Head(norm=getattr(base, family.norm), lm_head=model.lm_head))
    names.append(f"{family.base}.{family.norm}+lm_head")

    def prepare(*args: Any, **kwargs: Any) -> tuple:
        kw = _bind(family.positional, args, kwargs)
        _check_kwargs(model, kw, family.allowed)
        if (kw.get("input_ids") is None) == (kw.get("inputs_embeds") is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        return family.inputs(model, kw)

    # transformers' ``loss_function`` getter logs a warning when the config names no loss
    # type, on every read: under torch.compile a logger call is a graph break, and the one graph
    # ran the loss eagerly after it. Resolved here, eagerly, once; one set on the model later
    # (its setter's ``_loss_function``) is still read in the step.
    loss_function = model.loss_function

    def finish(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from transformers import modeling_outputs

        kw = _bind(family.positional, args, kwargs)
        extra = {
            k: v for k, v in kw.items() if k not in family.positional and k not in _COMMON_IGNORED
        }
        loss = None
        labels = kw.get("labels")
        if labels is not None:
            loss = getattr(model, "_loss_function", loss_function)(
                logits=logits, labels=labels, vocab_size=model.config.vocab_size, **extra
            )
        out = getattr(modeling_outputs, family.output)(loss=loss, logits=logits)
        return_dict = kw.get("return_dict")
        if return_dict is None:
            return_dict = model.config.use_return_dict
        return out if return_dict else out.to_tuple()

    return Stages(tuple(modules), tuple(names), prepare, finish, kind=family.kind)
