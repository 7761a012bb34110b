"""Conformance: any model, planned before it runs (tiny transformers, timm and torchvision models).

Every entry of :data:`MODELS` is built from a tiny configuration (random weights, nothing is
downloaded; ``pretrained=False`` / ``weights=None``) with a seeded batch. :func:`run_case` trains
one entry through :func:`remat.auto` at one total budget, with one of three loop shapes:

* ``"held"`` (a): ``out = planned(x); loss = crit(out, y); loss.backward(); opt.step()`` — the
  output is held to the end of the step; ``auto`` is called without a loss (its default loss);
* ``"inside"`` (b): the loss is computed inside the model: ``planned(**batch).loss`` for Hugging
  Face models with labels, the loss dict summed for torchvision detection, and for the others a
  :class:`WithLoss` module (``forward(x, y) -> crit(model(x), y)``) is what is planned;
* ``"loss_fn"`` (c): ``loss_fn(model, batch)`` is passed to ``auto``; the step is
  ``loss_fn(planned, batch).backward(); opt.step()``.

The budget lies between the least total peak ``auto`` can plan for (the minimum its
``BudgetTooSmallError`` names) and the eager step's measured peak. A case passes when the
planned model's gradients equal eager's (same weights and random numbers, ``torch.allclose``), its
buffers (batch-norm running statistics) are updated as eager updates them, and its measured
whole-step peak (:func:`remat.measure.events.step_peak_bytes`, allocator events, SGD with momentum)
is within the budget. Each record names the path ``auto`` took (a chain of N stages or a graph
of N nodes), the memory ratio (measured peak / eager measured peak) and, when timed, the time
ratio. Beside each model, :func:`every_block_peak` measures what checkpointing every block
reaches (Hugging Face ``gradient_checkpointing_enable()``, else ``torch.utils.checkpoint``
around each block the entry names): remat must reach as low.

``python benchmarks/conformance.py`` writes ``docs/results/conformance/conformance.{json,md}``;
``tests/test_conformance.py`` runs the three loop shapes at one (rotated) budget per model.
"""

from __future__ import annotations

import contextlib
import json
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.bench.suites import machine_info
from remat.capture.stages import UnsupportedModelError
from remat.core.chain import Chain
from remat.core.units import format_bytes
from remat.measure.events import interleaved_times, median_ratio, step_peak_bytes
from remat.planners import BudgetTooSmallError

__all__ = [
    "LOOPS",
    "MODELS",
    "ModelEntry",
    "Record",
    "WithLoss",
    "build",
    "every_block_peak",
    "run_case",
    "run_model",
    "main",
]

LOOPS = ("held", "inside", "loss_fn")
"""The three loop shapes: (a) output held to the end of the step, (b) loss inside the model,
(c) ``loss_fn`` passed to ``remat.auto``."""

AUTO_LOOP = {"held": "output-held", "inside": "loss-only", "loss_fn": "loss-only"}
"""The ``loop=`` each shape tells :func:`remat.auto`: (b) and (c) keep only the loss."""

GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-6
COMPILED_GRAD_TOL = (1e-4, 1e-5)
"""``(rtol, atol)`` of a compiled case against eager (tests/test_compile.py's: compiled kernels
sum in another order)."""
BUDGET_SLACK = 1.001
"""A measured peak within 0.1% of the budget counts as within it (tests/test_auto.py: the
checkpoint machinery's own few KiB)."""


# ---------------------------------------------------------------------- the registry
@dataclass
class Built:
    """A freshly built model and its batch, split the three ways the loop shapes need."""

    model: nn.Module
    inputs: Any
    """What the model is called with in loop (a): a dict (``model(**inputs)``), a tuple
    (``model(*inputs)``) or a tensor."""
    target: Any
    """What ``crit(out, target)`` compares the output with."""
    crit: Callable[[Any, Any], torch.Tensor]
    labelled: Any = None
    """Loop (b)'s batch when the model computes its own loss (HF ``labels``, detection
    targets); None: a :class:`WithLoss` module is planned instead."""
    own_loss: Callable[[Any], torch.Tensor] | None = None
    """Loss from the model's output in loop (b) (default: ``out.loss``)."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    family: str
    make: Callable[[], Built]
    blocks: Callable[[nn.Module], list[nn.Module]] | None = None
    """The blocks that "checkpoint every block" wraps (None: HF gradient checkpointing)."""
    description: str = ""


def call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple | list):
        return model(*inputs)
    return model(inputs)


class WithLoss(nn.Module):
    """``forward(inputs..., target) -> crit(model(inputs...), target)``: loop (b) for a model
    that does not compute its own loss."""

    def __init__(self, model: nn.Module, crit: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.crit = crit

    def forward(self, x: Any, target: Any) -> torch.Tensor:
        return self.crit(self.model(x), target)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ce(out: Any, y: torch.Tensor) -> torch.Tensor:
    if isinstance(out, Mapping) and "out" in out:  # torchvision segmentation
        out = out["out"]
    logits = getattr(out, "logits", out)
    if logits.dim() == 3:  # tokens: (batch, seq, vocab) against (batch, seq)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return F.cross_entropy(logits, y)


def _seg_ce(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out["out"] if isinstance(out, Mapping) else out, y)


def _sum_losses(out: Any, _y: Any = None) -> torch.Tensor:
    return sum(out.values())  # type: ignore[return-value]


# --- Hugging Face
def _hf(cls_name: str, config_name: str, **config: Any) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_name)(**config)
    if hasattr(cfg, "_attn_implementation"):
        cfg._attn_implementation = "eager"
    return getattr(transformers, cls_name)(cfg).train()


VOCAB, SEQ, BATCH = 128, 32, 2
LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _tokens(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seq), generator=_gen())


def _causal_lm(cls_name: str, config_name: str, **config: Any) -> Callable[[], Built]:
    def make() -> Built:
        model = _hf(cls_name, config_name, **config)
        ids = _tokens()
        return Built(model, {"input_ids": ids}, ids, _ce, {"input_ids": ids, "labels": ids})

    return make


def _seq_cls(cls_name: str, config_name: str, **config: Any) -> Callable[[], Built]:
    def make() -> Built:
        model = _hf(cls_name, config_name, num_labels=3, **config)
        ids = _tokens()
        y = torch.randint(0, 3, (BATCH,), generator=_gen(1))
        return Built(model, {"input_ids": ids}, y, _ce, {"input_ids": ids, "labels": y})

    return make


def _t5() -> Built:
    model = _hf(
        "T5ForConditionalGeneration",
        "T5Config",
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    ids, labels = _tokens(), _tokens(16)
    dec = model._shift_right(labels)
    return Built(
        model,
        {"input_ids": ids, "decoder_input_ids": dec},
        labels,
        _ce,
        {"input_ids": ids, "labels": labels},
    )


def _hf_image(cls_name: str, config_name: str, size: int, **config: Any) -> Callable[[], Built]:
    def make() -> Built:
        model = _hf(cls_name, config_name, num_labels=3, image_size=size, **config)
        x, y = _images(size, classes=3)
        return Built(model, {"pixel_values": x}, y, _ce, {"pixel_values": x, "labels": y})

    return make


def _lora() -> Built:
    import peft

    built = _causal_lm("LlamaForCausalLM", "LlamaConfig", **LLAMA_LIKE)()
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
    )
    built.model = peft.get_peft_model(built.model, config).train()
    return built


# --- vision (timm / torchvision)
IMG = 32


def _images(
    size: int = IMG, batch: int = BATCH, classes: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, 3, size, size, generator=_gen())
    return x, torch.randint(0, classes, (batch,), generator=_gen(1))


def _classifier(
    factory: Callable[[], nn.Module], size: int = IMG, batch: int = BATCH
) -> Callable[[], Built]:
    """A classifier on ``batch`` images of ``size``²; CNNs get 64² x 8 so that activations,
    not parameters, make most of the step's peak (else no budget lies between the least
    plannable peak and the eager one)."""

    def make() -> Built:
        torch.manual_seed(0)
        model = factory().train()
        x, y = _images(size, batch)
        return Built(model, x, y, _ce)

    return make


def _timm(name: str, **kw: Any) -> Callable[[], nn.Module]:
    def factory() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, **kw)

    return factory


def _tv(name: str, **kw: Any) -> Callable[[], nn.Module]:
    def factory() -> nn.Module:
        import torchvision

        return torchvision.models.get_model(name, weights=None, **kw)

    return factory


def _tv_convnext() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt(
        [CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)],
        num_classes=10,
    )


def _tv_swin() -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        patch_size=[4, 4],
        embed_dim=16,
        depths=[1, 1],
        num_heads=[1, 2],
        window_size=[4, 4],
        num_classes=10,
    )


def _tv_efficientnet() -> nn.Module:
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    setting = [
        MBConvConfig(1, 3, 1, 16, 16, 1),
        MBConvConfig(4, 3, 2, 16, 24, 2),
        MBConvConfig(4, 5, 2, 24, 32, 1),
    ]
    return EfficientNet(
        setting, dropout=0.0, stochastic_depth_prob=0.0, num_classes=10, last_channel=64
    )


def _tv_regnet() -> nn.Module:
    from torchvision.models.regnet import BlockParams, RegNet

    params = BlockParams.from_init_params(depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8)
    return RegNet(params, num_classes=10, stem_width=16)


def _tiny_mobilenet_v3(dilated: bool = False) -> nn.Module:
    from functools import partial

    from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3

    cfg = partial(InvertedResidualConfig, width_mult=1.0)
    d = 2 if dilated else 1
    setting = [
        cfg(16, 3, 16, 16, True, "RE", 2, 1),
        cfg(16, 3, 48, 24, False, "RE", 2, 1),
        cfg(24, 3, 64, 24, False, "RE", 1, 1),
        cfg(24, 5, 72, 32, True, "HS", 2, 1),
        cfg(32, 5, 96, 32, True, "HS", 1, d),
    ]
    return MobileNetV3(setting, last_channel=128, num_classes=10)


def _tv_resnet10() -> nn.Module:
    """torchvision's ResNet with one BasicBlock per stage (resnet18 has two): at 64² x 8,
    resnet18's 11 M parameters make most of the step (auto's least plannable peak lies above
    the eager step's measured one, docs/results/conformance/FINDINGS.md)."""
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


def _tv_resnet_frozen() -> nn.Module:
    model = _tv_resnet10()
    for module in (model.conv1, model.bn1, model.layer1):
        module.requires_grad_(False)
    return model


def _lraspp() -> Built:

    torch.manual_seed(0)
    from torchvision.models.segmentation.lraspp import _lraspp_mobilenetv3

    # lraspp_mobilenet_v3_large's head on a 5-block MobileNetV3 (the stock backbone's 139-node
    # graph takes the MILP over a minute)
    model = _lraspp_mobilenetv3(_tiny_mobilenet_v3(dilated=True), num_classes=3).train()
    x = torch.randn(BATCH, 3, 64, 64, generator=_gen())
    y = torch.randint(0, 3, (BATCH, 64, 64), generator=_gen(1))
    return Built(model, x, y, _seg_ce)


def _fasterrcnn() -> Built:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None,
        weights_backbone=None,
        min_size=64,
        max_size=64,
        rpn_pre_nms_top_n_train=200,
        rpn_post_nms_top_n_train=100,
        box_batch_size_per_image=64,
    )
    # small box head (the stock one is a 12.8M-parameter MLP), 3 classes
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead

    channels = model.backbone.out_channels
    model.roi_heads.box_head = TwoMLPHead(channels * 7 * 7, 64)
    model.roi_heads.box_predictor = FastRCNNPredictor(64, 3)
    model.train()
    g = _gen()
    images = [torch.rand(3, 64, 64, generator=g) for _ in range(BATCH)]
    targets = [
        {"boxes": torch.tensor([[4.0, 6.0, 30.0, 40.0]]), "labels": torch.tensor([1])},
        {"boxes": torch.tensor([[10.0, 10.0, 50.0, 60.0]]), "labels": torch.tensor([2])},
    ]
    return Built(model, (images, targets), None, _sum_losses, (images, targets), _sum_losses)


# --- "checkpoint every block": the blocks per model
def _attr_list(*paths: str) -> Callable[[nn.Module], list[nn.Module]]:
    def blocks(model: nn.Module) -> list[nn.Module]:
        out: list[nn.Module] = []
        for path in paths:
            out.extend(model.get_submodule(path))
        return out

    return blocks


def _resnet_blocks(model: nn.Module) -> list[nn.Module]:
    return [b for name in ("layer1", "layer2", "layer3", "layer4") for b in getattr(model, name)]


def _children_of(path: str) -> Callable[[nn.Module], list[nn.Module]]:
    def blocks(model: nn.Module) -> list[nn.Module]:
        return list(model.get_submodule(path).children())

    return blocks


def _nested(path: str) -> Callable[[nn.Module], list[nn.Module]]:
    """The grandchildren of ``path`` (stages of blocks: ConvNeXt, Swin, EfficientNet)."""

    def blocks(model: nn.Module) -> list[nn.Module]:
        out: list[nn.Module] = []
        from torchvision.ops.misc import ConvNormActivation

        for child in model.get_submodule(path).children():
            kids = list(child.children())
            # a stage of blocks, not a conv-norm-activation (whose in-place activation cannot
            # be checkpointed apart from its norm)
            if isinstance(child, nn.Sequential) and not isinstance(child, ConvNormActivation):
                out.extend(kids)
            else:
                out.append(child)
        return out

    return blocks


BERT_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)

MODELS: dict[str, ModelEntry] = {
    e.name: e
    for e in [
        # decoder language models (HF, loss from labels)
        ModelEntry(
            "hf-gpt2",
            "decoder LM",
            _causal_lm(
                "GPT2LMHeadModel",
                "GPT2Config",
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=2,
                n_positions=64,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            ),
        ),
        ModelEntry(
            "hf-llama", "decoder LM", _causal_lm("LlamaForCausalLM", "LlamaConfig", **LLAMA_LIKE)
        ),
        ModelEntry(
            "hf-mistral",
            "decoder LM",
            _causal_lm("MistralForCausalLM", "MistralConfig", **LLAMA_LIKE),
        ),
        ModelEntry(
            "hf-qwen2", "decoder LM", _causal_lm("Qwen2ForCausalLM", "Qwen2Config", **LLAMA_LIKE)
        ),
        ModelEntry(
            "hf-opt",
            "decoder LM",
            _causal_lm(
                "OPTForCausalLM",
                "OPTConfig",
                vocab_size=VOCAB,
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=64,
                word_embed_proj_dim=32,
                dropout=0.0,
                attention_dropout=0.0,
            ),
        ),
        # encoders
        ModelEntry(
            "hf-bert",
            "encoder",
            _seq_cls("BertForSequenceClassification", "BertConfig", **BERT_LIKE),
        ),
        ModelEntry(
            "hf-roberta",
            "encoder",
            _seq_cls(
                "RobertaForSequenceClassification", "RobertaConfig", **BERT_LIKE, pad_token_id=1
            ),
        ),
        ModelEntry(
            "hf-distilbert",
            "encoder",
            _seq_cls(
                "DistilBertForSequenceClassification",
                "DistilBertConfig",
                vocab_size=VOCAB,
                dim=32,
                n_layers=2,
                n_heads=4,
                hidden_dim=64,
                max_position_embeddings=64,
                dropout=0.0,
                attention_dropout=0.0,
                seq_classif_dropout=0.0,
            ),
        ),
        # encoder-decoder
        ModelEntry("hf-t5", "encoder-decoder", _t5),
        # vision transformers
        ModelEntry(
            "hf-vit",
            "vision transformer",
            _hf_image(
                "ViTForImageClassification",
                "ViTConfig",
                32,
                patch_size=4,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            ),
        ),
        ModelEntry(
            "hf-swin",
            "swin",
            _hf_image(
                "SwinForImageClassification",
                "SwinConfig",
                32,
                patch_size=4,
                embed_dim=16,
                depths=[1, 1],
                num_heads=[1, 2],
                window_size=4,
                drop_path_rate=0.0,
            ),
        ),
        ModelEntry(
            "timm-vit",
            "vision transformer",
            _classifier(
                _timm(
                    "vit_tiny_patch16_224",
                    img_size=32,
                    patch_size=4,
                    embed_dim=32,
                    depth=2,
                    num_heads=2,
                )
            ),
            _attr_list("blocks"),
        ),
        ModelEntry(
            "timm-swin",
            "swin",
            _classifier(
                _timm(
                    "swin_tiny_patch4_window7_224",
                    img_size=32,
                    window_size=4,
                    embed_dim=16,
                    depths=(1, 1),
                    num_heads=(1, 2),
                )
            ),
            lambda m: [b for layer in m.layers for b in layer.blocks],
        ),
        # CNNs
        ModelEntry("timm-resnet", "CNN", _classifier(_timm("resnet10t"), 64, 8), _resnet_blocks),
        ModelEntry(
            "timm-convnext",
            "CNN",
            _classifier(_timm("convnext_atto", depths=(1, 1, 1, 1), dims=(16, 32, 64, 128)), 64, 8),
            lambda m: [b for s in m.stages for b in s.blocks],
        ),
        ModelEntry("tv-resnet10", "CNN", _classifier(_tv_resnet10, 64, 8), _resnet_blocks),
        ModelEntry(
            "tv-mobilenet_v3_small",
            "CNN",
            _classifier(_tv("mobilenet_v3_small", num_classes=10), 64, 8),
            _children_of("features"),
        ),
        ModelEntry(
            "tv-efficientnet",
            "CNN",
            _classifier(_tv_efficientnet, 64, 8),
            _nested("features"),
        ),
        ModelEntry("tv-convnext", "CNN", _classifier(_tv_convnext, 64, 8), _nested("features")),
        ModelEntry(
            "tv-regnet",
            "CNN",
            _classifier(_tv_regnet, 64, 8),
            _nested("trunk_output"),
        ),
        ModelEntry("tv-swin", "swin", _classifier(_tv_swin), _nested("features")),
        # segmentation and detection
        ModelEntry(
            "tv-lraspp_mobilenet_v3",
            "segmentation",
            _lraspp,
            _children_of("backbone"),
        ),
        ModelEntry(
            "tv-fasterrcnn_mobilenet_v3_fpn",
            "detection",
            _fasterrcnn,
            _children_of("backbone.body"),
        ),
        # fine-tuning
        ModelEntry("peft-lora-llama", "fine-tuning (LoRA)", _lora),
        ModelEntry(
            "tv-resnet10-frozen",
            "fine-tuning (frozen layers)",
            _classifier(_tv_resnet_frozen, 64, 8),
            _resnet_blocks,
        ),
        # found in session 38, each with a capture fault (tests/test_carried_grads.py): BLOOM's
        # training GeLU is a custom autograd.Function; DeBERTa hands every block a relative
        # embedding that requires grad
        ModelEntry(
            "hf-bloom",
            "decoder LM",
            _causal_lm(
                "BloomForCausalLM",
                "BloomConfig",
                vocab_size=VOCAB,
                hidden_size=32,
                n_layer=2,
                n_head=4,
                hidden_dropout=0.1,
                attention_dropout=0.1,
            ),
        ),
        ModelEntry(
            "hf-deberta",
            "encoder",
            _seq_cls(
                "DebertaV2ForSequenceClassification",
                "DebertaV2Config",
                **BERT_LIKE,
                relative_attention=True,
                pos_att_type=["p2c", "c2p"],
                max_relative_positions=16,
            ),
        ),
    ]
}


def build(name: str, dropout: bool = True) -> Built:
    """``MODELS[name]`` built afresh; ``dropout=False`` sets every dropout module's ``p`` to 0.
    Compiled cases keep dropout on (:func:`eager_random`): remat keeps the partitioner from
    drawing fresh masks (pytorch/pytorch#190758; torch.compile@0.5 alone moved MobileNetV3's
    gradients by 0.033)."""
    built = MODELS[name].make()
    if not dropout:
        for m in built.model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.p = 0.0
    return built


# ---------------------------------------------------------------------- one case
@dataclass
class Record:
    model: str
    loop: str
    budget_fraction: float | None
    status: str = "pass"
    """``pass``, ``fail`` (a broken promise), ``error`` (an exception) or ``refused`` (remat
    refused the model with its own error)."""
    path: str = ""
    budget_bytes: int | None = None
    least_bytes: int | None = None
    eager_peak_bytes: int | None = None
    peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    memory_ratio: float | None = None
    time_ratio: float | None = None
    max_grad_abs_diff: float | None = None
    compile_grad_abs_diff: float | None = None
    """Compiled cases whose gradients missed eager's at :data:`COMPILED_GRAD_TOL`: the largest
    difference of ``torch.compile(model)``'s own (same backend, unplanned) from eager's
    (:func:`compiled_grads_agree`)."""
    buffers_equal: bool | None = None
    every_block_peak_bytes: int | None = None
    violations: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0


class Loop:
    """One loop shape on one built model: the module that is planned, the batch ``auto`` sees,
    its ``loss_fn``, the step's loss, and ``data``: the batch tensors counted as the step's
    persistent bytes when it is measured (those ``auto`` sees: the batch, and in loop (c) the
    target ``loss_fn`` reads, which the capture counts; in loop (a) the criterion's target lies
    outside what ``auto`` is given)."""

    def __init__(self, built: Built, shape: str) -> None:
        self.built, self.shape = built, shape
        self.module: nn.Module = built.model
        self.loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
        if shape == "held":
            self.batch = built.inputs
        elif shape == "inside":
            if built.labelled is not None:
                self.batch = built.labelled
            else:
                self.module = WithLoss(built.model, built.crit)
                self.batch = (built.inputs, built.target)
        elif shape == "loss_fn":
            self.batch = built.inputs

            def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
                return built.crit(call(model, batch), built.target)

            self.loss_fn = loss_fn
        else:
            raise ValueError(f"loop shape {shape!r}: one of {LOOPS}")
        self.data: Any = (self.batch, built.target) if shape == "loss_fn" else self.batch

    def step_loss(self, module: nn.Module) -> tuple[Any, torch.Tensor]:
        """``(what the step holds, loss)`` for ``module`` (the planned or the eager one)."""
        if self.shape == "held":
            out = call(module, self.batch)
            return out, self.built.crit(out, self.built.target)
        if self.shape == "inside":
            out = call(module, self.batch)
            if isinstance(out, torch.Tensor):
                return None, out
            own = self.built.own_loss
            return None, own(out) if own is not None else out.loss
        assert self.loss_fn is not None
        return None, self.loss_fn(module, self.batch)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def _step_fn(loop: Loop, module: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
    def step() -> None:
        held, loss = loop.step_loss(module)  # noqa: F841 (held to the end of the step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _measure(loop: Loop, module: nn.Module, opt: torch.optim.Optimizer) -> int:

    return step_peak_bytes(_step_fn(loop, module, opt), module, opt, loop.data)


def _grads_and_buffers(
    loop: Loop, module: nn.Module, params: list[nn.Parameter], buffers: list[torch.Tensor]
) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    for p in params:
        p.grad = None
    torch.manual_seed(1234)
    _, loss = loop.step_loss(module)
    loss.backward()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    return grads, [b.detach().clone() for b in buffers]


def _auto(
    loop: Loop,
    budget: int | None,
    opt: torch.optim.Optimizer,
    compile: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, Any]:

    if compile is not None:
        torch._dynamo.reset()  # (each case compiles afresh: no graph of another case is reused)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return remat.auto(
            loop.module,
            loop.batch,
            loss_fn=loop.loss_fn,
            budget=budget,
            optimizer=opt,
            loop=AUTO_LOOP[loop.shape],
            compile=compile or False,
        )


def _path(summary: Any) -> str:

    if isinstance(summary.chain, Chain):
        return f"chain of {summary.chain.n} stages"
    return f"graph of {len(summary.chain.nodes)} nodes"


def eager_random(compile: Mapping[str, Any] | None) -> contextlib.AbstractContextManager[Any]:
    """Where a case runs compiled (``compile``: torch.compile's keyword arguments), inductor's
    ``fallback_random``: compiled code draws eager's random numbers, so a compiled step with
    dropout is compared with eager's gradients as an eager one is (aot_eager runs eager's ops
    anyway)."""
    if compile is None:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(fallback_random=True)


def _least(name: str, shape: str, compile: Mapping[str, Any] | None = None) -> int:
    """The least total peak ``auto`` plans for (the minimum its BudgetTooSmallError names)."""

    loop = Loop(build(name), shape)
    try:
        with eager_random(compile):
            _auto(loop, 1, _optimizer(loop.built.model), compile=compile)
    except BudgetTooSmallError as err:
        return int(err.minimum_bytes)
    raise AssertionError("remat.auto accepted a budget of 1 byte")


def eager_peak(name: str, shape: str, dropout: bool = True) -> int:
    """The eager (unplanned) step's measured peak for this loop shape."""
    loop = Loop(build(name, dropout), shape)
    return _measure(loop, loop.module, _optimizer(loop.built.model))


def _is_refusal(err: BaseException) -> bool:

    if isinstance(err, UnsupportedModelError | BudgetTooSmallError):  # remat's own refusals
        return True
    return isinstance(err, TypeError) and ("remat" in str(err) or "loss_fn" in str(err))


def _error_text(err: BaseException) -> str:
    tb = traceback.extract_tb(err.__traceback__)
    where = f" (at {tb[-1].filename.split('/site-packages/')[-1]}:{tb[-1].lineno})" if tb else ""
    return f"{type(err).__name__}: {err}"[:1500] + where


def run_case(
    name: str,
    shape: str,
    fraction: float | None = 0.5,
    *,
    budget: int | None = None,
    eager: int | None = None,
    least: int | None = None,
    timed: bool = False,
    compile: Mapping[str, Any] | None = None,
) -> Record:
    """Train ``MODELS[name]`` through ``remat.auto`` with loop ``shape`` at the budget
    ``least + fraction * (eager - least)`` (or ``budget`` when given); returns its record.
    ``compile``: ``auto``'s (torch.compile's keyword arguments): the gradients are then
    compared at :data:`COMPILED_GRAD_TOL`, and a compiled least above the eager peak is no
    broken promise (inductor's CNNs hold more than eager on the CPU); dropout stays on, with
    eager's random numbers (:func:`eager_random`)."""
    with eager_random(compile):
        return _run_case(name, shape, fraction, budget, eager, least, timed, compile)


def _run_case(
    name: str,
    shape: str,
    fraction: float | None,
    budget: int | None,
    eager: int | None,
    least: int | None,
    timed: bool,
    compile: Mapping[str, Any] | None,
) -> Record:
    start = time.perf_counter()
    record = Record(name, shape, fraction)
    stage = "eager peak"
    try:
        record.eager_peak_bytes = eager = eager if eager is not None else eager_peak(name, shape)
        if budget is None:
            stage = "least peak (auto at a 1-byte budget)"
            record.least_bytes = least = (
                least if least is not None else _least(name, shape, compile)
            )
            assert fraction is not None
            budget = int(least + fraction * max(0, eager - least))
            if least >= eager and compile is None:
                record.violations.append(
                    f"least plannable peak {least} >= eager measured peak {eager}"
                )
        record.budget_bytes = budget
        stage = "gradients of the eager step"
        built = build(name)
        loop = Loop(built, shape)
        params = list(built.model.parameters())
        buffers = list(loop.module.buffers())
        saved = [b.detach().clone() for b in buffers]
        ref_grads, ref_buffers = _grads_and_buffers(loop, loop.module, params, buffers)
        with torch.no_grad():
            for b, s in zip(buffers, saved, strict=True):
                b.copy_(s)
        opt = _optimizer(built.model)
        stage = "remat.auto"
        planned, summary = _auto(loop, budget, opt, compile=compile)
        record.path = _path(summary)
        record.predicted_peak_bytes = int(summary.predicted_peak_bytes)
        stage = "gradients of the planned step"
        grads, new_buffers = _grads_and_buffers(loop, planned, params, buffers)
        compiled_grads: list[torch.Tensor | None] = []

        def compiled_reference(i: int) -> torch.Tensor | None:
            # where remat's compiled gradients miss eager's: torch.compile(model)'s own, made
            # once (compiled kernels sum in another order: compiled_grads_agree)
            nonlocal stage
            if not compiled_grads:
                stage = "gradients of torch.compile(model)"
                unplanned = build(name)
                u_loop = Loop(unplanned, shape)
                torch._dynamo.reset()
                compiled_grads.extend(
                    _grads_and_buffers(
                        u_loop,
                        torch.compile(u_loop.module, **(compile or {})),
                        list(unplanned.model.parameters()),
                        [],
                    )[0]
                )
                record.compile_grad_abs_diff = max(
                    (
                        float((u - r).abs().max())
                        for u, r in zip(compiled_grads, ref_grads, strict=True)
                        if u is not None and r is not None
                    ),
                    default=0.0,
                )
            return compiled_grads[i]

        diff = 0.0
        for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
            if (g is None) != (r is None):
                record.violations.append(
                    f"parameter {i}: gradient {'missing' if g is None else 'unexpected'}"
                )
            elif g is not None and r is not None:
                off = float((g - r).abs().max())
                diff = max(diff, off)
                if compile is None:
                    ok = torch.allclose(g, r, rtol=GRAD_RTOL, atol=GRAD_ATOL)
                else:
                    ok = compiled_grads_agree(g, r, None) or compiled_grads_agree(
                        g, r, compiled_reference(i)
                    )
                if not ok:
                    u = compiled_grads[i] if compiled_grads else None
                    own = (
                        "" if u is None else f" (torch.compile's own by {(u - r).abs().max():.3g})"
                    )
                    record.violations.append(f"parameter {i}: gradient differs by {off:.3g}{own}")
        record.max_grad_abs_diff = diff
        record.buffers_equal = all(
            _buffers_agree(a, b, compiled=compile is not None)
            for a, b in zip(new_buffers, ref_buffers, strict=True)
        )
        if not record.buffers_equal:
            record.violations.append("buffers (batch-norm statistics) differ from eager's")
        stage = "measured peak of the planned step"
        record.peak_bytes = _measure(loop, planned, opt)
        record.memory_ratio = record.peak_bytes / eager
        if record.peak_bytes > BUDGET_SLACK * budget:
            record.violations.append(
                f"measured peak {record.peak_bytes} > budget {budget} "
                f"(predicted {record.predicted_peak_bytes})"
            )
        if timed:
            eager_built = build(name)
            eager_loop = Loop(eager_built, shape)
            times = interleaved_times(
                {
                    "remat": _step_fn(loop, planned, opt),
                    "eager": _step_fn(eager_loop, eager_loop.module, _optimizer(eager_built.model)),
                },
                repeats=5,
            )
            record.time_ratio = median_ratio(times, "remat", "eager")
        record.status = "fail" if record.violations else "pass"
    except Exception as err:  # noqa: BLE001 (the record carries it)
        record.status = "refused" if _is_refusal(err) else "error"
        record.error = f"[{stage}] {_error_text(err)}"
    record.seconds = time.perf_counter() - start
    return record


def compiled_grads_agree(
    got: torch.Tensor, eager: torch.Tensor, compiled: torch.Tensor | None
) -> bool:
    """A compiled case's gradient ``got`` is right: within :data:`COMPILED_GRAD_TOL` of eager's,
    or else of ``compiled`` (``torch.compile``'s own, unplanned, same backend) where that one
    differs from eager's by at least as much (inductor's convolutions and batch norm on the CPU:
    ResNet-10's gradients 2.8e-4 from eager's under torch.compile alone, remat's 8.9e-7 from
    torch.compile's). A gradient further from eager's than torch.compile's own is wrong."""
    rtol, atol = COMPILED_GRAD_TOL
    if torch.allclose(got, eager, rtol=rtol, atol=atol):
        return True
    if compiled is None:
        return False
    return torch.allclose(got, compiled, rtol=rtol, atol=atol) and bool(
        (got - eager).abs().max() <= (compiled - eager).abs().max() * (1 + rtol) + atol
    )


def _buffers_agree(got: torch.Tensor, want: torch.Tensor, compiled: bool) -> bool:
    """Equal; compiled, within :data:`COMPILED_GRAD_TOL` where floating (torch.compile's own
    batch-norm statistics differ from eager's in the last bit: 1.2e-7 on ResNet-10), exactly
    otherwise (``num_batches_tracked``: a second update is 2, not 1)."""
    if not compiled or not got.is_floating_point():
        return torch.equal(got, want)
    rtol, atol = COMPILED_GRAD_TOL
    return torch.allclose(got, want, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------- every block
def _checkpoint_each(blocks: list[nn.Module]) -> None:
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        forward = block.forward

        def wrapped(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = wrapped  # type: ignore[method-assign]


def every_block_peak(name: str, shape: str = "loss_fn") -> tuple[int, str]:
    """Measured peak of the eager step with every block checkpointed, and how it was done."""
    entry = MODELS[name]
    built = build(name)
    if entry.blocks is None:
        model = built.model
        target = model.get_base_model() if hasattr(model, "get_base_model") else model
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        how = "HF gradient_checkpointing_enable()"
    else:
        blocks = entry.blocks(built.model)
        _checkpoint_each(blocks)
        how = f"torch.utils.checkpoint around {len(blocks)} blocks"
    loop = Loop(built, shape)
    return _measure(loop, loop.module, _optimizer(built.model)), how


# ---------------------------------------------------------------------- the matrix
FRACTIONS = (0.1, 0.5, 0.9)


def run_model(
    name: str,
    loops: tuple[str, ...] = LOOPS,
    fractions: tuple[float, ...] = FRACTIONS,
    timed: bool = True,
    progress: Callable[[str], None] | None = None,
    compile: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every loop shape at every budget for one model, and its every-block baseline
    (``compile``: :func:`run_case`'s)."""
    result: dict[str, Any] = {"model": name, "family": MODELS[name].family, "records": []}
    try:
        result["every_block_peak_bytes"], result["every_block"] = every_block_peak(name)
    except Exception as err:  # noqa: BLE001
        result["every_block_error"] = _error_text(err)
    for shape in loops:
        try:
            eager = eager_peak(name, shape)
        except Exception as err:  # noqa: BLE001
            rec = Record(name, shape, None, status="error", error=f"[eager] {_error_text(err)}")
            result["records"].append(asdict(rec))
            continue
        least: int | None = None
        try:
            least = _least(name, shape, compile)
        except Exception:  # noqa: BLE001 (run_case records it)
            least = None
        budgets: list[tuple[float | None, int | None]] = [(f, None) for f in fractions]
        if shape == "loss_fn" and "every_block_peak_bytes" in result:
            budgets.append((None, result["every_block_peak_bytes"]))  # reach as low
        for fraction, budget in budgets:
            rec = run_case(
                name,
                shape,
                fraction,
                budget=budget,
                eager=eager,
                least=least,
                timed=timed,
                compile=compile,
            )
            if budget is not None:
                rec.least_bytes = least
                rec.every_block_peak_bytes = budget
            if progress:
                progress(
                    f"{name:32s} {shape:8s} {fraction if fraction is not None else 'ckpt':>5} "
                    f"{rec.status:7s} {rec.path:22s} "
                    f"{'' if rec.memory_ratio is None else f'{rec.memory_ratio:.3f}'} "
                    f"{'; '.join(rec.violations)[:100]} {rec.error[:200]}"
                )
            result["records"].append(asdict(rec))
    return result


def _bytes(n: int | None) -> str:

    return "-" if n is None else format_bytes(n)


def _summary(results: list[dict[str, Any]]) -> list[str]:
    """One line per model: the path, the eager and every-block peaks, the lowest peak remat
    measured within its budget, and how many cases passed."""
    lines = [
        "| model | family | path | eager peak (loss_fn) | every block | remat's lowest "
        "(loss_fn, within budget) | remat / eager | every block / eager | cases passed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        recs = res["records"]
        paths = sorted({r["path"] for r in recs if r["path"]})
        eager = next((r["eager_peak_bytes"] for r in recs if r["loop"] == "loss_fn"), None)
        passed = [r for r in recs if r["status"] == "pass"]
        # the loss_fn loop, where the every-block baseline is measured too
        low = min((r["peak_bytes"] for r in passed if r["loop"] == "loss_fn"), default=None)
        block = res.get("every_block_peak_bytes")
        ratio = "-" if not (low and eager) else f"{low / eager:.3f}"
        block_ratio = "-" if not (block and eager) else f"{block / eager:.3f}"
        lines.append(
            f"| {res['model']} | {res['family']} | {', '.join(paths) or '-'} | {_bytes(eager)} | "
            f"{_bytes(block)} | {_bytes(low)} | {ratio} | {block_ratio} | "
            f"{len(passed)}/{len(recs)} |"
        )
    return lines + [""]


def markdown(results: list[dict[str, Any]], machine: dict[str, Any], seconds: float) -> str:
    lines = [
        "# Conformance: any model, planned before it runs",
        "",
        f"Measured {machine['date']} on {machine['device']} ({machine.get('cpus')} CPUs, "
        f"{machine['threads']} torch threads), torch {machine['torch']}; the run took "
        f"{seconds:.0f} s. Written by `benchmarks/conformance.py` "
        "(`remat.bench.conformance`); the failures are discussed in docs/results/conformance/FINDINGS.md.",
        "",
        *(
            [
                f"**Compiled**: every case runs `remat.auto(..., compile={{'backend': "
                f"'{machine['compile']}'}})`; gradients against eager's at rtol "
                f"{COMPILED_GRAD_TOL[0]}, atol {COMPILED_GRAD_TOL[1]}, or where they miss "
                "them, against `torch.compile(model)`'s own (same backend, unplanned) at that "
                "tolerance and no further from eager's than those.",
                "",
            ]
            if machine.get("compile")
            else []
        ),
        "Each model is trained through `remat.auto` with three loop shapes — **held** (output "
        "held to the end of the step, auto's default loss), **inside** (loss computed inside "
        "the model: HF `labels`, detection's loss dict, else a `WithLoss` module), **loss_fn** "
        "(passed to auto) — at budgets 10 %, 50 % and 90 % of the way from the least peak "
        "auto can plan for (the minimum its BudgetTooSmallError names) to the eager step's "
        "measured peak; `ckpt` rows use the budget that checkpointing every block reaches "
        "(remat must reach as low; HF `gradient_checkpointing_enable()`, else "
        "`torch.utils.checkpoint` around each block). Peaks are whole-step (SGD with "
        "momentum), exact, from the allocator's events. *ratio* = measured peak / eager "
        "measured peak; *time ratio* = median step time / eager's, interleaved (tiny models: "
        "overhead-bound). A row passes when the gradients equal eager's "
        f"(allclose rtol {GRAD_RTOL}, atol {GRAD_ATOL}), buffers are updated as eager's, and "
        f"the measured peak is within the budget (+{(BUDGET_SLACK - 1) * 100:.1f} %); "
        "*refused* = remat's own error (a budget below its minimum, a dict output without "
        "loss_fn); *error* = any other exception.",
        "",
    ]
    lines += _summary(results)
    counts: dict[str, int] = {}
    for res in results:
        for r in res["records"]:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines += ["Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), ""]
    lines += [
        "| model | every block | loop | budget | status | path | least | budget | eager | "
        "peak | ratio | time ratio | max grad diff | problem |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        ckpt = _bytes(res.get("every_block_peak_bytes"))
        if "every_block_error" in res:
            ckpt = "error"
        for r in res["records"]:
            frac = "ckpt" if r["budget_fraction"] is None else f"{r['budget_fraction']:.1f}"
            problem = "; ".join(r["violations"]) or r["error"]
            problem = problem.replace("|", "/").replace("\n", " ")
            if len(problem) > 200:
                problem = problem[:197] + "..."
            ratio = "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.3f}"
            timing = "-" if r["time_ratio"] is None else f"{r['time_ratio']:.2f}"
            diff = "-" if r["max_grad_abs_diff"] is None else f"{r['max_grad_abs_diff']:.1e}"
            if r.get("compile_grad_abs_diff") is not None:
                diff += f" (torch.compile's own: {r['compile_grad_abs_diff']:.1e})"
            lines.append(
                f"| {res['model']} | {ckpt} | {r['loop']} | {frac} | {r['status']} | "
                f"{r['path']} | {_bytes(r['least_bytes'])} | {_bytes(r['budget_bytes'])} | "
                f"{_bytes(r['eager_peak_bytes'])} | {_bytes(r['peak_bytes'])} | {ratio} | "
                f"{timing} | {diff} | {problem} |"
            )
    lines.append("")
    errors = {
        res["model"]: res["every_block_error"] for res in results if "every_block_error" in res
    }
    if errors:
        lines += ["Every-block baseline errors:", ""]
        lines += [f"- {m}: {e}" for m, e in errors.items()]
        lines.append("")
    hows = {res["model"]: res.get("every_block", "") for res in results}
    lines += ["Every-block baselines: " + "; ".join(f"{m}: {h}" for m, h in hows.items() if h), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    parser.add_argument("--loops", default=",".join(LOOPS))
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    parser.add_argument("--no-time", action="store_true", help="skip the time ratios")
    parser.add_argument("--out", default="docs/results/conformance")
    parser.add_argument(
        "--compile",
        default="",
        help="a torch.compile backend: remat.auto(..., compile={'backend': it}) in every case",
    )
    parser.add_argument(
        "--markdown-only", action="store_true", help="rewrite OUT/conformance.md from its JSON"
    )
    args = parser.parse_args(argv)
    if args.markdown_only:
        saved = json.loads((Path(args.out) / "conformance.json").read_text())
        text = markdown(saved["results"], saved["machine"], saved["seconds"])
        (Path(args.out) / "conformance.md").write_text(text)
        return 0
    names = [n for n in args.models.split(",") if n] or list(MODELS)
    loops = tuple(s for s in args.loops.split(",") if s)
    fractions = tuple(float(f) for f in args.fractions.split(",") if f)
    torch.set_num_threads(1)
    start = time.perf_counter()
    results = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        results.append(
            run_model(
                name,
                loops,
                fractions,
                timed=not args.no_time,
                progress=lambda s: print(s, flush=True),
                compile={"backend": args.compile} if args.compile else None,
            )
        )
        seconds = time.perf_counter() - start
        machine = {**machine_info(), "compile": args.compile or None}
        (out / "conformance.json").write_text(
            json.dumps({"machine": machine, "seconds": seconds, "results": results}, indent=1)
        )
        (out / "conformance.md").write_text(markdown(results, machine, seconds))
    return 0
