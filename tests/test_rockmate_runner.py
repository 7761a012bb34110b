"""The Rockmate peer runner's own helpers: argument parsing, budgets, errors, the CPU patch's
pieces and the export-graph cleanup. None of these needs rockmate installed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

RUNNER = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "rockmate_runner.py"


@pytest.fixture(scope="module")
def rr():
    spec = importlib.util.spec_from_file_location("rockmate_runner", RUNNER)
    module = importlib.util.module_from_spec(spec)
    sys.modules["rockmate_runner"] = module
    spec.loader.exec_module(module)
    return module


def test_parse_args_defaults_and_errors(rr):
    a = rr.parse_args(["--model", "chain", "--budget-fraction", "0.25", "--out", "r.json"])
    assert (a.solver, a.steps, a.batch, a.budget_fraction) == ("rotor", 5, None, 0.25)
    a = rr.parse_args(
        ["--model", "gpt2", "--budget-fraction", "0.5", "--out", "x", "--solver", "hilp"]
    )
    assert rr.method_name(a.solver) == "rockmate-hilp"
    assert rr.SOLVERS[a.solver] == "rockmate"  # rotor on top, HILP below
    with pytest.raises(SystemExit):
        rr.parse_args(["--model", "chain", "--budget-fraction", "0", "--out", "x"])
    with pytest.raises(SystemExit):
        rr.parse_args(
            ["--model", "chain", "--budget-fraction", "0.5", "--out", "x", "--solver", "z"]
        )


def test_budget_is_fraction_of_activations(rr):
    assert rr.activation_bytes(300, 100) == 200
    assert rr.activation_bytes(50, 100) == 0
    assert rr.budget_bytes(0.25, 300, 100) == 50


def test_max_grad_rel_diff(rr):
    ref = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([4.0])}
    got = {"a": torch.tensor([1.0, -2.2])}
    worst, compared, missing = rr.max_grad_rel_diff(ref, got)
    assert worst == pytest.approx(0.1)
    assert (compared, missing) == (1, ["b"])


def test_format_error_keeps_message_and_place(rr):
    def boom():
        raise ValueError("no schedule, budget 12 B")

    try:
        boom()
    except ValueError as err:
        e = rr.format_error(err, "plan")
    assert e["stage"] == "plan" and e["type"] == "ValueError"
    assert e["message"] == "no schedule, budget 12 B"
    assert any("in boom" in w for w in e["where"])
    json.dumps(e)


def test_renamed_forward_args(rr):
    assert rr.renamed_forward_args(["input", "mask"]) == ["input_arg", "mask"]
    seq = torch.nn.Sequential(torch.nn.Linear(3, 2))
    wrapped, renamed = rr.wrap_builtin_arg_names(seq)
    assert renamed
    x = torch.randn(4, 3)
    assert torch.equal(wrapped(x), seq(x))
    assert list(wrapped.parameters()) == list(seq.parameters())
    assert "input_arg" in str(torch.export.export(wrapped, (x,)).graph)

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x * 2

    m = Plain()
    assert rr.wrap_builtin_arg_names(m) == (m, False)


def test_torch_proxy_maps_cuda_to_cpu(rr):
    proxy = rr.make_torch_proxy(torch)
    assert proxy.device("cuda") == torch.device("cpu")
    assert proxy.device("cuda", 0) == torch.device("cpu")
    assert proxy.device("meta") == torch.device("meta")
    assert isinstance(torch.device("cpu"), proxy.device)
    t = proxy.empty(3, device="cuda", pin_memory=True)
    assert t.device.type == "cpu"
    assert proxy.ones_like(t, device=torch.device("cuda")).device.type == "cpu"
    assert proxy.nn is torch.nn and proxy.Tensor is torch.Tensor
    torch.get_rng_state()  # the proxy leaves torch itself alone
    assert torch.device("cpu") != "cuda"


def test_cuda_shim(rr):
    cuda = rr.make_cuda_shim(torch)
    cuda.synchronize()
    s = cuda.Stream(torch.device("cpu"))
    with cuda.stream(s):
        pass
    s.synchronize()
    a, b = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    a.record(cuda.current_stream())
    b.record()
    assert b.elapsed_time(a) <= 0 <= a.elapsed_time(b)
    assert cuda.memory_allocated() == cuda.max_memory_allocated() == 0
    state = cuda.get_rng_state()
    x = torch.rand(2)
    cuda.set_rng_state(state)
    assert torch.equal(torch.rand(2), x)


def _export(fn, *args):
    class M(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    return torch.export.export(M(), args)


def test_clean_exported_graph_inplace_and_aliases(rr):
    def f(x):
        y = x * 2
        y.add_(1)
        z = torch.nn.functional.dropout(y, p=0.0, training=True)
        z = z.to(torch.float32)
        return torch.relu_(z) + y

    x = torch.randn(5)
    ep = _export(f, x)
    counts = rr.clean_exported_graph(ep.graph)
    ep.graph_module.recompile()
    names = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert not any(name.split(".")[-2].endswith("_") for name in names if "." in name), names
    assert counts["inplace_rewritten"] >= 1
    assert torch.allclose(ep.module()(x), f(x.clone()))


def test_clean_exported_graph_erases_asserts(rr):
    def f(x):
        return x.to(torch.float64).sum()

    ep = _export(f, torch.randn(3))
    rr.clean_exported_graph(ep.graph)
    assert not any("_assert" in str(n.target) for n in ep.graph.nodes if n.op == "call_function")
    ep.graph_module.recompile()
    x = torch.randn(3)
    assert torch.allclose(ep.module()(x), x.double().sum())


def test_result_json_on_failure(rr, tmp_path, monkeypatch):
    """Without rockmate (as in CI) the runner still writes its JSON, with the error verbatim."""
    out = tmp_path / "r.json"

    def failing_run(args, result):
        try:
            import rockmate_absent_for_this_test  # noqa: F401
        except ImportError as err:
            result["error"] = rr.format_error(err, "import rockmate")

    monkeypatch.setattr(rr, "run", failing_run)
    rc = rr.main(["--model", "chain", "--budget-fraction", "0.25", "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == 1
    assert r["method"] == "rockmate-rotor" and r["budget_fraction"] == 0.25
    assert r["error"]["stage"] == "import rockmate"
    assert "rockmate_absent_for_this_test" in r["error"]["message"]
    assert r["peak_bytes"] is None and r["patched"] == []
