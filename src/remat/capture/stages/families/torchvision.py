"""torchvision's image classifiers as stages.

* ``ResNet``: stem (``conv1+bn1+relu+maxpool``), each residual block (``layer1.0``, ...), head
  (``avgpool`` + flatten + ``fc``).
* ``VGG``, ``AlexNet``, ``MobileNetV2``, ``MobileNetV3``: each child of ``features`` (in-place
  activations joined to the stage before), then one head stage (pool + flatten +
  ``classifier``).

A subclass that overrides ``forward`` (or ``_forward_impl``) is not recognised.
"""

from __future__ import annotations

from torch import nn

from remat.capture.stages.base import (
    Stages,
    children_stages,
    group,
    identity_finish,
    identity_prepare,
    items,
    same_forward,
)


def split(model: nn.Module) -> Stages | None:
    try:
        from torchvision.models import VGG, AlexNet, MobileNetV2, MobileNetV3, ResNet
    except ImportError:  # pragma: no cover
        return None

    if same_forward(model, ResNet, "forward", "_forward_impl"):
        modules: list[nn.Module] = [group([model.conv1, model.bn1, model.relu, model.maxpool])]
        names = ["conv1+bn1+relu+maxpool"]
        for layer_name in ("layer1", "layer2", "layer3", "layer4"):
            for block_name, block in items(getattr(model, layer_name)):
                modules.append(block)
                names.append(f"{layer_name}.{block_name}")
        modules.append(nn.Sequential(model.avgpool, nn.Flatten(1), model.fc))
        names.append("avgpool+flatten+fc")
        return Stages(
            tuple(modules), tuple(names), identity_prepare, identity_finish, kind="resnet"
        )

    head_pool: nn.Module | None = None
    kind = None
    if same_forward(model, VGG, "forward"):
        head_pool, kind = model.avgpool, "vgg"
    elif same_forward(model, AlexNet, "forward"):
        head_pool, kind = model.avgpool, "alexnet"
    elif same_forward(model, MobileNetV3, "forward", "_forward_impl"):
        head_pool, kind = model.avgpool, "mobilenet_v3"
    elif same_forward(model, MobileNetV2, "forward", "_forward_impl"):
        # MobileNetV2 pools with F.adaptive_avg_pool2d(x, (1, 1)): the same as this module.
        head_pool, kind = nn.AdaptiveAvgPool2d((1, 1)), "mobilenet_v2"
    if kind is None:
        return None
    modules, names = children_stages([(f"features.{n}", m) for n, m in items(model.features)])
    modules.append(nn.Sequential(head_pool, nn.Flatten(1), model.classifier))
    names.append("avgpool+flatten+classifier")
    return Stages(tuple(modules), tuple(names), identity_prepare, identity_finish, kind=kind)
