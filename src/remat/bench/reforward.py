"""Feng & Huang's Re-forwarding table reproduced with remat: ``remat bench reforward``.

Paper: Feng & Huang, "Optimal Gradient Checkpoint Search for Arbitrary Computation Graphs"
(CVPR 2021; arXiv:1808.00079 "Cutting Down Training Memory by Re-forwarding"). Their README table
(``shared/papers/notes.md`` §4.6) gives, for 15 torchvision models at fixed batch and input
sizes, the training memory after removing weights and gradients, without and with their
gradient checkpoints, and the time per iteration (GPU, PyTorch 0.4/1.x).

What this suite does, per model (:data:`DEFAULT_MODELS`, the paper's order and sizes):

1. **Table** (``part == "table"``): the model is captured at the paper's batch and input size
   under fake tensors (:func:`remat.capture.graph.trace_levels`, module level, nothing
   allocated, FLOPs as times) and planned with ``none``; ``reforward`` (Feng & Huang's division
   tree); ``chen-sqrt`` (Chen's sqrt(n) on the articulation chain); ``checkmate-milp`` and
   ``optimal-time`` (``articulation`` with the heterogeneous-chain DP) at the ``reforward``
   plan's memory; and the same two at the paper's memory ratio (``@paper``: the least time at
   the paper's cut; at the least feasible peak when the paper's ratio is below it). Memory is
   :func:`remat.graphs.simulate_graph`'s exact peak of activations, activation gradients and
   the input (weights and weight gradients excluded, as the paper excludes them); the time
   ratio is the predicted one (simulated FLOPs of forward + recomputation + backward over the
   regular step's). The loss is ``output.sum()``, as in the paper's benchmark.
2. **Measured** (``part == "measured"``): for the models in :data:`MEASURED` the *same plans*
   (node for node) are applied to the eager model at a batch that fits this CPU
   (:func:`remat.execute.graph.apply_graph`); the step time is a ratio to the unplanned step,
   interleaved with it, median of 5 (:func:`remat.measure.events.interleaved_times`), and the exact
   activation peak (:func:`remat.measure.profile.profile`) sits beside the simulated one.
3. **Speed** (``part == "speed"``, not in ``--quick``): ``reforward`` and ``articulation`` on
   DenseNet-201 at op level (target < 10 s), ``checkmate-milp`` on ResNet-50 at module level
   at the ``reforward`` memory (target < 60 s).
4. **MILP formulations** (:func:`milp_speed`, separately: ``python -m remat.bench.reforward
   milp-speed --out docs/results/reforward``, ~10 min): ``checkmate-milp`` on ResNet-50 at
   module level (paper size) at 0.7 and 0.5 of the regular peak and at the ``reforward``
   memory, with the plain model (``strengthen=False``) and the strengthened one, on the graph
   as captured and on the same graph with every ``keeps_output`` set (the cost model before
   outputs freed by their consumers were modelled): ``milp_speed.json`` / ``milp_speed.md``.

Every row has ``model``, ``method``, ``part``, ``peak_bytes``, ``memory_ratio`` and
``time_ratio`` (table rows also the paper's columns and ``target_met``).

Example::

    remat bench reforward --out docs/results/reforward          # 15 models, ~45 min on 2 shared cores
    remat bench reforward --quick --out /tmp/rf                  # alexnet at batch 16, ~2 min

Known limitations:
    * Memory at the paper's sizes is simulated (exact bytes of the captured costs); the executor
      reproduces it within a few percent where measured (the measured part, and
      ``tests/test_graph_runtime.py``), but the paper's MB are CUDA allocator peaks.
    * The full-batch time ratio is predicted from FLOPs, which ignores that cheap memory-bound
      ops (ReLU, BN, concatenation) cost more than their FLOPs on real hardware.
    * Graphs are captured at module level (one node per leaf module or functional call); op
      level is finer but makes ``checkmate-milp`` too slow at this size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from remat.capture.graph import trace_levels
from remat.core.graph import Graph
from remat.core.plan import Plan
from remat.core.simulate import simulate_graph
from remat.execute.graph import apply_graph
from remat.measure.events import interleaved_times, median_ratio
from remat.measure.profile import profile
from remat.planners.checkmate_milp import backward_floor
from remat.planners.graph import plan_graph

__all__ = [
    "DEFAULT_MODELS",
    "MEASURED",
    "NOTES",
    "PAPER",
    "suite",
    "write_report",
]

# model: (batch, image, regular MB, OGC MB, regular s/iter, OGC s/iter), notes §4.6 / issue 5
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
DEFAULT_MODELS: list[str] = list(PAPER)
"""The paper's 15 torchvision models, in its order."""

MEASURED: dict[str, tuple[int, int]] = {
    "alexnet": (8, 224),
    "vgg11": (2, 224),
    "resnet18": (4, 224),
    "resnet50": (2, 224),
    "densenet121": (2, 224),
    "densenet201": (1, 224),
    "inception_v3": (2, 300),
}
"""model: (batch, image) of the CPU measurement (the others: see the report)."""

QUICK_BATCH = 16
"""``--quick``: the table at the paper's input at this batch."""
QUICK_MEASURE_BATCH = 4
"""``--quick``: the measurement's batch."""

METHODS = (
    "none",
    "reforward",
    "chen-sqrt",
    "checkmate-milp",
    "optimal-time",
    "checkmate-milp@paper",
    "optimal-time@paper",
)
MEASURED_METHODS = ("none", "reforward", "chen-sqrt", "checkmate-milp", "best@paper")
LEVEL = "module"
MILP_SECONDS = 60.0
"""HiGHS limit of each ``checkmate-milp`` solve of the main table (the best plan found by then
is kept, with its proven gap)."""
MILP_RETRY_SECONDS = 600.0
"""A solve that found no plan at all in :data:`MILP_SECONDS` runs again with this limit before
falling back to LP rounding. Near the least feasible peak of the DenseNets (500-700 nodes,
7,000 binaries) HiGHS needs minutes for a first plan: DenseNet-169 at the paper's memory found
its first at 109 s, DenseNet-201's was found within 600 s."""
QUICK_MILP_SECONDS = 20.0
_TIME_LIMITED = frozenset({"checkmate-milp"})
"""The planners :func:`_plan` gives its ``milp_s`` as ``time_limit_s`` (the exact MILP)."""

SPEED_TARGETS_S = {"reforward": 10.0, "articulation": 10.0, "checkmate-milp": 60.0}

NOTES = (
    "Table: simulated exact peak of activations + activation gradients + input at the paper's "
    "batch and input sizes (fake tensors, module-level graph, loss output.sum()), weights and "
    "weight gradients excluded as in the paper; time ratio predicted from FLOPs. Measured: the "
    "same plans applied to the eager model at a small batch on this CPU (interleaved with the "
    "unplanned step, median of 5). Paper: Feng & Huang's README table, CUDA allocator MB, GPU."
)


def sum_loss(model: Any, batch: Any) -> Any:
    """The paper's benchmark loss: ``output.sum()``."""
    return model(batch).sum()


def build(name: str) -> Any:
    """The torchvision model in train mode, seeded (no pretrained weights)."""
    import torch
    import torchvision

    options: dict[str, Any] = {}
    if name == "inception_v3":
        options = dict(aux_logits=False, init_weights=True)
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None, **options).train()


def capture(name: str, batch: int, image: int, level: str = LEVEL) -> tuple[Any, Any, Any, float]:
    """``(graph, model, batch tensor, seconds)``: the graph under fake tensors."""
    import torch

    model = build(name)
    x = torch.randn(batch, 3, image, image)
    start = time.perf_counter()
    graph = trace_levels(model, x, sum_loss, (level,), fake=True)[level].graph
    return graph, model, x, time.perf_counter() - start


# ---------------------------------------------------------------------- planning
def _plan(graph: Any, method: str, budget: int | None, milp_s: float, **options: Any) -> dict:
    """One planner run: ``{"plan", "seconds", "error", "minimum_bytes"}``; a failure is data."""

    if method in _TIME_LIMITED:
        options["time_limit_s"] = milp_s
    start = time.perf_counter()
    try:
        plan = plan_graph(graph, method, budget, **options)
        return {"plan": plan, "seconds": time.perf_counter() - start}
    except Exception as err:  # noqa: BLE001 - a failing planner is a row, not a crash
        return {
            "plan": None,
            "seconds": time.perf_counter() - start,
            "error": f"{type(err).__name__}: {err}",
            "minimum_bytes": int(getattr(err, "minimum_bytes", 0) or 0),
        }


def plan_all(
    graph: Any, paper_ratio: float, milp_s: float, retry_s: float | None = None
) -> dict[str, dict]:
    """Every method of :data:`METHODS` on ``graph``.

    ``checkmate-milp`` / ``optimal-time``: least time at the ``reforward`` plan's peak.
    ``@paper``: at ``paper_ratio`` x our regular peak; when that is below the least feasible
    peak, at the least feasible peak instead (``budget_basis`` says which). A MILP that finds
    no plan in ``milp_s`` runs again for ``retry_s`` (``solver`` says so), then falls back to
    Checkmate's LP rounding (``solver`` says so too).
    """

    art = {"chain_method": "optimal-time"}
    out = {
        "none": _plan(graph, "none", None, milp_s),
        "reforward": _plan(graph, "reforward", None, milp_s),
        "chen-sqrt": _plan(graph, "articulation", None, milp_s, chain_method="chen-sqrt"),
    }
    ref = out["reforward"]["plan"]
    ref_budget = ref.predicted_peak_bytes if ref is not None else None
    paper_budget = int(paper_ratio * simulate_graph(graph, Plan.none()).peak_bytes)
    for key, budget in (("", ref_budget), ("@paper", paper_budget)):
        for method, planner, options in (
            ("checkmate-milp", "checkmate-milp", {}),
            ("optimal-time", "articulation", art),
        ):
            res = _plan(graph, planner, budget, milp_s, **options)
            res["budget_basis"] = "reforward" if not key else "paper"
            if res["plan"] is None and res.get("minimum_bytes") and key:
                first_error = res["error"]
                res = _plan(graph, planner, res["minimum_bytes"], milp_s, **options)
                res["budget_basis"] = "minimum (paper's memory is below it)"
                res["paper_budget_error"] = first_error
            if _timed_out(res) and retry_s and planner == "checkmate-milp":
                basis = res["budget_basis"]
                res = _plan(graph, planner, budget, retry_s, **options)
                res["budget_basis"] = basis
                res["solver"] = f"MILP, second solve of {retry_s:.0f} s (none in {milp_s:.0f} s)"
                limit = retry_s
            else:
                limit = milp_s
            if _timed_out(res):
                lp = _plan(graph, "checkmate-lp", budget, milp_s)
                if lp["plan"] is not None:
                    lp["solver"] = f"LP rounding (MILP found no plan in {limit:.0f} s)"
                    lp["budget_basis"] = res["budget_basis"]
                    res = lp
            out[method + key] = res
    return out


def _timed_out(res: dict) -> bool:
    """The MILP of a :func:`_plan` result found no plan within its time limit."""
    return res["plan"] is None and "PlannerTimeoutError" in res.get("error", "")


def _params(plan: Any) -> dict[str, Any]:
    return {k: v for k, v in plan.params.items() if isinstance(v, int | float | str)}


def table_rows(name: str, graph: Any, plans: dict[str, dict], batch: int, image: int) -> list:
    """Rows of the main table for one model (see the module docstring)."""

    _, _, regular_mb, ogc_mb, regular_s, ogc_s = PAPER[name]
    none = simulate_graph(graph, Plan.none())
    floor_bytes, floor_node = backward_floor(graph)
    rows = []
    for method in METHODS:
        res = plans[method]
        row: dict[str, Any] = {
            "model": name,
            "method": method,
            "part": "table",
            "batch": batch,
            "image": image,
            "level": LEVEL,
            "nodes": graph.n,
            "plan_seconds": round(res["seconds"], 3),
            "regular_bytes": none.peak_bytes,
            "paper_batch": PAPER[name][0],
            "paper_regular_mb": regular_mb,
            "paper_ogc_mb": ogc_mb,
            "paper_memory_ratio": round(ogc_mb / regular_mb, 4),
            "paper_overhead": round(ogc_s / regular_s - 1, 4),
            "floor_bytes": floor_bytes,
            "floor_node": "the loss" if floor_node is None else graph.nodes[floor_node].name,
        }
        for key in ("budget_basis", "solver", "paper_budget_error"):
            if key in res:
                row[key] = res[key]
        plan = res["plan"]
        if plan is None:
            row["error"] = res["error"]
            if res.get("minimum_bytes"):
                row["minimum_bytes"] = res["minimum_bytes"]
            row["target_met"] = False
        else:
            sim = simulate_graph(graph, plan)
            row.update(
                peak_bytes=sim.peak_bytes,
                memory_ratio=round(sim.peak_bytes / none.peak_bytes, 4),
                time_ratio=round(sim.total_time / none.total_time, 4),
                segments=len(plan.segments),
                recomputed_nodes=len(plan.recomputed_nodes()),
                plan_params=_params(plan),
            )
            # the unplanned row recomputes nothing: it is the reference, not a method meeting it
            row["target_met"] = bool(plan.recomputed_nodes()) and bool(
                row["memory_ratio"] <= row["paper_memory_ratio"]
                and row["time_ratio"] - 1 <= row["paper_overhead"] + 5e-5
            )
        rows.append(row)
    return rows


# ---------------------------------------------------------------------- measurement
def best_at_paper(rows: list[dict]) -> str | None:
    """The ``@paper`` method with the least predicted time (None if neither planned)."""
    done = [r for r in rows if r["method"].endswith("@paper") and "time_ratio" in r]
    return min(done, key=lambda r: r["time_ratio"])["method"] if done else None


def measure(
    name: str, batch: int, image: int, plans: dict[str, Any], repeats: int = 5
) -> list[dict]:
    """Apply ``plans`` (made on the full-batch graph; same nodes) to the eager model at
    ``batch``: measured time ratio (interleaved with the unplanned step) and exact peak."""

    graph, model, x, _ = capture(name, batch, image)
    none_sim = simulate_graph(graph, Plan.none())
    planned: dict[str, Any] = {}
    for key, plan in plans.items():
        if key == "none":
            continue
        plan = replace(plan, fingerprint=graph.fingerprint)
        planned[key] = apply_graph(model, plan, graph, x, sum_loss)

    def step(module: Any) -> Callable[[], None]:
        def run() -> None:
            sum_loss(module, x).backward()
            for p in model.parameters():
                p.grad = None

        return run

    steps = {"none": step(model), **{k: step(m) for k, m in planned.items()}}
    times = interleaved_times(steps, repeats=repeats, warmup=1)
    eager_peak = profile(model, x, sum_loss, timeline=False).activation_peak_bytes
    rows = []
    for key in steps:
        module = planned.get(key, model)
        sim = simulate_graph(graph, module.executed_plan) if key in planned else none_sim
        peak = (
            eager_peak
            if key == "none"
            else profile(module, x, sum_loss, timeline=False).activation_peak_bytes
        )
        rows.append(
            {
                "model": name,
                "method": key,
                "part": "measured",
                "batch": batch,
                "image": image,
                "plan_from": plans[key].params.get("label", "") if key != "none" else "",
                "peak_bytes": peak,
                "simulated_peak_bytes": sim.peak_bytes,
                "memory_ratio": round(peak / eager_peak, 4),
                "predicted_memory_ratio": round(sim.peak_bytes / none_sim.peak_bytes, 4),
                "time_ratio": round(median_ratio(times, key, "none"), 4),
                "predicted_time_ratio": round(sim.total_time / none_sim.total_time, 4),
                "step_seconds": round(statistics.median(times[key]), 4),
                "repeats": repeats,
            }
        )
    return rows


# ---------------------------------------------------------------------- speed
def speed_rows(progress: Callable[[str], None]) -> list[dict]:
    """Planner wall time: reforward and articulation on DenseNet-201 at op level, checkmate-milp
    on ResNet-50 at module level at the reforward plan's memory."""

    rows = []
    cases = (
        (
            "densenet201",
            "op",
            (
                ("reforward", "reforward", {}),
                ("articulation", "articulation", {"chain_method": "chen-sqrt"}),
            ),
        ),
        ("resnet50", "module", (("checkmate-milp", "checkmate-milp", {}),)),
    )
    for name, level, runs in cases:
        batch, image = PAPER[name][:2]
        graph, _, _, capture_s = capture(name, batch, image, level)
        none = simulate_graph(graph, Plan.none())
        for method, planner, options in runs:
            budget = None
            if planner == "checkmate-milp":
                ref = _plan(graph, "reforward", None, SPEED_TARGETS_S[planner])["plan"]
                budget = ref.predicted_peak_bytes if ref is not None else None
            res = _plan(graph, planner, budget, SPEED_TARGETS_S[planner], **options)
            row: dict[str, Any] = {
                "model": name,
                "method": method,
                "part": "speed",
                "level": level,
                "batch": batch,
                "image": image,
                "nodes": graph.n,
                "capture_seconds": round(capture_s, 2),
                "plan_seconds": round(res["seconds"], 3),
                "target_seconds": SPEED_TARGETS_S[method],
                "target_met": res["plan"] is not None
                and res["seconds"] < SPEED_TARGETS_S[method]
                and res["plan"].params.get("status", "optimal") == "optimal",
            }
            if res["plan"] is None:
                row["error"] = res["error"]
            else:
                sim = simulate_graph(graph, res["plan"])
                row.update(
                    peak_bytes=sim.peak_bytes,
                    memory_ratio=round(sim.peak_bytes / none.peak_bytes, 4),
                    time_ratio=round(sim.total_time / none.total_time, 4),
                    plan_params=_params(res["plan"]),
                )
            progress(f"speed {name} {level} {method}: {row['plan_seconds']} s")
            rows.append(row)
    return rows


# ---------------------------------------------------------------------- the suite
def suite(models: list[str], quick: bool, progress: Callable[[str], None]) -> list[dict]:
    """Rows of the three parts for ``models`` (``quick``: batch :data:`QUICK_BATCH`, MILP
    limit 20 s, measured at that batch, no speed part)."""
    import torch

    unknown = [m for m in models if m not in PAPER]
    if unknown:
        raise ValueError(f"not in the paper's table: {unknown}; choose from {DEFAULT_MODELS}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    milp_s = QUICK_MILP_SECONDS if quick else MILP_SECONDS
    rows: list[dict] = []
    for name in models:
        batch, image = PAPER[name][:2]
        if quick:
            batch = min(batch, QUICK_BATCH)
        graph, _, _, capture_s = capture(name, batch, image)
        plans = plan_all(
            graph, PAPER[name][3] / PAPER[name][2], milp_s, None if quick else MILP_RETRY_SECONDS
        )
        table = table_rows(name, graph, plans, batch, image)
        for r in table:
            r["capture_seconds"] = round(capture_s, 2)
            progress(
                f"{name} {r['method']}: memory {r.get('memory_ratio', '-')} time "
                f"{r.get('time_ratio', '-')} ({r['plan_seconds']:.1f} s) {r.get('error', '')[:80]}"
            )
        rows += table
        small = (QUICK_MEASURE_BATCH, image) if quick else MEASURED.get(name)
        if small is None:
            continue
        chosen = {k: plans[k]["plan"] for k in MEASURED_METHODS if k in plans}
        best = best_at_paper(table)
        if best is not None:
            chosen["best@paper"] = replace(
                plans[best]["plan"], params={**plans[best]["plan"].params, "label": best}
            )
        chosen = {k: p for k, p in chosen.items() if p is not None}
        for r in measure(name, *small, chosen):
            progress(
                f"measured {name} {r['method']}: memory {r['memory_ratio']} "
                f"(simulated {r['predicted_memory_ratio']}) time {r['time_ratio']} "
                f"(predicted {r['predicted_time_ratio']})"
            )
            rows.append(r)
    if not quick:
        rows += speed_rows(progress)
    return rows


# ---------------------------------------------------------------------- the report
def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def _cell(r: dict | None) -> str:
    if r is None:
        return "—"
    if "memory_ratio" not in r:
        return "fails"
    mark = "**" if r.get("target_met") else ""
    solver = str(r.get("solver", ""))
    extra = "†" if solver.startswith("LP") else "§" if solver else ""
    extra += "‡" if str(r.get("budget_basis", "")).startswith("minimum") else ""
    return f"{mark}{r['memory_ratio']:.2f}, {r['time_ratio'] - 1:+.0%}{mark}{extra}"


def _verdict(m: dict[str, dict]) -> str:
    """Plain words: is the target met on this row, by what, and if not, why."""
    ref = m["reforward"]
    pr, po = ref["paper_memory_ratio"], ref["paper_overhead"]
    met = [k for k in METHODS if m.get(k, {}).get("target_met")]
    words = []
    if met:
        best = min((m[k] for k in met), key=lambda r: (r["memory_ratio"], r["time_ratio"]))
        words.append(
            f"met by {', '.join(met)} (best {best['method']}: {best['memory_ratio']:.2f} at "
            f"{best['time_ratio'] - 1:+.0%} vs the paper's {pr:.2f} at {po:+.0%})"
        )
    else:
        words.append(f"**not met** (paper {pr:.2f} at {po:+.0%})")
    if "memory_ratio" in ref:
        if ref["memory_ratio"] > pr:
            words.append(f"`reforward` alone cuts less ({ref['memory_ratio']:.2f})")
        elif ref["time_ratio"] - 1 > po:
            words.append(
                f"`reforward` alone cuts as much ({ref['memory_ratio']:.2f}) but its predicted "
                f"overhead {ref['time_ratio'] - 1:+.0%} is above the paper's (it re-runs "
                "nearly the whole forward; the MILP / optimal-time at the same memory do not)"
            )
    milp = m.get("checkmate-milp@paper", {})
    basis = str(milp.get("budget_basis", ""))
    if basis.startswith("minimum") and "memory_ratio" in milp:
        least = milp["memory_ratio"]
        words.append(
            f"the paper's ratio is below the least peak `checkmate-milp` finds ({least:.2f})"
        )
        if "floor_bytes" in ref:
            floor = ref["floor_bytes"] / ref["regular_bytes"]
            words.append(
                f"no plan at this granularity goes below {floor:.2f} "
                f"({_mib(ref['floor_bytes'])} MiB: at the backward of `{ref['floor_node']}` its "
                "saved tensors, the inputs it saved, its output gradient and the input gradient "
                "it makes are live at once; `remat.planners.checkmate_milp.backward_floor`)"
                + (", and the MILP's least peak is that bound" if abs(floor - least) < 5e-4 else "")
            )
        if ref["batch"] == ref["paper_batch"]:
            ours_mib = least * ref["regular_bytes"] / 2**20
            verdict = "below" if ours_mib <= ref["paper_ogc_mb"] else "above"
            words.append(
                f"in absolute terms that peak is {ours_mib:.0f} MiB, {verdict} the paper's "
                f"{ref['paper_ogc_mb']:.0f} MB at {milp['time_ratio'] - 1:+.0%}: their ratio is "
                f"smaller because their regular figure is larger ({ref['paper_regular_mb']:.0f} "
                f"MB vs our {_mib(ref['regular_bytes'])} MiB; see 'What memory counts')"
            )
    elif "PlannerTimeoutError" in milp.get("error", ""):
        words.append(
            "`checkmate-milp` at the paper's memory found no plan within its time limit on this "
            "loaded machine (a longer limit may find one)"
        )
    art = m.get("optimal-time@paper", {})
    if str(art.get("budget_basis", "")).startswith("minimum") and "memory_ratio" in art:
        if not basis.startswith("minimum"):
            words.append(
                f"the articulation chain cannot reach the paper's memory (least "
                f"{art['memory_ratio']:.2f}: too few cut points)"
            )
    return "; ".join(words)


def _plot(out: Path, table: list[dict], paper: dict[str, tuple[float, float]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - plotting is optional
        return None
    models = [m for m in DEFAULT_MODELS if m in paper]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=False)
    width = 0.2
    series = (("paper", None), ("reforward", "reforward"), ("least time @paper", "@paper"))
    for ax, key, label in (
        (axes[0], "memory_ratio", "memory ratio (planned / regular)"),
        (axes[1], "time_ratio", "time overhead (predicted, full batch)"),
    ):
        for i, (name, method) in enumerate(series):
            values = []
            for model in models:
                if method is None:
                    pr, po = paper[model]
                    values.append(pr if key == "memory_ratio" else po)
                    continue
                rows = [
                    r
                    for r in table
                    if r["model"] == model and r["method"].endswith(method) and key in r
                ]
                if method == "@paper" and rows:
                    rows = [min(rows, key=lambda r: r["time_ratio"])]
                v = rows[0][key] if rows else float("nan")
                values.append(v - 1 if key == "time_ratio" else v)
            ax.bar([j + (i - 1) * width for j in range(len(models))], values, width, label=name)
        ax.set_xticks(range(len(models)), models, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Re-forwarding table: paper (GPU, measured) vs remat (exact bytes, FLOPs)")
    fig.tight_layout()
    path = out / "reforward.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out: Path, result: dict[str, Any]) -> None:
    """``out/reforward.md`` (the table beside the paper's, measured rows, planner speed,
    discussion) and ``out/reforward.png``."""
    rows = result["rows"]
    table = [r for r in rows if r.get("part") == "table"]
    measured = [r for r in rows if r.get("part") == "measured"]
    speed = [r for r in rows if r.get("part") == "speed"]
    by_model: dict[str, dict[str, dict]] = {}
    for r in table:
        by_model.setdefault(r["model"], {})[r["method"]] = r
    machine = result["machine"]
    lines = [
        f"# Re-forwarding (Feng & Huang) reproduced{' (quick)' if result.get('quick') else ''}",
        "",
        "Generated by `remat bench reforward` (`src/remat/bench/reforward.py`); do not edit by "
        f"hand. Run {machine['date']} on {machine['device']} ({machine.get('cpus')} CPUs, "
        f"{machine['threads']} torch threads), torch {machine['torch']}; it took "
        f"{result['seconds'] / 60:.0f} min."
        + "".join(
            f" Rows of {', '.join(run['models'])} were rerun {run['date']} ({run['minutes']:.0f} "
            "min, `python -m remat.bench.reforward merge`)."
            for run in result.get("reruns", ())
        ),
        "",
        "**Paper**: Feng & Huang's README table (`shared/papers/notes.md` §4.6): CUDA allocator "
        "peak minus the stationary memory (weights, gradients, CUDA context), GPU not named, "
        "PyTorch 0.4/1.x, time per iteration averaged over 70 iterations.",
        "",
        "**Ours**: remat's module-level graph captured under fake tensors at the paper's batch "
        "and input size, loss `output.sum()`; memory = the exact simulated peak of activations, "
        "activation gradients and the input (weights and weight gradients excluded, as in the "
        "paper); time = predicted from FLOPs (forward + recomputation + backward over the "
        "regular step's). The measured section below checks both on the eager model.",
        "",
        "## Main table",
        "",
        "Each cell: memory ratio (planned peak / regular peak), time overhead. **Bold**: the "
        "target (a memory ratio at most the paper's at an overhead at most the paper's) is met. "
        "`milp`, `opt-time`: least time at the `reforward` plan's memory (`checkmate-milp`; "
        "`articulation` + `optimal-time`). `@paper`: least time at the paper's memory ratio; "
        "‡ at the least feasible peak because the paper's ratio is below it; † LP rounding "
        "because the exact MILP found no plan within its time limit "
        f"({QUICK_MILP_SECONDS if result.get('quick') else MILP_SECONDS:.0f} s per HiGHS solve"
        + (
            ""
            if result.get("quick")
            else f"; {MILP_RETRY_SECONDS:.0f} s for a second solve "
            "when the first found no plan, marked §"
        )
        + ").",
        "",
        "| model | batch×image | regular MB paper / MiB ours | paper | reforward | chen-sqrt | "
        "milp | opt-time | milp @paper | opt-time @paper |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, m in by_model.items():
        ref = m["reforward"]
        lines.append(
            f"| {model} | {ref['batch']}×{ref['image']}² | {ref['paper_regular_mb']:.0f} / "
            f"{_mib(ref['regular_bytes'])} | {ref['paper_memory_ratio']:.2f}, "
            f"{ref['paper_overhead']:+.0%} | "
            + " | ".join(_cell(m.get(k)) for k in METHODS[1:])
            + " |"
        )
    lines += ["", "### Row by row: is the target met?", ""]
    for model, m in by_model.items():
        text = _verdict(m)
        best = [r for r in measured if r["model"] == model and r["method"] == "best@paper"]
        if best:
            b, ref = best[0], m["reforward"]
            ok = (
                b["memory_ratio"] <= ref["paper_memory_ratio"]
                and b["time_ratio"] - 1 <= ref["paper_overhead"]
            )
            text += (
                f"; measured on this CPU at batch {b['batch']}, the {b['plan_from']} plan: "
                f"{b['memory_ratio']:.2f} at {b['time_ratio'] - 1:+.0%} "
                f"({'meets' if ok else 'does not meet'} the target measured)"
            )
        lines.append(f"* **{model}**: {text}.")
    failed = [r for r in table if "error" in r]
    if failed:
        lines += ["", "Planner failures (no plan, see the error):", ""]
        lines += [f"* {r['model']} {r['method']}: {r['error'][:240]}" for r in failed]
    lines += [
        "",
        "## Measured on this CPU (the same plans on the eager model, small batch)",
        "",
        "The plans of the main table (made for the full batch) applied node for node to the "
        "eager model at a batch that fits this machine with `apply_graph`. Time: step time / "
        "unplanned step time, the two interleaved, median of "
        f"{measured[0]['repeats'] if measured else 5} steps each "
        "(`remat.measure.events.interleaved_times`); memory: exact activation peak "
        "(`remat.profile`), simulated beside it. `best@paper`: the faster of the two `@paper` "
        "plans.",
        "",
        "| model | batch×image | method | peak measured / simulated (MiB) | memory ratio measured"
        " / simulated | time ratio measured / predicted |",
        "|---|---|---|---|---|---|",
    ]
    for r in measured:
        label = r["method"] + (f" ({r['plan_from']})" if r.get("plan_from") else "")
        lines.append(
            f"| {r['model']} | {r['batch']}×{r['image']}² | {label} | {_mib(r['peak_bytes'])} / "
            f"{_mib(r['simulated_peak_bytes'])} | {r['memory_ratio']:.2f} / "
            f"{r['predicted_memory_ratio']:.2f} | {r['time_ratio']:.2f} / "
            f"{r['predicted_time_ratio']:.2f} |"
        )
    not_measured = [m for m in by_model if m not in {r["model"] for r in measured}]
    if not_measured:
        lines += [
            "",
            f"Not measured: {', '.join(not_measured)}. On this shared 2-core machine (one torch "
            "thread) one step of these at even batch 1-2 takes several seconds, and the "
            "measurement needs ~6 x 6 steps per model; each is a deeper or wider member of a "
            "measured family (same planners, same executor path), so their full-batch time "
            "ratio is the predicted one only.",
        ]
    lines += ["", "## Planner speed", ""]
    if speed:
        lines += [
            "| model | level | nodes | planner | seconds | target | met | plan |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in speed:
            plan = r.get("error", "")[:80]
            if "memory_ratio" in r:
                plan = f"memory {r['memory_ratio']:.2f}, time {r['time_ratio']:.2f}"
                status = r["plan_params"].get("status")
                if status is not None:
                    gap = r["plan_params"].get("mip_gap")
                    plan += f"; HiGHS {status}" + (f", proven gap {gap:.1%}" if gap else "")
            lines.append(
                f"| {r['model']} {r['batch']}×{r['image']}² | {r['level']} | {r['nodes']} | "
                f"{r['method']} | {r['plan_seconds']:.2f} | < {r['target_seconds']:.0f} s | "
                f"{'yes' if r['target_met'] else '**no**'} | {plan} |"
            )
    else:
        lines.append("Not run (`--quick`).")
    lines += ["", _discussion(by_model, measured)]
    (out / "reforward.md").write_text("\n".join(lines).rstrip() + "\n")
    paper = {
        m: (r["reforward"]["paper_memory_ratio"], r["reforward"]["paper_overhead"])
        for m, r in by_model.items()
        if "reforward" in r
    }
    if table:
        _plot(out, table, paper)


def _discussion(by_model: dict[str, dict[str, dict]], measured: list[dict]) -> str:
    """The "why they differ" section, with the numbers of this run."""
    full = {
        m: r
        for m, r in by_model.items()
        if r["reforward"]["batch"] == r["reforward"]["paper_batch"]
    }
    regular = ", ".join(
        f"{m} {r['reforward']['regular_bytes'] / 2**20 / r['reforward']['paper_regular_mb'] - 1:+.0%}"
        for m, r in full.items()
    )
    milp_paper = [
        f"{m} {r[k]['memory_ratio']:.2f} at {r[k]['time_ratio'] - 1:+.0%}"
        for m, r in by_model.items()
        for k in ("checkmate-milp@paper",)
        if m.startswith("densenet") and "memory_ratio" in r.get(k, {})
    ]
    feng = [
        f"{m} {r['reforward']['memory_ratio']:.2f}"
        for m, r in by_model.items()
        if m.startswith("densenet") and "memory_ratio" in r["reforward"]
    ]
    text = [
        "## Why ours and the paper's differ",
        "",
        '* **What "memory" counts.** The paper\'s MB are CUDA allocator peaks minus the '
        "stationary memory: they include cuDNN workspaces, allocator block rounding and the "
        "gradient of the input (their benchmark makes a fresh input with `requires_grad=True`). "
        "Ours are the exact bytes of what autograd keeps, the activation gradients and the "
        "input. Our *regular* peak (MiB) against theirs (MB, as printed): "
        + (regular or "(no full-size rows in this run)")
        + ". Where theirs is larger (AlexNet, VGG), a constant that sits in both of their "
        "columns makes their *ratio* smaller than the same plan's ratio in exact bytes; the "
        "row-by-row notes compare absolute numbers there.",
        "* **Granularity.** The table is planned on module-level graphs: one node per leaf "
        "module or functional call, in-place ReLUs merged into the op before them (as the "
        "paper's PyTorch 0.4 code merges them; op level merges them too). The least peak of "
        "any plan is bounded by the costliest single backward "
        "(`remat.planners.checkmate_milp.backward_floor`): for AlexNet and VGG-11 the first convolution + "
        "ReLU at full resolution with ReLU's output, the gradient in and the gradient out live "
        "(plus the 588 MiB input at AlexNet's batch 1024), for VGG-13/16 the second one with "
        "its input too. On those four rows the MILP's least peak equals that bound, so the "
        "paper's ratio is out of reach for any checkpointing plan in exact bytes; only a "
        "different backward (ReLU's gradient written in place, a 1-byte mask instead of its "
        "float output) would go lower. The paper's ratios there are smaller because of what "
        "their denominator counts (previous point), which only a CUDA measurement like theirs "
        "can reproduce.",
        "* **Their objective vs the true peak.** `reforward` is Feng & Huang's algorithm, "
        "optimal for *their* objective: the forward tensors of the checkpoints plus the largest "
        "segment, no gradients, no backward transients; among its candidate max terms remat "
        "keeps the plan of least *simulated* peak. That plan re-runs nearly the whole forward "
        "(about +33% FLOPs, as their measured +29% to +55%). `checkmate-milp` (exact under the "
        "true peak) and `optimal-time` on the articulation chain reach the same memory with a "
        "fraction of the recomputation, because they recompute only what the budget forces; "
        "that is why the target is met by them and usually not by `reforward` itself.",
        "* **DenseNet.** In Feng & Huang's graph a multi-input op sits *on* its vertex (notes "
        "§4.2): a dense layer's concatenated input is not a costed tensor, so their search "
        "keeps thin per-layer outputs and re-does the concatenations. In ours every "
        "concatenation is a node with its full bytes, so Feng's algorithm on our graph does not reach their cut "
        "(`reforward`: "
        + (", ".join(feng) or "-")
        + "). Plans at the paper's memory do exist in remat's plan space: `checkmate-milp` at "
        "the paper's ratio finds them (" + (", ".join(milp_paper) or "-") + ", predicted).",
        "* **Time.** The paper's overheads are GPU measurements (`time.time()` without "
        "synchronisation); ours are FLOP predictions at the full batch, checked on this CPU at "
        "a small batch in the measured section. FLOPs undercount memory-bound ops (batch norm, "
        "ReLU, concatenation), which are much of a DenseNet's recomputation, and this machine "
        "is shared, so single measured ratios carry noise of about ±10%.",
    ]
    worse = [
        f"{r['model']} {r['method']} {r['time_ratio']:.2f} vs {r['predicted_time_ratio']:.2f}"
        for r in measured
        if r["method"] != "none" and r["time_ratio"] > r["predicted_time_ratio"] + 0.1
    ]
    if worse:
        text.append(
            "  Measured CPU ratios more than 0.1 above the prediction: " + "; ".join(worse) + "."
        )
    return "\n".join(text)


# ---------------------------------------------------------------------- MILP formulations
MILP_SPEED_FRACTIONS = (0.7, 0.5)
"""Budgets of :func:`milp_speed` as fractions of the regular peak (plus the reforward memory)."""


def milp_speed(out: Path, time_limit_s: float = SPEED_TARGETS_S["checkmate-milp"]) -> list[dict]:
    """``checkmate-milp`` solve times on ResNet-50 (module level, paper size), plain vs
    strengthened formulation, at 0.7 / 0.5 of the regular peak and at the ``reforward`` plan's
    memory; writes ``out/milp_speed.json`` and ``out/milp_speed.md``."""
    import json
    import os

    batch, image = PAPER["resnet50"][:2]
    graph, _, _, _ = capture("resnet50", batch, image, "module")
    kept = Graph(
        tuple(replace(n, keeps_output=True) for n in graph.nodes),
        graph.input_bytes,
        graph.time_unit,
    )
    rows: list[dict] = []
    for variant, g in (("captured", graph), ("keeps_output=True", kept)):
        none = simulate_graph(g, Plan.none()).peak_bytes
        ref = plan_graph(g, "reforward").predicted_peak_bytes
        budgets = [(f"{f:g}", int(f * none)) for f in MILP_SPEED_FRACTIONS]
        budgets.append(("reforward", ref))
        for label, budget in budgets:
            for strengthen in (False, True):
                start = time.perf_counter()
                plan = plan_graph(
                    g, "checkmate-milp", budget, time_limit_s=time_limit_s, strengthen=strengthen
                )
                seconds = time.perf_counter() - start
                p = plan.params
                rows.append(
                    {
                        "graph": variant,
                        "nodes": g.n,
                        "budget": label,
                        "budget_bytes": budget,
                        "memory_ratio": round(budget / none, 4),
                        "formulation": "strengthened" if strengthen else "plain",
                        "seconds": round(seconds, 2),
                        "status": p["status"],
                        "mip_gap": round(float(p["mip_gap"]), 4),
                        "overhead": round(simulate_graph(g, plan).overhead, 4),
                        "bb_nodes": p.get("mip_node_count"),
                        "rows": p["rows"],
                        "columns": p["columns"],
                        "time_limit_s": time_limit_s,
                    }
                )
    out.mkdir(parents=True, exist_ok=True)
    meta = {"cpu_count": os.cpu_count(), "load_average": list(os.getloadavg())}
    (out / "milp_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# checkmate-milp on ResNet-50 (module level, batch 64, 224²): plain vs strengthened",
        "",
        f"`python -m remat.bench.reforward milp-speed` (HiGHS via scipy.optimize.milp, time "
        f"limit {time_limit_s:.0f} s, wall seconds on a shared 2-core machine, load average "
        f"{meta['load_average'][0]:.1f} at the end). Strengthened: the kept-copy variables `S` "
        "declared integer, big-M constants and variable bounds from the budget "
        "(`MilpConfig.strengthen`). `overhead`: recomputation time over forward + backward of "
        "the returned plan.",
        "",
        "| graph | budget | formulation | seconds | status | gap | overhead | B&B nodes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['graph']} | {r['budget']} ({r['memory_ratio']:.3f}) | {r['formulation']} | "
            f"{r['seconds']:.1f} | {r['status']} | {r['mip_gap']:.2%} | {r['overhead']:.4f} | "
            f"{r['bb_nodes']} |"
        )
    (out / "milp_speed.md").write_text("\n".join(lines) + "\n")
    return rows


# ---------------------------------------------------------------------- partial reruns
def merge(out: Path, reruns: list[Path]) -> dict[str, Any]:
    """Replace the rows of the models rerun (``remat bench reforward --models ... --out DIR``,
    one ``DIR`` per rerun) in ``out/reforward.json`` and write the report again; the header
    says which rows come from which run. The speed part is taken from the latest run that has
    it. Returns the merged result."""
    import json
    import re

    def header(md: Path) -> tuple[dict[str, Any], float]:
        found = re.search(
            r"Run (\S+ \S+) on (\S+) \((\S+) CPUs, (\S+) torch threads\), torch (\S+); "
            r"it took (\d+) min",
            md.read_text(),
        )
        if found is None:
            raise ValueError(f"{md}: no 'Run DATE on DEVICE (...); it took N min' header")
        date, device, cpus, threads, torch_version, minutes = found.groups()
        machine = {"date": date, "device": device, "cpus": cpus, "threads": threads}
        return {**machine, "torch": torch_version}, float(minutes)

    machine, base_minutes = header(out / "reforward.md")
    rows: list[dict] = json.loads((out / "reforward.json").read_text())
    old_reruns: list[dict] = []
    if (out / "reruns.json").exists():
        old_reruns = json.loads((out / "reruns.json").read_text())
    runs = list(old_reruns)
    for folder in reruns:
        new: list[dict] = json.loads((folder / "reforward.json").read_text())
        rerun_machine, minutes = header(folder / "reforward.md")
        date = rerun_machine["date"]
        models = [
            m
            for m in DEFAULT_MODELS
            if any(r["model"] == m and r.get("part") != "speed" for r in new)
        ]
        has_speed = any(r.get("part") == "speed" for r in new)
        rows = [
            r
            for r in rows
            if not (r.get("part") == "speed" and has_speed)
            and not (r.get("part") != "speed" and r["model"] in models)
        ] + new
        runs = [run for run in runs if not set(run["models"]) <= set(models)]
        runs.append({"models": models, "date": date, "minutes": minutes})
    order = {m: i for i, m in enumerate(DEFAULT_MODELS)}
    parts = {"table": 0, "measured": 1, "speed": 2}
    rows.sort(key=lambda r: (parts.get(r.get("part", ""), 3), order.get(r["model"], 99)))
    result = {
        "suite": "reforward",
        "quick": False,
        "machine": machine,
        "seconds": base_minutes * 60,
        "rows": rows,
        "reruns": runs,
    }
    (out / "reforward.json").write_text(json.dumps(rows, indent=1, default=str))
    (out / "reruns.json").write_text(json.dumps(runs, indent=1))
    write_report(out, result)
    return result


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="remat.bench.reforward extra parts")
    parser.add_argument("part", choices=["milp-speed", "merge"])
    parser.add_argument("reruns", nargs="*", type=Path, help="merge: folders of partial reruns")
    parser.add_argument("--out", type=Path, default=Path("docs/results/reforward"))
    parser.add_argument("--time-limit", type=float, default=SPEED_TARGETS_S["checkmate-milp"])
    args = parser.parse_args()
    if args.part == "merge":
        merged = merge(args.out, args.reruns)
        print(f"{len(merged['rows'])} rows -> {args.out / 'reforward.md'}")
    else:
        for row in milp_speed(args.out, args.time_limit):
            print(row)
