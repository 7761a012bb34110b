"""One compiled graph against a graph per stage (issue #19, NOTE [ One compiled graph ] in
remat.execute.chain): memory and time of GPT-2 tiny's training step, inductor on the CPU.

Per dropout setting, one process, the model of docs/results/compile (GPT-2, 2 layers, d=128,
4 heads, vocab 1024, batch 4 x 128 tokens), a step = the captured loss (the model's own, from
``labels``) and its backward, no optimizer (``loop="loss-only"``):

* the report's plan ``(1-2) (3) [4]`` run five ways: ``eager`` (the unplanned model),
  ``torch-compile`` (``torch.compile(model)``, unplanned), ``eager-executor`` (remat's eager
  checkpoints), ``per-stage`` (``remat.apply(compile=...)`` of an unmarked plan: each stage its
  own compiled graph) and ``one-graph`` (``remat.apply(compile=..., one_graph=True)``); peak
  bytes from the allocator's events (:func:`remat.measure.events.step_peak_bytes`), the
  per-stage prediction from the compiled capture, the largest gradient difference from eager;
* ``remat.auto(..., compile=...)`` at a whole-step budget (``--budget``, default 80% of the
  unplanned step's compiled prediction): which mode and plan it chose, its prediction, the measured peak,
  and its step timed against eager and against the same plan run a graph per stage;
* times: every step of a group timed in one interleaved loop (A B C ... A B C ...), the median
  of ``--repeats`` after a warm-up; ratios are median / median of ``eager`` in the same loop.

Run (one torch thread, as docs/results/compile):

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src .venv/bin/python \\
        benchmarks/compile_one_graph.py --dropout 0 --out docs/results/compile/one-graph-d0.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters

import remat
from remat import zoo
from remat.auto import predicted_step_peak_bytes
from remat.capture.chain import capture
from remat.core.plan import ChainSegment, Plan
from remat.measure.events import SCRATCH_MIN_BYTES, interleaved_times, step_peak_bytes

PLAN = Plan.from_chain_segments(
    (ChainSegment(1, 2, True), ChainSegment(3, 3, True), ChainSegment(4, 4))
)


def gpt2(dropout: float) -> tuple[nn.Module, Any, Any]:
    pdrop = {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    z = zoo.get("gpt2", batch_size=4, seq_len=128, n_layer=2, **pdrop)
    z.model.loss_type = "ForCausalLM"  # (transformers' loss otherwise logs: a graph break)
    return z.model, z.batch, z.loss_fn


def step_of(module: nn.Module, model: nn.Module, loss_fn: Any, batch: Any) -> Any:
    def step() -> None:
        loss_fn(module, batch).backward()
        for p in model.parameters():
            p.grad = None

    return step


def grads_after(module: nn.Module, model: nn.Module, loss_fn: Any, batch: Any) -> list:
    torch.manual_seed(1)
    loss_fn(module, batch).backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def max_relative_difference(got: list, want: list) -> float:
    return max(
        float((g - w).abs().max() / w.abs().max().clamp_min(1e-12))
        for g, w in zip(got, want, strict=True)
    )


def graphs_of(run: Any) -> tuple[int, int]:
    """Graphs compiled and graph breaks while ``run()`` runs."""
    counters.clear()
    run()
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def ratios(times: dict[str, list[float]]) -> dict[str, float]:
    base = statistics.median(times["eager"])
    return {name: round(statistics.median(t) / base, 3) for name, t in times.items()}


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "src"], capture_output=True, text=True
        )
    except OSError:
        return "?"
    return out.stdout.strip() + (" (src modified)" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--budget", default="80%", help="remat.auto's budget")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    options = {"backend": args.backend}
    torch.manual_seed(0)
    model, batch, loss_fn = gpt2(args.dropout)
    model.train()
    result: dict[str, Any] = {
        "model": "GPT-2 2 layers, d=128, 4 heads, vocab 1024, batch 4 x 128",
        "dropout": args.dropout,
        "backend": args.backend,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": _commit(),
        "plan": PLAN.describe(),
    }
    start = time.perf_counter()
    captured = capture(model, batch, loss_fn=loss_fn, compile=options)
    result["compiled_capture_s"] = round(time.perf_counter() - start, 1)
    stages = captured.stages
    eager_grads = grads_after(model, model, loss_fn, batch)
    variants: dict[str, nn.Module] = {
        "eager": model,
        "torch-compile": torch.compile(model, **options),
        "eager-executor": remat.apply(model, PLAN, stages=stages),
        "per-stage": remat.apply(model, PLAN, stages=stages, compile=options),
        "one-graph": remat.apply(model, PLAN, stages=stages, compile=options, one_graph=True),
    }
    rows: dict[str, dict[str, Any]] = {}
    for name, module in variants.items():
        start = time.perf_counter()
        graphs, breaks = graphs_of(step_of(module, model, loss_fn, batch))
        rows[name] = {
            "first_step_s": round(time.perf_counter() - start, 1),
            "graphs": graphs,
            "graph_breaks": breaks,
            "peak_bytes": step_peak_bytes(
                step_of(module, model, loss_fn, batch), model, None, batch
            ),
            "grad_max_rel_diff": max_relative_difference(
                grads_after(module, model, loss_fn, batch), eager_grads
            ),
        }
    rows["per-stage"]["predicted_bytes"] = (
        predicted_step_peak_bytes(model, captured, PLAN) + SCRATCH_MIN_BYTES
    )
    times = interleaved_times(
        {n: step_of(m, model, loss_fn, batch) for n, m in variants.items()}, args.repeats
    )
    for name, ratio in ratios(times).items():
        rows[name]["time_ratio"] = ratio
        rows[name]["median_s"] = round(statistics.median(times[name]), 4)
    result["fixed_plan"] = rows

    # remat.auto at a whole-step budget (a percentage of the unplanned compiled prediction)
    budget = args.budget
    torch._dynamo.reset()
    start = time.perf_counter()
    planned, summary = remat.auto(
        model, batch, loss_fn=loss_fn, budget=budget, compile=options, loop="loss-only"
    )
    auto_s = time.perf_counter() - start
    same_per_stage = remat.apply(
        model, planned.plan, stages=planned.stages, compile=options, one_graph=False
    )
    graphs, breaks = graphs_of(step_of(same_per_stage, model, loss_fn, batch))
    counters.clear()
    measured = step_peak_bytes(step_of(planned, model, loss_fn, batch), model, None, batch)
    recompiled = counters["stats"]["unique_graphs"]
    steps = {
        "eager": step_of(model, model, loss_fn, batch),
        "auto": step_of(planned, model, loss_fn, batch),
        "auto-plan-per-stage": step_of(same_per_stage, model, loss_fn, batch),
    }
    auto_times = interleaved_times(steps, args.repeats)
    result["auto"] = {
        "budget": budget,
        "budget_bytes": summary.budget_bytes,
        "seconds": round(auto_s, 1),
        "compiled": summary.compiled,
        "plan": planned.plan.describe(),
        "predicted_bytes": summary.predicted_peak_bytes,
        "measured_bytes": measured,
        "one_graph_over_bytes": summary.one_graph_over_bytes,
        "note": summary.compiled_note,
        "graphs_compiled_by_the_measured_step": recompiled,
        "grad_max_rel_diff": max_relative_difference(
            grads_after(planned, model, loss_fn, batch), eager_grads
        ),
        "time_ratio": ratios(auto_times),
        "per_stage_graphs": graphs,
        "per_stage_graph_breaks": breaks,
    }
    result["ended"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
