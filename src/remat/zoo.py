"""Built-in models for the CLI, the tests and the benchmarks: ``zoo.get(name) -> ZooModel``.

Every entry is a freshly built model with random weights (nothing is downloaded), a seeded
example batch of matching shape, and the loss that a training step minimises::

    entry = zoo.get("resnet18", batch_size=4, image_size=64)
    loss = entry.loss_fn(entry.model, entry.batch)

Names:

* any torchvision classification builder (``resnet18``, ``resnet50``, ``vgg11``, ``alexnet``,
  ``mobilenet_v2``, ``densenet121``, ...; ``weights=None``). Options: ``image_size`` (default 64;
  224 for ``maxvit_t``, 299 for ``inception_v3``), ``num_classes`` (default 10). Batch
  ``(images, labels)``, cross-entropy loss.
* ``resnet1001``: the pre-activation bottleneck ResNet of He et al. 2016 ("Identity Mappings in
  Deep Residual Networks") at the 1000-layer depth of Chen et al. 2016's experiment, with an
  ImageNet stem for 224² input. ``depth = 3 * blocks + 2`` (default 1001: 333 bottleneck blocks)
  spread over four stages in the ResNet-200 proportions ``[3, 24, 36, 3]`` used by the authors'
  example (memonger ``example_resnet.py``): ``[15, 121, 182, 15]``. Built as an
  ``nn.Sequential(stem, block, ..., block, head)``: a clean chain. Options: ``depth``,
  ``image_size`` (224), ``num_classes`` (1000), ``width`` (64). Default batch 32 (the paper's);
  its activations take tens of GB: profile it with ``fake=True``.
* ``wrn-28-2``: WideResNet-28-2 for CIFAR-10 (Zagoruyko & Komodakis 2016), pre-activation basic
  blocks, 1,467,610 parameters; ``nn.Sequential(stem, 12 blocks, head)``. Options: ``depth``,
  ``widen``, ``num_classes``, ``image_size`` (32), ``dropout`` (0.0).
* ``gpt2``: ``GPT2LMHeadModel`` from a small ``GPT2Config`` (options ``n_layer=4``,
  ``n_embd=128``, ``n_head=4``, ``vocab_size=1024``, ``seq_len=128``, and any other config field);
  batch ``{"input_ids", "labels"}``; loss: the model's ``.loss``.
* ``llama-tiny``: ``LlamaForCausalLM`` from a small ``LlamaConfig`` (``num_hidden_layers=4``,
  ``hidden_size=128``, ``intermediate_size=256``, ``num_attention_heads=4``,
  ``vocab_size=1024``, ``seq_len=128``).
* ``mlp-chain``: ``nn.Sequential`` of ``layers`` × (Linear ``width``→``width``, GELU), default
  32 × 512 on a ``1024 × 512`` input (shared/peers.md's "chain"), loss: mean square (MSE to 0).
* ``lstm-seq``: ``nn.Sequential`` of ``layers`` modules each wrapping one ``nn.LSTM`` layer
  (batch first), then a head (last time step → Linear); a long sequence (``seq_len=512``,
  ``input_size=32``, ``hidden=128``, ``layers=4``, ``num_classes=10``); cross-entropy loss.
* ``regnet``: torchvision ``regnet_y_400mf`` (Rockmate's RegNet; ``arch`` picks another
  ``regnet_*``) re-wrapped, sharing its modules, as ``nn.Sequential(stem, block, ..., block,
  head)`` (torchvision's ``RegNet.forward`` is stem, trunk, pool, flatten, fc: the same function,
  but not a structure remat detects). Options: ``arch``, ``image_size`` (64), ``num_classes``
  (10). Any torchvision ``regnet_*`` name is also available unwrapped (not a chain).
* ``unet``: a 2-D U-Net (Ronneberger et al. 2015; padded 3x3 convolutions, batch norm, max-pool
  down, transposed-convolution up, concatenated skips), per-pixel cross-entropy against random
  labels. Options: ``depth`` (3 down/up levels), ``width`` (16 channels at the top, doubled per
  level), ``image_size`` (64, a multiple of ``2 ** depth``), ``in_channels`` (3),
  ``num_classes`` (2), ``form``: ``"module"`` (default: :class:`UNet`, whose ``forward`` keeps
  the skips in a list: **not a chain**, :func:`remat.capture` raises ``UnsupportedModelError``;
  :func:`remat.capture.graph.capture_graph` captures it as a graph) or ``"chain"``
  (:func:`unet_chain`: the same modules and function as an ``nn.Sequential`` of stages whose
  activation is the tuple ``(x, skip_1, ..., skip_k)``: the skips ride along the chain).
* ``mlp-mixer``: an MLP-Mixer (Tolstikhin et al. 2021) as ``nn.Sequential(patch embedding,
  block, ..., block, head)``. Options: ``image_size`` (64), ``patch`` (8), ``dim`` (128),
  ``depth`` (8), ``token_hidden`` (64), ``channel_hidden`` (512), ``num_classes`` (10).
* ``package.module:factory``: your own model. The factory is called with the options (and
  ``batch_size`` if it accepts it) and returns an ``nn.Module``, a ``(module, batch)`` pair or a
  :class:`ZooModel`. For a bare module remat makes a batch from its first layer (Linear, Conv,
  Embedding, RNN); return ``(module, batch)`` when that guess is wrong.

Known limitations: batches are random (memory and time depend on shapes only); torchvision
detection/segmentation/video builders are not included.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.core.errors import RematError
from remat.measure.profile import default_loss_fn

__all__ = [
    "ZooModel",
    "get",
    "names",
    "UnknownModelError",
    "BUILTIN",
    "UNet",
    "unet_chain",
    "regnet_chain",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class UnknownModelError(RematError, ValueError):
    """No zoo model or factory by that name (the message lists the names)."""


@dataclass(frozen=True)
class ZooModel:
    """A model with an example batch and the loss of its training step."""

    name: str
    """The name it was asked for."""
    model: nn.Module
    """The model, in training mode, on the CPU, random weights."""
    batch: Any
    """An example batch: a tensor, a tuple of tensors, or a dict of tensors (seeded)."""
    loss_fn: LossFn
    """``loss_fn(model, batch) -> scalar loss`` (see :func:`remat.measure.profile.default_loss_fn`)."""
    description: str
    """One line: what the model is and the batch shape."""


BUILTIN: tuple[str, ...] = (
    "resnet1001",
    "wrn-28-2",
    "gpt2",
    "llama-tiny",
    "mlp-chain",
    "lstm-seq",
    "regnet",
    "unet",
    "mlp-mixer",
)


def names() -> list[str]:
    """The built-in names followed by every torchvision classification builder."""
    return [*BUILTIN, *_torchvision_names()]


def get(name: str, batch_size: int | None = None, seed: int = 0, **options: Any) -> ZooModel:
    """Build the model ``name`` with an example batch of ``batch_size`` (default: per model).

    ``options`` go to the model (see the module docstring). Raises :class:`UnknownModelError`
    for an unknown name (listing the names) and ``TypeError`` for an unknown option or a
    factory that does not return a module.
    """
    if not isinstance(name, str) or not name:
        raise UnknownModelError(f"a model name must be a non-empty string, got {name!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if ":" in name:
        return _from_factory(name, batch_size, seed, options)
    builder = _BUILDERS.get(name)
    if builder is None and name in _torchvision_names():
        builder = _torchvision
        options = {"arch": name, **options}
    if builder is None:
        raise UnknownModelError(
            f"no zoo model {name!r}. Built-in: {', '.join(BUILTIN)}; or any torchvision "
            f"classification model ({', '.join(_torchvision_names()[:6])}, ... "
            f"{len(_torchvision_names())} in all: remat.zoo.names()); or your own "
            "'package.module:factory'"
        )
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, batch, loss_fn, description = builder(batch_size, generator, **options)
    model.train()
    return ZooModel(name, model, batch, loss_fn, description)


# ---------------------------------------------------------------------- losses
def classification_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross-entropy of ``model(batch[0])`` against ``batch[1]`` (first output if a tuple)."""
    out = model(batch[0])
    if isinstance(out, tuple | list):  # GoogLeNet / Inception auxiliary outputs in training
        out = out[0]
    return F.cross_entropy(out, batch[1])


def mean_square_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean square of the output (MSE to zero), as shared/peers.md's chain."""
    return model(batch).square().mean()


def _hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(**batch).loss


def _image_case(
    model: nn.Module,
    b: int,
    generator: torch.Generator,
    image_size: int,
    num_classes: int,
    description: str,
    channels: int = 3,
    per_pixel: bool = False,
) -> tuple[nn.Module, Any, LossFn, str]:
    """``model`` on ``b`` random ``channels x image_size x image_size`` images and random
    labels of ``num_classes`` (one per image, or per pixel), drawn in that order from
    ``generator``, trained with :func:`classification_loss`."""
    images = torch.randn(b, channels, image_size, image_size, generator=generator)
    shape = (b, image_size, image_size) if per_pixel else (b,)
    labels = torch.randint(0, num_classes, shape, generator=generator)
    return model, (images, labels), classification_loss, description


# ---------------------------------------------------------------------- torchvision
def _torchvision_names() -> list[str]:
    import torchvision

    return list(torchvision.models.list_models(module=torchvision.models))


_TV_IMAGE_SIZE = {"inception_v3": 299, "maxvit_t": 224}


def _torchvision(
    batch_size: int | None,
    generator: torch.Generator,
    arch: str,
    image_size: int | None = None,
    num_classes: int = 10,
    **kwargs: Any,
) -> tuple[nn.Module, Any, LossFn, str]:
    import torchvision

    size = image_size or _TV_IMAGE_SIZE.get(arch, 64)
    if arch.startswith("vit_"):
        kwargs.setdefault("image_size", size)
    if arch in ("googlenet", "inception_v3"):
        kwargs.setdefault("init_weights", True)
    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)
    b = batch_size or 8
    what = f"torchvision {arch}, {num_classes} classes, batch {b} x 3 x {size} x {size}"
    return _image_case(model, b, generator, size, num_classes, what)


# ---------------------------------------------------------------------- ResNet-1001
class PreActBottleneck(nn.Module):
    """He et al. 2016 pre-activation bottleneck: BN-ReLU-conv1x1, BN-ReLU-conv3x3,
    BN-ReLU-conv1x1, plus the shortcut (a 1x1 projection of the pre-activated input when the
    shape changes, identity otherwise)."""

    def __init__(self, in_channels: int, mid: int, stride: int = 1) -> None:
        super().__init__()
        out = 4 * mid
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, mid, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, out, 1, bias=False)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_channels != out:
            self.shortcut = nn.Conv2d(in_channels, out, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = F.relu(self.bn1(x))
        shortcut = x if self.shortcut is None else self.shortcut(pre)
        y = self.conv1(pre)
        y = self.conv2(F.relu(self.bn2(y)))
        y = self.conv3(F.relu(self.bn3(y)))
        return y + shortcut


def _preact_head(channels: int, num_classes: int) -> nn.Sequential:
    """The pre-activation networks' head: BN-ReLU, global average pool, linear classifier."""
    return nn.Sequential(
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(1),
        nn.Linear(channels, num_classes),
    )


def _split_depth(blocks: int, ratios: tuple[int, ...]) -> list[int]:
    """``blocks`` spread over stages in proportion to ``ratios`` (largest remainder, >= 1 each)."""
    if blocks < len(ratios):
        raise ValueError(f"need at least {len(ratios)} blocks, got {blocks}")
    total = sum(ratios)
    exact = [blocks * r / total for r in ratios]
    counts = [max(1, math.floor(e)) for e in exact]
    order = sorted(range(len(ratios)), key=lambda i: exact[i] - math.floor(exact[i]), reverse=True)
    i = 0
    while sum(counts) < blocks:
        counts[order[i % len(order)]] += 1
        i += 1
    while sum(counts) > blocks:
        j = max(range(len(counts)), key=lambda k: counts[k])
        counts[j] -= 1
    return counts


def preact_resnet(
    depth: int = 1001, num_classes: int = 1000, width: int = 64
) -> tuple[nn.Sequential, list[int]]:
    """The pre-activation bottleneck ResNet of ``depth = 3 * blocks + 2`` layers, ImageNet stem;
    returns the model and the blocks per stage."""
    if depth < 14 or (depth - 2) % 3:
        raise ValueError(
            f"depth must be 3 * blocks + 2 with at least 4 blocks (e.g. 14, 50, 164, 1001), "
            f"got {depth}"
        )
    per_stage = _split_depth((depth - 2) // 3, (3, 24, 36, 3))
    stem = nn.Sequential(
        nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
    )
    layers: list[nn.Module] = [stem]
    channels = width
    for stage, count in enumerate(per_stage):
        mid = width * 2**stage
        for k in range(count):
            stride = 2 if (k == 0 and stage > 0) else 1
            layers.append(PreActBottleneck(channels, mid, stride))
            channels = 4 * mid
    layers.append(_preact_head(channels, num_classes))
    return nn.Sequential(*layers), per_stage


def _resnet1001(
    batch_size: int | None,
    generator: torch.Generator,
    depth: int = 1001,
    image_size: int = 224,
    num_classes: int = 1000,
    width: int = 64,
) -> tuple[nn.Module, Any, LossFn, str]:
    model, per_stage = preact_resnet(depth, num_classes, width)
    b = batch_size or 32
    what = (
        f"pre-activation bottleneck ResNet-{depth} ({sum(per_stage)} blocks {per_stage}), "
        f"batch {b} x 3 x {image_size} x {image_size}"
    )
    return _image_case(model, b, generator, image_size, num_classes, what)


# ---------------------------------------------------------------------- WideResNet
class PreActBasicBlock(nn.Module):
    """WideResNet block: BN-ReLU-conv3x3, BN-ReLU-(dropout)-conv3x3, plus the shortcut (a 1x1
    projection of the pre-activated input when the shape changes)."""

    def __init__(self, in_channels: int, out: int, stride: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_channels != out:
            self.shortcut = nn.Conv2d(in_channels, out, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = F.relu(self.bn1(x))
        shortcut = x if self.shortcut is None else self.shortcut(pre)
        y = self.conv1(pre)
        y = self.conv2(self.dropout(F.relu(self.bn2(y))))
        return y + shortcut


def wide_resnet(
    depth: int = 28, widen: int = 2, num_classes: int = 10, dropout: float = 0.0
) -> nn.Sequential:
    """WRN-``depth``-``widen`` for 32x32 input as ``nn.Sequential(stem, blocks..., head)``."""
    if (depth - 4) % 6:
        raise ValueError(f"WideResNet depth must be 6n + 4 (10, 16, 22, 28, 40), got {depth}")
    n = (depth - 4) // 6
    widths = [16 * widen, 32 * widen, 64 * widen]
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1, bias=False)]
    channels = 16
    for stage, out in enumerate(widths):
        for k in range(n):
            stride = 2 if (k == 0 and stage > 0) else 1
            layers.append(PreActBasicBlock(channels, out, stride, dropout))
            channels = out
    layers.append(_preact_head(channels, num_classes))
    return nn.Sequential(*layers)


def _wrn(
    batch_size: int | None,
    generator: torch.Generator,
    depth: int = 28,
    widen: int = 2,
    num_classes: int = 10,
    image_size: int = 32,
    dropout: float = 0.0,
) -> tuple[nn.Module, Any, LossFn, str]:
    model = wide_resnet(depth, widen, num_classes, dropout)
    b = batch_size or 32
    what = (
        f"WideResNet-{depth}-{widen} (pre-activation), batch {b} x 3 x {image_size} x "
        f"{image_size}, {num_classes} classes"
    )
    return _image_case(model, b, generator, image_size, num_classes, what)


# ---------------------------------------------------------------------- transformers
def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover
        raise ImportError(
            "this zoo model needs Hugging Face transformers: pip install 'remat[hf]'"
        ) from err
    return transformers


def _token_batch(
    batch_size: int | None, generator: torch.Generator, vocab: int, seq_len: int
) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch_size or 4, seq_len), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def _gpt2(
    batch_size: int | None, generator: torch.Generator, seq_len: int = 128, **config: Any
) -> tuple[nn.Module, Any, LossFn, str]:
    transformers = _import_transformers()
    settings = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 1024, **config}
    settings.setdefault("n_positions", max(1024, seq_len))
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings))
    batch = _token_batch(batch_size, generator, settings["vocab_size"], seq_len)
    return (
        model,
        batch,
        _hf_loss,
        f"GPT2LMHeadModel ({settings['n_layer']} layers, d={settings['n_embd']}, "
        f"{settings['n_head']} heads, vocab {settings['vocab_size']}), batch "
        f"{batch['input_ids'].shape[0]} x {seq_len} tokens",
    )


def _llama(
    batch_size: int | None, generator: torch.Generator, seq_len: int = 128, **config: Any
) -> tuple[nn.Module, Any, LossFn, str]:
    transformers = _import_transformers()
    settings = {
        "num_hidden_layers": 4,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "vocab_size": 1024,
        **config,
    }
    settings.setdefault("max_position_embeddings", max(2048, seq_len))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    batch = _token_batch(batch_size, generator, settings["vocab_size"], seq_len)
    return (
        model,
        batch,
        _hf_loss,
        f"LlamaForCausalLM ({settings['num_hidden_layers']} layers, "
        f"hidden {settings['hidden_size']}, vocab {settings['vocab_size']}), batch "
        f"{batch['input_ids'].shape[0]} x {seq_len} tokens",
    )


# ---------------------------------------------------------------------- MLP and LSTM
def _mlp_chain(
    batch_size: int | None, generator: torch.Generator, layers: int = 32, width: int = 512
) -> tuple[nn.Module, Any, LossFn, str]:
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.GELU()]
    b = batch_size or 1024
    return (
        nn.Sequential(*modules),
        torch.randn(b, width, generator=generator),
        mean_square_loss,
        f"{layers} x (Linear {width}->{width}, GELU), batch {b} x {width}",
    )


class LSTMLayer(nn.Module):
    """One ``nn.LSTM`` layer (batch first) that passes its sequence output on."""

    def __init__(self, input_size: int, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


class LastStep(nn.Module):
    """``x[:, -1]``: the last time step of a batch-first sequence."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, -1]


def _lstm_seq(
    batch_size: int | None,
    generator: torch.Generator,
    seq_len: int = 512,
    input_size: int = 32,
    hidden: int = 128,
    layers: int = 4,
    num_classes: int = 10,
) -> tuple[nn.Module, Any, LossFn, str]:
    modules: list[nn.Module] = [LSTMLayer(input_size, hidden)]
    modules += [LSTMLayer(hidden, hidden) for _ in range(layers - 1)]
    modules.append(nn.Sequential(LastStep(), nn.Linear(hidden, num_classes)))
    b = batch_size or 8
    x = torch.randn(b, seq_len, input_size, generator=generator)
    labels = torch.randint(0, num_classes, (b,), generator=generator)
    return (
        nn.Sequential(*modules),
        (x, labels),
        classification_loss,
        f"{layers} x LSTM({hidden}) layers + last-step head, batch {b} x {seq_len} steps x "
        f"{input_size}",
    )


# ---------------------------------------------------------------------- RegNet (Rockmate's list)
def regnet_chain(model: nn.Module) -> nn.Sequential:
    """A torchvision ``RegNet`` as ``nn.Sequential(stem, block, ..., block, head)``, sharing its
    modules: ``regnet_chain(m)(x) == m(x)``."""
    blocks = [block for stage in model.trunk_output for block in stage]
    head = nn.Sequential(model.avgpool, nn.Flatten(1), model.fc)
    return nn.Sequential(model.stem, *blocks, head)


def _regnet(
    batch_size: int | None,
    generator: torch.Generator,
    arch: str = "regnet_y_400mf",
    image_size: int = 64,
    num_classes: int = 10,
) -> tuple[nn.Module, Any, LossFn, str]:
    import torchvision

    if not arch.startswith("regnet_"):
        raise ValueError(f"arch must be a torchvision regnet_* builder, got {arch!r}")
    model = regnet_chain(torchvision.models.get_model(arch, weights=None, num_classes=num_classes))
    b = batch_size or 8
    what = (
        f"torchvision {arch} as a chain of {len(model)} stages, {num_classes} classes, batch {b} "
        f"x 3 x {image_size} x {image_size}"
    )
    return _image_case(model, b, generator, image_size, num_classes, what)


# ---------------------------------------------------------------------- U-Net
class DoubleConv(nn.Sequential):
    """(3x3 conv, batch norm, ReLU) twice, padded: the U-Net's unit."""

    def __init__(self, in_channels: int, out: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out, 3, padding=1, bias=False),
            nn.BatchNorm2d(out),
            nn.ReLU(),
            nn.Conv2d(out, out, 3, padding=1, bias=False),
            nn.BatchNorm2d(out),
            nn.ReLU(),
        )


class UNet(nn.Module):
    """A 2-D U-Net: ``depth`` levels of (DoubleConv, 2x2 max-pool) down, a DoubleConv at the
    bottom, then per level a 2x2 transposed convolution up, the concatenation with the skip of
    that level, and a DoubleConv; a 1x1 convolution to ``num_classes`` per pixel."""

    def __init__(
        self, in_channels: int = 3, num_classes: int = 2, width: int = 16, depth: int = 3
    ) -> None:
        super().__init__()
        if depth < 1 or width < 1:
            raise ValueError(f"depth and width must be >= 1, got depth={depth}, width={width}")
        self.depth = depth
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList(
            DoubleConv(in_channels if i == 0 else widths[i - 1], widths[i]) for i in range(depth)
        )
        self.pool = nn.MaxPool2d(2)
        self.bottom = DoubleConv(widths[depth - 1], widths[depth])
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2) for i in range(depth)
        )
        self.decode = nn.ModuleList(DoubleConv(2 * widths[i], widths[i]) for i in range(depth))
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for level in self.down:
            x = level(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottom(x)
        for i in reversed(range(self.depth)):
            x = self.up[i](x)
            x = self.decode[i](torch.cat([skips[i], x], dim=1))
        return self.head(x)


class UNetDown(nn.Module):
    """Chain stage: ``(x, *skips) -> (pool(y), *skips, y)`` with ``y = level(x)``."""

    def __init__(self, level: nn.Module, pool: nn.Module) -> None:
        super().__init__()
        self.level = level
        self.pool = pool

    def forward(self, a: Any) -> tuple[torch.Tensor, ...]:
        x, *skips = a if isinstance(a, tuple) else (a,)
        y = self.level(x)
        return (self.pool(y), *skips, y)


class UNetBottom(nn.Module):
    """Chain stage: ``(x, *skips) -> (bottom(x), *skips)``."""

    def __init__(self, bottom: nn.Module) -> None:
        super().__init__()
        self.bottom = bottom

    def forward(self, a: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, *skips = a
        return (self.bottom(x), *skips)


class UNetUp(nn.Module):
    """Chain stage: ``(x, *skips, s) -> (decode(cat(s, up(x))), *skips)`` (a tensor when no
    skip is left)."""

    def __init__(self, up: nn.Module, decode: nn.Module) -> None:
        super().__init__()
        self.up = up
        self.decode = decode

    def forward(self, a: tuple[torch.Tensor, ...]) -> Any:
        x, *skips = a
        skip = skips.pop()
        y = self.decode(torch.cat([skip, self.up(x)], dim=1))
        return (y, *skips) if skips else y


def unet_chain(model: UNet) -> nn.Sequential:
    """``model`` as an ``nn.Sequential`` of stages sharing its modules (``unet_chain(m)(x) ==
    m(x)``): each down level, the bottom, each up level, the head. The skips travel in the
    activation tuple, so a stage boundary's activation includes every skip still pending."""
    stages: list[nn.Module] = [UNetDown(level, model.pool) for level in model.down]
    stages.append(UNetBottom(model.bottom))
    stages += [UNetUp(model.up[i], model.decode[i]) for i in reversed(range(model.depth))]
    stages.append(model.head)
    return nn.Sequential(*stages)


def _unet(
    batch_size: int | None,
    generator: torch.Generator,
    depth: int = 3,
    width: int = 16,
    image_size: int = 64,
    in_channels: int = 3,
    num_classes: int = 2,
    form: str = "module",
) -> tuple[nn.Module, Any, LossFn, str]:
    if form not in ("module", "chain"):
        raise ValueError(f"form must be 'module' or 'chain', got {form!r}")
    if image_size % 2**depth:
        raise ValueError(
            f"image_size must be a multiple of 2 ** depth = {2**depth}, got {image_size}"
        )
    unet = UNet(in_channels, num_classes, width, depth)
    model: nn.Module = unet if form == "module" else unet_chain(unet)
    b = batch_size or 4
    what = (
        f"U-Net (depth {depth}, width {width}, {form}), per-pixel {num_classes} classes, batch "
        f"{b} x {in_channels} x {image_size} x {image_size}"
    )
    return _image_case(
        model, b, generator, image_size, num_classes, what, channels=in_channels, per_pixel=True
    )


# ---------------------------------------------------------------------- MLP-Mixer
class PatchEmbedding(nn.Module):
    """Non-overlapping ``patch`` x ``patch`` patches to ``dim`` channels: ``(B, N, dim)``."""

    def __init__(self, in_channels: int, dim: int, patch: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class MixerBlock(nn.Module):
    """Token mixing (an MLP across patches) then channel mixing (an MLP across channels), each
    after a layer norm and with a residual connection."""

    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(
            nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens)
        )
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(
            nn.Linear(dim, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class MixerHead(nn.Module):
    """Layer norm, mean over patches, linear classifier."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


def _mlp_mixer(
    batch_size: int | None,
    generator: torch.Generator,
    image_size: int = 64,
    patch: int = 8,
    dim: int = 128,
    depth: int = 8,
    token_hidden: int = 64,
    channel_hidden: int = 512,
    num_classes: int = 10,
) -> tuple[nn.Module, Any, LossFn, str]:
    if image_size % patch:
        raise ValueError(f"image_size must be a multiple of patch={patch}, got {image_size}")
    tokens = (image_size // patch) ** 2
    model = nn.Sequential(
        PatchEmbedding(3, dim, patch),
        *(MixerBlock(tokens, dim, token_hidden, channel_hidden) for _ in range(depth)),
        MixerHead(dim, num_classes),
    )
    b = batch_size or 8
    what = (
        f"MLP-Mixer ({depth} blocks, dim {dim}, {tokens} patches of {patch}x{patch}, hidden "
        f"{token_hidden}/{channel_hidden}), batch {b} x 3 x {image_size} x {image_size}"
    )
    return _image_case(model, b, generator, image_size, num_classes, what)


_BUILDERS: dict[str, Callable[..., tuple[nn.Module, Any, LossFn, str]]] = {
    "resnet1001": _resnet1001,
    "wrn-28-2": _wrn,
    "gpt2": _gpt2,
    "llama-tiny": _llama,
    "mlp-chain": _mlp_chain,
    "lstm-seq": _lstm_seq,
    "regnet": _regnet,
    "unet": _unet,
    "mlp-mixer": _mlp_mixer,
}


# ---------------------------------------------------------------------- user factories
def _from_factory(
    spec: str, batch_size: int | None, seed: int, options: dict[str, Any]
) -> ZooModel:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UnknownModelError(f"{spec!r}: write a factory as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UnknownModelError(
            f"{spec!r}: cannot import {module_name!r} ({err}); is it on PYTHONPATH?"
        ) from err
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise UnknownModelError(f"{spec!r}: module {module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise TypeError(f"{spec!r} is not callable (got {type(factory).__name__})")
    kwargs = dict(options)
    if batch_size is not None and _accepts(factory, "batch_size"):
        kwargs["batch_size"] = batch_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        result = factory(**kwargs)
    if isinstance(result, ZooModel):
        return result
    batch: Any = None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        result, batch = result
    if not isinstance(result, nn.Module):
        raise TypeError(
            f"factory {spec!r} returned {type(result).__name__}; it must return an nn.Module, "
            "a (module, batch) pair, or a remat.zoo.ZooModel"
        )
    if batch is None:
        batch = guess_batch(result, batch_size or 8, torch.Generator().manual_seed(seed))

    result.train()
    return ZooModel(spec, result, batch, default_loss_fn, f"{type(result).__name__} from {spec}")


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def guess_batch(model: nn.Module, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """A random input for ``model`` guessed from its first layer (Linear, Conv, Embedding, RNN).

    Raises ``TypeError`` when there is nothing to guess from: return ``(module, batch)`` from
    the factory instead.
    """
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            return torch.randn(batch_size, layer.in_features, generator=generator)
        if isinstance(layer, nn.Conv1d | nn.Conv2d | nn.Conv3d):
            dims = {nn.Conv1d: (256,), nn.Conv2d: (64, 64), nn.Conv3d: (16, 16, 16)}[type(layer)]
            return torch.randn(batch_size, layer.in_channels, *dims, generator=generator)
        if isinstance(layer, nn.Embedding):
            return torch.randint(0, layer.num_embeddings, (batch_size, 128), generator=generator)
        if isinstance(layer, nn.RNNBase):
            shape = (batch_size, 128) if layer.batch_first else (128, batch_size)
            return torch.randn(*shape, layer.input_size, generator=generator)
    raise TypeError(
        f"cannot guess an input for {type(model).__name__} (no Linear, Conv, Embedding or RNN "
        "layer found): make the factory return (module, batch)"
    )
