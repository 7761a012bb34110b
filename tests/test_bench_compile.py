"""``remat bench compile --quick`` on the MLP chain: the files it writes and their schema.

The compiled points use ``aot_eager_decomp_partition`` here (torch.compile's partitioner with
``activation_memory_budget``, no C++ compilation) so the test runs in seconds; the committed
results (docs/results/compile) are inductor's. No timing is asserted: a ratio is a result.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import remat.bench.compile as compile_suite
from remat.cli import main


def test_quick_compile_bench_writes_every_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compile_suite, "BACKEND", "aot_eager_decomp_partition")
    monkeypatch.setenv("REMAT_BENCH_REPEATS", "3")  # (31 by default: a result, not a test)
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
