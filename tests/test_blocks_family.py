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
from remat.capture.stages import StageMismatchError, run_stages, split_stages
from remat.capture.stages.families import FAMILIES, blocks
from remat.core.plan import Plan, Segment
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
    """Each block gets another extra argument: not a chain of identical calls."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for i, layer in enumerate(self.layers):
            h = layer(h, self.bias, scale=float(i))
        return self.head(h)


def _plans(n: int) -> list[Plan]:
    """Every stage checkpointed; the prefix with the first block and the last block with the
    suffix checkpointed, the middle stored; nested: the whole chain checkpointed, recomputed
    under every-stage."""
    inner = tuple(Segment(i, i, True) for i in range(1, n + 1))
    return [
        Plan.every_stage(n),
        Plan.from_segments([Segment(1, 2, True), Segment(3, n - 2), Segment(n - 1, n, True)]),
        Plan.from_segments([Segment(1, n, True, inner)]),
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


@pytest.mark.parametrize(
    "cls, what",
    [
        (SkipTower, "computed before them"),
        (AllHidden, "other than the last"),
        (Changing, "other arguments"),
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
    plan = Plan.from_segments([Segment(1, 2, True), Segment(3, n)])
    planned = apply(model, plan, stages=captured.stages)

    def step() -> None:
        loss_fn(planned, x).backward()
        planned.zero_grad(set_to_none=True)

    measured = step_peak_bytes(step, planned, None, x)
    predicted = predicted_step_peak_bytes(model, captured, plan)
    assert measured <= predicted * 1.01, (measured, predicted)
