"""remat.capture: a model as a costed Chain; the unplanned simulation predicts the measured
activation peak of a real training step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat import Chain, Plan, zoo
from remat.auto import predicted_step_peak_bytes
from remat.capture.chain import Captured, capture, capture_chain
from remat.capture.stages import Stages, UnsupportedModelError
from remat.measure.events import step_peak_bytes

# Issue 3's key test: the whole step's peak predicted from the captured chain (no plan) vs the
# exact peak of a real step, counted from the allocator's events (remat.measure.events.step_peak_bytes:
# it also sees the scratch memory oneDNN kernels allocate inside convolutions and LSTMs, which
# MemTracker cannot). Sizes keep the suite fast on a 2-core CPU.
KEY_MODELS = {
    "mlp-chain": dict(layers=8, width=256, batch_size=256),
    "resnet18": dict(image_size=64, batch_size=8),
    "vgg11": dict(image_size=32, batch_size=8),
    "gpt2": dict(n_layer=3, n_embd=128, n_head=4, vocab_size=512, seq_len=128, batch_size=4),
    "lstm-seq": dict(seq_len=256, input_size=16, hidden=64, layers=3, batch_size=4),
}


@pytest.mark.parametrize("name", sorted(KEY_MODELS))
def test_unplanned_simulation_predicts_the_measured_step_peak(name):
    entry = zoo.get(name, **KEY_MODELS[name])
    model = entry.model

    def step():
        entry.loss_fn(model, entry.batch).backward()
        model.zero_grad(set_to_none=True)

    measured = step_peak_bytes(step, model, None, entry.batch)
    captured = capture(model, entry.batch, entry.loss_fn, repeats=1)
    predicted = predicted_step_peak_bytes(model, captured, Plan.none(captured.chain))
    assert abs(predicted / measured - 1) <= 0.01, (name, predicted, measured)


def test_a_channels_last_model_is_predicted_as_it_runs():
    """Each stage's backward is measured with its gradient in the layout the step gives it
    (NOTE [ Gradient layouts ] in remat.capture.chain): in channels_last, ResNet-18's stem
    seeded with contiguous ones measured 21 MB more than in the step, and the least budget
    remat named was 8 % above what its plan then measured. Its average pool gives layer4's
    output a contiguous gradient: that stage is measured again with it."""
    import torchvision

    torch.manual_seed(0)
    cl = torch.channels_last
    model = torchvision.models.resnet18(num_classes=10).to(memory_format=cl)
    x = torch.randn(8, 3, 96, 96).to(memory_format=cl)
    _assert_predicted_as_measured(model, x, ("hong-dp", "every-stage"))


def test_a_stage_whose_gradient_comes_back_in_another_layout_is_measured_with_it():
    """A flatten gives the channels_last stage before it a contiguous gradient. Measured
    seeded in its own layout, that stage's backward (a max pool's, which copies the gradient
    into its input's layout first) was 21 MB short, and the unplanned step's peak predicted
    27 % below what it measured: the stage is measured again with the layout that came back."""
    torch.manual_seed(0)
    cl = torch.channels_last
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.Sequential(nn.Conv2d(4, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(64 * 32 * 32, 10)),
    ).to(memory_format=cl)
    x = torch.randn(16, 3, 64, 64).to(memory_format=cl)
    _assert_predicted_as_measured(model, x, ("every-stage",))


def _assert_predicted_as_measured(model: nn.Module, x: torch.Tensor, methods) -> None:
    """The whole step's predicted peak (loss-only loop, no optimizer) within 1 % of the
    measured one, unplanned and under each of ``methods``' plans."""
    from remat.execute.chain import apply

    def loss_fn(m, b):
        return m(b).square().mean()

    captured = capture(model, x, loss_fn, repeats=1)
    chain = captured.chain
    for plan in (Plan.none(chain), *(remat.plan(chain, m) for m in methods)):
        planned = apply(model, plan, stages=captured.stages)

        def step(planned=planned):
            loss_fn(planned, x).backward()
            model.zero_grad(set_to_none=True)

        measured = step_peak_bytes(step, model, None, x)
        predicted = predicted_step_peak_bytes(model, captured, plan)
        assert abs(predicted / measured - 1) <= 0.01, (plan.describe(), predicted, measured)


@pytest.mark.fresh_process
def test_costs_are_stable_across_runs():
    entry = zoo.get("resnet18", image_size=32, batch_size=4)
    a = capture_chain(entry.model, entry.batch, entry.loss_fn, repeats=3)
    b = capture_chain(entry.model, entry.batch, entry.loss_fn, repeats=3)
    for field in ("out_bytes", "saved_bytes"):
        assert getattr(a, field) == getattr(b, field), field
    # The overheads include oneDNN's scratch memory, seen by the allocator. Whether a stage's
    # convolution reorders its weight into a fresh buffer depends on oneDNN's caches, which
    # earlier work in the same process leaves behind (seen under pytest-xdist: 146,944 B on one
    # layer1 block, a 64x64x3x3 weight). So the overheads agree up to one such weight.
    weight = max(p.numel() * p.element_size() for p in entry.model.layer1.parameters())
    for field in ("fwd_overhead_bytes", "bwd_overhead_bytes"):
        for x, y in zip(getattr(a, field), getattr(b, field), strict=True):
            assert abs(x - y) <= weight, (field, x, y)
    assert a.input_bytes == b.input_bytes
    # times: medians of 3 on a shared 2-core machine (±30 % between runs, shared/peers.md);
    # the totals of forward + backward agree within a factor of 3
    ta = a.total_fwd_time() + a.total_bwd_time()
    tb = b.total_fwd_time() + b.total_bwd_time()
    assert 1 / 3 < ta / tb < 3, (ta, tb)


@pytest.mark.parametrize("name", ["mlp-chain", "gpt2"])
def test_fake_capture_has_the_real_bytes_and_counts_flops(name):
    entry = zoo.get(name, **KEY_MODELS[name])
    real = capture_chain(entry.model, entry.batch, entry.loss_fn, repeats=1)
    fake = capture_chain(entry.model, entry.batch, entry.loss_fn, fake=True)
    assert fake.time_unit == "flop" and real.time_unit == "s"
    for field in (
        "out_bytes",
        "saved_bytes",
        "fwd_overhead_bytes",
        "fwd_none_overhead_bytes",
        "bwd_overhead_bytes",
    ):
        assert getattr(real, field) == getattr(fake, field), field
    assert real.input_bytes == fake.input_bytes
    assert sum(fake.fwd_time) > 0 and sum(fake.bwd_time) > sum(fake.fwd_time)


def test_saved_bytes_follow_the_cost_model_convention():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    chain = capture_chain(model, x, repeats=1)
    assert chain.names == ("0", "1", "2")
    assert chain.input_bytes == 4 * 16 * 4
    # Linear: saves its input (the batch: not counted) and its weight (a parameter: not
    # counted); its output is not saved by itself, so it is added: 4 x 32 floats.
    # GELU: saves its input (stage 1's output: not counted) + its own output.
    # Linear + loss (.sum()): the loss is folded in: output = the scalar loss.
    assert chain.out_bytes == (512, 512, 4)
    assert chain.saved_bytes == (512, 512, 4)
    assert chain.time_unit == "s" and all(t > 0 for t in chain.fwd_time)


def test_loss_is_folded_into_the_last_stage():
    entry = zoo.get("gpt2", **KEY_MODELS["gpt2"])
    chain = capture_chain(entry.model, entry.batch, entry.loss_fn, repeats=1)
    assert chain.n == 2 + 2 * 3  # embedding, 3 blocks of 2 halves, head + loss
    assert chain.out_bytes[-1] == 4  # the loss
    logits = 4 * 128 * 512 * 4
    assert chain.saved_bytes[-1] >= logits  # the cross-entropy keeps its log-softmax


def test_capture_returns_real_stages_and_restores_the_model():
    entry = zoo.get("resnet18", image_size=32, batch_size=4)
    model = entry.model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    marker = torch.ones_like(model.fc.weight)
    model.fc.weight.grad = marker
    rng = torch.get_rng_state()
    for fake in (False, True):
        captured = capture(model, entry.batch, entry.loss_fn, fake=fake, repeats=1)
        assert isinstance(captured, Captured) and isinstance(captured.chain, Chain)
        assert isinstance(captured.stages, Stages) and captured.stages.n == captured.chain.n
        assert captured.chain.names == captured.stages.names
        assert captured.stages.modules[-1][-1] is model.fc
    for k, v in model.state_dict().items():
        assert type(v) is torch.Tensor and torch.equal(v, state[k]), k
    assert model.fc.weight.grad is marker
    assert model.conv1.weight.grad is None
    assert torch.equal(torch.get_rng_state(), rng)


def test_named_stages_and_unsupported_models():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 2)

        def forward(self, x):
            return self.b(self.a(x))

    x = torch.randn(3, 8)
    with pytest.raises(UnsupportedModelError):
        capture_chain(Net(), x)
    chain = capture_chain(Net(), x, stages=["a", "b"], repeats=1)
    assert chain.names == ("a", "b") and chain.out_bytes == (3 * 8 * 4, 4)
    fake = capture_chain(Net(), x, stages=["a", "b"], fake=True)
    assert fake.out_bytes == chain.out_bytes and fake.saved_bytes == chain.saved_bytes


def test_loss_fn_with_labels_and_custom_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 3))
    batch = (torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1]))

    def loss_fn(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    chain = capture_chain(model, batch, loss_fn, repeats=1)
    assert chain.n == 2  # Linear+ReLU (in-place joins), Linear+loss
    assert chain.input_bytes == 5 * 6 * 4 + 5 * 8
    with pytest.raises(ValueError, match="never called the model"):
        capture_chain(model, batch, lambda m, b: b[0].sum())


def test_capture_inside_a_profiler_warns_and_leaves_it_running():
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.warns(UserWarning, match="inside a torch.profiler session"):
            chain = capture_chain(model, torch.randn(4, 8), repeats=1)
        assert torch.autograd.profiler._is_profiler_enabled
        torch.ones(3).sum()
    assert chain.n == 3
    assert any(e.name == "aten::sum" for e in prof.events())
