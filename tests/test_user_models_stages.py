"""Stages of user models: never silently wrong, never a crash.

A module object used twice in an ``nn.Sequential``; user-named stages that leave a parameter
outside; a submodule replaced after planning; a plan made for another model; a Hugging Face
model with its own gradient checkpointing enabled. Each gives the unplanned model's output and
gradients, or a clear error saying what to do.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torchvision
from torch import nn

import remat
from remat.auto import stage_grad_bytes
from remat.capture.chain import capture, capture_chain
from remat.capture.stages import (
    StageMismatchError,
    Stages,
    UnsupportedModelError,
    run_stages,
    split_stages,
)
from remat.core.chain import Chain
from remat.core.plan import Plan, PlanError
from remat.execute.chain import apply


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and parameter gradients of one step (``sum`` of the output), grads reset."""
    for p in model.parameters():
        p.grad = None
    out = model(x)
    out.float().sum().backward()
    grads = {
        n.removeprefix("model."): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    for p in model.parameters():
        p.grad = None
    return out.detach(), grads


def _assert_same_step(planned: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    torch.manual_seed(7)
    out_ref, grads_ref = _step(model, x)
    torch.manual_seed(7)
    out, grads = _step(planned, x)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    assert len(grads) == len([p for p in model.parameters() if p.requires_grad])
    for key in grads_ref:
        torch.testing.assert_close(grads[key], grads_ref[key], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- 1. repeated modules
def _shared_relu() -> nn.Sequential:
    relu = nn.ReLU()
    return nn.Sequential(nn.Linear(16, 16), relu, nn.Linear(16, 16), relu, nn.Linear(16, 4))


def _repeated_block() -> nn.Sequential:
    block = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.2))
    return nn.Sequential(block, block, block, nn.Linear(16, 4))


def test_a_module_used_twice_is_one_stage_per_occurrence():
    model = _shared_relu()
    stages = split_stages(model)
    assert stages.names == ("0", "1", "2", "3", "4")  # named_children() lists relu once
    assert stages.modules[1] is stages.modules[3] is model[1]
    model = _repeated_block()
    stages = split_stages(model)
    assert stages.n == 4 and stages.modules[0] is stages.modules[1] is stages.modules[2]
    x = torch.randn(8, 16)
    with torch.no_grad():
        torch.manual_seed(0)
        expected = model(x)
        torch.manual_seed(0)
        assert torch.equal(run_stages(stages, x), expected)


@pytest.mark.parametrize("make", [_shared_relu, _repeated_block])
@pytest.mark.parametrize(
    "plan",
    [Plan.none(), Plan.every_stage(), Plan.from_checkpoints(4, [2])],
    ids=["none", "every-stage", "checkpoints"],
)
def test_repeated_modules_equal_gradients_under_plans(make, plan):
    torch.manual_seed(0)
    model = make().train()
    if plan.n is not None and plan.n != split_stages(model).n:
        plan = Plan.from_checkpoints(split_stages(model).n, [2])
    reference = make()
    reference.load_state_dict(model.state_dict())
    planned = apply(model, plan)
    x = torch.randn(8, 16)
    # batch-norm statistics: updated once per occurrence per step, as in the unplanned model
    torch.manual_seed(7)
    reference(x).sum().backward()
    torch.manual_seed(7)
    planned(x).sum().backward()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value)
    _assert_same_step(planned, model, x)
    with torch.no_grad():  # no_grad and eval run the stages plainly: the same function
        torch.manual_seed(7)
        expected = model(x)
        torch.manual_seed(7)
        torch.testing.assert_close(planned(x), expected)
    planned.eval()
    torch.testing.assert_close(planned(x), model.eval()(x))


def test_repeated_block_auto_with_a_budget_and_gradient_ownership():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(256, 256), nn.Tanh())
    model = nn.Sequential(block, block, block, block, block, block, nn.Linear(256, 8))
    x = torch.randn(512, 256)
    captured = capture(model, x, repeats=1)
    weight = sum(p.numel() * 4 for p in block.parameters())
    head = sum(p.numel() * 4 for p in model[6].parameters())
    # the shared block's gradient is made at its last occurrence (the backward's first)
    assert stage_grad_bytes(captured.stages) == [0, 0, 0, 0, 0, weight, head]
    _, free = remat.auto(model, x)  # the unplanned step's predicted peak
    fixed = free.fixed_bytes
    budget = fixed + (free.unplanned_peak_bytes - fixed) * 6 // 10
    planned, summary = remat.auto(model, x, budget=budget)
    assert summary.chain.n == 7
    assert any(True for _ in summary.plan.walk())
    assert summary.predicted_peak_bytes <= budget
    _assert_same_step(planned, model, x)


# ---------------------------------------------------------------------- 2. uncovered parameters
class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)) * self.scale)


def test_named_stages_that_leave_a_used_parameter_outside_are_refused():
    model = _Scaled()
    x = torch.randn(4, 8)
    names = ["stem", "body", "head"]
    with pytest.raises(StageMismatchError, match=r"\['scale'\].*the model itself.*freeze"):
        split_stages(model, names)
    with pytest.raises(StageMismatchError, match="'scale'"):
        apply(model, Plan.none(), stages=names)
    with pytest.raises(StageMismatchError, match="'scale'"):
        remat.auto(model, x, stages=names)
    # frozen: no gradient is lost (and the first call's check compares the output)
    model.scale.requires_grad_(False)
    planned = apply(model, Plan.every_stage(), stages=names)
    _assert_same_step(planned, model, x)


def test_an_unused_parameter_outside_the_stages_is_refused_too():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.extra = nn.Linear(4, 4)  # not used by the forward, but trained by the optimizer
    with pytest.raises(StageMismatchError, match=r"'extra.weight'.*\('extra'\).*freeze"):
        split_stages(model, ["0", "1"])
    model.extra.requires_grad_(False)
    assert split_stages(model, ["0", "1"]).n == 2


# ---------------------------------------------------------------------- 3. replaced submodules
def test_a_replaced_sequential_child_is_run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Linear(8, 2))
    planned = apply(model, Plan.from_checkpoints(4, [2]))
    x = torch.randn(4, 8)
    _assert_same_step(planned, model, x)
    model[2] = nn.Linear(8, 8)
    _assert_same_step(planned, model, x)
    assert planned.stages.modules[2] is model[2]
    with torch.no_grad():
        torch.testing.assert_close(planned(x), model(x))
    # a child added: 5 stages, the 4-stage plan no longer fits
    model.append(nn.Linear(2, 2))
    with pytest.raises(PlanError, match=r"'4' \(added\).*4 stages but the model has 5"):
        planned(x)
    with torch.no_grad(), pytest.raises(PlanError, match="plan again"):
        planned(x)


def test_a_replaced_resnet_head_and_block_are_run():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4)
    x = torch.randn(2, 3, 32, 32)
    planned = apply(model, Plan.from_checkpoints(10, [3, 6]))
    model.fc = nn.Linear(512, 4)
    model.layer2[1] = torchvision.models.resnet.BasicBlock(128, 128)
    _assert_same_step(planned, model, x)
    model.fc = nn.Linear(512, 7)  # another shape: this plan records no structure, so it runs
    _assert_same_step(planned, model, x)


def test_a_replaced_submodule_under_a_captured_plan_is_checked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    plan = remat.plan(capture_chain(model, x, fake=True), "chen-sqrt")
    planned = apply(model, plan)
    model[2] = nn.Linear(16, 2)  # same structure: the plan still fits
    _assert_same_step(planned, model, x)
    model[2] = nn.Linear(16, 3)  # other parameter shapes: plan again
    with pytest.raises(PlanError, match=r"'2' \(replaced\).*other stages.*capture_chain"):
        planned(x)


def test_replaced_submodule_with_hand_made_stages_is_an_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    stages = Stages((model[0], model[1]), ("a", "b"), lambda x: x, lambda a, x: a)
    planned = apply(model, Plan.every_stage(), stages=stages)
    model[1] = nn.Linear(4, 2)
    with pytest.raises(PlanError, match=r"'1' \(replaced\).*hand-made stages"):
        planned(torch.randn(2, 4))


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("transformers")


def test_a_replaced_gpt2_block_is_run(hf):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    config = hf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
    model = hf.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 128, (2, 8))
    planned = apply(model, Plan.every_stage())
    model.transformer.h[1] = GPT2Block(config, layer_idx=1)

    def loss_grads(m: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(3)
        loss = m(ids, labels=ids).loss
        loss.backward()
        grads = {n.removeprefix("model."): p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad(set_to_none=True)
        return loss.detach(), grads

    loss_ref, grads_ref = loss_grads(model)
    loss, grads = loss_grads(planned)
    torch.testing.assert_close(loss, loss_ref)
    for key in grads_ref:
        torch.testing.assert_close(grads[key], grads_ref[key])


# ---------------------------------------------------------------------- 4. a plan for another model
def test_apply_refuses_a_plan_made_for_another_model():
    torch.manual_seed(0)
    small = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    wide = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    x = torch.randn(4, 8)
    chain = capture_chain(small, x, fake=True)
    assert chain.stages_fingerprint == split_stages(small).fingerprint
    plan = remat.plan(chain, "chen-sqrt")
    assert plan.stages_fingerprint == chain.stages_fingerprint
    apply(small, plan)  # its own model
    with pytest.raises(PlanError, match="made for a model with other stages.*capture_chain"):
        apply(wide, plan)
    # JSON keeps it (same schema version); an older file without the field still loads
    again = Plan.from_json(plan.to_json())
    assert again == plan
    with pytest.raises(PlanError, match="other stages"):
        apply(wide, again)
    data = json.loads(plan.to_json())
    del data["stages_fingerprint"]
    old = Plan.from_json(json.dumps(data))
    assert old.stages_fingerprint is None
    apply(wide, old)
    apply(wide, Plan.from_checkpoints(3, [1]))  # a plan made without a captured chain
    # the chain keeps it through JSON; it is not part of the costs' fingerprint
    assert Chain.from_json(chain.to_json()).stages_fingerprint == chain.stages_fingerprint
    bare = Chain.from_json(json.dumps({**chain.to_dict(), "stages_fingerprint": ""}))
    assert bare.fingerprint == chain.fingerprint and "stages_fingerprint" not in bare.to_dict()
    # auto's plans carry it
    _, summary = remat.auto(small, x)
    assert summary.plan.stages_fingerprint == chain.stages_fingerprint


# ---------------------------------------------------------------------- 5. HF's own checkpointing
def _gpt2(hf):
    config = hf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
    return hf.GPT2LMHeadModel(config), torch.randint(0, 128, (2, 8))


def _bert(hf):
    config = hf.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=128,
        max_position_embeddings=32,
    )
    return hf.BertForMaskedLM(config), torch.randint(0, 128, (2, 8))


def _bert_model(hf):
    model, ids = _bert(hf)
    return model.bert, ids


@pytest.mark.parametrize("make", [_gpt2, _bert, _bert_model])
def test_hf_own_gradient_checkpointing_is_refused_everywhere(hf, make):
    from remat.capture.graph import trace_graph
    from remat.execute.graph import apply_graph

    torch.manual_seed(0)
    model, ids = make(hf)
    model.train()
    graph = trace_graph(model, ids, costs=False).graph  # before enabling it
    model.gradient_checkpointing_enable()
    match = r"gradient_checkpointing_disable\(\); remat plans the checkpointing itself"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not a chain, planning its graph" fallback
        with pytest.raises(UnsupportedModelError, match=match):
            remat.auto(model, ids)
        with pytest.raises(UnsupportedModelError, match=match):
            remat.auto(model, ids, budget="1GiB")
    with pytest.raises(UnsupportedModelError, match=match):
        apply(model, Plan.none())
    with pytest.raises(UnsupportedModelError, match=match):
        capture_chain(model, ids, fake=True)
    with pytest.raises(UnsupportedModelError, match=match):
        trace_graph(model, ids, fake=True, costs=False)
    with pytest.raises(UnsupportedModelError, match=match):
        apply_graph(model, remat.graphs.Plan.none(), graph)
    model.gradient_checkpointing_disable()
    apply_graph(model, remat.graphs.Plan.none(), graph)


@pytest.mark.parametrize("name", ["resnet18", "convnext_atto", "vit_tiny_patch16_224"])
def test_timm_own_gradient_checkpointing_is_refused(name):
    """timm's ``set_grad_checkpointing()`` (its training script's ``--grad-checkpointing``) is
    refused as Hugging Face's is; before, the graph capture crashed with "the timed step made 91
    torch calls, the recorded one 99", which did not say why. Off again, the model plans."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    kwargs = {"img_size": 32} if name.startswith("vit") else {}
    model = timm.create_model(name, num_classes=4, **kwargs)
    x = torch.randn(2, 3, 32, 32)
    model.set_grad_checkpointing(True)
    match = r"own \(timm\).*set_grad_checkpointing\(False\); remat plans the checkpointing"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not a chain, planning its graph" fallback
        with pytest.raises(UnsupportedModelError, match=match):
            remat.auto(model, x, budget="1GiB")
    with pytest.raises(UnsupportedModelError, match=match):
        apply(model, Plan.none())
    model.set_grad_checkpointing(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remat.auto(model, x, budget="1GiB")


def test_a_forward_that_checkpoints_its_own_layers_is_refused_saying_so():
    """A user's forward that runs torch.utils.checkpoint over its blocks: remat.auto raised a
    private error, "the timed step made 35 torch calls, the recorded one 42: the model's forward
    is not deterministic in its calls". Now an UnsupportedModelError says the forward
    checkpoints part of itself and what to do."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)) for _ in range(4)
            )
            self.head = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + checkpoint(block, x, use_reentrant=False)
            return self.head(x)

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsupportedModelError, match="forward checkpoints part of itself"):
            remat.auto(Net(), torch.randn(64, 32), budget="50%")


def _resnet10() -> nn.Module:
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


@pytest.mark.parametrize("where", ["layer2", ""])
def test_a_container_with_its_own_hooks_is_not_cut_into_stages(where: str) -> None:
    # torchvision's ResNet is cut into its residual blocks: layer2's forward (and the model's
    # own) never runs, so a forward hook keeping layer2's output for a feature loss never
    # fired (the loss raised KeyError; a stale tensor from an earlier call would have been
    # used silently). The stages are refused; auto plans the module graph, which runs the
    # model's own forward, and the gradients equal eager's
    model = _resnet10()
    feats: dict[str, torch.Tensor] = {}
    model.get_submodule(where).register_forward_hook(lambda m, i, o: feats.__setitem__("f", o))
    with pytest.raises(UnsupportedModelError, match=f"{where or 'the model'} .*has hooks"):
        split_stages(model)
    # a hook on a module a stage runs fires: such stages are kept
    inner = _resnet10()
    inner.layer2[0].register_forward_hook(lambda m, i, o: feats.__setitem__("g", o))
    assert split_stages(inner).n == 6

    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        out = m(batch)
        return nn.functional.cross_entropy(out, y) + feats["f"].float().pow(2).mean()

    reference = _resnet10()
    reference.load_state_dict(model.state_dict())
    reference.get_submodule(where).register_forward_hook(lambda m, i, o: feats.__setitem__("f", o))
    loss_fn(reference, x).backward()
    with pytest.warns(UserWarning, match="has hooks of its own"):
        planned, summary = remat.auto(model, x, loss_fn=loss_fn, budget="1GB")
    assert "graph" in str(summary)
    loss_fn(planned, x).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("where", ["layer2", "layer2.0", "layer3.0.bn1"])
def test_a_feature_hook_the_loss_reads_is_planned_within_the_least_budget(where: str) -> None:
    # a feature loss: a forward hook keeps a layer's output in a dict and the loss reads it.
    # The dict holds it through the backward (the plan cannot free it) and the last step's
    # until the next overwrites it: the module graph's plan at its least measured 262,144 B
    # over it (hook on layer2). And on the chain path (hook on a module a stage runs) the
    # stages, measured one at a time, raised "backward through the graph a second time"
    from remat.measure.events import step_peak_bytes
    from remat.planners import BudgetTooSmallError

    model = _resnet10()
    feats: dict[str, torch.Tensor] = {}
    model.get_submodule(where).register_forward_hook(lambda m, i, o: feats.__setitem__("f", o))
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(batch), y) + 1e-3 * feats["f"].pow(2).mean()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BudgetTooSmallError) as refused:
            remat.auto(model, x, loss_fn=loss_fn, budget=1, optimizer=opt)
        least = refused.value.minimum_bytes
        planned, summary = remat.auto(model, x, loss_fn=loss_fn, budget=least, optimizer=opt)
    assert "graph" in str(summary) and summary.plan.segments

    def step() -> None:
        loss_fn(planned, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    assert step_peak_bytes(step, model, opt, (x, y)) <= least
