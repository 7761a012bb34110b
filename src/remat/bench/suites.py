"""Benchmark suites: every method measured the same way, in one process, as ratios.

A step is forward, loss, backward, ``Adam.step()``, ``zero_grad(set_to_none=True)``, after one
warm-up step so the optimizer state exists (shared/peers.md). For every method:

* ``peak_bytes``: exact, :func:`remat.measure.events.step_peak_bytes` (allocator events, persistent
  state included; sees compiled code), or ``torch.cuda.max_memory_allocated`` on a GPU;
* ``time_ratio``: median step time / median eager step time, the two interleaved A B A B in
  the same run (at least 5 steps each);
* ``max_grad_rel_diff``: the largest relative gradient difference against eager at the same
  weights (equal gradients are part of the result, not assumed): each tensor's largest
  difference over its largest value. A tensor whose true gradient is zero makes it noise over
  noise (DenseNet-121's stem batch norm: every consumer of its output starts with a batch norm,
  so its scale does not change the loss; 0.40 for torch.compile, float32 rounding alone);
* ``grad_error_fp64``: the whole gradient's error against the same step run in float64,
  ``||g - g64|| / ||g64||`` over every parameter; the eager row's is float32's own rounding,
  the floor a method's is read against (absent where the model does not run in float64).

Every suite runs with inductor's ``fallback_random`` on (:func:`run_suite`), as torch's own
accuracy benchmarks do: compiled code draws its random numbers (dropout's masks) as eager does,
so a compiled method's gradients can be compared with eager's at all (with inductor's own random
numbers GPT-2's compiled gradients differed from eager's by 0.81-0.97, the masks, not the
method). torch.compile's points and remat's run under it alike.

Suites write ``OUT/SUITE.json`` (a list of rows with ``model``, ``method``, ``peak_bytes``,
``memory_ratio``, ``time_ratio``, ``machine`` and more), ``OUT/SUITE.md`` (the table, with the
machine and the run's length) and a PNG per model (the memory–time plane).
"""

from __future__ import annotations

import copy
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from remat import zoo
from remat.api import plan as make_plan
from remat.auto import fixed_bytes, stage_grad_bytes
from remat.bench.methods import Setup, Workload, compile_setup, peer_methods, remat_setup
from remat.bench.report import write_markdown, write_plots
from remat.capture.chain import capture, capture_chain
from remat.core.chain_simulate import simulate
from remat.measure.events import cuda_step_peak_bytes, interleaved_times, step_peak_bytes
from remat.measure.profile import optimizer_costs
from remat.planners import available
from remat.planners.optimal_time import min_feasible_peak

__all__ = [
    "SUITES",
    "EagerGrads",
    "eager_reference",
    "gradient_error",
    "load_workload",
    "machine_info",
    "measure_setup",
    "run_suite",
    "training_step",
]

PEER_MODELS = ("resnet50", "densenet121", "gpt2", "llama-tiny")
# Rockmate's own experiments (Zhao et al. 2023): the comparison on the ground its authors chose
ROCKMATE_MODELS = ("gpt2", "resnet101", "regnet", "unet", "mlp-mixer")
QUICK_MODEL = "mlp-chain"


def machine_info() -> dict[str, Any]:
    """Where a result was measured."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "device": "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    try:
        import os

        info["cpus"] = os.cpu_count()
    except Exception:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    return info


# Suite models whose chain form lives in remat.bench.models (a zoo factory): the suite, its peers
# and the Rockmate runner all build the same module from the same name and options.
CHAIN_FORMS = {"densenet121": "remat.bench.models:densenet121_chain"}


def zoo_name(name: str) -> str:
    """What ``remat.zoo.get`` builds for the suite's model ``name``."""
    return CHAIN_FORMS.get(name, name)


def load_workload(name: str, batch_size: int | None = None, **options: Any) -> Workload:
    """A zoo model with its capture (chain, stages) and fixed bytes (Adam)."""

    torch.manual_seed(0)
    entry = zoo.get(zoo_name(name), batch_size=batch_size, **options)
    work = Workload(name, entry.model, entry.batch, entry.loss_fn)
    captured = capture(entry.model, entry.batch, loss_fn=entry.loss_fn)
    work.chain, work.stages = captured.chain, captured.stages
    opt = torch.optim.Adam(entry.model.parameters())
    work.fixed_bytes = fixed_bytes(entry.model, opt)
    work.optimizer_step_bytes = optimizer_costs(entry.model, opt)[1]
    work.grad_bytes = stage_grad_bytes(captured.stages, captured.grad_made)
    work.grad_rise_bytes = captured.grad_rise_bytes
    return work


def _grads(
    module: torch.nn.Module,
    work: Workload,
    ctx: Callable[[], Any],
    batch: Any = None,
    names: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """The gradients of one step of ``module`` (``work.model`` wrapped by a method, sharing its
    parameters), keyed by the parameters' names in ``names`` (default ``work.model``): a
    wrapper's own names (``_orig_mod.``, an executor's) differ from the model's, and keyed by
    them Llama-tiny's remat rows were compared on 1 tensor of 21."""
    named = {id(p): n for n, p in (names or work.model).named_parameters()}
    torch.manual_seed(1234)  # the same dropout masks for every method
    module.zero_grad(set_to_none=True)
    with ctx():
        loss = work.loss_fn(module, work.batch if batch is None else batch)
        loss.backward()
    grads = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            grads[named.get(id(p), name)] = p.grad.detach().clone()
    module.zero_grad(set_to_none=True)
    return grads


@dataclass
class EagerGrads:
    """Eager's gradients at the bench's weights (what every method's are compared with), and the
    same step's in float64 (the reference of ``grad_error_fp64``; None where the model does not
    run in float64)."""

    fp32: dict[str, torch.Tensor]
    fp64: dict[str, torch.Tensor] | None


def eager_reference(work: Workload) -> EagerGrads:
    """:class:`EagerGrads` of ``work``: its model as it is, and a float64 copy of it on the
    float64 batch (the same seed, so the same dropout masks)."""
    fp32 = _grads(work.model, work, nullcontext)
    try:
        model64 = copy.deepcopy(work.model).double()
        batch64 = tree_map_only(
            torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, work.batch
        )
        fp64 = _grads(model64, work, nullcontext, batch64, names=model64)
        del model64
    except (RuntimeError, TypeError):  # an op or a model without float64: no reference
        fp64 = None
    return EagerGrads(fp32, fp64)


def gradient_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """``||g - ref|| / ||ref||`` over the parameters both have, all tensors as one vector
    (float64): a parameter whose true gradient is zero adds its absolute error, not a ratio of
    two roundings."""
    err = ref = 0.0
    for key, r in reference.items():
        if key in grads:
            r64 = r.double()
            err += float((grads[key].double() - r64).square().sum())
            ref += float(r64.square().sum())
    return math.sqrt(err / ref) if ref else math.sqrt(err)


def training_step(
    module: torch.nn.Module, work: Workload, context: Callable[[], Any] = nullcontext
) -> tuple[Callable[[], None], torch.optim.Optimizer]:
    """One training step of ``module`` on ``work`` as the benches time it, and its optimizer:
    ``work.loss_fn`` and its backward inside ``context()``, then Adam at lr 0 (it allocates and
    updates its state as usual but the weights stay the same, so every method's gradients are
    compared at the same point)."""
    opt = torch.optim.Adam(module.parameters(), lr=0.0)

    def step() -> None:
        with context():
            work.loss_fn(module, work.batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt


def measure_setup(
    setup: Setup, work: Workload, eager_grads: EagerGrads | None, repeats: int = 5
) -> dict[str, Any]:
    """Measure one method: exact peak, interleaved time ratio vs eager, gradient agreement."""

    row: dict[str, Any] = {"model": work.name, "method": setup.method, "family": setup.family}
    row.update({k: v for k, v in setup.notes.items() if v is not None})
    if setup.module is None:
        row["error"] = setup.error
        return row
    module = setup.module
    ctx = setup.context or nullcontext
    try:
        start = time.perf_counter()
        grads = _grads(module, work, ctx)  # also compiles
        row["first_step_seconds"] = time.perf_counter() - start
        if eager_grads is not None:
            worst = 0.0
            for key, ref in eager_grads.fp32.items():
                if key in grads:
                    denom = float(ref.abs().max()) or 1.0
                    worst = max(worst, float((grads[key] - ref).abs().max()) / denom)
            row["max_grad_rel_diff"] = worst
            row["grads_compared"] = sum(k in grads for k in eager_grads.fp32)
            if eager_grads.fp64 is not None:
                row["grad_error_fp64"] = gradient_error(grads, eager_grads.fp64)
        step, opt = training_step(module, work, ctx)
        eager_step, _ = training_step(work.model, work)

        if torch.cuda.is_available():
            row["peak_bytes"] = cuda_step_peak_bytes(step)
        else:
            row["peak_bytes"] = step_peak_bytes(step, module, opt, work.batch)
        times = interleaved_times({"eager": eager_step, "method": step}, repeats=repeats)
        row["step_seconds"] = statistics.median(times["method"])
        row["eager_step_seconds"] = statistics.median(times["eager"])
        row["time_ratio"] = row["step_seconds"] / row["eager_step_seconds"]
        if setup.predicted_peak_bytes is not None:
            row["predicted_peak_bytes"] = setup.predicted_peak_bytes
    except Exception as err:  # a peer failing here is a result: report it verbatim
        row["error"] = f"{type(err).__name__}: {err}"[:2000]
    return row


def _finish_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_model: dict[str, int] = {}
    for row in rows:
        if row["method"] == "eager" and "peak_bytes" in row:
            by_model[row["model"]] = row["peak_bytes"]
    for row in rows:
        base = by_model.get(row["model"])
        if base and "peak_bytes" in row:
            row["memory_ratio"] = row["peak_bytes"] / base
    return rows


def suite_peers(models: list[str], quick: bool, progress: Callable[[str], None]) -> list[dict]:
    """remat against every peer, on the same model and input, in one run."""
    rows: list[dict[str, Any]] = []
    for name in models:
        progress(f"{name}: capture")
        work = load_workload(name, **_model_options(name, quick))
        setups = peer_methods(work, quick=quick)
        eager_grads = eager_reference(work)
        measured: list[dict[str, Any]] = []
        for setup in setups:
            progress(f"{name}: {setup.method}")
            measured.append(measure_setup(setup, work, eager_grads))
        budgets = [] if quick else [1.0, 0.5, 0.1]
        for b in budgets:
            progress(f"{name}: torch-compile@{b}")
            row = _compiled_row(work, b, eager_grads)
            row["compile_phase_seconds"] = _compile_phase_seconds()
            progress(
                f"{name}: torch-compile@{b} first step {row.get('first_step_seconds', 0):.0f} s"
            )
            measured.append(row)
        torch._dynamo.reset()
        # remat: its default plans, then optimal-time at every peer's measured peak
        remat_setups = [remat_setup(work, m) for m in ("chen-sqrt", "every-stage")]
        remat_setups.append(remat_setup(work, "optimal-time", None, "remat-optimal-time"))
        for row in measured:
            if row["method"] != "eager" and "peak_bytes" in row:
                remat_setups.append(
                    remat_setup(
                        work,
                        "optimal-time",
                        row["peak_bytes"],
                        f"remat-optimal-time@{row['method']}",
                    )
                )
        for frac in [] if quick else [0.3, 0.5, 0.7, 0.9]:
            eager_peak = next((r["peak_bytes"] for r in measured if r["method"] == "eager"), 0)
            remat_setups.append(
                remat_setup(
                    work, "optimal-time", int(eager_peak * frac), f"remat-optimal-time@{frac:.0%}"
                )
            )
        for setup in remat_setups:
            progress(f"{name}: {setup.method}")
            measured.append(measure_setup(setup, work, eager_grads))
        if not quick:
            for fraction in (0.25, 0.5):
                progress(f"{name}: rockmate-rotor@{fraction}")
                measured.append(_rockmate_row(name, fraction, measured))
        rows.extend(_finish_rows(measured))
    return rows


def _compiled_row(work: Workload, budget: float, eager_grads: Any) -> dict[str, Any]:
    """torch.compile at ``activation_memory_budget=budget``, compiled afresh and measured; a
    compilation error becomes the row's ``error``."""
    torch._dynamo.reset()
    try:
        setup = compile_setup(work, budget)
    except Exception as err:  # pragma: no cover - reported
        setup = Setup(f"torch-compile@{budget:g}", None, error=f"{type(err).__name__}: {err}")
    return measure_setup(setup, work, eager_grads)


def _compile_phase_seconds() -> dict[str, float]:
    """Seconds per torch.compile phase since the last ``torch._dynamo.reset()`` (dynamo's own
    ``compilation_time_metrics``, summed over the forward and backward graphs): where a compile's
    time went (``compile_file``: the C++ compiler; ``min_cut_rematerialization_partition``: the
    partitioner that applies ``activation_memory_budget``)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover
        return {}
    return {k: round(sum(v), 3) for k, v in compilation_time_metrics.items() if sum(v) >= 0.5}


def _rockmate_row(model: str, fraction: float, measured: list[dict[str, Any]]) -> dict[str, Any]:
    """Rockmate 2.0.0 (patched to run on the CPU, benchmarks/peers/README.md) in its own process:
    it keeps one live module per process. Its ratios are against the eager steps it interleaves
    in that process; its exact error is the row when it cannot run here."""
    import subprocess
    import sys
    import tempfile

    row: dict[str, Any] = {
        "model": model,
        "method": f"rockmate-rotor@{fraction:g}",
        "family": "peer",
        "notes_runner": "Rockmate 2.0.0, patched to run on the CPU",
    }
    runner = Path(__file__).resolve().parents[3] / "benchmarks" / "peers" / "rockmate_runner.py"
    if not runner.is_file():
        row["error"] = f"runner not found at {runner} (run from a source checkout)"
        return row
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rockmate.json"
        try:
            proc = subprocess.run(
                [
                    sys.executable,
                    str(runner),
                    "--model",
                    zoo_name(model),
                    *(
                        ["--options", json.dumps(_model_options(model, False))]
                        if model in CHAIN_FORMS
                        else []
                    ),
                    "--budget-fraction",
                    str(fraction),
                    "--out",
                    str(out),
                ],
                capture_output=True,
                text=True,
                timeout=1200,
            )
        except subprocess.TimeoutExpired:
            row["error"] = "rockmate runner exceeded 1200 s"
            return row
        if not out.is_file():
            row["error"] = (proc.stderr or proc.stdout or "no output")[-1500:]
            return row
        result = json.loads(out.read_text())
    if result.get("error"):
        row["error"] = str(result["error"])[:2000]
        return row
    eager_peak = result.get("eager_peak_bytes")
    row["peak_bytes"] = result["peak_bytes"]
    row["time_ratio"] = result.get("time_ratio")
    row["max_grad_rel_diff"] = result.get("max_grad_rel_diff")
    row["plan_seconds"] = result.get("plan_seconds")
    row["patched"] = result.get("patched")
    if eager_peak:
        row["rockmate_eager_peak_bytes"] = eager_peak
    return row


def suite_budget(models: list[str], quick: bool, progress: Callable[[str], None]) -> list[dict]:
    """Budget adherence: ``remat.auto``'s plan (optimal-time under the whole-step budget) at
    30/50/70/90% of the unplanned peak, and torch.compile's 0..1 ``activation_memory_budget``
    knob swept beside it; each row says whether its measured peak is within the budget and
    whether the peaks fall monotonically as the budget falls (``monotone``, per family)."""
    rows: list[dict[str, Any]] = []
    for name in models:
        work = load_workload(name, **_model_options(name, quick))
        eager_grads = eager_reference(work)
        measured = [measure_setup(Setup("eager", work.model, family="baseline"), work, eager_grads)]
        eager_peak = measured[0]["peak_bytes"]
        remat_rows = []
        for frac in (0.9, 0.7, 0.5, 0.3):
            progress(f"{name}: remat budget {frac:.0%}")
            setup = remat_setup(
                work, "optimal-time", int(eager_peak * frac), f"remat-auto@{frac:.0%}"
            )
            row = measure_setup(setup, work, eager_grads)
            row["budget_bytes"] = int(eager_peak * frac)
            row["budget_fraction"] = frac
            if "peak_bytes" in row:
                row["within_budget"] = bool(row["peak_bytes"] <= row["budget_bytes"])
            remat_rows.append(row)
        compile_rows = []
        for knob in () if quick else (1.0, 0.8, 0.6, 0.4, 0.2, 0.0):
            progress(f"{name}: torch-compile@{knob}")
            row = _compiled_row(work, knob, eager_grads)
            row["budget_fraction"] = knob
            compile_rows.append(row)
        torch._dynamo.reset()
        for family in (remat_rows, compile_rows):
            peaks = [r["peak_bytes"] for r in family if "peak_bytes" in r]
            monotone = all(b <= a for a, b in zip(peaks, peaks[1:], strict=False))
            for r in family:
                r["monotone"] = monotone
        measured += remat_rows + compile_rows
        rows.extend(_finish_rows(measured))
    return rows


def suite_chen2016(models: list[str], quick: bool, progress: Callable[[str], None]) -> list[dict]:
    """Chen et al.'s 1000-layer ResNet at ImageNet size, with fake tensors; memory vs depth."""

    rows: list[dict[str, Any]] = []
    depths = [56, 101] if quick else [101, 200, 302, 500, 701, 1001]
    batch, image = (4, 64) if quick else (32, 224)
    # PyTorch's own baselines are plans too: `checkpoint_sequential` with sqrt(n) segments
    # runs exactly chen-sqrt's plan (equal segments, the last one stored), and checkpointing
    # every block is every-stage
    methods = [
        "none",
        "every-stage",
        "chen-sqrt",
        "chen-budget",
        "chen-recursive",
        "hong-linear",
        "reforward",
        "optimal-time",
    ]
    for depth in depths:
        progress(f"resnet{depth}: fake capture")
        entry = zoo.get("resnet1001", batch_size=batch, depth=depth, image_size=image)
        chain = capture_chain(entry.model, entry.batch, loss_fn=entry.loss_fn, fake=True)
        base = simulate(chain, make_plan(chain, "none"))

        sqrt_peak = simulate(chain, make_plan(chain, "chen-sqrt")).peak_bytes
        budgets: dict[str, int | None] = {m: None for m in methods}
        budgets["optimal-time@chen-sqrt"] = sqrt_peak
        budgets["optimal-time@min"] = min_feasible_peak(chain)
        for method, budget in budgets.items():
            planner = method.split("@")[0]
            try:
                p = make_plan(chain, planner, budget)
            except Exception as err:  # report, do not hide
                rows.append({"model": f"resnet{depth}", "method": method, "error": str(err)})
                continue
            sim = simulate(chain, p)
            rows.append(
                {
                    "model": f"resnet{depth}",
                    "method": method,
                    "depth": depth,
                    "stages": chain.n,
                    "batch": batch,
                    "image_size": image,
                    "peak_bytes": sim.peak_bytes,
                    "memory_ratio": sim.peak_bytes / base.peak_bytes,
                    "time_ratio": sim.total_time / base.total_time,
                    "recompute_forwards": sim.recompute_time / chain.total_fwd_time(),
                    "measured_by": "fake tensors (FakeTensorMode) + simulate; time from FLOPs",
                }
            )
    return rows


def suite_planners(models: list[str], quick: bool, progress: Callable[[str], None]) -> list[dict]:
    """Planning time and plan quality of every planner against ``optimal-time`` (the optimum
    over nested plans) on captured zoo chains: ``time_vs_optimal`` = the planner's simulated time
    / optimal-time's at the same peak; ``memory_vs_optimal`` = its peak / the least peak at
    which optimal-time is as fast."""

    rows: list[dict[str, Any]] = []
    for name in models:
        progress(f"{name}: capture")
        entry = _zoo_entry(name, quick)
        chain = capture_chain(entry.model, entry.batch, loss_fn=entry.loss_fn)
        base = simulate(chain, make_plan(chain, "none"))
        for method in available():
            start = time.perf_counter()
            p = make_plan(chain, method)
            seconds = time.perf_counter() - start
            sim = simulate(chain, p)
            best = make_plan(chain, "optimal-time", sim.peak_bytes)
            lo, hi = 0, sim.peak_bytes  # least budget where optimal-time is as fast
            while hi - lo > max(1, hi // 1000):
                mid = (lo + hi) // 2
                try:
                    q = make_plan(chain, "optimal-time", mid)
                except ValueError:
                    lo = mid
                    continue
                if (q.predicted_time or 0.0) <= sim.total_time:
                    hi = q.predicted_peak_bytes or mid
                else:
                    lo = mid
            rows.append(
                {
                    "model": name,
                    "method": method,
                    "stages": chain.n,
                    "plan_seconds": seconds,
                    "peak_bytes": sim.peak_bytes,
                    "memory_ratio": sim.peak_bytes / base.peak_bytes,
                    "time_ratio": sim.total_time / base.total_time,
                    "time_vs_optimal": sim.total_time / (best.predicted_time or sim.total_time),
                    "memory_vs_optimal": sim.peak_bytes / max(1, hi),
                    "measured_by": "captured chain + simulate (no training step)",
                }
            )
    return rows


def _zoo_entry(name: str, quick: bool) -> Any:

    small = {
        "mlp-chain": {"batch_size": 256},
        "resnet18": {"batch_size": 8},
        "gpt2": {"batch_size": 4},
        "lstm-seq": {"batch_size": 8},
        "wrn-28-2": {"batch_size": 32},
        "vgg11": {"batch_size": 4},
    }
    return zoo.get(name, **small.get(name, {}))


# Suites with a module of their own (imported only when run): ``remat.bench.<name>`` defines
# ``suite(models, quick, progress) -> rows``, ``DEFAULT_MODELS``, ``NOTES`` and, optionally,
# ``write_report(out, result)`` for a report beyond the generic table (the papers' columns).
OWN_MODULE_SUITES = ("reforward", "sohoni", "compile")


def _own_module(suite: str) -> Any:
    import importlib

    return importlib.import_module(f"remat.bench.{suite}")


def _lazy_suite(suite: str) -> Callable[[list[str], bool, Callable[[str], None]], list[dict]]:
    def run(models: list[str], quick: bool, progress: Callable[[str], None]) -> list[dict]:
        return _own_module(suite).suite(models, quick, progress)

    run.__name__ = f"suite_{suite}"
    return run


SUITES: dict[str, Callable[[list[str], bool, Callable[[str], None]], list[dict]]] = {
    "peers": suite_peers,
    "budget": suite_budget,
    "chen2016": suite_chen2016,
    "planners": suite_planners,
    **{name: _lazy_suite(name) for name in OWN_MODULE_SUITES},
}
SUITE_NOTES = {
    "budget": (
        "remat-auto@F: optimal-time planned for a whole-step budget of F x the eager peak "
        "(what remat.auto does); torch-compile@K: torch.compile with "
        "activation_memory_budget = K. budget.json has, per row, `within_budget` (measured "
        "peak <= budget) and `monotone` (the family's measured peaks never rise as its budget "
        "falls)."
    ),
    "planners": (
        "Pure planning on captured chains (simulated memory and time, no training step): "
        "time_vs_optimal = the planner's time / optimal-time's at the same peak (1.0 = "
        "optimal); memory_vs_optimal = its peak / the least peak at which optimal-time is as "
        "fast."
    ),
    "chen2016": (
        "Memory here is the simulated activation peak of the captured chain (saved tensors, "
        "activation gradients, transients; parameters, gradients and optimizer state excluded), "
        "captured on fake tensors (FakeTensorMode: exact bytes, nothing allocated), batch 32 at "
        "224² as in Chen et al. Time is predicted from FLOP counts of each stage's forward and "
        "backward. Paper (Chen et al. 2016, MXNet, 1000-layer ResNet): 48 GB -> 7 GB (ratio "
        "0.146) at about 30% extra time. PyTorch's baselines are plans here: "
        "`checkpoint_sequential` with sqrt(n) segments runs chen-sqrt's plan, checkpointing "
        "every block is every-stage."
    ),
}
DEFAULT_MODELS = {
    "peers": list(dict.fromkeys(PEER_MODELS + ROCKMATE_MODELS)),
    "budget": ["gpt2", "mlp-chain"],
    "chen2016": [],
    "planners": ["mlp-chain", "resnet18", "vgg11", "wrn-28-2", "gpt2", "lstm-seq"],
}


def _model_options(name: str, quick: bool) -> dict[str, Any]:
    if quick:
        return {}
    return {
        "resnet50": {"batch_size": 16, "image_size": 224},
        # DenseNet-121 as a chain (remat.bench.models), two dense layers per stage (34 stages,
        # as in the committed results; one per layer, 63 stages, plans in seconds too); 96²
        # keeps a run near the hour here while activations are 60 % of the eager peak
        "densenet121": {"batch_size": 8, "image_size": 96, "group": 2},
        "gpt2": {"batch_size": 4, "seq_len": 512},
        "llama-tiny": {"batch_size": 4, "seq_len": 512},
        # Rockmate's models, smaller than its paper's (GPU) so that a run ends in <= 15 min on
        # a loaded 2-core CPU (docs/results/peers/README.md)
        "resnet101": {"batch_size": 2, "image_size": 64},
        "regnet": {"batch_size": 8, "image_size": 64},
        "unet": {"batch_size": 4, "image_size": 64, "depth": 4, "width": 16, "form": "chain"},
        "mlp-mixer": {"batch_size": 16, "image_size": 64},
    }.get(name, {})


def run_suite(
    suite: str,
    out: Path,
    models: list[str] | None = None,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``suite`` and write ``out/SUITE.json``, ``out/SUITE.md`` and plots."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; choose one of: {', '.join(SUITES)}")
    module = _own_module(suite) if suite in OWN_MODULE_SUITES else None
    defaults = module.DEFAULT_MODELS if module else DEFAULT_MODELS[suite]
    notes = module.NOTES if module else SUITE_NOTES.get(suite, "")
    if module:
        chosen = models or (defaults[:1] if quick else list(defaults))
    else:
        chosen = models or ([QUICK_MODEL] if quick else defaults)
    say = progress or (lambda msg: None)
    start = time.perf_counter()
    import torch._inductor.config as inductor_config

    # compiled code draws dropout's masks as eager does: its gradients compare with eager's
    with inductor_config.patch(fallback_random=True):
        rows = SUITES[suite](chosen, quick, say)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    label = f"{machine['device']}, {machine.get('cpus')} cpus, torch {machine['torch']}"
    for row in rows:
        row["machine"] = label
    result = {
        "suite": suite,
        "quick": quick,
        "machine": machine,
        "seconds": time.perf_counter() - start,
        "rows": rows,
    }
    (out / f"{suite}.json").write_text(json.dumps(rows, indent=1, default=str))

    if module is not None and hasattr(module, "write_report"):
        module.write_report(out, result)
    else:
        write_markdown(out / f"{suite}.md", suite, result, notes)
        write_plots(out, suite, rows)
    return rows
