"""remat.execute.chain: a plan applied with nested non-reentrant checkpoints gives the unplanned
model's loss and gradients, runs exactly the forwards remat.simulate counts, keeps batch-norm
statistics and dropout masks right, and refuses plans made for other inputs."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torchvision
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat
import remat.execute.chain as runtime
from remat import Chain, ChainSegment, Plan, PlanError, simulate
from remat.capture.stages import split_stages
from remat.execute.chain import PlannedModule, SignatureMismatchError, apply

# ---------------------------------------------------------------------- helpers


def nested_segment(lo: int, hi: int, depth: int) -> ChainSegment:
    """Checkpointed segment lo..hi with a sub-plan of the given depth: (ck) [stored] (ck)."""
    n = hi - lo + 1
    if depth <= 1 or n < 3:
        return ChainSegment(lo, hi, True)
    a = lo + n // 3 - 1
    b = lo + 2 * n // 3 - 1
    children = (
        nested_segment(lo, a, depth - 1),
        ChainSegment(a + 1, b),
        nested_segment(b + 1, hi, depth - 1),
    )
    return ChainSegment(lo, hi, True, children)


def plans_for(n: int) -> dict[str, Plan]:
    third = max(1, n // 3)
    plans = {
        "none": Plan.none(),
        "every-stage": Plan.every_stage(),
        "checkpoints": Plan.from_checkpoints(n, sorted({third, min(n - 1, 2 * third)})),
        "checkpoints-store-last": Plan.from_checkpoints(n, [third], store_last=True),
        "nested-2": Plan.from_chain_segments((nested_segment(1, n, 2),)),
        "nested-3": Plan.from_chain_segments((nested_segment(1, n, 3),)),
    }
    if n >= 4:
        # a stored head, then a nested segment whose last child is checkpointed
        half = n // 2
        plans["mixed"] = Plan.from_chain_segments(
            (
                ChainSegment(1, 1),
                ChainSegment(2, n, True, (ChainSegment(2, half), ChainSegment(half + 1, n, True))),
            )
        )
    return plans


def count_forwards(planned: PlannedModule) -> tuple[list[int], list]:
    counts = [0] * planned.stages.n
    handles = []
    for k, module in enumerate(planned.stages.modules):

        def hook(mod, inp, out, k=k):
            counts[k] += 1

        handles.append(module.register_forward_hook(hook))
    return counts, handles


def loss_of(output, target=None) -> torch.Tensor:
    if hasattr(output, "loss") and output.loss is not None:
        return output.loss
    if hasattr(output, "logits"):
        output = output.logits
    return (output.float() ** 2).mean()


def step(model, args, kwargs, seed=0, autocast=False):
    torch.manual_seed(seed)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else _null()
    with ctx:
        out = model(*args, **kwargs)
        loss = loss_of(out)
    loss.backward()
    return loss.detach()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        name: (None if p.grad is None else p.grad.detach().clone())
        for name, p in model.named_parameters()
    }


def assert_grads_equal(ref: nn.Module, got: nn.Module, rtol=1e-5, atol=1e-6):
    g_ref, g_got = grads(ref), grads(got)
    assert g_ref.keys() == g_got.keys()
    assert any(g is not None for g in g_ref.values())
    for name in g_ref:
        if g_ref[name] is None:
            assert g_got[name] is None, name
        else:
            torch.testing.assert_close(g_got[name], g_ref[name], rtol=rtol, atol=atol, msg=name)


# ---------------------------------------------------------------------- models


class LSTMLayer(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(size, size, batch_first=True)

    def forward(self, x):
        out, _ = self.lstm(x)
        return out


def mlp_chain():
    layers = []
    for _ in range(6):
        layers += [nn.Linear(32, 32), nn.GELU()]
    return nn.Sequential(*layers), (torch.randn(8, 32),), {}


def resnet18():
    return torchvision.models.resnet18(num_classes=10), (torch.randn(2, 3, 32, 32),), {}


def vgg11():
    model = torchvision.models.vgg11(num_classes=10)
    # the same structure with a small classifier (the stock one has 120M parameters)
    model.classifier = nn.Sequential(
        nn.Linear(512 * 7 * 7, 32), nn.ReLU(True), nn.Dropout(), nn.Linear(32, 10)
    )
    return model, (torch.randn(2, 3, 32, 32),), {}


def mobilenet_v2():
    return torchvision.models.mobilenet_v2(num_classes=10), (torch.randn(2, 3, 32, 32),), {}


def lstm_stack():
    model = nn.Sequential(*[LSTMLayer(16) for _ in range(4)], nn.Linear(16, 4))
    return model, (torch.randn(3, 96, 16),), {}


def gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64
    )  # default dropout 0.1 stays on: masks must match in recomputation
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 24))
    return model, (ids,), {"labels": ids}


def llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        attention_dropout=0.1,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 24))
    return model, (ids,), {"labels": ids}


MODELS = {
    "mlp-chain": mlp_chain,
    "resnet18": resnet18,
    "vgg11": vgg11,
    "mobilenet_v2": mobilenet_v2,
    "lstm-stack": lstm_stack,
    "gpt2": gpt2,
    "llama": llama,
}


def make(name):
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    model.train()
    return model, args, kwargs


# ---------------------------------------------------------------------- equality + counts


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_and_forward_counts_match(name):
    original, args, kwargs = make(name)
    n = split_stages(original).n
    chain = Chain.homogeneous(n)
    reference = copy.deepcopy(original)
    ref_loss = step(reference, args, kwargs, seed=1)
    for plan_name, plan in plans_for(n).items():
        model = copy.deepcopy(original)
        # early stop off: the executor runs exactly what simulate counts
        planned = apply(model, plan, example=(args, kwargs), early_stop=False)
        counts, handles = count_forwards(planned)
        try:
            loss = step(planned, args, kwargs, seed=1)
        finally:
            for h in handles:
                h.remove()
        assert list(simulate(chain, plan).forward_counts) == counts, plan_name
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6, msg=plan_name)
        assert_grads_equal(reference, model)
        # buffers (batch-norm running statistics and counts) as after one unplanned step
        for (k, b_ref), (k2, b) in zip(
            reference.named_buffers(), model.named_buffers(), strict=True
        ):
            assert k == k2
            torch.testing.assert_close(b, b_ref, rtol=1e-5, atol=1e-6, msg=f"{plan_name} {k}")


@pytest.mark.parametrize("plan_name", ["every-stage", "nested-3", "mixed"])
def test_batchnorm_statistics_updated_once_per_step(plan_name):
    model, args, kwargs = make("resnet18")
    reference = copy.deepcopy(model)
    plan = plans_for(split_stages(model).n)[plan_name]
    planned = apply(model, plan)
    for s in range(3):
        step(reference, args, kwargs, seed=s)
        step(planned, args, kwargs, seed=s)
    for (k, b_ref), (k2, b) in zip(reference.named_buffers(), model.named_buffers(), strict=True):
        assert k == k2
        if k.endswith("num_batches_tracked"):
            assert int(b) == int(b_ref) == 3, k
        else:
            torch.testing.assert_close(b, b_ref, rtol=1e-5, atol=1e-6, msg=k)
    assert_grads_equal(reference, model, rtol=1e-4, atol=1e-5)


def test_plain_torch_checkpoint_updates_batchnorm_twice():
    """What remat fixes (pytorch issue 96136): plain checkpoint counts each batch twice."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    reference = copy.deepcopy(block)
    reference(x).sum().backward()
    torch_checkpoint(block, x, use_reentrant=False).sum().backward()
    assert int(reference[1].num_batches_tracked) == 1
    assert int(block[1].num_batches_tracked) == 2
    assert not torch.allclose(block[1].running_mean, reference[1].running_mean)
    # the same block under remat: once
    block2 = copy.deepcopy(reference)
    block2[1].reset_running_stats()
    apply(block2, Plan.every_stage())(x).sum().backward()
    assert int(block2[1].num_batches_tracked) == 1
    torch.testing.assert_close(block2[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(block2[1].running_var, reference[1].running_var)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_recomputed_with_its_update_paused_counts_each_batch_once(momentum):
    """Torch's batch norm is recomputed on its real statistics with the update paused
    (momentum None and no batch count: factor 0), cumulative averages (momentum=None)
    included; the attributes are given back after each recomputation."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU()),
        nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU()),
    )
    reference = copy.deepcopy(model)
    planned = apply(
        model,
        Plan.from_chain_segments(
            [ChainSegment(1, 2, True, (ChainSegment(1, 1, True), ChainSegment(2, 2)))]
        ),
    )
    for s in range(3):
        x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(s))
        reference(x).sum().backward()
        planned(x).sum().backward()
        assert model[0][1].momentum == momentum and model[1][1].momentum == momentum
    for (k, b_ref), (_, b) in zip(reference.named_buffers(), model.named_buffers(), strict=True):
        assert torch.equal(b, b_ref), k
    assert int(model[1][1].num_batches_tracked) == 3
    assert_grads_equal(reference, model, rtol=1e-5, atol=1e-6)


def test_track_running_stats_false_would_break_checkpoint():
    """Why remat swaps in copies of the statistics instead of disabling tracking."""
    import contextlib

    from torch.utils.checkpoint import CheckpointError

    block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))

    @contextlib.contextmanager
    def no_tracking():
        block[1].track_running_stats = False
        try:
            yield
        finally:
            block[1].track_running_stats = True

    out = torch_checkpoint(
        block,
        torch.randn(2, 3, 8, 8),
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), no_tracking()),
    )
    with pytest.raises(CheckpointError, match="different number of tensors"):
        out.sum().backward()


def test_dropout_masks_identical_in_recomputation():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)) for _ in range(6)])
    x = torch.randn(4, 16)
    reference = copy.deepcopy(model)
    ref_loss = step(reference, (x,), {}, seed=7)
    rng_after_ref = torch.get_rng_state()
    planned = apply(model, Plan.from_chain_segments((nested_segment(1, 6, 3),)))
    loss = step(planned, (x,), {}, seed=7)
    assert torch.equal(torch.get_rng_state(), rng_after_ref)  # the same random numbers drawn
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert_grads_equal(reference, model)
    # and the masks differ from another seed's, so the test does test something
    model.zero_grad()
    other = step(planned, (x,), {}, seed=8)
    assert not torch.equal(other, ref_loss)


@pytest.mark.parametrize("name", ["mlp-chain", "resnet18", "gpt2"])
def test_autocast_bfloat16(name):
    model, args, kwargs = make(name)
    reference = copy.deepcopy(model)
    ref_loss = step(reference, args, kwargs, seed=3, autocast=True)
    plan = plans_for(split_stages(model).n)["nested-2"]
    planned = apply(model, plan)
    loss = step(planned, args, kwargs, seed=3, autocast=True)
    # recomputation re-enters the forward's autocast state: the same bf16 ops, the same values
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_equal(reference, model, rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = planned(*args, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out
    assert logits.dtype == torch.bfloat16  # autocast did apply


class _CountingCheckpoint:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return torch_checkpoint(*args, **kwargs)


@pytest.mark.parametrize("name", ["mlp-chain", "resnet18", "gpt2"])
def test_eval_and_no_grad_use_no_checkpoint(name, monkeypatch):
    counter = _CountingCheckpoint()
    monkeypatch.setattr(runtime, "checkpoint", counter)
    model, args, kwargs = make(name)
    planned = apply(model, Plan.every_stage())

    def out_of(o):
        return o.logits if hasattr(o, "logits") else o

    planned.eval()
    assert not model.training
    with torch.no_grad():
        expected = out_of(model(*args, **kwargs))
    got = out_of(planned(*args, **kwargs))  # eval with grad enabled
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert counter.calls == 0
    planned.train()
    torch.manual_seed(0)
    with torch.no_grad():
        got = out_of(planned(*args, **kwargs))  # training mode, no grad
        torch.manual_seed(0)
        expected = out_of(model(*args, **kwargs))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert counter.calls == 0
    step(planned, args, kwargs)
    assert counter.calls == split_stages(model).n  # every stage checkpointed, once each


def test_input_requiring_grad_and_not():
    model, (x,), _ = make("mlp-chain")
    reference = copy.deepcopy(model)
    plan = Plan.from_checkpoints(12, [3, 7])
    planned = apply(model, plan)
    # input without grad (the usual case): parameters still get gradients
    step(reference, (x,), {})
    step(planned, (x,), {})
    assert_grads_equal(reference, model)
    # input with grad: its gradient matches too
    xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    step(reference, (xr,), {})
    step(planned, (xp,), {})
    torch.testing.assert_close(xp.grad, xr.grad)


# ---------------------------------------------------------------------- signatures & errors


def test_batch_shape_change_raises_without_replan():
    model, (x,), _ = make("mlp-chain")
    planned = apply(model, Plan.from_checkpoints(12, [4, 8]), example=x)
    planned(x).sum().backward()
    with pytest.raises(SignatureMismatchError, match=r"\[8, 32\] float32.*\[5, 32\] float32"):
        planned(torch.randn(5, 32))
    with pytest.raises(SignatureMismatchError):
        planned(x.double())
    # eval / no_grad do not use the plan, so any size runs
    with torch.no_grad():
        planned(torch.randn(5, 32))


def test_first_training_call_records_the_signature():
    model, (x,), _ = make("mlp-chain")
    planned = apply(model, Plan.every_stage())
    assert planned.signature is None
    planned(x).sum().backward()
    assert planned.signature is not None
    with pytest.raises(SignatureMismatchError):
        planned(torch.randn(3, 32))


def test_replan_callback():
    model, (x,), _ = make("mlp-chain")
    calls = []

    def replan(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return Plan.from_checkpoints(12, [6])

    first = Plan.from_checkpoints(12, [4, 8])
    planned = apply(model, first, example=(x,), replan=replan, early_stop=False)
    planned(x).sum().backward()
    assert calls == [] and planned.plan == first
    y = torch.randn(5, 32)
    counts, handles = count_forwards(planned)
    planned(y).sum().backward()
    for h in handles:
        h.remove()
    assert calls == [(5, 32)]
    assert planned.plan.kept_activations() == [6]
    assert counts == list(
        simulate(Chain.homogeneous(12), Plan.from_checkpoints(12, [6])).forward_counts
    )
    planned(y).sum().backward()  # cached: no second call
    planned(x).sum().backward()  # back to the first plan
    assert calls == [(5, 32)] and planned.plan == first


def test_plan_stage_count_mismatch():
    model, (x,), _ = make("mlp-chain")
    with pytest.raises(PlanError, match="covers 5 stages but the model has 12 stages"):
        apply(model, Plan.from_checkpoints(5, [2]))


def test_a_graphs_plan_is_refused_by_the_chain_executor_even_with_as_many_nodes():
    """One plan type: a plan made for a module graph names nodes, not stages; with as many
    nodes as the model has stages it would otherwise run as a stage plan, silently other than
    planned."""
    from remat.core.synthetic import random_dag
    from remat.graphs import plan_graph

    model, (x,), _ = make("mlp-chain")
    graph = random_dag(12, 3)
    graph_plan = plan_graph(graph, "reforward")
    assert graph_plan.n == 12 and graph_plan.segments and not graph_plan.chain
    with pytest.raises(PlanError, match="made for a graph of 12 nodes.*apply_graph"):
        apply(model, graph_plan)
    # the same segments made by hand (no graph recorded) are a stage plan, as any manual plan
    manual = Plan.from_segments(s.nodes for s in graph_plan.segments if s.is_interval())
    assert apply(copy.deepcopy(model), manual).plan.n == 12


def test_shares_parameters_and_state_dict():
    model, (x,), _ = make("resnet18")
    planned = apply(model, Plan.every_stage())
    assert planned.model is model
    assert {id(p) for p in planned.parameters()} == {id(p) for p in model.parameters()}
    assert list(planned.state_dict()) == list(model.state_dict())  # the model's own keys
    assert planned.fc is model.fc  # attribute access falls through to the model
    assert "every-stage" in repr(planned)
    with pytest.raises(TypeError, match="already has a plan"):
        apply(planned, Plan.none())


def test_lazy_entry_point_and_named_stages():
    model = nn.Sequential(
        nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.GELU()), nn.Linear(4, 1)
    )
    reference = copy.deepcopy(model)
    planned = remat.apply(model, Plan.from_checkpoints(4, [2]), stages=["0", "1.0", "1.1", "2"])
    x = torch.randn(3, 4)
    step(reference, (x,), {})
    step(planned, (x,), {})
    assert_grads_equal(reference, model)


def test_early_stop_option_runs_less_than_simulated():
    """torch's early stop skips recomputation that remat.simulate counts (docs/executor.md)."""
    model, (x,), _ = make("mlp-chain")
    plan = Plan.from_chain_segments(
        (ChainSegment(1, 12, True, (ChainSegment(1, 6, True), ChainSegment(7, 12, True))),)
    )
    reference = copy.deepcopy(model)
    step(reference, (x,), {})
    planned = apply(model, plan, early_stop=True)
    counts, handles = count_forwards(planned)
    step(planned, (x,), {})
    for h in handles:
        h.remove()
    assert_grads_equal(reference, model)
    simulated = list(simulate(Chain.homogeneous(12), plan).forward_counts)
    assert simulated == [3] * 12
    # the parent's recomputation stops once the last child's input a[6] exists: stages 7..12
    # are not run by it; and the last stage of each recomputation stops at its last save.
    assert counts[6:11] == [2] * 5 and sum(counts) < sum(simulated)
    assert math.isclose(sum(counts[:6]) / 6, 3, rel_tol=0.2)


def test_runs_under_torch_compile_with_batchnorm():
    """Nested non-reentrant checkpoints are traced by dynamo; BN statistics are still right."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
            for _ in range(4)
        ]
    )
    x = torch.randn(2, 4, 8, 8)
    reference = copy.deepcopy(model)
    step(reference, (x,), {})
    planned = apply(model, Plan.from_chain_segments((nested_segment(1, 4, 2),)))
    compiled = torch.compile(planned, backend="aot_eager")
    step(compiled, (x,), {})
    assert_grads_equal(reference, model, rtol=1e-4, atol=1e-5)
    for (k, b_ref), (_, b) in zip(reference.named_buffers(), model.named_buffers(), strict=True):
        torch.testing.assert_close(b, b_ref, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.gpu
def test_cuda_dropout_and_batchnorm():
    """On a GPU: CUDA RNG state restored in recomputation, BN statistics updated once."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[
            nn.Sequential(
                nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.3)
            )
            for _ in range(6)
        ]
    ).cuda()
    x = torch.randn(2, 4, 16, 16, device="cuda")
    reference = copy.deepcopy(model)
    with torch.backends.cudnn.flags(enabled=True, deterministic=True, benchmark=False):
        ref_loss = step(reference, (x,), {}, seed=5)
        # early stop off: the executor runs exactly what simulate counts (with it, torch ended
        # the recomputations early: [3, 2, 2, 2, 2, 1] on an H100, docs/results/gpu)
        planned = apply(
            model, Plan.from_chain_segments((nested_segment(1, 6, 3),)), example=x, early_stop=False
        )
        counts, handles = count_forwards(planned)
        loss = step(planned, (x,), {}, seed=5)
    for h in handles:
        h.remove()
    assert counts == list(simulate(Chain.homogeneous(6), planned.plan).forward_counts)
    torch.testing.assert_close(loss, ref_loss)
    assert_grads_equal(reference, model, rtol=1e-4, atol=1e-5)
    for (k, b_ref), (_, b) in zip(reference.named_buffers(), model.named_buffers(), strict=True):
        torch.testing.assert_close(b, b_ref, msg=k)


# ---------------------------------------------------------------------- memory


def test_inner_checkpoint_inputs_are_freed_after_the_forward():
    """Only the top-level checkpoint inputs survive the forward: an inner checkpoint's input is
    recomputed by its parent (Rule 2), so nothing may hold it (e.g. the checkpointed closure)."""
    import gc
    import weakref

    torch.manual_seed(0)
    n = 12
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])
    for plan in plans_for(n).values():
        planned = apply(model, plan)
        first: dict[int, weakref.ref] = {}

        def hook(mod, inp, out, k, first=first):
            first.setdefault(k, weakref.ref(out))

        handles = [
            m.register_forward_hook(lambda mod, i, o, k=k: hook(mod, i, o, k))
            for k, m in enumerate(planned.stages.modules, start=1)
        ]
        out = planned(torch.randn(4, 8))
        gc.collect()
        alive = {k for k, r in first.items() if r() is not None}
        full = plan.for_chain(n)
        expected = {n}
        for seg in full.chain_segments():
            if seg.checkpoint:
                expected.add(seg.start - 1)
            else:  # a stored Linear keeps its input
                expected.update(i - 1 for i in seg.stages())
        expected.discard(0)
        assert alive == expected, plan.describe()
        out.sum().backward()
        for h in handles:
            h.remove()


def test_measured_peak_matches_simulate():
    """Exact allocator bytes of a step equal remat.core.chain_simulate's peak on a Linear chain."""
    from remat.measure.events import step_peak_bytes

    torch.manual_seed(0)
    n, batch, width = 12, 2048, 64
    act = batch * width * 4
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])
    x = torch.randn(batch, width)
    # a Linear saves only its input: saved_bytes == out_bytes, no overheads
    chain = Chain(
        fwd_time=[1.0] * n,
        bwd_time=[1.0] * n,
        out_bytes=[act] * n,
        saved_bytes=[act] * n,
        input_bytes=act,
    )
    for plan in plans_for(n).values():
        planned = apply(model, plan)

        def train_step(planned=planned):
            out = planned(x)
            out.backward(torch.ones_like(out))  # δ[n], as simulate's loss

        persistent = step_peak_bytes(lambda: None, model, None, x, warmup=0)
        measured = step_peak_bytes(train_step, model, None, x) - persistent + act  # + input
        simulated = simulate(chain, plan).peak_bytes
        # parameter-gradient temporaries are the only extra: < 0.5 activation here
        assert simulated <= measured <= simulated + act // 2, (plan.describe(), measured / act)
