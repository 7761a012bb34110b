"""The peers suite's DenseNet chain form (remat.bench.models): the same function and gradients as
torchvision's DenseNet, one stage per dense layer, trainable under a remat plan with eager's
gradients; the suite and the Rockmate runner build it from the same name."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
import torch.nn.functional as F

torchvision = pytest.importorskip("torchvision")

from remat import zoo  # noqa: E402
from remat.bench.models import DenseStage, densenet_chain  # noqa: E402
from remat.bench.suites import CHAIN_FORMS, _model_options, zoo_name  # noqa: E402

torch.set_num_threads(1)


def _small_densenet(**kwargs: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.DenseNet(
        growth_rate=8, block_config=(2, 3), num_init_features=16, num_classes=5, **kwargs
    )


def test_chain_equals_torchvision_forward_and_gradients() -> None:
    model = _small_densenet()
    chain = densenet_chain(model)
    # stem, 2 dense layers, transition, 3 dense layers, head
    assert len(chain) == 1 + 2 + 1 + 3 + 1
    assert sum(isinstance(m, DenseStage) for m in chain) == 5
    # the chain shares the model's parameters (no copies)
    assert {id(p) for p in chain.parameters()} == {id(p) for p in model.parameters()}
    x = torch.randn(3, 3, 32, 32)
    y = torch.tensor([0, 4, 2])
    F.cross_entropy(model(x), y).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out = chain(x)
    # training-mode batch norm normalises with the batch's statistics: the same logits
    assert torch.equal(out, model(x))
    F.cross_entropy(out, y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-6)


def test_grouped_stages_compute_the_same() -> None:
    model = _small_densenet()
    x = torch.randn(2, 3, 32, 32)
    ref = densenet_chain(model)(x)
    grouped = densenet_chain(model, group=2)
    # blocks of 2 and 3 layers: one stage of 2, then stages of 2 and 1
    assert [len(m.layers) for m in grouped if isinstance(m, DenseStage)] == [2, 2, 1]
    assert torch.equal(grouped(x), ref)
    with pytest.raises(ValueError, match="group"):
        densenet_chain(model, group=0)


def test_refuses_memory_efficient_and_dropout_and_other_models() -> None:
    with pytest.raises(ValueError, match="memory_efficient=False"):
        densenet_chain(_small_densenet(memory_efficient=True))
    with pytest.raises(ValueError, match="drop_rate=0"):
        densenet_chain(_small_densenet(drop_rate=0.1))
    with pytest.raises(ValueError, match="torchvision DenseNet"):
        densenet_chain(torchvision.models.resnet18())


def test_remat_every_stage_plan_gives_eager_gradients() -> None:
    from remat.api import plan as make_plan
    from remat.capture.chain import capture
    from remat.execute.chain import apply

    chain_model = densenet_chain(_small_densenet())
    batch = (torch.randn(2, 3, 32, 32), torch.tensor([1, 3]))

    def loss_fn(m: torch.nn.Module, b: tuple) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    captured = capture(chain_model, batch, loss_fn=loss_fn)
    assert captured.chain.n == len(chain_model)
    loss_fn(chain_model, batch).backward()
    ref = {n: p.grad.clone() for n, p in chain_model.named_parameters()}
    chain_model.zero_grad(set_to_none=True)
    planned = apply(chain_model, make_plan(captured.chain, "every-stage"), stages=captured.stages)
    loss_fn(planned, batch).backward()
    for n, p in chain_model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-6)


def test_suite_and_runner_build_the_chain_from_the_suite_name() -> None:
    assert zoo_name("densenet121") == CHAIN_FORMS["densenet121"]
    assert zoo_name("resnet101") == "resnet101"
    options = dict(_model_options("densenet121", False))
    options["image_size"] = 32
    options["batch_size"] = 2
    entry = zoo.get(zoo_name("densenet121"), **options)
    assert entry.batch[0].shape == (2, 3, 32, 32)
    assert isinstance(entry.model, torch.nn.Sequential)
    # 1 stem + (6 + 12 + 24 + 16) / group dense stages + 3 transitions + 1 head
    group = options["group"]
    assert len(entry.model) == 1 + sum(-(-n // group) for n in (6, 12, 24, 16)) + 3 + 1
    # the factory seeds torchvision's builder: the same weights as a plain densenet121
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reference = torchvision.models.densenet121(num_classes=10)
    x = entry.batch[0]
    assert torch.equal(entry.model(x), reference(x))
