"""Public entry points: remat.plan, remat.compare, remat.pareto, lean import, the plan CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import remat
from remat import BudgetTooSmallError, Chain, Plan, simulate
from remat.api import compare, pareto
from remat.cli import build_parser, main


def test_import_is_lean() -> None:
    code = (
        "import sys, remat, remat.api, remat.planners; remat.available(); "
        "heavy = [m for m in ('torch', 'scipy', 'matplotlib', 'transformers') if m in sys.modules];"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_entry_points_survive_importing_their_submodules() -> None:
    # `remat.profile` and `remat.fit` are functions living in submodules of the same name;
    # importing those submodules (as remat's own code does) must not replace them. `remat.capture`
    # is the capture package (the functions are `remat.capture_chain` / `remat.capture_graph`)
    code = (
        "import remat, types\n"
        "from remat.measure.profile import StepTracker\n"
        "from remat.capture.chain import capture_chain\n"
        "from remat.fit import fit\n"
        "import remat.measure.profile\n"
        "names = ('profile', 'fit', 'apply', 'auto', 'capture_chain')\n"
        "print([n for n in names if isinstance(getattr(remat, n), types.ModuleType)])\n"
        "print(remat.fit is fit, remat.capture_chain is capture_chain, callable(remat.profile))\n"
        "print(remat.zoo.__name__, remat.levers.__name__, remat.capture.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:3] == [
        "[]",
        "True True True",
        "remat.zoo remat.levers remat.capture",
    ]


def test_plan_stamps_prediction_and_fingerprint() -> None:
    chain = Chain.random(9, seed=1)
    p = remat.plan(chain, "every-stage")
    sim = simulate(chain, p)
    assert p.predicted_peak_bytes == sim.peak_bytes
    assert p.predicted_time == sim.total_time
    assert p.fingerprint == chain.fingerprint
    assert p.method == "every-stage"


def test_plan_budget_error_names_minimum() -> None:
    chain = Chain.random(6, seed=2)
    need = simulate(chain, Plan.none(chain)).peak_bytes
    with pytest.raises(BudgetTooSmallError) as info:
        remat.plan(chain, "none", need - 1)
    assert info.value.minimum_bytes == need
    assert str(need) in str(info.value)
    assert remat.plan(chain, "none", need).predicted_peak_bytes == need
    assert remat.plan(chain, "none", f"{need}B").predicted_peak_bytes == need


def test_unknown_planner_lists_names() -> None:
    with pytest.raises(ValueError, match="choose one of: .*every-stage"):
        remat.plan(Chain.homogeneous(3), "magic")


def test_compare_and_pareto_are_consistent_with_simulate() -> None:
    chain = Chain.random(8, seed=5, max_bytes=1000)
    rows = compare(chain)
    assert {r.method for r in rows} == set(remat.available())
    for row in rows:
        assert row.plan is not None
        assert row.peak_bytes == simulate(chain, row.plan).peak_bytes
    frontier = pareto(chain, num_budgets=5)
    for points in frontier.values():
        peaks = [pt.peak_bytes for pt in points]
        times = [pt.total_time for pt in points]
        assert peaks == sorted(peaks)
        assert all(a > b for a, b in zip(times, times[1:], strict=False))  # strictly better
        for pt in points:
            assert simulate(chain, pt.plan).peak_bytes == pt.peak_bytes


def test_cli_plan_json_and_out(tmp_path, capsys) -> None:
    chain = Chain.random(7, seed=4, max_bytes=10_000)
    path = tmp_path / "chain.json"
    path.write_text(chain.to_json())
    assert main(["plan", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["method"] for r in rows} == set(remat.available())
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--method", "every-stage", "--out", str(out)]) == 0
    saved = Plan.from_json(out.read_text())
    assert saved.for_chain(chain).segments == Plan.every_stage(chain).segments
    assert "every-stage" in capsys.readouterr().out


def test_cli_errors_are_one_line(capsys) -> None:
    assert main(["plan", "homogeneous:4", "--method", "none", "--activation-budget", "1"]) == 2
    err = capsys.readouterr().err
    assert "minimum feasible activation peak" in err and "Traceback" not in err
    assert main(["plan", "missing.json"]) == 2
    assert "no chain file" in capsys.readouterr().err


def test_cli_help_lists_commands() -> None:
    text = build_parser().format_help()
    for command in ("plan", "demo"):
        assert command in text


def test_plan_and_simulate_dispatch_on_graphs() -> None:
    from remat.core.synthetic import residual_chain
    from remat.graphs import Graph, Plan, simulate_graph

    graph = residual_chain(4)
    assert isinstance(graph, Graph)
    for method in ("reforward", "articulation"):
        p = remat.plan(graph, method)
        assert isinstance(p, Plan)
        assert simulate(graph, p).peak_bytes == simulate_graph(graph, p).peak_bytes
        assert p.predicted_peak_bytes == simulate(graph, p).peak_bytes
    with pytest.raises(TypeError, match="Chain or a Graph"):
        remat.plan([1, 2, 3], "none")  # type: ignore[arg-type]
