"""``remat bench compile``: remat against ``torch.compile``'s own activation-memory knob.

For every model, in one process, each point measured the same way (:func:`measure_setup`:
exact step peak from allocator events, time as the median ratio against eager steps
interleaved with it, gradients compared with eager's):

* ``eager``: no checkpointing;
* ``torch-compile@K``: ``torch.compile(model)`` with
  ``torch._functorch.config.activation_memory_budget = K`` for K in 1, 0.5, 0.2, 0.1, 0;
* ``remat-eager@M``: remat's plan for a whole-step budget M (what ``remat.auto`` plans:
  ``optimal-time`` under :func:`remat.auto.plan_for_total_budget`), M = every distinct measured
  peak of the compile points, plus budgets below the least of them (fractions of it and
  remat's own least feasible budget, ``least``);
* ``remat-compiled@M``: ``remat.auto(model, batch, budget=M, compile=<the backend>,
  loop="loss-only", optimizer=Adam)``, the planned model it returns measured as it is
  (:func:`auto_compiled_point`): its plan on the compiled stages' costs, run as **one**
  compiled graph where that graph's measured step fits M, else a graph per stage
  (``compiled`` in the row: ``summary.compiled``; NOTE [ One compiled graph ] in
  :mod:`remat.execute.chain`), with ``predicted_peak_bytes`` the summary's. A budget below
  auto's least is a refusal (``BudgetTooSmallError``): the row keeps the error and the
  minimum it names (``minimum_bytes``). Budgets: the same M, plus auto's own least
  (``least-compiled``: the minimum a refusal names).

The **goal** per model (``goal`` in ``compile.json``): at every compile point a
``remat-compiled`` point with peak <= and time ratio <= it (``dominated``), and remat points
below the least peak torch.compile reaches (``below_compile_min``). Time ratios of two points
come from separate interleaved loops (each against its own eager steps), so a tie within noise
can go either way: ``margin`` says by how much each compile point was beaten or missed. So at
the end of each model every compile point is timed in one loop against the fastest
remat-compiled points within its peak (:func:`_pair`; ``paired`` in its row), and where that was
measured it decides ``dominated`` (remat step / compile step <= 1). Its 95 % interval
(``paired_interval``: the loop's rounds resampled) says whether a miss is noise (1 inside it:
``within_noise``) or measured (``slower``: the whole interval above 1); the verdict stays the
ratio itself.

    remat bench compile --out docs/results/compile
    remat bench compile --quick --out /tmp/compile      # the MLP chain, two compile points
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from remat.auto import auto, plan_for_total_budget
from remat.bench.methods import Setup, Workload, compile_setup, remat_setup
from remat.bench.report import markdown_table
from remat.bench.suites import (
    _finish_rows,
    eager_reference,
    load_workload,
    measure_setup,
    training_step,
)
from remat.core.units import format_bytes
from remat.execute.chain import describe_compiled, partitioner_budget
from remat.measure.events import interleaved_times, median_ratio, median_ratio_interval
from remat.planners import BudgetTooSmallError

__all__ = [
    "DEFAULT_MODELS",
    "NOTES",
    "COMPILE_BUDGETS",
    "auto_compiled_point",
    "goal",
    "suite",
    "write_report",
]

# torch.compile's backend for every compiled point (the tests use "aot_eager_decomp_partition":
# the same partitioner and activation_memory_budget, no C++ compilation)
BACKEND = "inductor"
DEFAULT_MODELS = ["mlp-chain", "gpt2", "llama-tiny", "densenet121"]
COMPILE_BUDGETS = (1.0, 0.5, 0.2, 0.1, 0.0)
QUICK_COMPILE_BUDGETS = (1.0, 0.0)
# budgets below the least compile peak, as fractions of it
BELOW_FRACTIONS: tuple[float, ...] = ()  # the full run: remat's least only (CPU time)
QUICK_BELOW_FRACTIONS = (0.8,)
NOTES = (
    "torch-compile@K: torch.compile (inductor) with activation_memory_budget = K; "
    "remat-eager@P: remat's plan (optimal-time for a whole-step budget, as remat.auto plans) at "
    "the measured peak of point P; remat-compiled@P: remat.auto(model, batch, budget=P, "
    "compile=inductor, loop='loss-only', optimizer=Adam), measured as it returns it (one "
    "compiled graph where that graph's measured step fits P, else a graph per stage: "
    "'compiled'); a refusal keeps the minimum it names. "
    "Peak = exact bytes of a whole training step (Adam) from allocator events; time ratio = "
    "median step time / median eager step time, interleaved in the same loop."
)


def _options(name: str, quick: bool) -> dict[str, Any]:
    """Model sizes: small enough that the full CPU run (about 40 compilations) fits in
    minutes, real enough that activations dominate the step."""
    if quick:
        return {"mlp-chain": {"batch_size": 512, "layers": 4, "width": 128}}.get(name, {})
    return {
        "mlp-chain": {"batch_size": 1024, "layers": 16, "width": 256},
        # two layers: an inductor compilation of the 4-layer zoo model took 7.5 min on the
        # shared 2-core CPU, and a full run compiles each model about 9 times
        "gpt2": {"batch_size": 4, "seq_len": 128, "n_layer": 2},
        "llama-tiny": {"batch_size": 4, "seq_len": 128, "num_hidden_layers": 2},
        # 4 dense layers per stage (the compiled capture compiles each stage once). At 4 x 32²
        # the step peaked in Adam's step (110.64 MiB for eager, compile and remat alike: no
        # method could save memory); at 16 x 64² the activations set the peak (eager 248.5 MiB,
        # parameters 26.6 MiB)
        "densenet121": {"batch_size": 16, "image_size": 64, "group": 4},
    }.get(name, {})


def _auto_options() -> dict[str, Any]:
    return {"backend": BACKEND}


def auto_compiled_point(
    work: Workload,
    total_budget: int,
    label: str,
    eager_grads: Any,
    repeats: int,
    keep: dict[str, Setup] | None = None,
) -> dict[str, Any]:
    """``remat.auto(..., budget=total_budget, compile=...)`` on ``work``'s model for the
    bench's step (the loss of ``work.loss_fn``, its backward, Adam): the planned model it
    returns, measured by :func:`measure_setup`; or its refusal with the minimum it names."""
    torch._dynamo.reset()  # a fresh compilation
    optimizer = torch.optim.Adam(work.model.parameters(), lr=0.0)
    start = time.perf_counter()
    try:
        planned, summary = auto(
            work.model,
            work.batch,
            loss_fn=work.loss_fn,
            budget=total_budget,
            optimizer=optimizer,
            loop="loss-only",
            compile=_auto_options(),
        )
    except BudgetTooSmallError as err:
        return {
            "model": work.name,
            "method": label,
            "error": f"BudgetTooSmallError: {str(err).splitlines()[0]}",
            "refused": True,
            "minimum_bytes": err.minimum_bytes,
            "auto_seconds": round(time.perf_counter() - start, 1),
            "backend": BACKEND,
        }
    seconds = time.perf_counter() - start
    setup = Setup(
        label,
        planned,
        family="remat",
        predicted_peak_bytes=summary.predicted_peak_bytes,
        notes={
            "plan": describe_compiled(summary.plan),
            "partitioner_budget": partitioner_budget(summary.plan),
            "planner": summary.method,
            "compiled": summary.compiled,
            "one_graph_over_bytes": summary.one_graph_over_bytes,
            "compiled_note": summary.compiled_note or None,
            "auto_seconds": round(seconds, 1),
            "backend": BACKEND,
        },
    )
    if keep is not None:
        keep[label] = setup
    return measure_setup(setup, work, eager_grads, repeats)


def _compile_point(
    work: Workload,
    knob: float,
    eager_grads: Any,
    repeats: int,
    keep: dict[str, Setup] | None = None,
) -> dict:
    """torch.compile at ``activation_memory_budget=knob``, compiled afresh and measured."""
    torch._dynamo.reset()
    try:
        setup = compile_setup(work, knob, backend=BACKEND)
    except Exception as err:  # pragma: no cover - reported
        setup = Setup(f"torch-compile@{knob:g}", None, error=f"{type(err).__name__}: {err}")
    if keep is not None and setup.module is not None:
        keep[setup.method] = setup
    row = measure_setup(setup, work, eager_grads, repeats)
    row["backend"] = BACKEND
    return row


def _least_remat_budget(work: Workload, method: str = "optimal-time") -> int | None:
    """The least whole-step budget ``method`` plans for on ``work`` (None: not known)."""

    try:
        plan_for_total_budget(
            work.chain,
            work.fixed_bytes,
            0,
            method,
            work.grad_bytes or None,
            work.grad_rise_bytes,
            work.optimizer_step_bytes,
        )
    except BudgetTooSmallError as err:
        return err.minimum_bytes
    return None


def _remat_point(
    work: Workload,
    kind: str,
    budget: int,
    method: str,
    eager_grads: Any,
    repeats: int,
    seen: dict[tuple[str, str], dict[str, Any]],
    keep: dict[str, Setup] | None = None,
) -> dict[str, Any]:
    """One remat point: ``remat-eager`` (the eager executor, ``optimal-time`` for ``budget``)
    or ``remat-compiled`` (:func:`auto_compiled_point`)."""
    if kind == "eager":
        setup = remat_setup(work, "optimal-time", budget, method)
        same = seen.get((kind, str(setup.notes.get("plan"))))
        if setup.module is not None and same is not None:
            # the same plan at a larger budget: its measurement
            row = {**same, "method": method, "same_plan_as": same["method"]}
        else:
            row = measure_setup(setup, work, eager_grads, repeats)
            if "peak_bytes" in row:
                seen.setdefault((kind, str(setup.notes.get("plan"))), row)
    else:
        # auto plans and compiles afresh at every budget (what a user gets)
        row = auto_compiled_point(work, budget, method, eager_grads, repeats, keep)
    row["family"] = f"remat-{kind}"
    row["budget_bytes"] = budget
    if "peak_bytes" in row:
        row["within_budget"] = bool(row["peak_bytes"] <= budget)
    return row


def goal(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Does remat compiled dominate every torch.compile point, and reach below them?"""
    ok = [r for r in rows if "peak_bytes" in r and "time_ratio" in r]
    compiled = [r for r in ok if r["method"].startswith("torch-compile@")]
    remat_c = [r for r in ok if r["method"].startswith("remat-compiled@")]
    remat_all = [r for r in ok if r["method"].startswith("remat-")]
    points = []
    for c in compiled:
        fits = [r for r in remat_c if r["peak_bytes"] <= c["peak_bytes"]]
        best = min(fits, key=lambda r: r["time_ratio"], default=None)
        point = {
            "compile_point": c["method"],
            "peak_bytes": c["peak_bytes"],
            "time_ratio": c["time_ratio"],
            "best_remat_compiled": best["method"] if best else None,
            "best_time_ratio": best["time_ratio"] if best else None,
            # > 0: remat compiled was faster by this much of an eager step
            "margin": (c["time_ratio"] - best["time_ratio"]) if best else None,
            "dominated": bool(best and best["time_ratio"] <= c["time_ratio"]),
        }
        paired = _paired_by_plan(c, fits)
        if paired:
            # timed against each other in one loop: the verdict (the ratios against eager
            # above come from separate loops)
            plan = min(paired, key=lambda k: paired[k][0])
            ratio, names, interval = paired[plan]
            point.update(
                paired_remat_compiled=names[0],
                paired_points=names,
                paired_plan=plan,
                paired_ratio=ratio,
                dominated=ratio <= 1.0,
                # a tie: 1 inside the 95 % interval of the loop's rounds resampled (older
                # results without one: within PAIRED_NOISE of 1)
                within_noise=(
                    interval[0] <= 1.0 <= interval[1]
                    if interval
                    else abs(ratio - 1.0) < PAIRED_NOISE
                ),
            )
            if interval:
                point["paired_interval"] = list(interval)
                # remat measurably slower: the whole interval above 1
                point["slower"] = interval[0] > 1.0
        points.append(point)
    least = min((c["peak_bytes"] for c in compiled), default=None)
    below = [r for r in remat_all if least is not None and r["peak_bytes"] < least]
    return {
        "dominated_all": bool(points) and all(p["dominated"] for p in points),
        "points": points,
        "compile_min_peak_bytes": least,
        "below_compile_min": bool(below),
        "least_remat_peak_bytes": min((r["peak_bytes"] for r in remat_all), default=None),
        "holds": bool(points) and all(p["dominated"] for p in points) and bool(below),
    }


PAIRED_CANDIDATES = 2
"""Per compile point, the remat-compiled points within its peak (fastest against eager first)
:func:`_pair` times against it."""


PAIRED_NOISE = 0.02
"""Results written before the paired interval (``paired_interval``): how far apart two
pairings of the same remat plan against the same compile point came out (GPT-2, 31 steps:
0.910 and 0.946); a paired ratio closer to 1 was reported as within noise."""


def _paired_by_plan(
    c: dict[str, Any], fits: list[dict[str, Any]]
) -> dict[str, tuple[float, list[str], tuple[float, float] | None]]:
    """``c``'s paired ratios (:func:`_pair`) against the points of ``fits``, per plan run (the
    plan and its peak): their mean, the points, and an interval that holds each point's 95 %
    interval (None where one was not measured). auto gives the same plan at several budgets;
    the least of their ratios would be biased low, their mean is not."""
    by_plan: dict[str, list[str]] = {}
    for r in fits:
        if r["method"] in c.get("paired", {}):
            key = f"{r.get('plan')} ({format_bytes(r['peak_bytes'])})"
            by_plan.setdefault(key, []).append(r["method"])
    found = c.get("paired_interval", {})
    out = {}
    for key, names in by_plan.items():
        intervals = [found.get(name) for name in names]
        interval = (
            (min(lo for lo, _ in intervals), max(hi for _, hi in intervals))  # type: ignore[misc]
            if all(intervals)
            else None
        )
        out[key] = (statistics.fmean(c["paired"][name] for name in names), names, interval)
    return out


def _pair(rows: list[dict[str, Any]], keep: dict[str, Setup], work: Workload, repeats: int) -> None:
    """Time each compile point against the fastest remat-compiled points within its peak
    (:data:`PAIRED_CANDIDATES`), the two interleaved in one loop (``repeats`` steps each, Adam
    included), and write ``paired``, ``{remat point: median remat step / median compile
    step}``, into the compile point's row: :func:`goal`'s verdict. Two points' ratios against
    eager come from separate loops, minutes apart on a shared machine; a pair in one loop
    drifts together. Each pair is compiled afresh first (``torch._dynamo.reset``: dynamo does
    not guard on the partitioner's budget, so a graph compiled at another would be reused)."""
    ok = [r for r in rows if "peak_bytes" in r and "time_ratio" in r]
    for c in (r for r in ok if r["method"] in keep and r["method"].startswith("torch-compile@")):
        fits = sorted(
            (
                r
                for r in ok
                if r["method"].startswith("remat-compiled@")
                and r["method"] in keep
                and r["peak_bytes"] <= c["peak_bytes"]
            ),
            key=lambda r: r["time_ratio"],
        )
        c["paired"], c["paired_interval"] = {}, {}
        for r in fits[:PAIRED_CANDIDATES]:
            torch._dynamo.reset()
            steps = {
                name: training_step(keep[name].module, work, keep[name].context or nullcontext)[0]
                for name in (c["method"], r["method"])
            }
            times = interleaved_times(steps, repeats=repeats, warmup=2)
            c["paired"][r["method"]] = median_ratio(times, r["method"], c["method"])
            c["paired_interval"][r["method"]] = median_ratio_interval(
                times, r["method"], c["method"]
            )
    torch._dynamo.reset()


def _save_partial(rows: list[dict[str, Any]]) -> None:
    """With ``REMAT_BENCH_PARTIAL=path``, the rows measured so far go to ``path`` after every
    point (a long CPU run stopped early keeps what it measured)."""
    import json

    path = os.environ.get("REMAT_BENCH_PARTIAL")
    if path:
        Path(path).write_text(json.dumps(rows, indent=1, default=str))


def suite(models: list[str], quick: bool, progress: Callable[[str], None]) -> list[dict]:
    rows: list[dict[str, Any]] = []
    budgets = QUICK_COMPILE_BUDGETS if quick else COMPILE_BUDGETS
    below = QUICK_BELOW_FRACTIONS if quick else BELOW_FRACTIONS
    # timed steps per point, interleaved with eager's (REMAT_BENCH_REPEATS). The bench's
    # models step in 0.03-0.3 s on the CPU, where eager against itself came out 0.94-1.06 over
    # 7 steps and 0.99-1.01 over 50 (GPT-2, 2026-11-29): 31 by default
    repeats = int(os.environ.get("REMAT_BENCH_REPEATS", "31"))
    for name in models:
        progress(f"{name}: capture")
        start = time.perf_counter()
        work = load_workload(name, **_options(name, quick))
        eager_capture_seconds = time.perf_counter() - start
        eager_grads = eager_reference(work)
        measured = [
            measure_setup(Setup("eager", work.model, family="baseline"), work, eager_grads, repeats)
        ]
        measured[0]["capture_seconds"] = round(eager_capture_seconds, 1)
        keep: dict[str, Setup] = {}  # the compiled points, timed in pairs at the end
        for knob in budgets:
            progress(f"{name}: torch-compile@{knob:g}")
            row = _compile_point(work, knob, eager_grads, repeats, keep)
            row["family"] = "torch-compile"
            row["activation_memory_budget"] = knob
            measured.append(row)
            _save_partial(rows + measured)
        torch._dynamo.reset()
        targets: dict[int, str] = {}
        for row in measured[1:]:
            if "peak_bytes" in row:
                targets.setdefault(row["peak_bytes"], row["method"].removeprefix("torch-"))
        least = min(targets, default=None)  # torch.compile's least peak
        floor = _least_remat_budget(work)
        if least is not None and floor is not None and floor < least:
            # below torch.compile's least peak: fractions of it, and remat's own least
            for frac in below:
                if int(least * frac) > floor:
                    targets.setdefault(int(least * frac), f"{frac:g}x-compile-min")
            targets.setdefault(floor, "least")
        seen: dict[tuple[str, str], dict[str, Any]] = {}  # (kind, plan) -> its row
        minimum: int | None = None  # the least budget auto(compile=) named in a refusal
        for budget, label in sorted(targets.items(), reverse=True):
            for kind in ("eager", "compiled"):
                method = f"remat-{kind}@{label}"
                progress(f"{name}: {method}")
                row = _remat_point(work, kind, budget, method, eager_grads, repeats, seen, keep)
                if row.get("refused"):
                    minimum = row["minimum_bytes"]
                measured.append(row)
                _save_partial(rows + measured)
            torch._dynamo.reset()
        # auto(compile=)'s own least: the minimum a refusal names (asked for if none was)
        if minimum is None:
            progress(f"{name}: remat-compiled least (a refused budget)")
            probe = auto_compiled_point(work, 1, "remat-compiled@probe", eager_grads, repeats)
            minimum = probe.get("minimum_bytes")
        if minimum is not None and minimum not in targets:
            method = "remat-compiled@least-compiled"
            progress(f"{name}: {method}")
            row = _remat_point(work, "compiled", minimum, method, eager_grads, repeats, seen, keep)
            measured.append(row)
            _save_partial(rows + measured)
            torch._dynamo.reset()
        progress(f"{name}: each compile point against its fastest remat-compiled points")
        _pair(measured, keep, work, repeats)
        keep.clear()
        measured = _finish_rows(measured)
        summary = goal(measured)
        for row in measured:
            row["goal_holds"] = summary["holds"]
        rows.extend(measured)
    return rows


# ---------------------------------------------------------------------- report
def write_report(out: Path, result: dict[str, Any]) -> None:
    """compile.md (tables, goal per model), compile-MODEL.png (memory-time plane)."""

    rows = result["rows"]
    machine = result["machine"]
    lines = [
        f"# remat bench compile{' (quick)' if result.get('quick') else ''}",
        "",
        f"Measured {machine['date']} on {machine['device']} ({machine.get('processor')}, "
        f"{machine.get('cpus')} CPUs, {machine['threads']} torch threads), torch "
        f"{machine['torch']}, Python {machine['python']}; the run took "
        f"{result['seconds']:.0f} s. {NOTES}",
        "",
        "Goal: at every torch.compile point a remat-compiled point with peak <= and time <= "
        "it, and remat points below the least peak torch.compile reaches.",
        "",
        "| model | every compile point dominated | below compile's least peak | goal |",
        "|---|---|---|---|",
    ]
    goals = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        g = goal([r for r in rows if r["model"] == model])
        goals[model] = g
        least = g["compile_min_peak_bytes"]
        below = (
            f"yes ({format_bytes(g['least_remat_peak_bytes'])} < {format_bytes(least)})"
            if g["below_compile_min"]
            else "no"
        )
        undominated = [p["compile_point"] for p in g["points"] if not p["dominated"]]
        dom = "yes" if g["dominated_all"] else "no: " + ", ".join(undominated)
        ties = [p["compile_point"] for p in g["points"] if p.get("within_noise")]
        if ties:
            dom += f" (within noise at {', '.join(ties)})"
        slower = [p["compile_point"] for p in g["points"] if p.get("slower")]
        if slower:
            dom += f" (measurably slower at {', '.join(slower)})"
        lines.append(f"| {model} | {dom} | {below} | {'holds' if g['holds'] else 'fails'} |")
    lines += ["", "## Per compile point", ""]
    lines += [
        "Time against eager comes from each point's own loop; the verdict is the paired time:",
        "the compile point and the fastest remat-compiled points within its peak timed against",
        "each other in one loop (remat step / compile step; <= 1 dominates; points that run the",
        "same plan averaged). In brackets its 95 % interval (the loop's rounds resampled, SciPy's",
        "bootstrap; for a plan paired twice, one interval holding both): 1 inside it is within",
        "noise, a tie; all of it above 1, measurably slower.",
        "",
        "| model | compile point | peak | time | best remat-compiled within it | its time | "
        "margin | paired (remat / compile) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, g in goals.items():
        for p in g["points"]:
            best = p["best_remat_compiled"] or "none fits"
            bt = f"{p['best_time_ratio']:.2f}" if p["best_time_ratio"] is not None else "-"
            mg = f"{p['margin']:+.2f}" if p["margin"] is not None else "-"
            paired = "-"
            if "paired_ratio" in p:
                paired = f"{p['paired_ratio']:.3f}"
                if "paired_interval" in p:
                    paired += " [{:.3f}, {:.3f}]".format(*p["paired_interval"])
                paired += f" ({p['paired_plan']}"
                if len(p["paired_points"]) > 1:
                    paired += f"; mean of {len(p['paired_points'])} points"
                paired += ")" + (" within noise" if p["within_noise"] else "")
                paired += " measurably slower" if p.get("slower") else ""
            lines.append(
                f"| {model} | {p['compile_point']} | {format_bytes(p['peak_bytes'])} | "
                f"{p['time_ratio']:.2f} | {best} | {bt} | {mg} | {paired} |"
            )
    lines += ["", "## All points", "", markdown_table(rows)]
    (out / "compile.md").write_text("\n".join(lines) + "\n")
    _plots(out, rows)


def _plots(out: Path, rows: list[dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - plotting is optional
        return
    styles = {
        "baseline": ("k", "*", "eager"),
        "torch-compile": ("tab:red", "s", "torch.compile @ activation_memory_budget"),
        "remat-eager": ("tab:blue", "o", "remat eager"),
        "remat-compiled": ("tab:green", "^", "remat compiled"),
    }
    for model in dict.fromkeys(r["model"] for r in rows):
        pts = [r for r in rows if r["model"] == model and "memory_ratio" in r and "time_ratio" in r]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(7, 5))
        for family, (color, marker, label) in styles.items():
            fam = sorted(
                (r for r in pts if r.get("family") == family), key=lambda r: r["peak_bytes"]
            )
            if not fam:
                continue
            xs = [r["memory_ratio"] for r in fam]
            ys = [r["time_ratio"] for r in fam]
            ax.plot(
                xs,
                ys,
                marker=marker,
                color=color,
                label=label,
                linestyle="-" if len(fam) > 1 else "",
            )
        ax.set_xlabel("peak memory / eager peak (whole step, exact bytes)")
        ax.set_ylabel("step time / eager step time")
        ax.set_title(f"{model}: remat vs torch.compile's activation_memory_budget")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"compile-{model}.png", dpi=100)
        plt.close(fig)
