"""Some of ``remat bench compile``'s points for one model: torch.compile at the given
``activation_memory_budget`` values, ``remat.auto(compile=)`` at each one's measured peak, and
the two timed against each other in one interleaved loop, measured as the full bench measures
them (:mod:`remat.bench.compile`: exact whole-step peaks with Adam, time ratios against eager
steps interleaved, gradients against eager's). For re-checking one point after a change
without the full run (DenseNet-121's takes 75 minutes on the shared CPU). Writes
``OUT/points.json`` (the rows, the goal at these points, the machine) and prints the verdict::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src .venv/bin/python \
        benchmarks/compile_points.py densenet121 0.2 --out docs/results/compile/points
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

from remat.bench.compile import (
    _compile_point,
    _options,
    _pair,
    _remat_point,
    goal,
    load_workload,
)
from remat.bench.methods import Setup
from remat.bench.suites import _finish_rows, eager_reference, machine_info, measure_setup

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("model")
parser.add_argument("knobs", nargs="+", type=float, help="activation_memory_budget values")
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()
repeats = int(os.environ.get("REMAT_BENCH_REPEATS", "31"))
start = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - start:7.1f}s] {message}", flush=True)


say(f"{args.model}: capture")
work = load_workload(args.model, **_options(args.model, False))
grads = eager_reference(work)
rows = [measure_setup(Setup("eager", work.model, family="baseline"), work, grads, repeats)]
keep: dict[str, Setup] = {}
for knob in args.knobs:
    say(f"torch-compile@{knob:g}")
    row = _compile_point(work, knob, grads, repeats, keep)
    row.update(family="torch-compile", activation_memory_budget=knob)
    rows.append(row)
    if "peak_bytes" not in row:
        continue
    method = f"remat-compiled@compile@{knob:g}"
    say(method)
    rows.append(_remat_point(work, "compiled", row["peak_bytes"], method, grads, repeats, {}, keep))
    torch._dynamo.reset()
say("each compile point against its remat-compiled point")
_pair(rows, keep, work, repeats)
rows = _finish_rows(rows)
verdict = goal(rows)
args.out.mkdir(parents=True, exist_ok=True)
result = {
    "machine": machine_info(),
    "seconds": round(time.perf_counter() - start, 1),
    "rows": rows,
    "points": verdict["points"],
}
(args.out / "points.json").write_text(json.dumps(result, indent=1, default=str))
for p in verdict["points"]:
    interval = p.get("paired_interval")
    shown = f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
    say(
        f"{p['compile_point']}: remat-compiled / compile {p.get('paired_ratio', float('nan')):.3f} "
        f"{shown} ({p.get('paired_plan')}), dominated {p['dominated']}"
    )
