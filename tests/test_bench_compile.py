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
    # the summary the report is written from
    summary = compile_suite.goal(rows)
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
