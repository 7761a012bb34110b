"""``remat bench compile --quick`` on the MLP chain: the files it writes and their schema.

The compiled points use ``aot_eager_decomp_partition`` here (torch.compile's partitioner with
``activation_memory_budget``, no C++ compilation) so the test runs in seconds; the committed
results (docs/results/compile) are inductor's. No timing is asserted: a ratio is a result.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import remat.bench.compile as compile_suite
import remat.bench.suites as suites
from remat.bench.methods import Setup, Workload
from remat.bench.suites import eager_reference, gradient_error, run_suite
from remat.cli import main


def test_quick_compile_bench_writes_every_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compile_suite, "BACKEND", "aot_eager_decomp_partition")
    monkeypatch.setenv("REMAT_BENCH_REPEATS", "3")  # (31 by default: a result, not a test)
    # (remat.auto's store-all trials, tested in test_compile, at torch.compile's own points
    # only: this test is about the points the bench writes, and it saves CI half a minute)
    monkeypatch.setattr(
        importlib.import_module("remat.auto"), "PARTITIONER_TRIALS", (0.5, 0.2, 0.1)
    )
    out = tmp_path / "compile"
    assert main(["bench", "compile", "--quick", "--models", "mlp-chain", "--out", str(out)]) == 0
    rows = json.loads((out / "compile.json").read_text())
    assert {r["model"] for r in rows} == {"mlp-chain"}
    families = {r["family"] for r in rows}
    assert families == {"baseline", "torch-compile", "remat-eager", "remat-compiled"}
    methods = [r["method"] for r in rows]
    assert methods[0] == "eager"
    assert [m for m in methods if m.startswith("torch-compile@")] == [
        f"torch-compile@{k:g}" for k in compile_suite.QUICK_COMPILE_BUDGETS
    ]
    measured = [r for r in rows if "error" not in r]
    # every compile point and one remat point per kind at each compile point's peak
    for row in rows:
        if row["family"] in ("baseline", "torch-compile"):
            assert "error" not in row, row
    for row in measured:
        assert isinstance(row["peak_bytes"], int) and row["peak_bytes"] > 0, row
        assert row["time_ratio"] > 0 and row["memory_ratio"] > 0, row
        assert row["max_grad_rel_diff"] < 1e-4, row
        assert row["grad_error_fp64"] < 1e-5, row  # float32's rounding, against float64
        assert isinstance(row["goal_holds"], bool)
        assert row["machine"]
    for row in rows:
        if row["family"].startswith("remat-"):
            assert row["budget_bytes"] > 0
            if "peak_bytes" in row:
                assert isinstance(row["within_budget"], bool)
    kinds = {r["family"] for r in measured}
    assert {"remat-eager", "remat-compiled"} <= kinds
    # each compile point timed in one loop against the fastest remat-compiled points within
    # its peak (at most PAIRED_CANDIDATES), the verdict taken from that pair
    compiled = {
        r["method"]: r for r in rows if r["family"] == "remat-compiled" and "peak_bytes" in r
    }
    for row in (r for r in rows if r["family"] == "torch-compile"):
        fits = [m for m, r in compiled.items() if r["peak_bytes"] <= row["peak_bytes"]]
        assert set(row["paired"]) <= set(fits)
        assert len(row["paired"]) == min(len(fits), compile_suite.PAIRED_CANDIDATES), row
        assert all(ratio > 0 for ratio in row["paired"].values())
        assert row["paired_interval"].keys() == row["paired"].keys()
        assert all(0 < lo <= hi for lo, hi in row["paired_interval"].values())
    # the summary the report is written from
    summary = compile_suite.goal(rows)
    for point in summary["points"]:
        if "paired_ratio" in point:
            assert point["dominated"] == (point["paired_ratio"] <= 1.0)
    assert len(summary["points"]) == len(compile_suite.QUICK_COMPILE_BUDGETS)
    assert set(summary) >= {"holds", "dominated_all", "below_compile_min", "points"}
    text = (out / "compile.md").read_text()
    assert "| mlp-chain |" in text and "torch-compile@0" in text
    assert (out / "compile-mlp-chain.png").stat().st_size > 0


def test_goal_is_judged_per_compile_point() -> None:
    rows = [
        {"method": "torch-compile@1", "peak_bytes": 100, "time_ratio": 1.0},
        {"method": "torch-compile@0", "peak_bytes": 60, "time_ratio": 1.3},
        {"method": "remat-compiled@compile@1", "peak_bytes": 100, "time_ratio": 0.9},
        {"method": "remat-compiled@compile@0", "peak_bytes": 58, "time_ratio": 1.4},
        {"method": "remat-eager@least", "peak_bytes": 40, "time_ratio": 1.6},
    ]
    g = compile_suite.goal(rows)
    assert [p["dominated"] for p in g["points"]] == [True, False]
    assert g["below_compile_min"] and not g["holds"]
    rows[3]["time_ratio"] = 1.2
    assert compile_suite.goal(rows)["holds"]


def test_the_paired_time_decides_where_it_was_measured() -> None:
    # against eager, remat looked slower (1.1 against 1.0); timed against the compile point
    # in one loop it ran at 0.98 of it: dominated. A paired point over the peak is not read.
    rows = [
        {"method": "torch-compile@1", "peak_bytes": 100, "time_ratio": 1.0},
        {"method": "remat-compiled@a", "peak_bytes": 90, "time_ratio": 1.1},
        {"method": "remat-compiled@b", "peak_bytes": 120, "time_ratio": 0.5},
    ]
    assert not compile_suite.goal(rows)["points"][0]["dominated"]
    rows[0]["paired"] = {"remat-compiled@a": 0.98, "remat-compiled@b": 0.5}
    point = compile_suite.goal(rows)["points"][0]
    assert point["dominated"] and point["paired_ratio"] == 0.98
    assert point["paired_remat_compiled"] == "remat-compiled@a"
    rows[0]["paired"] = {"remat-compiled@a": 1.02}
    assert not compile_suite.goal(rows)["points"][0]["dominated"]
    # two points that run the same plan are one plan timed twice: their mean decides (the
    # least of two noisy timings would be biased low), and near 1 it is said to be noise
    rows[1]["plan"] = "[1-6]"
    rows.append(
        {"method": "remat-compiled@c", "peak_bytes": 90, "time_ratio": 1.1, "plan": "[1-6]"}
    )
    rows[0]["paired"] = {"remat-compiled@a": 0.97, "remat-compiled@c": 1.05}
    point = compile_suite.goal(rows)["points"][0]
    assert point["paired_points"] == ["remat-compiled@a", "remat-compiled@c"]
    assert not point["dominated"] and point["paired_ratio"] == pytest.approx(1.01)
    assert point["within_noise"]
    # with each pairing's 95 % interval, noise is 1 inside the interval holding both, and a
    # miss whose whole interval is above 1 is measured
    rows[0]["paired_interval"] = {"remat-compiled@a": (0.95, 0.99), "remat-compiled@c": (1.0, 1.1)}
    point = compile_suite.goal(rows)["points"][0]
    assert point["paired_interval"] == [0.95, 1.1]
    assert point["within_noise"] and not point["slower"]
    rows[0]["paired"] = {"remat-compiled@a": 1.03, "remat-compiled@c": 1.05}
    rows[0]["paired_interval"] = {
        "remat-compiled@a": (1.01, 1.04),
        "remat-compiled@c": (1.02, 1.08),
    }
    point = compile_suite.goal(rows)["points"][0]
    assert not point["within_noise"] and point["slower"] and not point["dominated"]


def test_the_paired_interval_brackets_a_tie_and_excludes_a_measured_loss() -> None:
    from remat.measure.events import median_ratio, median_ratio_interval

    gen = torch.Generator().manual_seed(0)
    drift = 1 + 0.5 * torch.rand(41, generator=gen)  # the machine's load, shared by a round
    base = (drift * (1 + 0.02 * torch.rand(41, generator=gen))).tolist()
    same = (drift * (1 + 0.02 * torch.rand(41, generator=gen))).tolist()
    slower = (drift * (1.05 + 0.02 * torch.rand(41, generator=gen))).tolist()
    times = {"base": base, "same": same, "slower": slower}
    lo, hi = median_ratio_interval(times, "same", "base")
    assert lo <= 1.0 <= hi and hi - lo < 0.2
    lo, hi = median_ratio_interval(times, "slower", "base")
    assert 1.0 < lo <= median_ratio(times, "slower", "base") <= hi
    assert median_ratio_interval(times, "slower", "base") == (lo, hi)  # seeded


def test_gradient_error_reads_a_zero_gradient_as_its_absolute_error() -> None:
    # a tensor whose true gradient is zero (DenseNet-121's stem batch norm: each consumer of its
    # output starts with a batch norm) comes out as rounding noise: per tensor, two runs differ
    # by 200 % of its largest value; over the whole gradient, by its absolute error
    want = {"stem": torch.tensor([1e-7, -1e-7]), "conv": torch.tensor([3.0, 4.0])}
    got = {"stem": torch.tensor([-1e-7, 1e-7]), "conv": torch.tensor([3.0, 4.0])}
    assert gradient_error(got, want) == pytest.approx(math.sqrt(8e-14) / 5, rel=1e-6)
    got["conv"] = torch.tensor([3.0, 5.0])  # a real difference shows
    assert gradient_error(got, want) == pytest.approx(1 / 5, rel=1e-6)


def test_the_float64_reference_draws_eagers_dropout_masks() -> None:
    # the float64 step runs on a copy with the same seed: the same masks, so eager's error
    # against it is float32's rounding (with other masks it would be of the order of 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Tanh(), nn.Linear(64, 4))
    batch = torch.randn(32, 16)
    work = Workload("dropout-mlp", model, batch, lambda m, b: m(b).square().mean())
    ref = eager_reference(work)
    assert ref.fp64 is not None and set(ref.fp64) == set(ref.fp32)
    assert all(g.dtype == torch.float64 for g in ref.fp64.values())
    assert next(model.parameters()).dtype == torch.float32  # the model itself is untouched
    assert 0 < gradient_error(ref.fp32, ref.fp64) < 1e-6
    torch.manual_seed(99)  # other masks
    work.loss_fn(model, batch).backward()
    other = {n: p.grad.double() for n, p in model.named_parameters()}
    assert gradient_error(ref.fp32, other) > 0.05


def test_every_suite_runs_compiled_code_with_eagers_random_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # inductor's own random numbers gave GPT-2's compiled steps other dropout masks than eager's
    # (gradients 0.81-0.97 apart): the suites run with fallback_random, as torch's own accuracy
    # benchmarks do
    import torch._inductor.config as inductor_config

    seen: list[bool] = []

    def suite(models: list[str], quick: bool, progress: Any) -> list[dict]:
        seen.append(inductor_config.fallback_random)
        return []

    monkeypatch.setitem(suites.SUITES, "peers", suite)
    run_suite("peers", tmp_path, models=["mlp-chain"])
    assert seen == [True]
    assert inductor_config.fallback_random is False


def test_a_wrapped_models_gradients_are_compared_tensor_by_tensor() -> None:
    # a method's module wraps the model under names of its own (an executor's, torch.compile's
    # "_orig_mod."): keyed by those, Llama-tiny's remat rows were compared on 1 gradient of 21.
    # Keyed by the model's own names (the parameters are shared), every tensor is compared, and
    # a wrong gradient shows
    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module, scale: float = 1.0) -> None:
            super().__init__()
            self.inner, self.scale = inner, scale

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * self.scale

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    work = Workload("wrapped", model, torch.randn(4, 8), lambda m, b: m(b).square().mean())
    reference = eager_reference(work)
    for scale, close in ((1.0, True), (1.5, False)):
        row = suites.measure_setup(Setup("wrapped", Wrapper(model, scale)), work, reference)
        assert row["grads_compared"] == 4, row
        assert (row["max_grad_rel_diff"] < 1e-6) is close, row
        assert (row["grad_error_fp64"] < 1e-6) is close, row
