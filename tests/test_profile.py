"""remat.profile: exact step memory by category; fake tensors agree with real ones to the byte;
the ``remat profile`` command."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from remat import zoo
from remat.measure.events import step_peak_bytes
from remat.measure.profile import (
    CATEGORIES,
    OPTIMIZER_SCALAR_BYTES,
    MemoryReport,
    default_loss_fn,
    profile,
    training_step,
)

TINY = {
    "mlp-chain": dict(layers=4, width=64, batch_size=32),
    "resnet18": dict(image_size=32, batch_size=2),
    "gpt2": dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, seq_len=16, batch_size=2),
}


def _entry(name):
    return zoo.get(name, **TINY[name])


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("with_optimizer", [False, True])
def test_fake_equals_real_to_the_byte(name, with_optimizer):
    reports = []
    for fake in (False, True):
        entry = _entry(name)
        opt = torch.optim.Adam(entry.model.parameters()) if with_optimizer else None
        reports.append(profile(entry.model, entry.batch, entry.loss_fn, opt, fake=fake))
    real, fake = reports
    assert fake.fake and not real.fake
    assert real.peak_bytes == fake.peak_bytes
    assert real.categories == fake.categories
    assert real.activation_peak_bytes == fake.activation_peak_bytes
    assert real.start_bytes == fake.start_bytes
    assert real.module_peaks == fake.module_peaks
    # fake tensors may run a few more (metadata) operations: the points differ, not the peak
    assert max(b for _, b in real.timeline) == max(b for _, b in fake.timeline)
    assert real.peak_label == fake.peak_label


@pytest.mark.parametrize("name", sorted(TINY))
def test_categories_add_up_to_the_peak(name):
    entry = _entry(name)
    opt = torch.optim.Adam(entry.model.parameters())
    report = profile(entry.model, entry.batch, entry.loss_fn, opt)
    assert tuple(report.categories) == CATEGORIES
    assert sum(report.categories.values()) == report.peak_bytes
    assert max(b for _, b in report.timeline) == report.peak_bytes
    params = sum(p.numel() * p.element_size() for p in entry.model.parameters())
    assert report.categories["parameters"] == params
    assert report.by_category == report.categories  # the name the issue gives
    assert report.warmup_steps == 1
    assert 0 < report.activation_peak_bytes < report.peak_bytes


def test_breakdown_of_a_linear_chain_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(16, 64)
    params = sum(p.numel() * 4 for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    report = profile(model, x, optimizer=opt)
    c = report.categories
    assert c["parameters"] == params and c["buffers"] == 0
    # steady state: two Adam moments per parameter plus one 4-byte step counter per tensor
    assert c["optimizer"] == 2 * params + 4 * 4
    assert report.start_bytes == params + c["optimizer"] + x.numel() * 4
    # forward keeps: x (batch), Linear1 out (saved by GELU), GELU out (saved by Linear2)
    act = 16 * 64 * 4
    assert report.activation_peak_bytes >= 3 * act


def test_peak_equals_memtracker_and_allocator_events():
    entry = _entry("mlp-chain")
    model, batch = entry.model, entry.batch
    opt = torch.optim.Adam(model.parameters())
    ours = profile(model, batch, entry.loss_fn, opt).peak_bytes
    tracker = MemTracker()
    tracker.track_external(model, opt, batch)
    with tracker:
        training_step(model, batch, entry.loss_fn, opt)
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert ours == theirs

    def step() -> None:
        training_step(model, batch, entry.loss_fn, opt)

    assert abs(step_peak_bytes(step, model, opt, batch) - ours) <= 64


@pytest.mark.parametrize("onednn", [True, False], ids=["oneDNN", "without-oneDNN"])
def test_allocator_peak_counts_convolution_scratch(onednn, monkeypatch):
    # Convolutions allocate scratch memory that is not a tensor: MemTracker (peak_bytes) misses
    # it, the allocator's events (allocator_peak_bytes) do not. How much depends on the CPU with
    # oneDNN (its weight and input reorders follow the instruction set: 225 KiB measured here,
    # AVX2), not without it (im2col buffers, fixed by the shapes: 7.1 MiB at the peak).
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", onednn)  # restored after the test
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 8, 3))
    x = torch.randn(4, 64, 32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report = profile(model, x, optimizer=opt)
    assert report.allocator_peak_bytes is not None
    assert report.scratch_bytes == report.allocator_peak_bytes - report.peak_bytes
    assert report.scratch_bytes > 0  # oneDNN reorders the NCHW input into its blocked layout
    if not onednn:
        assert report.scratch_bytes >= 64 * 1024  # activations: 1 MiB

    def step() -> None:
        training_step(model, x, default_loss_fn, opt)

    assert abs(step_peak_bytes(step, model, opt, x) - report.allocator_peak_bytes) <= 64
    assert "kernel scratch" in report.table()
    back = MemoryReport.from_json(report.to_json())
    assert back.allocator_peak_bytes == report.allocator_peak_bytes
    fake = profile(model, x, optimizer=opt, fake=True)
    assert fake.allocator_peak_bytes is None and fake.scratch_bytes is None


def test_profile_without_optimizer_leaves_gradients_alone():
    entry = _entry("mlp-chain")
    marker = torch.full_like(entry.model[0].weight, 3.0)
    entry.model[0].weight.grad = marker
    report = profile(entry.model, entry.batch, entry.loss_fn)
    assert report.warmup_steps == 0 and report.categories["optimizer"] == 0
    assert entry.model[0].weight.grad is marker
    assert entry.model[2].weight.grad is None


def test_fake_profile_does_not_touch_the_model():
    entry = _entry("resnet18")
    before = {k: v.clone() for k, v in entry.model.state_dict().items()}
    opt = torch.optim.SGD(entry.model.parameters(), lr=0.1, momentum=0.9)
    profile(entry.model, entry.batch, entry.loss_fn, opt, fake=True)
    assert not opt.state
    for k, v in entry.model.state_dict().items():
        assert type(v) is torch.Tensor and torch.equal(v, before[k]), k
    assert all(type(p) is nn.Parameter for p in entry.model.parameters())


def test_module_peaks_and_timeline_labels():
    entry = _entry("resnet18")
    report = profile(entry.model, entry.batch, entry.loss_fn)
    assert report.model_name == "ResNet"
    for name in ("layer1", "layer4.1", "fc"):
        fwd, bwd = report.module_peaks[name]
        assert 0 < fwd <= report.peak_bytes and 0 < bwd <= report.peak_bytes
    phases = {label.split(":", 1)[0] for label, _ in report.timeline}
    assert {"forward", "backward"} <= phases
    assert any(label == "forward:layer1.0.conv1" for label, _ in report.timeline)


def test_json_round_trip_and_table():
    entry = _entry("mlp-chain")
    report = profile(entry.model, entry.batch, entry.loss_fn)
    again = MemoryReport.from_json(report.to_json())
    assert again == report
    with pytest.raises(ValueError, match="version"):
        MemoryReport.from_json(report.to_json().replace('"version": 1', '"version": 99'))
    table = report.table()
    for key in CATEGORIES:
        assert key in table
    assert "MiB" in table or "KiB" in table


def test_default_loss_fn_calling_conventions():
    class Two(nn.Module):
        def forward(self, a, b=None):
            return a * 2 if b is None else (a + b, a)

    model = Two()
    x = torch.ones(3)
    assert default_loss_fn(model, x).item() == 6
    assert default_loss_fn(model, (x, x)).item() == 6
    assert default_loss_fn(model, {"a": x, "b": x}).item() == 6
    with pytest.raises(TypeError, match="scalar"):
        training_step(model, x, loss_fn=lambda m, b: m(b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_reports_max_memory_allocated():
    entry = _entry("mlp-chain")
    report = profile(entry.model, entry.batch, entry.loss_fn, device="cuda")
    assert report.cuda_max_allocated_bytes is not None
    assert report.cuda_max_allocated_bytes >= report.peak_bytes * 0.9


# ---------------------------------------------------------------------- the command
def _args(model, *extra):
    from remat.cli import profile as command

    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    return command, parser.parse_args(["profile", model, *extra])


def test_command_tables_on_two_models(capsys):
    command, args = _args("mlp-chain", "--batch", "4")
    assert command.run(args) == 0
    out = capsys.readouterr().out
    assert "activations" in out and "chain: 64 stages" in out and "predicted" in out
    command, args = _args("wrn-28-2", "--batch", "2", "--optimizer", "sgd")
    assert command.run(args) == 0
    out = capsys.readouterr().out
    assert "WideResNet-28-2" in out and "chain: 14 stages" in out


def test_command_json_fake_and_plot(tmp_path, capsys):
    plot = tmp_path / "profile.png"
    command, args = _args("wrn-28-2", "--batch", "2", "--fake", "--json", "--plot", str(plot))
    assert command.run(args) == 0
    data = json.loads(capsys.readouterr().out)
    report = MemoryReport.from_json(json.dumps(data["report"]))
    assert report.fake and sum(report.categories.values()) == report.peak_bytes
    assert data["chain"]["time_unit"] == "flop" and len(data["chain"]["out_bytes"]) == 14
    assert data["predicted_activation_peak_bytes"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_errors_are_clear(tmp_path, monkeypatch):
    from remat.cli import main

    command, args = _args("no-such-model")
    with pytest.raises(ValueError, match="no zoo model 'no-such-model'"):
        command.run(args)
    (tmp_path / "bad_factories.py").write_text(
        "import torch\n"
        "def three():\n    return 3\n"
        "def mismatch():\n    return torch.nn.Linear(4, 2), torch.randn(2, 5)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    command, args = _args("bad_factories:three")
    with pytest.raises(ValueError, match="must return an nn.Module"):
        command.run(args)
    command, args = _args("bad_factories:mismatch")
    with pytest.raises(ValueError, match="does not fit bad_factories:mismatch"):
        command.run(args)
    command, args = _args("mlp-chain", "--plot", "out.jpg")
    with pytest.raises(ValueError, match="PNG"):
        command.run(args)
    assert main(["profile", "no-such-model"]) == 2


def test_fake_profile_with_adam_state_already_made():
    # Adam's `step` counter is a 0-d tensor read with .item(): it must stay real under fake mode
    entry = _entry("mlp-chain")
    opt = torch.optim.Adam(entry.model.parameters(), lr=0.0)
    entry.loss_fn(entry.model, entry.batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    real = profile(entry.model, entry.batch, entry.loss_fn, opt)
    fake = profile(entry.model, entry.batch, entry.loss_fn, opt, fake=True)
    assert real.peak_bytes == fake.peak_bytes
    assert real.categories == fake.categories


def test_optimizer_costs_take_the_real_optimizers_implementation(monkeypatch):
    # Fake tensors are not plain tensors, so a fake optimizer left at foreach=None would
    # always loop; optimizer_costs fixes the choice the real one makes (foreach on CUDA).
    import torch.optim.optimizer as torch_optimizer

    from remat.measure.profile import optimizer_costs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())

    def costs(**options):
        return optimizer_costs(model, torch.optim.Adam(model.parameters(), **options))

    assert costs() == costs(foreach=False)
    steps = 4 * len(list(model.parameters()))  # a float32 step counter per parameter
    state, transient = costs()
    assert state == 2 * params + steps  # exp_avg, exp_avg_sq
    # CPU: the for-loop implementation, and a wrapped scalar with its float copy
    scalar = OPTIMIZER_SCALAR_BYTES + 4
    assert transient == 2 * largest + scalar
    assert costs(foreach=True) == (state, params + scalar)
    monkeypatch.setattr(
        torch_optimizer, "_default_to_fused_or_foreach", lambda *a, **k: (False, True)
    )
    assert costs() == (state, params + scalar)  # what a CUDA optimizer would choose
    assert all(p.grad is None for p in model.parameters())
