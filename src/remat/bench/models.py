"""Benchmark models that need a chain form remat's stage splitter does not derive by itself.

torchvision's ``DenseNet`` is not a chain: inside each dense block every layer reads the
concatenation of *all* earlier feature maps (``_DenseBlock.forward`` keeps them in a list).
It is one as a sequence of concatenations, though: with ``x`` the concatenation so far, dense
layer ``i`` computes ``new = conv2(relu2(norm2(conv1(relu1(norm1(x))))))`` and the block goes on
with ``cat([x, new], 1)``, which is exactly the input torchvision's next layer concatenates for
itself. :func:`densenet_chain` re-wraps a torchvision DenseNet, **sharing its modules**, as
``nn.Sequential(stem, dense stage, ..., transition, ..., head)`` with one stage per ``group``
dense layers; ``densenet_chain(m)(x) == m(x)`` (the same function of the same parameters)::

    import torchvision
    from remat.bench.models import densenet_chain

    net = torchvision.models.densenet121(num_classes=10)
    chain = densenet_chain(net)  # 63 stages; densenet_chain(net, group=2): 34
    remat.capture_chain(chain, (images, labels), loss_fn=classification_loss)

:func:`densenet121_chain` is the ``peers`` suite's DenseNet-121 (a ``remat.zoo`` factory:
``zoo.get("remat.bench.models:densenet121_chain", batch_size=8, image_size=96, group=2)``), so
the suite, its peers and the out-of-process Rockmate runner all train the same module.

Known limitations: the chain keeps the concatenation ``x`` (as torchvision keeps the list and
each layer's concatenated input); torchvision's ``memory_efficient=True`` (its own per-layer
checkpointing) and ``drop_rate > 0`` are refused, because they change what a step keeps or
draws; the forward's ``F.relu(inplace=True)`` after ``features`` becomes an out-of-place
``nn.ReLU`` in the head (same values).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat.zoo import ZooModel, classification_loss

__all__ = ["DenseStage", "densenet_chain", "densenet121_chain"]


class DenseStage(nn.Module):
    """Consecutive torchvision ``_DenseLayer`` s as one chain stage: for each layer,
    ``x -> cat([x, layer(x)], 1)``."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lay in self.layers:
            bottleneck = lay.conv1(lay.relu1(lay.norm1(x)))
            new = lay.conv2(lay.relu2(lay.norm2(bottleneck)))
            x = torch.cat([x, new], 1)
        return x


def densenet_chain(model: nn.Module, group: int = 1) -> nn.Sequential:
    """A torchvision ``DenseNet`` as ``nn.Sequential(stem, DenseStage, ..., transition, ...,
    head)`` sharing its modules: ``densenet_chain(m)(x) == m(x)``. Each ``DenseStage`` holds
    ``group`` consecutive dense layers (fewer at a block's end).

    Raises ``ValueError`` for a model that is not a torchvision DenseNet, or one built with
    ``memory_efficient=True`` or ``drop_rate > 0``.
    """
    from torchvision.models.densenet import DenseNet, _DenseBlock, _DenseLayer, _Transition

    if group < 1:
        raise ValueError(f"group must be a positive number of dense layers, got {group}")
    if not isinstance(model, DenseNet) or type(model).forward is not DenseNet.forward:
        raise ValueError(f"densenet_chain takes a torchvision DenseNet, got {type(model).__name__}")
    f = model.features
    stem = nn.Sequential(f.conv0, f.norm0, f.relu0, f.pool0)
    stages: list[nn.Module] = [stem]
    for name, child in f.named_children():
        if name in ("conv0", "norm0", "relu0", "pool0", "norm5"):
            continue
        if isinstance(child, _DenseBlock):
            layers = list(child.values())
            for layer in layers:
                assert isinstance(layer, _DenseLayer)
                if layer.memory_efficient or float(layer.drop_rate) > 0:
                    raise ValueError(
                        "densenet_chain needs memory_efficient=False and drop_rate=0 (the "
                        "torchvision defaults): both change what a training step keeps or draws"
                    )
            for start in range(0, len(layers), group):
                stages.append(DenseStage(layers[start : start + group]))
        elif isinstance(child, _Transition):
            stages.append(child)
        else:  # pragma: no cover - torchvision's layout changed
            raise ValueError(f"unexpected DenseNet features child {name!r}: {type(child)}")
    head = nn.Sequential(
        f.norm5, nn.ReLU(), nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1), model.classifier
    )
    stages.append(head)
    return nn.Sequential(*stages)


def densenet121_chain(
    batch_size: int | None = None,
    image_size: int = 64,
    num_classes: int = 10,
    group: int = 1,
    seed: int = 0,
) -> Any:
    """The ``peers`` suite's DenseNet-121: torchvision ``densenet121(num_classes)`` (random
    weights) as :func:`densenet_chain` with ``group`` dense layers per stage, a seeded batch
    ``(images, labels)`` of ``batch_size`` (default 8) × 3 × ``image_size``², cross-entropy
    loss. Returns a ``remat.zoo.ZooModel``."""
    import torchvision

    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = densenet_chain(torchvision.models.densenet121(num_classes=num_classes), group)
    model.train()
    b = batch_size or 8
    images = torch.randn(b, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, num_classes, (b,), generator=generator)
    return ZooModel(
        "densenet121",
        model,
        (images, labels),
        classification_loss,
        f"torchvision densenet121 as a chain of {len(model)} stages ({group} dense layer(s) "
        "per stage), "
        f"{num_classes} classes, batch {b} x 3 x {image_size} x {image_size}",
    )
