"""Planning without the eager step: ``remat.auto(..., fake=True)`` and the calibrated time model
(src/remat/measure/calibration.py; issue #18).

The fake capture must see the bytes the real one sees (chain and graph paths), planning must
take a small fraction of the eager step's memory and never run the model on real tensors, the
plan it makes must hold its budget when trained for real with eager's gradients, and the
calibration is cached as versioned JSON.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch
from models import Recurrent
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import remat.measure.calibration as calibration
from remat import Chain, zoo
from remat.auto import auto, fixed_bytes
from remat.capture.chain import capture
from remat.capture.graph import trace_graph
from remat.measure.calibration import TimeModel, WorkCounter, time_model_for
from remat.measure.events import step_peak_bytes
from remat.measure.profile import profile


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    """One calibration for the module's tests, in a temporary cache directory."""
    return tmp_path_factory.mktemp("remat-cache")


@pytest.fixture(autouse=True)
def _cache_dir(cache, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(calibration.CACHE_ENV, str(cache))


class Branchy(nn.Module):
    """Not a chain (two branches meet in a product): planned as a module graph."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(32, width), nn.Tanh())
        self.a = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.b = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(self.a(h) * self.b(h))


def _mlp() -> zoo.ZooModel:
    torch.manual_seed(0)
    return zoo.get("mlp-chain", batch_size=1024, layers=8, width=128)


def _real_calls(model: nn.Module) -> tuple[list[str], object]:
    """Records every call of the model or of one of its modules on a tensor that is not fake
    (a global hook: a hook of the model's own would refuse its stages, which would not run it,
    remat.capture.stages._check_hooks_run)."""
    seen: list[str] = []
    mine = {id(m) for m in model.modules()}

    def hook(module: nn.Module, args: tuple) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if id(module) in mine and any(
            not isinstance(t, FakeTensor) and t.device.type != "meta" for t in tensors
        ):
            seen.append(type(module).__name__)

    return seen, nn.modules.module.register_module_forward_pre_hook(hook)


# ---------------------------------------------------------------- (a) bytes: fake == real
def test_fake_auto_captures_the_real_chain_bytes_without_a_real_step() -> None:
    entry = _mlp()
    real_plan, real = auto(entry.model, entry.batch, entry.loss_fn, budget="70%")
    seen, handle = _real_calls(entry.model)
    try:
        fake_plan, fake = auto(entry.model, entry.batch, entry.loss_fn, budget="70%", fake=True)
    finally:
        handle.remove()
    assert seen == []  # the model never ran on real tensors while planning
    assert fake.fake and not real.fake and "fake tensors" in str(fake)
    a, b = real.chain, fake.chain
    assert b.time_unit == "s" and a.time_unit == "s"
    assert (a.out_bytes, a.saved_bytes, a.input_bytes) == (
        b.out_bytes,
        b.saved_bytes,
        b.input_bytes,
    )
    assert (a.fwd_overhead_bytes, a.bwd_overhead_bytes) == (
        b.fwd_overhead_bytes,
        b.bwd_overhead_bytes,
    )
    assert fake.output_held_bytes == real.output_held_bytes > 0
    assert fake.unplanned_peak_bytes == real.unplanned_peak_bytes
    assert fake.fixed_bytes == real.fixed_bytes
    # modelled seconds: every stage costs something, backward more than forward overall
    assert all(t > 0 for t in b.fwd_time) and sum(b.bwd_time) > sum(b.fwd_time)


def test_fake_auto_captures_the_real_graph_bytes_without_a_real_step() -> None:
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(2048, 32)
    with pytest.warns(UserWarning, match="not a chain"):
        _, real = auto(model, x, budget="80%")
    seen, handle = _real_calls(model)
    try:
        with pytest.warns(UserWarning, match="not a chain"):
            _, fake = auto(model, x, budget="80%", fake=True)
    finally:
        handle.remove()
    assert seen == []
    a, b = real.chain, fake.chain
    assert [(n.name, n.out_bytes, n.saved_bytes) for n in a.nodes] == [
        (n.name, n.out_bytes, n.saved_bytes) for n in b.nodes
    ]
    assert a.input_bytes == b.input_bytes and b.time_unit == "s"
    assert fake.output_held_bytes == real.output_held_bytes > 0
    assert fake.unplanned_peak_bytes == real.unplanned_peak_bytes
    assert all(n.fwd_time > 0 for n in b.nodes)


def test_time_model_turns_the_counted_work_into_seconds() -> None:
    # the same capture with and without a time model: FLOPs, then a*FLOPs + b*bytes + c*ops
    entry = zoo.get("mlp-chain", batch_size=16, layers=4, width=32)
    flops = capture(entry.model, entry.batch, entry.loss_fn, fake=True).chain
    per_op = TimeModel("test", "torch.float32", 0.0, 0.0, 1.0)  # seconds = number of ops
    ops = capture(entry.model, entry.batch, entry.loss_fn, fake=True, time_model=per_op).chain
    assert flops.time_unit == "flop" and ops.time_unit == "s"
    assert ops.fwd_time[0] == 1.0  # a Linear stage's forward is one addmm
    per_flop = TimeModel("test", "torch.float32", 1.0, 0.0, 0.0)
    same = capture(entry.model, entry.batch, entry.loss_fn, fake=True, time_model=per_flop).chain
    assert same.fwd_time == flops.fwd_time and same.bwd_time == flops.bwd_time
    graph = trace_graph(entry.model, entry.batch, entry.loss_fn, fake=True, time_model=per_op)
    assert graph.graph.time_unit == "s" and graph.graph.nodes[0].fwd_time >= 1.0
    with pytest.raises(ValueError, match="fake=True"):
        capture(entry.model, entry.batch, entry.loss_fn, time_model=per_op)


def test_work_counter_counts_flops_bytes_and_ops_and_skips_views() -> None:
    a, b = torch.ones(64, 32), torch.ones(32, 16)
    with WorkCounter() as counter:
        c = a @ b
        c.view(-1), c.t(), c.detach()  # views move nothing
        c.add_(1)
    work = counter.work
    assert work.flops == 2 * 64 * 32 * 16
    assert work.ops == 2
    assert work.bytes_moved == 4 * (64 * 32 + 32 * 16 + 64 * 16) + 4 * (64 * 16 * 2)


# ------------------------------------------------------------ (b) planning memory is small
def test_fake_planning_peak_is_a_small_fraction_of_the_eager_step() -> None:
    torch.manual_seed(0)
    width, batch = 256, 8192
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(width, width), nn.GELU())])
    x = torch.randn(batch, width)

    def eager() -> None:
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)

    eager_peak = step_peak_bytes(eager, model, None, x)
    assert 50 * 2**20 < eager_peak < 200 * 2**20, eager_peak
    time_model_for(*calibration.planning_device(model))  # calibrated once per machine, cached
    plans = []

    def plan() -> None:
        plans.append(auto(model, x, budget="60%", fake=True))

    planning_peak = step_peak_bytes(plan, model, None, x, warmup=0)
    print(f"eager step peak {eager_peak} B, fake planning peak {planning_peak} B")
    # the parameters and the batch (10 MB here) and nothing of the step's activations
    assert planning_peak <= 0.25 * eager_peak, (planning_peak, eager_peak)
    assert plans[0][1].predicted_peak_bytes <= 0.6 * plans[0][1].unplanned_peak_bytes + 1


# --------------------------------------------------- (c) the fake plan holds when trained
def _grads(model: nn.Module, entry: zoo.ZooModel) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    entry.loss_fn(model, entry.batch).backward()
    grads = {n.removeprefix("model."): p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_fake_plan_meets_its_budget_for_real_with_eager_gradients() -> None:
    entry = _mlp()
    reference = profile(entry.model, entry.batch, loss_fn=entry.loss_fn)
    budget = (fixed_bytes(entry.model) + reference.peak_bytes) // 2
    expected = _grads(entry.model, entry)
    planned, summary = auto(entry.model, entry.batch, entry.loss_fn, budget=budget, fake=True)
    assert summary.predicted_peak_bytes <= budget
    assert summary.plan.describe() != "store all"
    measured = profile(planned, entry.batch, loss_fn=entry.loss_fn)
    assert measured.peak_bytes <= budget
    assert measured.peak_bytes <= 1.10 * summary.predicted_peak_bytes
    got = _grads(planned, entry)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-7)


def test_fake_graph_plan_meets_its_budget_for_real_with_eager_gradients() -> None:
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(4096, 32)

    def grads(m: nn.Module) -> dict[str, torch.Tensor]:
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        out = {n.removeprefix("model."): p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad(set_to_none=True)
        return out

    expected = grads(model)
    budget = int(0.8 * profile(model, x).peak_bytes)
    with pytest.warns(UserWarning, match="not a chain"):
        planned, summary = auto(model, x, budget=budget, fake=True)
    assert summary.predicted_peak_bytes <= budget
    assert profile(planned, x).peak_bytes <= budget
    for name, grad in grads(planned).items():
        torch.testing.assert_close(grad, expected[name])


def test_a_model_built_on_meta_is_planned_then_materialised_and_trained() -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(128, 128), nn.GELU())])
    x = torch.randn(1024, 128)  # a real batch is read on "meta" (shapes and dtypes only)
    with pytest.raises(ValueError, match="fake=True"):
        auto(model, x, budget="60%")
    planned, summary = auto(model, x, budget="60%", fake=True)
    assert summary.fake and summary.predicted_peak_bytes < summary.unplanned_peak_bytes
    meta_batch = auto(model, x.to("meta"), budget="60%", fake=True)[1]
    assert meta_batch.plan == summary.plan
    planned.to_empty(device="cpu")
    for module in planned.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    planned(x).square().mean().backward()
    assert all(p.grad is not None for p in planned.parameters())


# ------------------------------------------------------------ (d) the calibration cache
def test_calibration_is_cached_as_versioned_json(tmp_path, monkeypatch) -> None:
    calls = []
    real = calibration.calibrate

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(calibration, "calibrate", counted)
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    first = time_model_for("cpu")
    assert len(calls) == 1
    (path,) = tmp_path.glob("time-model-*.json")
    data = json.loads(path.read_text())
    assert data["schema"] == calibration.SCHEMA and data["version"] == calibration.VERSION
    assert first.seconds_per_flop > 0 and first.seconds_per_byte > 0 and first.seconds_per_op > 0
    assert time_model_for("cpu") == first and len(calls) == 1  # read back, not measured again
    assert TimeModel.from_json(first.to_json()) == first


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "not valid JSON"),
        ('{"schema": "remat.time-model", "version": 99}', "version 99"),
        ('{"schema": "remat.time-model", "version": 1}', "lacks the field"),
        ('{"schema": "remat.plan", "version": 1}', "no 'schema'"),
    ],
)
def test_a_bad_calibration_file_is_named_and_calibrated_again(tmp_path, text, why) -> None:
    first = time_model_for("cpu", directory=tmp_path)
    (path,) = tmp_path.glob("time-model-*.json")
    path.write_text(text)
    with pytest.warns(UserWarning, match=why) as record:
        again = time_model_for("cpu", directory=tmp_path)
    assert str(path) in str(record[0].message)
    assert again.device == first.device
    assert TimeModel.from_json(path.read_text()) == again  # rewritten, valid
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert time_model_for("cpu", directory=tmp_path) == again


def test_a_calibration_of_another_device_is_not_used(tmp_path) -> None:
    first = time_model_for("cpu", directory=tmp_path)
    (path,) = tmp_path.glob("time-model-*.json")
    other = TimeModel("cuda:Another GPU", first.dtype, 1.0, 1.0, 1.0)
    path.write_text(other.to_json())
    with pytest.warns(UserWarning, match="measured on 'cuda:Another GPU'"):
        assert time_model_for("cpu", directory=tmp_path).device == first.device


def test_time_model_refuses_negative_or_missing_numbers() -> None:
    with pytest.raises(ValueError, match="seconds_per_byte"):
        TimeModel("cpu", "torch.float32", 1e-11, -1.0, 1e-6)
    with pytest.raises(ValueError, match="seconds_per_op"):
        TimeModel("cpu", "torch.float32", 1e-11, 1e-10, float("nan"))


# ------------------------------------------------------------------------------ CLI
def test_cli_plan_fake_captures_a_model_under_fake_tensors(capsys, monkeypatch) -> None:
    import remat.cli.plan as plan_command
    from remat.cli import main

    seen = []
    real = calibration.time_model_for
    # where the CLI looks it up (remat.cli.plan imports it at its top)
    monkeypatch.setattr(plan_command, "time_model_for", lambda *a: seen.append(a) or real(*a))
    args = ["plan", "mlp-chain", "--batch", "8", "--method", "optimal-time", "--json"]
    assert main([*args, "--fake"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["plan"] is not None and not rows[0]["error"]
    assert len(seen) == 1  # the fake capture's times come from the calibrated model
    assert main(["plan", "homogeneous:4", "--fake"]) == 2
    assert "already a chain" in capsys.readouterr().err


# ------------------------------------------- an eager step that does not fit: fake instead
class Widen(nn.Module):
    """An intermediate of 32 TiB (no machine holds it), reduced back to the input's shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x.unsqueeze(-1).expand(*x.shape, 2**36).contiguous()).mean(-1)


class Enormous(nn.Module):
    """Not a chain (the widening is in the root's own forward): the graph path."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(Widen()(self.a(x)))


@pytest.mark.parametrize("path", ["chain", "graph"])
def test_auto_captures_under_fake_tensors_when_the_eager_step_does_not_fit(path) -> None:
    torch.manual_seed(0)
    if path == "chain":
        model = nn.Sequential(nn.Linear(8, 8), Widen(), nn.Linear(8, 8))
    else:
        model = Enormous()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, summary = auto(model, torch.randn(16, 8))  # fake=False: the eager capture fails
    messages = [str(w.message) for w in record]
    assert any("ran out of memory" in m and "fake tensors" in m for m in messages), messages
    assert summary.fake and summary.unplanned_peak_bytes > 2**40
    assert isinstance(summary.chain, Chain) == (path == "chain")


# ---------------------------------------------------------------- kernel scratch (issue #18)
def test_a_fake_capture_sees_the_kernel_scratch_the_real_one_measures() -> None:
    # oneDNN's convolution and batch-norm workspaces are allocated inside the kernels: a fake
    # capture saw none (ResNet-10's last stage: 4,653,056 B of backward overhead real, 0 fake),
    # and remat.auto(fake=True) planned a step that measured 832 KiB above its budget. The
    # scratch probe (remat.measure.scratch) runs each op once for real to measure it
    from remat.bench import conformance

    loop = conformance.Loop(conformance.build("tv-resnet10"), "loss_fn")
    real = capture(loop.module, loop.batch, loss_fn=loop.loss_fn)
    fake = capture(loop.module, loop.batch, loss_fn=loop.loss_fn, fake=True)
    a, b = real.chain, fake.chain
    assert max(a.bwd_overhead_bytes) > 4_000_000  # the workspaces are there to be seen
    for name in ("fwd_overhead_bytes", "fwd_none_overhead_bytes", "bwd_overhead_bytes"):
        assert getattr(a, name) == getattr(b, name), name
    assert real.small_scratch_bytes[:-1] == fake.small_scratch_bytes[:-1]


def _lraspp_graphs() -> tuple[Any, Any]:
    from remat.bench import conformance

    lraspp = conformance.Loop(conformance.build("tv-lraspp_mobilenet_v3"), "loss_fn")
    real_graph = trace_graph(lraspp.module, lraspp.batch, lraspp.loss_fn).graph
    fake_graph = trace_graph(lraspp.module, lraspp.batch, lraspp.loss_fn, fake=True).graph
    return real_graph, fake_graph


_NODE_BYTES = ["out_bytes", "saved_bytes", "fwd_overhead_bytes", "fwd_none_overhead_bytes"]


def test_a_fake_graph_capture_of_a_cnn_sees_the_kernel_scratch_and_is_never_below_the_real() -> (
    None
):
    real_graph, fake_graph = _lraspp_graphs()
    assert [[getattr(n, k) for k in _NODE_BYTES] for n in real_graph.nodes] == [
        [getattr(n, k) for k in _NODE_BYTES] for n in fake_graph.nodes
    ]
    for real_node, fake_node in zip(real_graph.nodes, fake_graph.nodes, strict=True):
        assert fake_node.bwd_overhead_bytes >= real_node.bwd_overhead_bytes, real_node.name


@pytest.mark.xfail(
    strict=True,
    reason="since the module hooks hold no gradient (tests/test_tracker_hooks.py) the real "
    "capture of LRASPP's backbone.6.1 (the 'high' feature's batch norm) measures its backward "
    "24,576 B (one output) lower, the fake one does not; cause not found "
    "(docs/results/conformance/FINDINGS.md)",
)
def test_a_fake_graph_capture_of_a_cnn_measures_each_backward_as_the_real() -> None:
    real_graph, fake_graph = _lraspp_graphs()
    assert [n.bwd_overhead_bytes for n in real_graph.nodes] == [
        n.bwd_overhead_bytes for n in fake_graph.nodes
    ]


def test_a_fake_plan_of_a_cnn_meets_its_least_budget_for_real() -> None:
    from remat.bench import conformance
    from remat.planners import BudgetTooSmallError

    loop = conformance.Loop(conformance.build("tv-resnet10"), "loss_fn")
    opt = torch.optim.SGD(loop.module.parameters(), lr=1e-3, momentum=0.9)
    with pytest.raises(BudgetTooSmallError) as info:
        auto(loop.module, loop.batch, loop.loss_fn, budget=1, optimizer=opt, fake=True)
    least = info.value.minimum_bytes
    planned, summary = auto(
        loop.module, loop.batch, loop.loss_fn, budget=least, optimizer=opt, fake=True
    )
    assert summary.fake and summary.plan.describe() != "store all"

    def step() -> None:
        loop.loss_fn(planned, loop.batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured = step_peak_bytes(step, planned, opt, loop.data)
    assert measured <= least, (measured, least)


def test_a_recurrent_model_is_refused_under_fake_tensors_and_never_crashes_the_probe() -> None:
    # nn.LSTM on the CPU runs oneDNN's kernel, which saves a workspace for the backward (2 MB
    # per layer here) that its fake kernel leaves out: a fake plan at its least (1,359,180 B)
    # measured 5,884,072 B. And the scratch probe ran oneDNN's LSTM backward for real on the
    # fake forward's workspace shape: the process died (SIGSEGV)
    import remat

    torch.manual_seed(0)
    model = Recurrent()
    ids, y = torch.randint(0, 128, (8, 64)), torch.randint(0, 5, (8,))

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(batch), y)

    with pytest.raises(ValueError, match="fake tensors cannot count rnn's memory"):
        remat.auto(model, ids, loss_fn=loss_fn, budget="1GB", fake=True)

    class FunctionalLSTM(nn.Module):  # the same kernel, called without nn.LSTM
        def __init__(self, lstm: nn.LSTM) -> None:
            super().__init__()
            self.weights = nn.ParameterList(lstm._flat_weights)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x.new_zeros(2, x.shape[0], 64)
            out, _, _ = torch.lstm(x, (h, h), list(self.weights), True, 2, 0.0, True, False, True)
            return out.sum()

    lstm = FunctionalLSTM(model.rnn)
    x = torch.randn(8, 64, 32)
    with pytest.warns(UserWarning, match="mkldnn_rnn_layer_backward"):
        trace_graph(lstm, x, lambda m, b: m(b), fake=True)
