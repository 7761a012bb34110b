"""The generic stages of a forward over a list of blocks (remat.capture.stages.families.blocks).

Every model here is cut into prefix + one stage per block + suffix, without an adapter of its
own; the planned model must give eager's loss, gradients, dropout masks and batch-norm
statistics under plans that checkpoint the prefix, the blocks and the suffix, and a model that
is not such a chain must be refused (auto then takes the module-graph path).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import remat
from remat.capture.chain import capture
from remat.capture.stages import StageMismatchError, run_stages, split_stages
from remat.capture.stages.families import FAMILIES, blocks
from remat.core.plan import ChainSegment, Plan
from remat.execute.chain import apply


# ---------------------------------------------------------------------- models
class MLP(nn.Sequential):
    """An nn.Sequential subclass with its own forward (the issue's 64-layer MLP, smaller)."""

    def __init__(self, depth: int = 16, width: int = 64) -> None:
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        super().__init__(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(self.norm(x)) + bias)) * scale


class Tower(nn.Module):
    """Code around a ModuleList loop: a stem with batch norm and dropout, an extra tensor
    passed to every block, a head with dropout."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.bn = nn.BatchNorm1d(width)
        self.bias = nn.Parameter(torch.zeros(width))
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(self.bn(self.stem(x)), 0.3, self.training)
        bias = torch.sin(torch.arange(h.shape[-1], dtype=h.dtype))  # needs no gradient
        for layer in self.layers:
            h = layer(h, bias, scale=0.5)
        return self.head(nn.functional.dropout(h, 0.3, self.training))


class SkipTower(Tower):
    """The head uses the stem's output besides the blocks' (a skip connection)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.stem(x)
        h = h0
        for layer in self.layers:
            h = layer(h, self.bias)
        return self.head(h + h0)


class AllHidden(Tower):
    """Returns every block's output (output_hidden_states-style)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        seen = []
        for layer in self.layers:
            h = layer(h, self.bias)
            seen.append(h)
        return self.head(torch.stack(seen).sum(0))


class Changing(Tower):
    """Each block gets another number (a non-tensor argument): recorded per block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for i, layer in enumerate(self.layers):
            h = layer(h, self.bias, scale=float(i + 1))
        return self.head(h)


class Counting(Tower):
    """Each block gets a number that also changes call to call (not a function of the
    input's shape): what was recorded does not hold on the next call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.stem(x)
        for i, layer in enumerate(self.layers):
            h = layer(h, self.bias, scale=float(i + self.calls))
        return self.head(h)


class ChangingTensor(Tower):
    """Each block gets another tensor: not a chain remat can cut."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for i, layer in enumerate(self.layers):
            h = layer(h, self.bias * i)
        return self.head(h)


class DimStage(nn.Module):
    """A Swin stage's calling convention: tokens ``(B, H*W, C)`` and their ``(H, W)``; returns
    the downsampled tokens, the tokens before downsampling and ``(H, W, H/2, W/2)``."""

    def __init__(self, width: int, down: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.down = down

    def forward(self, x: torch.Tensor, dims: tuple[int, int], scale: float | None = None):
        b, _, c = x.shape
        h, w = dims
        grid = self.norm(x).view(b, h, w, c).permute(0, 3, 1, 2)
        y = x + torch.tanh(self.conv(grid)).flatten(2).transpose(1, 2)
        if not self.down:
            return y, y, (h, w, h, w)
        pooled = nn.functional.avg_pool2d(y.transpose(1, 2).reshape(b, c, h, w), 2)
        return pooled.flatten(2).transpose(1, 2), y, (h, w, h // 2, w // 2)


class DimNet(nn.Module):
    """Stages that pass their dimensions on (Hugging Face's Swin encoder)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, width, 2, stride=2)
        self.layers = nn.ModuleList(DimStage(width, i < 2) for i in range(3))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.embed(x)
        dims = (e.shape[2], e.shape[3])
        h = nn.functional.dropout(e.flatten(2).transpose(1, 2), 0.2, self.training)
        for layer in self.layers:
            out = layer(h, dims)
            h = out[0]
            dims = (out[2][-2], out[2][-1])
        return self.head(h.mean(1))


class DimSkip(DimNet):
    """The head reads a stage's tokens before downsampling (a skip past the blocks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.embed(x)
        dims = (e.shape[2], e.shape[3])
        h = e.flatten(2).transpose(1, 2)
        before = []
        for layer in self.layers:
            out = layer(h, dims)
            h, dims = out[0], (out[2][-2], out[2][-1])
            before.append(out[1])
        return self.head(h.mean(1) + before[0].mean(1))


class Stem(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.drop(self.bn(self.conv(x))))


class AttributeNet(nn.Module):
    """timm's ResNet's shape: stages called as attributes (``self.layer1(x)``...), not in a
    loop; each stage an ``nn.Sequential`` of residual blocks."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = Stem(width)
        self.layer1 = nn.Sequential(Residual(width), Residual(width))
        self.layer2 = nn.Sequential(Residual(width))
        self.layer3 = nn.Sequential(Residual(width), Residual(width))
        self.fc = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        return self.fc(nn.functional.dropout(x.mean((2, 3)), 0.3, self.training))


class NamedBlocks(nn.Module):
    """Blocks of one class as attributes ``block1``, ``block2``, ... called one after another."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.block1 = Block(width)
        self.block2 = Block(width)
        self.block3 = Block(width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        bias = torch.cos(torch.arange(h.shape[-1], dtype=h.dtype))
        h = self.block1(h, bias)
        h = self.block2(h, bias)
        h = self.block3(h, bias)
        return self.head(h)


class Swapped(AttributeNet):
    """The attribute stages called out of their registration order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer2(x)
        x = self.layer1(x)
        x = self.layer3(x)
        return self.fc(x.mean((2, 3)))


class Skipping(AttributeNet):
    """The output of layer1 is added after layer3 (a skip past the stages in between)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.layer1(x)
        x = self.layer3(self.layer2(y)) + y
        return self.fc(x.mean((2, 3)))


def _plans(n: int) -> list[Plan]:
    """Every stage checkpointed; the prefix with the first block and the last block with the
    suffix checkpointed, the middle stored; nested: the whole chain checkpointed, recomputed
    under every-stage."""
    inner = tuple(ChainSegment(i, i, True) for i in range(1, n + 1))
    return [
        Plan.every_stage(n),
        Plan.from_chain_segments(
            [ChainSegment(1, 2, True), ChainSegment(3, n - 2), ChainSegment(n - 1, n, True)]
        ),
        Plan.from_chain_segments([ChainSegment(1, n, True, inner)]),
    ]


def _step(model: nn.Module, call, seed: int = 7) -> tuple[torch.Tensor, dict]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = call(model)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _check_plans(model: nn.Module, call, expect_names: tuple[str, str] | None = None) -> None:
    stages = split_stages(model)
    assert stages.kind == "blocks"
    if expect_names:
        assert (stages.names[1], stages.names[-2]) == expect_names
    eager = copy.deepcopy(model)
    loss0, grads0 = _step(eager, call)
    buffers0 = {k: b.clone() for k, b in eager.named_buffers()}
    for plan in _plans(stages.n):
        work = copy.deepcopy(model)
        planned = apply(work, plan)
        assert planned.stages.kind == "blocks"
        loss, grads = _step(planned.model, lambda m, p=planned: call(p))
        assert torch.equal(loss, loss0), plan.describe()
        assert grads.keys() == grads0.keys()
        for k in grads0:
            torch.testing.assert_close(grads[k], grads0[k], rtol=1e-5, atol=1e-7, msg=k)
        for k, b in work.named_buffers():  # batch-norm statistics updated once
            torch.testing.assert_close(b, buffers0[k], msg=k)


# ---------------------------------------------------------------------- recognition
def test_the_generic_family_is_tried_last() -> None:
    assert FAMILIES[-1] is blocks.split


def test_code_around_a_module_list_is_a_chain_with_eager_gradients_masks_and_statistics() -> None:
    torch.manual_seed(0)
    model = Tower().train()
    x = torch.randn(6, 8)
    _check_plans(model, lambda m: m(x).square().mean(), ("layers.0", "layers.3"))


def test_a_sequential_subclass_with_its_own_forward_is_a_chain() -> None:
    torch.manual_seed(0)
    model = MLP(depth=4, width=16)
    x = torch.randn(4, 16)
    stages = split_stages(model)
    assert stages.n == 2 + 8  # prefix, Linear and ReLU children, suffix
    _check_plans(model, lambda m: m(x).square().mean())


def test_blocks_called_with_other_numbers_each_are_a_chain() -> None:
    # a non-tensor argument that differs block to block is recorded on the model's own run
    # (the first call's check) and checked against the model's on every run
    torch.manual_seed(0)
    model = Changing().train()
    x = torch.randn(6, 8)
    _check_plans(model, lambda m: m(x).square().mean(), ("layers.0", "layers.3"))


def test_stages_passing_their_dimensions_are_a_chain_at_each_input_size() -> None:
    torch.manual_seed(0)
    model = DimNet().train()
    stages = split_stages(model)
    assert stages.names[1:-1] == ("layers.0", "layers.1", "layers.2")
    for size in (16, 8):  # another size: recorded again on its first call
        x = torch.randn(2, 3, size, size)
        _check_plans(model, lambda m, x=x: m(x).square().mean())
    plan = _plans(stages.n)[1]
    planned = apply(copy.deepcopy(model), plan, replan=lambda *a, **k: plan)
    eager = copy.deepcopy(model)
    for size in (16, 8, 16):  # one planned module, its input size changing
        x = torch.randn(2, 3, size, size)
        _, g0 = _step(eager, lambda m, x=x: m(x).square().mean())
        _, g1 = _step(planned.model, lambda m, x=x: planned(x).square().mean())
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-7, msg=k)


def test_stages_passing_their_dimensions_plan_on_fake_tensors() -> None:
    # a fake capture records the blocks' arguments on the model's own run on fake tensors
    # (no values to compare): the same bytes per stage as the real capture
    torch.manual_seed(0)
    model = DimNet().train()
    x = torch.randn(4, 3, 16, 16)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).square().mean()

    fake = capture(copy.deepcopy(model), x, loss_fn=loss_fn, fake=True)
    real = capture(copy.deepcopy(model), x, loss_fn=loss_fn)
    assert fake.stages.kind == real.stages.kind == "blocks"
    a, b = real.chain, fake.chain
    assert (a.out_bytes, a.saved_bytes, a.input_bytes) == (
        b.out_bytes,
        b.saved_bytes,
        b.input_bytes,
    )
    eager = copy.deepcopy(model)
    planned, summary = remat.auto(model, x, loss_fn, fake=True)
    assert "5 stages" in str(summary)
    _, g0 = _step(eager, lambda m: loss_fn(m, x))
    _, g1 = _step(model, lambda m: loss_fn(planned, x))
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-7, msg=k)


def test_stages_called_as_attributes_are_a_chain() -> None:
    torch.manual_seed(0)
    model = AttributeNet().train()
    x = torch.randn(4, 3, 8, 8)
    stages = split_stages(model)
    assert stages.names[1:-1] == ("layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer3.1")
    _check_plans(model, lambda m: m(x).square().mean())


def test_blocks_of_one_class_called_as_attributes_are_a_chain() -> None:
    torch.manual_seed(0)
    model = NamedBlocks().train()
    x = torch.randn(6, 8)
    _check_plans(model, lambda m: m(x).square().mean(), ("block1", "block3"))


@pytest.mark.parametrize(
    "cls, what",
    [(Swapped, "not a chain"), (Skipping, "other than the last"), (DimSkip, "other than the last")],
)
def test_image_stages_that_are_not_a_chain_are_refused(cls: type, what: str) -> None:
    torch.manual_seed(0)
    model = cls().train()
    x = torch.randn(4, 3, 8, 8)
    stages = split_stages(model)
    assert stages.kind == "blocks"
    with pytest.raises(StageMismatchError, match=what):
        run_stages(stages, x)


@pytest.mark.parametrize(
    "cls, what",
    [
        (SkipTower, "computed before them"),
        (AllHidden, "other than the last"),
        (ChangingTensor, "other arguments"),
        (Counting, "other arguments"),
    ],
)
def test_forwards_that_are_not_a_chain_are_refused(cls: type, what: str) -> None:
    torch.manual_seed(0)
    model = cls().train()
    x = torch.randn(6, 8)
    stages = split_stages(model)  # recognised by structure; refused on its first call
    with pytest.raises(StageMismatchError, match=what):
        run_stages(stages, x)


def test_auto_takes_the_graph_path_for_a_refused_forward() -> None:
    torch.manual_seed(0)
    model = SkipTower().train()
    x = torch.randn(6, 8)
    eager = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned, summary = remat.auto(model, x, lambda m, b: m(b).square().mean())
    assert "not a chain" in str(summary)
    _, g0 = _step(eager, lambda m: m(x).square().mean())
    _, g1 = _step(model, lambda m: planned(x).square().mean())
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-7)


def test_auto_plans_the_sequential_subclass_as_the_plain_sequential() -> None:
    # the issue: a 64-layer MLP subclassing nn.Sequential took the graph path and refused a
    # budget the chain path plans; now both reach the same least whole-step peak
    from remat.planners import BudgetTooSmallError

    torch.manual_seed(0)
    sub = MLP(depth=32, width=64)
    plain = nn.Sequential(*sub)
    x = torch.randn(64, 64)

    def least(model: nn.Module) -> int:
        with pytest.raises(BudgetTooSmallError) as info:
            remat.auto(model, x, lambda m, b: m(b).square().mean(), budget=1, loop="loss-only")
        return info.value.minimum_bytes

    budget = least(plain)  # the plain Sequential's chain path plans for it
    assert least(sub) <= budget
    planned, summary = remat.auto(
        sub, x, lambda m, b: m(b).square().mean(), budget=budget, loop="loss-only"
    )
    assert "66 stages" in str(summary)  # the chain path, as for the plain Sequential

    def step() -> None:
        planned(x).square().mean().backward()
        planned.zero_grad(set_to_none=True)

    assert remat.measure.events.step_peak_bytes(step, planned, None, x) <= budget * 1.001


# ---------------------------------------------------------------------- real families
transformers = pytest.importorskip("transformers")


def _hf(cls: str, config: str, **kw) -> nn.Module:
    torch.manual_seed(0)
    cfg = getattr(transformers, config)(**kw)
    cfg._attn_implementation = "eager"
    return getattr(transformers, cls)(cfg).train()


TINY = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=32,
)


@pytest.mark.parametrize(
    "make, names",
    [
        (
            lambda: _hf("BertForSequenceClassification", "BertConfig", num_labels=3, **TINY),
            ("bert.encoder.layer.0", "bert.encoder.layer.2"),
        ),
        (
            lambda: _hf(
                "Qwen2ForCausalLM",
                "Qwen2Config",
                num_key_value_heads=2,
                attention_dropout=0.1,
                **TINY,
            ),
            ("model.layers.0", "model.layers.2"),
        ),
    ],
    ids=["bert", "qwen2"],
)
def test_hugging_face_text_models(make, names) -> None:
    model = make()
    ids = torch.randint(0, 64, (2, 12))
    labels = torch.randint(0, 3, (2,)) if "Bert" in type(model).__name__ else ids
    _check_plans(model, lambda m: m(input_ids=ids, labels=labels).loss, names)


def test_hugging_face_vit() -> None:
    model = _hf(
        "ViTForImageClassification",
        "ViTConfig",
        num_labels=3,
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_dropout_prob=0.1,
    )
    x = torch.randn(2, 3, 16, 16)
    y = torch.randint(0, 3, (2,))
    _check_plans(
        model,
        lambda m: m(pixel_values=x, labels=y).loss,
        ("vit.encoder.layer.0", "vit.encoder.layer.2"),
    )


def test_use_cache_is_refused_and_off_by_default() -> None:
    model = _hf("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2, **TINY)
    ids = torch.randint(0, 64, (2, 8))
    stages = split_stages(model)
    assert run_stages(stages, ids).past_key_values is None
    with pytest.raises(StageMismatchError, match="use_cache=False"):
        run_stages(stages, ids, use_cache=True)


def test_timm_vit() -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=4,
        embed_dim=32,
        depth=3,
        num_heads=2,
        num_classes=3,
        drop_rate=0.1,
        proj_drop_rate=0.1,
    ).train()
    x = torch.randn(2, 3, 16, 16)
    _check_plans(model, lambda m: m(x).square().mean(), ("blocks.0", "blocks.2"))


def test_torchvision_stages_of_stages() -> None:
    tv = pytest.importorskip("torchvision")
    from torchvision.models.convnext import CNBlockConfig

    torch.manual_seed(0)
    model = tv.models.ConvNeXt(
        [CNBlockConfig(8, 16, 2), CNBlockConfig(16, None, 1)], num_classes=3
    ).train()
    x = torch.randn(2, 3, 32, 32)
    stages = split_stages(model)
    # the features' stages are flattened: stem, two blocks, downsample (norm, conv), a block
    assert stages.names[1:-1] == (
        "features.0.0",
        "features.0.1",
        "features.1.0",
        "features.1.1",
        "features.2.0",
        "features.2.1",
        "features.3.0",
    )
    _check_plans(model, lambda m: m(x).square().mean())


class MaskBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h)) * mask[..., 0]


class MaskTower(nn.Module):
    """The prefix makes a large tensor that every block takes (a mask): it lives through the
    whole forward whatever the plan, even where the prefix's output is dropped."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.layers = nn.ModuleList(MaskBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        mask = (x.detach().unsqueeze(-1) > 0).float().expand(-1, -1, 32).contiguous()
        for layer in self.layers:
            h = layer(h, mask)
        return self.head(h)


def test_a_tensor_every_block_takes_is_counted_while_it_lives() -> None:
    # NOTE [ Carried tensors ] in remat.capture: with the prefix and the first block
    # checkpointed, the mask the prefix made stays live (the blocks after take it); it was
    # predicted as dropped with the prefix's output (1 MiB under the measured peak)
    from remat.auto import predicted_step_peak_bytes
    from remat.capture.chain import capture
    from remat.measure.events import step_peak_bytes

    torch.manual_seed(0)
    model = MaskTower()
    x = torch.randn(128, 64)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).square().mean()

    captured = capture(model, x, loss_fn=loss_fn)
    assert captured.stages.kind == "blocks"
    n = captured.chain.n
    plan = Plan.from_chain_segments([ChainSegment(1, 2, True), ChainSegment(3, n)])
    planned = apply(model, plan, stages=captured.stages)

    def step() -> None:
        loss_fn(planned, x).backward()
        planned.zero_grad(set_to_none=True)

    measured = step_peak_bytes(step, planned, None, x)
    predicted = predicted_step_peak_bytes(model, captured, plan)
    assert measured <= predicted * 1.01, (measured, predicted)
