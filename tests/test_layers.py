"""The dependency rule (docs/architecture.md, .importlinter): the pure core plans with torch
blocked, and the definitions moved to break import cycles stay importable from their old homes."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

PURE_MODULES = (
    "remat",
    "remat.core.units",
    "remat.core.errors",
    "remat.core.chain",
    "remat.core.plan",
    "remat.core.chain_simulate",
    "remat.planners",
    "remat.api",
    "remat.planning",
    "remat.core.step",
    "remat.graphs",
    "remat.core.graph",
    "remat.core.simulate",
    "remat.planners.graph",
    "remat.planners.checkmate_milp",
    "remat.planners.reforward_graph",
    "remat.planners.articulation",
    "remat.core.synthetic",
)


def test_pure_modules_plan_with_torch_blocked() -> None:
    code = textwrap.dedent(
        f"""
        import importlib, sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        for name in {PURE_MODULES!r}:
            importlib.import_module(name)
        import remat
        from remat.graphs import plan_graph, simulate_graph
        from remat.core.synthetic import residual_chain

        chain = remat.Chain.homogeneous(6, out_bytes=10)
        none_peak = remat.simulate(chain, remat.Plan.none()).peak_bytes
        for method in remat.available():  # every chain planner, loaded by name
            p = remat.plan(chain, method, none_peak)
            assert p.predicted_peak_bytes == remat.simulate(chain, p).peak_bytes <= none_peak
        least = remat.plan(chain, "optimal-time", int(none_peak * 0.6))
        assert least.predicted_peak_bytes < none_peak
        graph = residual_chain(3)
        for method in ("none", "reforward", "articulation"):
            gp = remat.plan(graph, method)
            assert remat.simulate(graph, gp).peak_bytes == simulate_graph(graph, gp).peak_bytes
            assert gp.predicted_peak_bytes == plan_graph(graph, method).predicted_peak_bytes
        from remat.planning import plan_for_step, step_peak_of
        from remat.core.step import StepCosts

        costs = StepCosts(persistent_bytes=100, grad_bytes=(3,) * 6, checkpoint_state_bytes=7)
        chosen = plan_for_step(chain, costs, 100 + 18 + none_peak)
        assert step_peak_of(chain, chosen, costs) <= 100 + 18 + none_peak
        graph_costs = StepCosts(persistent_bytes=10, grad_bytes=(1,) * graph.n)
        assert plan_for_step(graph, graph_costs, None).method in ("reforward", "none")
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert loaded == ["torch"] and sys.modules["torch"] is None, loaded
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_moved_definitions_keep_their_old_import_paths() -> None:
    import remat.distributed
    import remat.guards
    import remat.report
    from remat.capture import stages
    from remat.core.errors import UnsupportedModelError
    from remat.measure.profile import format_memory_report

    assert remat.distributed.check_not_wrapped is remat.guards.check_not_wrapped
    assert remat.distributed.WrapOrderError is remat.guards.WrapOrderError
    assert remat.distributed.ORDER_HELP is remat.guards.ORDER_HELP
    assert stages.check_no_own_checkpointing is remat.guards.check_no_own_checkpointing
    assert stages.UnsupportedModelError is UnsupportedModelError
    assert issubclass(stages.StageMismatchError, UnsupportedModelError)
    assert remat.report.format_memory_report is format_memory_report


def test_plan_is_plan_chain_for_a_chain_and_simulate_refuses_other_types() -> None:
    import remat
    from remat.planners import plan_chain

    chain = remat.Chain.homogeneous(5, out_bytes=8)
    assert remat.plan(chain, "chen-sqrt", "1KiB") == plan_chain(chain, "chen-sqrt", 1024)
    with pytest.raises(TypeError, match="Chain or a Graph"):
        remat.simulate([1, 2], remat.Plan.none())  # type: ignore[arg-type]


# Modules that still import remat inside a function. No other module may: a remat import
# belongs at the top, where the layers (and import-linter) can see it. The lazy top-level
# ``remat/__init__.py`` is the one intended exception.
FUNCTION_IMPORT_DEBT: set[str] = set()


def _function_level_remat_imports(path: pathlib.Path) -> list[int]:
    tree = ast.parse(path.read_text())
    lines = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (
                    node.level or (node.module or "").startswith("remat")
                ):
                    lines.append(node.lineno)
                elif isinstance(node, ast.Import) and any(
                    a.name.startswith("remat") for a in node.names
                ):
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_remat_imports_live_at_module_top() -> None:
    root = pathlib.Path(__file__).resolve().parents[1] / "src" / "remat"
    found = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name == "__init__.py":
            continue
        lines = _function_level_remat_imports(path)
        if lines:
            found[name] = lines
    new = {name: lines for name, lines in found.items() if name not in FUNCTION_IMPORT_DEBT}
    assert not new, f"remat imports inside functions (move them to the module top): {new}"
    paid = FUNCTION_IMPORT_DEBT - set(found)
    assert not paid, f"no function-level imports left in {sorted(paid)}: drop them from the list"
