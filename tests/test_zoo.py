"""remat.zoo: every built-in model builds, trains one step, and has the documented shape."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from remat import zoo
from remat.zoo import UnknownModelError, ZooModel

SMALL = {
    "mlp-chain": dict(layers=3, width=32, batch_size=4),
    "lstm-seq": dict(seq_len=16, input_size=8, hidden=16, layers=2, batch_size=2),
    "gpt2": dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, seq_len=16, batch_size=2),
    "llama-tiny": dict(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, vocab_size=64, seq_len=16
    ),
    "wrn-28-2": dict(batch_size=2),
    "resnet1001": dict(depth=14, image_size=64, num_classes=10, width=8, batch_size=2),
    "resnet18": dict(image_size=32, batch_size=2),
    "mobilenet_v2": dict(image_size=32, batch_size=2),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_builds_and_trains_one_step(name):
    entry = zoo.get(name, **SMALL[name])
    assert isinstance(entry, ZooModel) and entry.name == name and entry.description
    assert entry.model.training
    loss = entry.loss_fn(entry.model, entry.batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in entry.model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)


def test_names_lists_builtins_and_torchvision():
    names = zoo.names()
    for name in ("resnet1001", "wrn-28-2", "gpt2", "llama-tiny", "mlp-chain", "lstm-seq"):
        assert name in names
    for name in ("resnet18", "resnet50", "vgg11", "alexnet", "mobilenet_v2", "densenet121"):
        assert name in names


def test_wrn_28_2_has_the_published_parameter_count():
    model = zoo.get("wrn-28-2").model
    assert sum(p.numel() for p in model.parameters()) == 1_467_610
    assert type(model) is nn.Sequential and len(model) == 1 + 12 + 1


def test_resnet1001_is_a_333_block_chain():
    with torch.device("meta"):
        model, per_stage = zoo.preact_resnet(1001)
    assert per_stage == [15, 121, 182, 15]
    assert type(model) is nn.Sequential and len(model) == 1 + 333 + 1
    blocks = [m for m in model if isinstance(m, zoo.PreActBottleneck)]
    assert len(blocks) == 333
    # 3 convolutions per block, the stem's, and one projection shortcut per stage: 1001 + 3
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 3 * 333 + 1 + 4
    with pytest.raises(ValueError, match="3 \\* blocks \\+ 2"):
        zoo.preact_resnet(1000)


def test_resnet1001_default_batch_is_the_papers():
    entry = zoo.get("resnet1001", depth=14, width=4)
    images, labels = entry.batch
    assert tuple(images.shape) == (32, 3, 224, 224) and tuple(labels.shape) == (32,)


def test_batches_are_seeded():
    a = zoo.get("mlp-chain", layers=1, width=8, batch_size=3)
    b = zoo.get("mlp-chain", layers=1, width=8, batch_size=3)
    assert torch.equal(a.batch, b.batch)
    assert torch.equal(a.model[0].weight, b.model[0].weight)
    c = zoo.get("mlp-chain", layers=1, width=8, batch_size=3, seed=1)
    assert not torch.equal(a.batch, c.batch)


def test_options_reach_the_model():
    entry = zoo.get("gpt2", **SMALL["gpt2"])
    assert entry.model.config.n_layer == 2
    assert tuple(entry.batch["input_ids"].shape) == (2, 16)
    assert torch.equal(entry.batch["input_ids"], entry.batch["labels"])
    tv = zoo.get("resnet18", image_size=48, num_classes=7, batch_size=3)
    assert tuple(tv.batch[0].shape) == (3, 3, 48, 48) and tv.model.fc.out_features == 7


def test_unknown_name_lists_the_names():
    with pytest.raises(UnknownModelError, match="mlp-chain.*torchvision"):
        zoo.get("no-such-model")


def test_unknown_option_is_an_error():
    with pytest.raises(TypeError):
        zoo.get("mlp-chain", colour="blue")


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn
            from remat.zoo import ZooModel

            def bare(width=8):
                return nn.Sequential(nn.Linear(width, width), nn.GELU())

            def pair(batch_size=2):
                return nn.Linear(4, 2), torch.randn(batch_size, 4)

            def full():
                m = nn.Linear(3, 1)
                return ZooModel("full", m, torch.randn(5, 3), lambda m, b: m(b).sum(), "mine")

            def wrong():
                return 3

            not_callable = 5
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_models", None)


def test_factory_returning_a_module_gets_a_guessed_batch(factories):
    entry = zoo.get("my_models:bare", batch_size=3, width=6)
    assert tuple(entry.batch.shape) == (3, 6)
    entry.loss_fn(entry.model, entry.batch).backward()


def test_factory_returning_module_and_batch(factories):
    entry = zoo.get("my_models:pair", batch_size=5)
    assert tuple(entry.batch.shape) == (5, 4)
    assert zoo.get("my_models:full").description == "mine"


def test_bad_factories_have_clear_errors(factories):
    with pytest.raises(TypeError, match="must return an nn.Module"):
        zoo.get("my_models:wrong")
    with pytest.raises(TypeError, match="not callable"):
        zoo.get("my_models:not_callable")
    with pytest.raises(UnknownModelError, match="has no attribute"):
        zoo.get("my_models:missing")
    with pytest.raises(UnknownModelError, match="cannot import"):
        zoo.get("no_such_package_xyz:make")


# ---------------------------------------------------------------------- Rockmate's models
ROCKMATE_SMALL = {
    "regnet": dict(batch_size=2, image_size=32),
    "unet": dict(batch_size=2, image_size=16, depth=2, width=4, form="chain"),
    "mlp-mixer": dict(batch_size=2, image_size=16, patch=4, dim=16, depth=2, channel_hidden=32),
    "resnet101": dict(batch_size=2, image_size=32),
}


@pytest.mark.parametrize("name", sorted(ROCKMATE_SMALL))
def test_rockmate_models_capture_as_chains_with_equal_gradients(name):
    from remat.capture.chain import capture
    from remat.execute.chain import apply

    entry = zoo.get(name, **ROCKMATE_SMALL[name])
    expected_stages = {"regnet": 2 + 16, "unet": 2 + 1 + 2 + 1, "mlp-mixer": 1 + 2 + 1}
    captured = capture(entry.model, entry.batch, loss_fn=entry.loss_fn, repeats=1)
    assert captured.chain.n == expected_stages.get(name, 1 + 33 + 1)  # resnet101: 3+4+23+3
    # every stage checkpointed: same loss and gradients as the model itself
    from remat.core.plan import Plan

    entry.model.eval()  # batch-norm in eval mode: both runs see the same statistics
    entry.model.zero_grad(set_to_none=True)
    loss = entry.loss_fn(entry.model, entry.batch)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in entry.model.named_parameters()}
    entry.model.zero_grad(set_to_none=True)
    planned = apply(entry.model, Plan.every_stage(captured.chain), stages=captured.stages)
    loss2 = entry.loss_fn(planned, entry.batch)
    loss2.backward()
    assert torch.equal(loss, loss2)
    for n, p in entry.model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-6)


def test_regnet_chain_is_torchvisions_regnet():
    import torchvision

    torch.manual_seed(0)
    tv = torchvision.models.regnet_y_400mf(num_classes=10).eval()
    chain = zoo.regnet_chain(tv)
    assert type(chain) is nn.Sequential and len(chain) == 1 + 16 + 1
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(chain(x), tv(x))
    assert zoo.get("regnet", **ROCKMATE_SMALL["regnet"]).model[-1][-1].out_features == 10


def test_unet_chain_computes_the_unet_and_the_module_form_is_not_a_chain():
    from remat.capture.chain import capture
    from remat.capture.graph import capture_graph
    from remat.capture.stages import UnsupportedModelError

    entry = zoo.get("unet", batch_size=2, image_size=16, depth=2, width=4)
    unet = entry.model
    assert isinstance(unet, zoo.UNet)
    images, labels = entry.batch
    assert tuple(labels.shape) == (2, 16, 16)
    unet.eval()
    out = unet(images)
    assert tuple(out.shape) == (2, 2, 16, 16)
    chain = zoo.unet_chain(unet)
    assert len(chain) == 2 + 1 + 2 + 1
    assert torch.equal(chain(images), out)
    # the skip connections: remat's chain capture refuses the plain module ...
    with pytest.raises(UnsupportedModelError, match="name the stage boundaries"):
        capture(unet, entry.batch, loss_fn=entry.loss_fn)
    # ... its graph capture takes it: the concatenations read the skips (several readers)
    graph = capture_graph(unet, entry.batch, loss_fn=entry.loss_fn)
    cats = [node for node in graph.nodes if "cat" in node.name]
    assert len(cats) == 2
    with pytest.raises(ValueError, match="multiple of 2 \\*\\* depth"):
        zoo.get("unet", image_size=20, depth=3)
    with pytest.raises(ValueError, match="form"):
        zoo.get("unet", form="graph")


def test_mlp_mixer_mixes_tokens_and_channels():
    entry = zoo.get("mlp-mixer", **ROCKMATE_SMALL["mlp-mixer"])
    model = entry.model
    assert type(model) is nn.Sequential and len(model) == 1 + 2 + 1
    block = model[1]
    assert block.token_mlp[0].in_features == (16 // 4) ** 2  # 16 patches
    assert block.channel_mlp[0].in_features == 16
    images, _ = entry.batch
    assert tuple(model[0](images).shape) == (2, 16, 16)
    # token mixing: changing one patch changes every patch's output after one block
    x = model[0](images).detach()
    y = x.clone()
    y[:, 0] += torch.linspace(-1.0, 1.0, 16)  # not constant: layer norm would cancel it
    changed = (block(y) - block(x)).abs().amax(dim=2) > 0
    assert bool(changed.all())
    with pytest.raises(ValueError, match="multiple of patch"):
        zoo.get("mlp-mixer", image_size=30, patch=8)
