"""The Re-forwarding table's planning and report logic (src/remat/bench/reforward.py) on small
synthetic graphs: no torch model, a few seconds. The full run is ``remat bench reforward``."""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.bench import reforward as rf
from remat.core.plan import Plan
from remat.core.simulate import simulate_graph
from remat.core.synthetic import dense_block, residual_chain

REQUIRED = ("model", "method", "part", "peak_bytes", "memory_ratio", "time_ratio")


def rows_for(name: str, graph, paper_ratio: float) -> list[dict]:
    plans = rf.plan_all(graph, paper_ratio, milp_s=10.0)
    return rf.table_rows(name, graph, plans, batch=rf.PAPER[name][0], image=rf.PAPER[name][1])


def test_table_rows_are_the_simulated_plans_and_the_target_is_the_definition() -> None:
    graph = residual_chain(2)
    rows = rows_for("resnet50", graph, rf.PAPER["resnet50"][3] / rf.PAPER["resnet50"][2])
    assert [r["method"] for r in rows] == list(rf.METHODS)
    regular = simulate_graph(graph, Plan.none())
    by = {r["method"]: r for r in rows}
    for r in rows:
        assert all(k in r for k in REQUIRED), r
        assert r["regular_bytes"] == regular.peak_bytes
        assert r["memory_ratio"] == round(r["peak_bytes"] / regular.peak_bytes, 4)
        met = r["method"] != "none" and (
            r["memory_ratio"] <= r["paper_memory_ratio"]
            and r["time_ratio"] - 1 <= r["paper_overhead"] + 5e-5
        )
        assert r["target_met"] == met
    assert by["none"]["memory_ratio"] == 1.0 and by["none"]["time_ratio"] == 1.0
    # least time at the reforward plan's memory: never slower than reforward, within its peak
    for key in ("checkmate-milp", "optimal-time"):
        assert by[key]["peak_bytes"] <= by["reforward"]["peak_bytes"]
        assert by[key]["time_ratio"] <= by["reforward"]["time_ratio"]
    assert by["checkmate-milp"]["budget_basis"] == "reforward"


def test_paper_memory_below_the_minimum_plans_at_the_minimum() -> None:
    graph = dense_block(3)
    rows = {r["method"]: r for r in rows_for("densenet121", graph, paper_ratio=0.01)}
    milp = rows["checkmate-milp@paper"]
    assert milp["budget_basis"].startswith("minimum")
    assert "BudgetTooSmallError" in milp["paper_budget_error"]
    # no plan of any method goes below the MILP's least peak over its plan space
    assert milp["peak_bytes"] <= min(r["peak_bytes"] for r in rows.values() if "peak_bytes" in r)
    assert not milp["target_met"]


def test_report_has_every_model_a_verdict_and_the_sections(tmp_path: Path) -> None:
    rows = rows_for("resnet50", residual_chain(2), 0.37)
    rows += rows_for("densenet121", dense_block(3), 0.01)
    speed = {
        "model": "densenet201",
        "method": "reforward",
        "part": "speed",
        "level": "op",
        "batch": 16,
        "image": 224,
        "nodes": 9,
        "plan_seconds": 0.5,
        "target_seconds": 10.0,
        "target_met": True,
        "peak_bytes": 1,
        "memory_ratio": 0.5,
        "time_ratio": 1.3,
        "plan_params": {},
    }
    machine = {"date": "today", "device": "cpu", "cpus": 2, "threads": 1, "torch": "x"}
    result = {"suite": "reforward", "quick": False, "machine": machine, "seconds": 60.0}
    rf.write_report(tmp_path, {**result, "rows": [*rows, speed]})
    text = (tmp_path / "reforward.md").read_text()
    for model in ("resnet50", "densenet121"):
        assert f"| {model} |" in text and f"* **{model}**:" in text
    assert "the paper's ratio is below the least peak `checkmate-milp` finds" in text
    assert "| reforward | 0.50 | < 10 s | yes |" in text
    assert "## Why ours and the paper's differ" in text


def test_suite_rejects_models_outside_the_table() -> None:
    with pytest.raises(ValueError, match="not in the paper's table"):
        rf.suite(["gpt2"], quick=True, progress=print)
    assert rf.DEFAULT_MODELS == list(rf.PAPER) and len(rf.DEFAULT_MODELS) == 15


def test_merge_replaces_the_rerun_models_and_says_so(tmp_path: Path) -> None:
    import json

    machine = {"date": "2026-01-01 10:00", "device": "cpu", "cpus": 2, "threads": 1}
    machine["torch"] = "x"
    base, rerun = tmp_path / "base", tmp_path / "rerun"
    base.mkdir()
    rerun.mkdir()
    old = rows_for("resnet50", residual_chain(2), 0.37) + rows_for(
        "densenet121", dense_block(3), 0.5
    )
    result = {"suite": "reforward", "quick": False, "machine": machine, "seconds": 120.0}
    (base / "reforward.json").write_text(json.dumps(old))
    rf.write_report(base, {**result, "rows": old})
    new = rows_for("densenet121", dense_block(3), 0.01)  # the rerun planned differently
    speed = {"model": "resnet50", "method": "checkmate-milp", "part": "speed", "level": "module"}
    speed |= {"batch": 64, "image": 224, "nodes": 9, "plan_seconds": 1.0}
    speed |= {"target_seconds": 60.0, "target_met": True, "error": "timed out"}
    new.append(speed)  # a speed row names a model whose table rows were not rerun
    (rerun / "reforward.json").write_text(json.dumps(new))
    later = {**machine, "date": "2026-01-02 11:00"}
    rf.write_report(rerun, {**result, "machine": later, "seconds": 600.0, "rows": new})

    merged = rf.merge(base, [rerun])["rows"]
    assert [r for r in merged if r["model"] == "resnet50" and r["part"] == "table"] == [
        r for r in old if r["model"] == "resnet50"
    ]
    assert [r for r in merged if r["model"] == "densenet121"] == new[:-1]
    assert speed in merged
    assert json.loads((base / "reforward.json").read_text()) == merged
    text = (base / "reforward.md").read_text()
    assert "Run 2026-01-01 10:00 on cpu (2 CPUs, 1 torch threads), torch x; it took 2 min" in text
    assert "Rows of densenet121 were rerun 2026-01-02 11:00 (10 min" in text
    # merging the same rerun again keeps one line for it
    rf.merge(base, [rerun])
    assert (base / "reforward.md").read_text().count("were rerun") == 1


def test_a_milp_without_a_plan_gets_a_second_longer_solve(monkeypatch) -> None:
    # the first solve (milp_s) "times out"; the second (retry_s) plans; the cell is marked §
    real = rf._plan
    limits: list[float] = []

    def plan(graph, method, budget, milp_s, **options):  # type: ignore[no-untyped-def]
        if method == "checkmate-milp":
            limits.append(milp_s)
            if milp_s < 100:
                return {"plan": None, "seconds": milp_s, "error": "PlannerTimeoutError: none"}
        return real(graph, method, budget, milp_s, **options)

    monkeypatch.setattr(rf, "_plan", plan)
    plans = rf.plan_all(residual_chain(2), 0.95, milp_s=10.0, retry_s=600.0)
    for key in ("checkmate-milp", "checkmate-milp@paper"):
        assert plans[key]["plan"] is not None
        assert plans[key]["solver"].startswith("MILP, second solve of 600 s")
    assert limits == [10.0, 600.0, 10.0, 600.0]
    rows = rf.table_rows("resnet50", residual_chain(2), plans, batch=64, image=224)
    cell = rf._cell(next(r for r in rows if r["method"] == "checkmate-milp"))
    assert cell.endswith("§")
