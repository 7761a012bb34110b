"""Reproduce Feng & Huang's Re-forwarding table (shared/papers/notes.md §4.6) with remat.

For each of the 15 torchvision models at the paper's batch and input sizes, the graph is
captured under fake tensors (:func:`remat.graphs.capture.trace_levels`, nothing allocated, FLOPs
as times) and planned with:

* ``none``: the regular step (the paper's "regular" column: activations, activation
  gradients and the input; weights and weight gradients removed, as the paper removes them);
* ``reforward``: Feng & Huang's optimal gradient checkpoints (division tree);
* ``chen-sqrt``: Chen et al.'s sqrt(n) segments on the articulation chain (``articulation``
  planner, ``chain_method="chen-sqrt"``);
* ``checkmate-milp`` and ``optimal-time`` (``articulation`` with the heterogeneous-chain DP):
  least time at the memory the ``reforward`` plan needs.

Memory is :func:`remat.graphs.simulate_graph`'s peak (exact bytes of the captured costs; the
executor is checked against it in tests/test_graph_runtime.py and in the measured part below);
the time ratio is the simulated FLOPs of forward + recomputation + backward over the regular
step's. The loss is ``output.sum()``, as in the paper's benchmark.

Measured part (``--measure``): a few models at a small batch on this CPU, the plan applied to
the eager model with :func:`remat.graphs.runtime.apply_graph`: step time as a ratio to eager
(interleaved, median of 5) and the exact activation peak (MemTracker) beside the simulated one.

Speed part: ``reforward`` and ``articulation`` on DenseNet-201 at op level, ``checkmate-milp``
on ResNet-50 at module level at the ``reforward`` budget (60 s limit).

Run: ``python benchmarks/reforward_table.py`` (about 20-30 min on 2 cores) writes
``docs/results/reforward.json`` and ``docs/results/reforward.md``. ``--quick`` runs 3 models.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torchvision

from remat.graphs.capture import trace_levels
from remat.graphs.graph import Graph
from remat.graphs.plan import GraphPlan
from remat.graphs.planners import plan_graph
from remat.graphs.simulate import simulate_graph
from remat.units import format_bytes

ROOT = Path(__file__).resolve().parent.parent
OUT_JSON = ROOT / "docs" / "results" / "reforward.json"
OUT_MD = ROOT / "docs" / "results" / "reforward.md"
SCHEMA = "remat.bench.reforward"

# model: (batch, image, regular MB, OGC MB, regular s/iter, OGC s/iter), notes §4.6
PAPER: dict[str, tuple[int, int, float, float, float, float]] = {
    "alexnet": (1024, 224, 4955, 3287, 0.388, 0.519),
    "vgg11": (64, 224, 3577, 2781, 0.266, 0.356),
    "vgg13": (64, 224, 5136, 3565, 0.418, 0.558),
    "vgg16": (64, 224, 5136, 3565, 0.503, 0.666),
    "vgg19": (64, 224, 5189, 3565, 0.581, 0.774),
    "resnet18": (256, 224, 5635, 3677, 0.422, 0.548),
    "resnet34": (128, 224, 4079, 1838, 0.364, 0.493),
    "resnet50": (64, 224, 5323, 1973, 0.394, 0.516),
    "resnet101": (32, 224, 3934, 1024, 0.356, 0.482),
    "resnet152": (16, 224, 2767, 526, 0.241, 0.331),
    "densenet121": (32, 224, 4027, 898, 0.218, 0.292),
    "densenet161": (16, 224, 3751, 666, 0.252, 0.341),
    "densenet169": (32, 224, 4862, 897, 0.270, 0.357),
    "densenet201": (16, 224, 3146, 474, 0.200, 0.306),
    "inception_v3": (32, 300, 3074, 881, 0.291, 0.374),
}
METHODS = (
    "none",
    "reforward",
    "chen-sqrt",
    "checkmate-milp",
    "optimal-time",
    "checkmate-milp@paper",
    "optimal-time@paper",
)
MEASURED = {  # model: (batch, image) for the CPU measurements
    "alexnet": (16, 224),
    "vgg11": (2, 224),
    "resnet18": (4, 224),
    "resnet50": (2, 224),
    "densenet121": (2, 224),
    "inception_v3": (2, 300),
}
LEVEL = "module"
MILP_SECONDS = 60.0


def sum_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The paper's benchmark loss: ``output.sum()``."""
    return model(batch).sum()


def build(name: str) -> torch.nn.Module:
    options: dict[str, Any] = {}
    if name == "inception_v3":
        options = dict(aux_logits=False, init_weights=True)
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None, **options).train()


def capture(name: str, batch: int, image: int, levels: tuple[str, ...]) -> dict[str, Any]:
    model = build(name)
    x = torch.randn(batch, 3, image, image)
    start = time.perf_counter()
    traces = trace_levels(model, x, sum_loss, levels, fake=True)
    return {"traces": traces, "seconds": time.perf_counter() - start, "model": model, "x": x}


def plan_all(graph: Graph, paper_ratio: float) -> dict[str, tuple[GraphPlan | None, float, str]]:
    """Every method's plan, its planning seconds and an error text (if it failed).

    ``@paper``: the budget is the paper's memory ratio times our regular peak (the least
    time at the paper's memory cut)."""
    plans: dict[str, tuple[GraphPlan | None, float, str]] = {}

    def run(key: str, *args: Any, **options: Any) -> None:
        start = time.perf_counter()
        try:
            plan = plan_graph(graph, *args, **options)
            plans[key] = (plan, time.perf_counter() - start, "")
        except Exception as err:  # noqa: BLE001 - a failing planner is a row, not a crash
            plans[key] = (None, time.perf_counter() - start, f"{type(err).__name__}: {err}")

    run("none", "none")
    run("reforward", "reforward")
    run("chen-sqrt", "articulation", chain_method="chen-sqrt")
    budget = plans["reforward"][0].predicted_peak_bytes if plans["reforward"][0] else None
    run("checkmate-milp", "checkmate-milp", budget, time_limit_s=MILP_SECONDS)
    run("optimal-time", "articulation", budget, chain_method="optimal-time")
    paper = int(paper_ratio * simulate_graph(graph, GraphPlan.none()).peak_bytes)
    run("checkmate-milp@paper", "checkmate-milp", paper, time_limit_s=MILP_SECONDS)
    run("optimal-time@paper", "articulation", paper, chain_method="optimal-time")
    return plans


def table_rows(name: str, graph: Graph, plans: dict, capture_s: float) -> list[dict]:
    batch, image, regular_mb, ogc_mb, regular_s, ogc_s = PAPER[name]
    none = simulate_graph(graph, GraphPlan.none())
    rows = []
    for method in METHODS:
        plan, seconds, error = plans[method]
        row: dict[str, Any] = {
            "model": name,
            "method": method,
            "batch": batch,
            "image": image,
            "level": LEVEL,
            "nodes": graph.n,
            "capture_seconds": round(capture_s, 2),
            "plan_seconds": round(seconds, 3),
            "paper_regular_mb": regular_mb,
            "paper_ogc_mb": ogc_mb,
            "paper_memory_ratio": round(ogc_mb / regular_mb, 4),
            "paper_overhead": round(ogc_s / regular_s - 1, 4),
        }
        if plan is None:
            row["error"] = error
        else:
            sim = simulate_graph(graph, plan)
            row.update(
                peak_bytes=sim.peak_bytes,
                regular_bytes=none.peak_bytes,
                memory_ratio=round(sim.peak_bytes / none.peak_bytes, 4),
                time_ratio=round(sim.total_time / none.total_time, 4),
                segments=len(plan.segments),
                depth=plan.depth(),
                recomputed_nodes=len(plan.recomputed_nodes()),
                plan_params={
                    k: v for k, v in plan.params.items() if isinstance(v, int | float | str)
                },
            )
            row["target_met"] = bool(
                row["memory_ratio"] <= row["paper_memory_ratio"]
                and row["time_ratio"] - 1 <= row["paper_overhead"]
            )
        rows.append(row)
    return rows


def measure(name: str, batch: int, image: int) -> list[dict]:
    """Apply the plans to the eager model at a small batch: time ratio and exact peak."""
    from remat.graphs.runtime import apply_graph
    from remat.measure import interleaved_times
    from remat.profile import profile

    cap = capture(name, batch, image, (LEVEL,))
    graph = cap["traces"][LEVEL].graph
    model, x = cap["model"], cap["x"]
    plans = {
        "reforward": plan_graph(graph, "reforward"),
        "chen-sqrt": plan_graph(graph, "articulation", chain_method="chen-sqrt"),
    }
    planned = {k: apply_graph(model, p, graph, x, sum_loss) for k, p in plans.items()}

    def step(module: torch.nn.Module) -> Any:
        def run() -> None:
            sum_loss(module, x).backward()
            for p in model.parameters():
                p.grad = None

        return run

    steps = {"eager": step(model), **{k: step(m) for k, m in planned.items()}}
    times = interleaved_times(steps, repeats=5, warmup=1)
    eager_peak = profile(model, x, sum_loss).activation_peak_bytes
    none_sim = simulate_graph(graph, GraphPlan.none())
    rows = [
        {
            "model": name,
            "method": "none",
            "batch": batch,
            "image": image,
            "measured_peak_bytes": eager_peak,
            "simulated_peak_bytes": none_sim.peak_bytes,
            "eager_step_seconds": round(statistics.median(times["eager"]), 4),
            "measured_time_ratio": 1.0,
            "predicted_time_ratio": 1.0,
        }
    ]
    for key, module in planned.items():
        sim = simulate_graph(graph, module.executed_plan)
        measured = profile(module, x, sum_loss).activation_peak_bytes
        rows.append(
            {
                "model": name,
                "method": key,
                "batch": batch,
                "image": image,
                "measured_peak_bytes": measured,
                "simulated_peak_bytes": sim.peak_bytes,
                "measured_memory_ratio": round(measured / eager_peak, 4),
                "predicted_memory_ratio": round(sim.peak_bytes / none_sim.peak_bytes, 4),
                "measured_time_ratio": round(
                    statistics.median(times[key]) / statistics.median(times["eager"]), 4
                ),
                "predicted_time_ratio": round(sim.total_time / none_sim.total_time, 4),
            }
        )
    return rows


def speed() -> dict[str, Any]:
    out: dict[str, Any] = {}
    cap = capture("densenet201", 16, 224, ("op",))
    graph = cap["traces"]["op"].graph
    for key, args, options in (
        ("reforward", ("reforward",), {}),
        ("articulation", ("articulation",), {"chain_method": "chen-sqrt"}),
    ):
        start = time.perf_counter()
        plan_graph(graph, *args, **options)
        out[f"densenet201_op_{key}_seconds"] = round(time.perf_counter() - start, 3)
    out["densenet201_op_nodes"] = graph.n
    cap = capture("resnet50", 64, 224, ("module",))
    graph = cap["traces"]["module"].graph
    budget = plan_graph(graph, "reforward").predicted_peak_bytes
    start = time.perf_counter()
    plan = plan_graph(graph, "checkmate-milp", budget, time_limit_s=MILP_SECONDS)
    out["resnet50_module_checkmate_milp_seconds"] = round(time.perf_counter() - start, 3)
    out["resnet50_module_nodes"] = graph.n
    out["resnet50_module_checkmate_milp_params"] = {
        k: v for k, v in plan.params.items() if isinstance(v, int | float | str)
    }
    return out


def write_markdown(data: dict[str, Any]) -> None:
    rows = [r for r in data["rows"] if "peak_bytes" in r]
    by_model: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], {})[r["method"]] = r
    lines = [
        "# Re-forwarding (Feng & Huang) reproduced: memory cut and time overhead",
        "",
        "Generated by `benchmarks/reforward_table.py` (do not edit by hand). Paper numbers:",
        "official README table (`shared/papers/notes.md` §4.6), GPU, PyTorch 1.x, MB as printed.",
        "Ours: remat's captured graph (module level, fake tensors, the paper's batch and input",
        "sizes, loss `output.sum()`), simulated peak of activations + activation gradients +",
        "input (weights and weight gradients excluded, as the paper excludes them); time =",
        "simulated FLOPs of forward + recomputation + backward over the regular step's.",
        "",
        "## Main table",
        "",
        "Each cell: memory ratio (peak / regular) and time overhead. `milp`, `optimal-time`: the",
        "least time at the `reforward` plan's memory; `@paper`: at the paper's memory ratio.",
        "",
        "| model | batch×image | regular: paper / ours | paper | reforward | chen-sqrt | milp "
        "| optimal-time | milp @paper | optimal-time @paper | target met by |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(r: dict | None) -> str:
        if r is None or "memory_ratio" not in r:
            return "—"
        return f"{r['memory_ratio']:.2f}, {r['time_ratio'] - 1:+.0%}"

    for model in PAPER:
        m = by_model.get(model)
        if not m or "reforward" not in m:
            continue
        ref = m["reforward"]
        met = [k for k in METHODS if m.get(k, {}).get("target_met")]
        lines.append(
            f"| {model} | {ref['batch']}×{ref['image']}² | {ref['paper_regular_mb']:.0f} MB / "
            f"{format_bytes(ref['regular_bytes'])} | {ref['paper_memory_ratio']:.2f}, "
            f"{ref['paper_overhead']:+.0%} | "
            + " | ".join(
                cell(m.get(k))
                for k in (
                    "reforward",
                    "chen-sqrt",
                    "checkmate-milp",
                    "optimal-time",
                    "checkmate-milp@paper",
                    "optimal-time@paper",
                )
            )
            + f" | {', '.join(met) if met else '**none**'} |"
        )
    failed = [r for r in data["rows"] if "error" in r]
    if failed:
        lines += ["", "Planner failures:", ""]
        lines += [f"* {r['model']} {r['method']}: {r['error'][:200]}" for r in failed]
    lines += ["", "## Measured on this CPU (eager model under apply_graph, small batch)", ""]
    lines += [
        "| model | batch×image | method | peak measured / simulated | memory ratio measured "
        "/ predicted | time ratio measured / predicted |",
        "|---|---|---|---|---|---|",
    ]
    for r in data.get("measured", []):
        mem = (
            f"{r['measured_memory_ratio']:.2f} / {r['predicted_memory_ratio']:.2f}"
            if "measured_memory_ratio" in r
            else "1 / 1"
        )
        lines.append(
            f"| {r['model']} | {r['batch']}×{r['image']}² | {r['method']} | "
            f"{format_bytes(r['measured_peak_bytes'])} / {format_bytes(r['simulated_peak_bytes'])}"
            f" | {mem} | {r['measured_time_ratio']:.2f} / {r['predicted_time_ratio']:.2f} |"
        )
    lines += ["", "## Planner speed", ""]
    for key, value in data.get("speed", {}).items():
        lines.append(f"* `{key}`: {value}")
    lines += ["", data.get("discussion", "")]
    OUT_MD.write_text("\n".join(lines).rstrip() + "\n")


DISCUSSION = """## How to read it

See `docs/results/reforward.md`'s discussion section, written from these numbers."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 models, no speed part")
    parser.add_argument("--no-measure", action="store_true", help="skip the CPU measurements")
    parser.add_argument("--models", nargs="*", help="subset of the table's models")
    parser.add_argument(
        "--only",
        choices=("table", "measure", "speed"),
        help="run one part, keep the others from the existing results file",
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    models = args.models or (["alexnet", "resnet50", "densenet121"] if args.quick else list(PAPER))
    data: dict[str, Any] = {
        "schema": SCHEMA,
        "version": 1,
        "environment": {
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
        },
        "rows": [],
        "measured": [],
        "speed": {},
    }
    if OUT_JSON.exists() and (args.models or args.only):  # update a part, keep the others
        old = json.loads(OUT_JSON.read_text())
        redo = set(models)
        keep_rows = args.only not in (None, "table")
        keep_measured = args.only not in (None, "measure")
        data["rows"] = [r for r in old.get("rows", []) if keep_rows or r["model"] not in redo]
        data["measured"] = [
            r for r in old.get("measured", []) if keep_measured or r["model"] not in redo
        ]
        data["speed"] = old.get("speed", {})
    for name in models if args.only in (None, "table") else ():
        batch, image = PAPER[name][:2]
        cap = capture(name, batch, image, (LEVEL,))
        graph = cap["traces"][LEVEL].graph
        plans = plan_all(graph, PAPER[name][3] / PAPER[name][2])
        rows = table_rows(name, graph, plans, cap["seconds"])
        data["rows"].extend(rows)
        for r in rows:
            print(
                f"{name:13s} {r['method']:15s} mem {r.get('memory_ratio', '-')!s:7s} "
                f"time {r.get('time_ratio', '-')!s:7s} plan {r['plan_seconds']:.2f}s "
                f"{r.get('error', '')[:80]}",
                flush=True,
            )
        del cap, graph, plans
        _save(data)
    if not args.no_measure and args.only in (None, "measure"):
        for name in models:
            if name in MEASURED:
                rows = measure(name, *MEASURED[name])
                data["measured"] = [r for r in data["measured"] if r["model"] != name] + rows
                for r in rows:
                    print("measured", r, flush=True)
                _save(data)
    if not args.quick and args.only in (None, "speed"):
        data["speed"] = speed()
        print("speed", data["speed"], flush=True)
    _save(data)


def _save(data: dict[str, Any]) -> None:
    data["rows"].sort(key=lambda r: (list(PAPER).index(r["model"]), METHODS.index(r["method"])))
    OUT_JSON.parent.mkdir(parents=True, exist_ok=True)
    OUT_JSON.write_text(json.dumps(data, indent=1) + "\n")
    write_markdown({**data, "discussion": DISCUSSION})


if __name__ == "__main__":
    main()
