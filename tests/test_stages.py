"""remat.capture.stages: models cut into sequential stages compute exactly what the model computes."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from remat.capture.stages import (
    StageMismatchError,
    Stages,
    UnsupportedModelError,
    run_stages,
    split_stages,
)


def _same(expected, got):
    if hasattr(expected, "logits"):
        assert torch.equal(expected.logits, got.logits)
        if expected.loss is None:
            assert got.loss is None
        else:
            assert torch.equal(expected.loss, got.loss)
    else:
        assert torch.equal(expected, got)


def _check(model, *args, train=True, **kwargs):
    model.train(train)
    stages = split_stages(model)
    assert isinstance(stages, Stages) and stages.n == len(stages.names) >= 1
    torch.manual_seed(1)
    expected = model(*args, **kwargs)
    torch.manual_seed(1)
    got = run_stages(stages, *args, **kwargs)
    _same(expected, got)
    return stages


def test_sequential_children_are_stages_and_inplace_joins_previous():
    model = nn.Sequential(
        nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)
    )
    stages = _check(model, torch.randn(3, 8))
    assert stages.names == ("0+1", "2", "3", "4")
    assert stages.kind == "sequential"
    # stage modules are the model's own modules (shared, not copies)
    assert stages.modules[1] is model[2]


def test_nested_sequential_is_not_flattened():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.GELU()))
    assert split_stages(model).names == ("0", "1")


def _small_head(factory):
    """The torchvision model with a small classifier (VGG's and AlexNet's have 60-120M
    parameters); the structure the splitter sees is the same."""

    def build(num_classes):
        model = factory(num_classes=num_classes)
        features = next(m for m in model.classifier if isinstance(m, nn.Linear)).in_features
        model.classifier = nn.Sequential(
            nn.Dropout(), nn.Linear(features, 16), nn.ReLU(inplace=True), nn.Linear(16, num_classes)
        )
        return model

    return build


@pytest.mark.parametrize(
    "factory, kind, n",
    [
        (torchvision.models.resnet18, "resnet", 10),
        (_small_head(torchvision.models.vgg11), "vgg", 14),
        (_small_head(torchvision.models.alexnet), "alexnet", 9),
        (torchvision.models.mobilenet_v2, "mobilenet_v2", 20),
        (torchvision.models.mobilenet_v3_small, "mobilenet_v3", 14),
    ],
)
@pytest.mark.parametrize("train", [True, False])
def test_torchvision(factory, kind, n, train):
    torch.manual_seed(0)
    model = factory(num_classes=10)
    size = 64 if kind == "alexnet" else 32  # AlexNet's stem needs >= 63 pixels
    stages = _check(model, torch.randn(2, 3, size, size), train=train)
    assert stages.kind == kind and stages.n == n
    # no stage starts with an in-place op
    for module in stages.modules:
        first = module[0] if isinstance(module, nn.Sequential) else module
        assert not getattr(first, "inplace", False)


def test_resnet_stage_names():
    names = split_stages(torchvision.models.resnet18()).names
    assert names[0] == "conv1+bn1+relu+maxpool"
    assert names[1:9] == tuple(f"layer{i}.{j}" for i in range(1, 5) for j in range(2))
    assert names[-1] == "avgpool+flatten+fc"


def test_subclass_with_own_forward_is_not_recognised():
    class MyNet(torchvision.models.ResNet):
        def forward(self, x):
            return super().forward(x) * 2

    model = MyNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1]).eval()
    # not a ResNet to the splitter (its adapter would drop the * 2): the generic stages around
    # the stages its forward calls as attributes, layer1..layer4
    # (remat.capture.stages.families.blocks), checked against the model on the first call
    stages = split_stages(model)
    assert stages.kind == "blocks"
    assert stages.names[1:-1] == ("layer1.0", "layer2.0", "layer3.0", "layer4.0")
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(run_stages(stages, x), model(x), rtol=0, atol=0)

    class MySeq(nn.Sequential):
        def forward(self, x):
            return super().forward(x) + 1

    with pytest.raises(UnsupportedModelError):
        split_stages(MySeq(nn.Linear(2, 2)))


def test_unsupported_model_message():
    with pytest.raises(UnsupportedModelError) as info:
        split_stages(nn.LSTM(3, 3))
    message = str(info.value)
    assert "nn.Sequential" in message and "stages=[" in message and "named_modules" in message


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gpt2(hf, impl):
    torch.manual_seed(0)
    config = hf.GPT2Config(
        n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64, attn_implementation=impl
    )
    model = hf.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 16))
    stages = _check(model, ids, labels=ids)  # dropout on: same masks from the same seed
    # two stages per block: NOTE [ Half blocks ] in remat.capture.stages.families.hf
    assert stages.kind == "gpt2" and stages.n == 2 + 2 * 3
    assert stages.names[1:3] == ("transformer.h.0.ln_1+attn", "transformer.h.0.ln_2+mlp")
    _check(model, input_ids=ids, attention_mask=torch.ones(2, 16, dtype=torch.long))
    _check(model, ids, train=False)
    out = run_stages(stages, ids, labels=ids, return_dict=False)
    assert isinstance(out, tuple) and out[0].ndim == 0
    with pytest.raises(UnsupportedModelError, match="head_mask"):
        run_stages(stages, ids, head_mask=torch.ones(3, 4))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_llama(hf, impl):
    torch.manual_seed(0)
    config = hf.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        attn_implementation=impl,
    )
    model = hf.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    stages = _check(model, ids, labels=ids)
    assert stages.kind == "llama" and stages.n == 2 + 2 * 2
    _check(model, input_ids=ids, attention_mask=torch.ones(2, 16, dtype=torch.long))


def test_hf_own_gradient_checkpointing_is_refused(hf):
    model = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    model.gradient_checkpointing_enable()
    with pytest.raises(UnsupportedModelError, match="gradient_checkpointing_disable"):
        split_stages(model)


def test_named_stages_verified_and_equal():
    model = nn.Sequential(
        nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), nn.Linear(4, 1)
    )
    model.train()
    stages = split_stages(model, ["0", "1.0", "1.1", "2"])
    assert stages.kind == "named" and stages.n == 4
    x = torch.randn(5, 4)
    torch.manual_seed(3)
    got = run_stages(stages, x)  # runs the check first; the check leaves the RNG untouched
    torch.manual_seed(3)
    assert torch.equal(got, model(x))


def test_named_stages_group_with_plus():
    model = torchvision.models.resnet18(num_classes=4)
    names = ["conv1+bn1+relu+maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc"]
    stages = split_stages(model, names)
    with pytest.raises(StageMismatchError, match="cannot be run in order"):
        run_stages(stages, torch.randn(2, 3, 32, 32))


def test_named_stages_wrong_composition_raises():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x)) + x

    model = Residual()
    stages = split_stages(model, ["a", "b"])
    with pytest.raises(StageMismatchError, match="do not compute what the model computes"):
        run_stages(stages, torch.randn(2, 4))


def test_named_check_has_no_side_effects_on_batchnorm():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.train()
    stages = split_stages(model, ["0", "1"])
    before = model[1].running_mean.clone()
    stages.check(torch.randn(8, 4))
    assert torch.equal(model[1].running_mean, before)
    assert int(model[1].num_batches_tracked) == 0


def test_named_stage_errors():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(UnsupportedModelError, match="no submodule 'foo'"):
        split_stages(model, ["foo"])
    with pytest.raises(UnsupportedModelError, match="named twice"):
        split_stages(model, ["0", "0"])
    with pytest.raises(UnsupportedModelError, match="list of submodule names"):
        split_stages(model, "0")
