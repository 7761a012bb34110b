"""remat's exact knapsack against torch's quantized DP at partitioner budget 0.5 (issue #19).

remat's one graph at a partitioner budget solves the partitioner's knapsack exactly
(``remat.execute.chain.PARTITIONER_SOLVERS``' first, torch's ``"ilp"``: SciPy's HiGHS); torch.compile
uses its DP over quantized bytes (``"dp"``). On the bench's GPT-2 and Llama-tiny (``remat bench
compile``'s sizes), per process: torch.compile@0.5, remat's store-everything one graph at 0.5
with the DP, and the same with the exact solver, each's exact whole-step peak (Adam, allocator
events) and the three steps timed in one interleaved loop (101 steps each), each over
torch.compile@0.5's. ``--processes`` runs of it per model.

The compile caches are turned off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``): torch leaves the
solver out of their keys, so a graph cached by the other solver would be served.

Writes ``docs/results/compile/knob/solver.json`` and ``solver.md``::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src .venv/bin/python \\
        benchmarks/compile_knob_solver.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from compile_knob import run_meta, write_results

MODELS = ("gpt2", "llama-tiny")
KNOB = 0.5
REPEATS = 101


def one(model: str) -> dict:
    """One process's row for ``model``."""
    import remat.execute.chain as executor
    from remat import Plan
    from remat.bench.compile import BACKEND, _options, load_workload
    from remat.bench.methods import compile_setup
    from remat.bench.suites import training_step
    from remat.capture.chain import capture
    from remat.measure.events import interleaved_times, step_peak_bytes

    work = load_workload(model, **_options(model, False))
    stages = capture(work.model, work.batch, loss_fn=work.loss_fn).stages
    torch._dynamo.reset()
    setup = compile_setup(work, KNOB, backend=BACKEND)
    steps = {}
    steps["compile"], opt = training_step(setup.module, work, setup.context)
    peaks = {"compile": step_peak_bytes(steps["compile"], work.model, opt, work.batch)}
    for solver in reversed(executor.PARTITIONER_SOLVERS):
        one_graph = executor.as_one_graph(Plan.none(stages.n))
        plan = executor.with_partitioner_budget(one_graph, KNOB, solver)
        planned = executor.apply(work.model, plan, stages=stages, compile={"backend": BACKEND})
        steps[solver], opt = training_step(planned, work)
        peaks[solver] = step_peak_bytes(steps[solver], work.model, opt, work.batch)
    times = interleaved_times(steps, REPEATS, warmup=2)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "model": model,
        "peak_bytes": peaks,
        "time_over_compile": {name: median[name] / median["compile"] for name in median},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("ROW " + json.dumps(one(args.one)), flush=True)
        return
    start = time.time()
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    rows = []
    for _ in range(args.processes):
        for model in args.models:
            out = subprocess.run(
                [sys.executable, __file__, "--one", model],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            rows.append(json.loads(out.split("ROW ", 1)[1]))
            print(rows[-1], flush=True)
    meta = run_meta(start, partitioner_budget=KNOB, repeats=REPEATS)
    lines = [
        "# The partitioner's knapsack at 0.5: torch's quantized DP against the exact solver",
        "",
        f"{meta['date']}, torch {meta['torch']}, inductor on the CPU, 1 torch thread, compile "
        f"caches off; {meta['seconds']} s. `benchmarks/compile_knob_solver.py`. remat's "
        f"store-everything one graph at partitioner budget {KNOB:g} with each solver, and "
        f"torch.compile@{KNOB:g}, timed in one interleaved loop per process ({REPEATS} steps "
        "each); time over torch.compile's in that process.",
        "",
        "| model | torch.compile@0.5 (B) | DP (B) | exact (B) | DP time | exact time |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak, ratio = r["peak_bytes"], r["time_over_compile"]
        lines.append(
            f"| {r['model']} | {peak['compile']:,} | {peak['dp']:,} | {peak['ilp']:,} | "
            f"{ratio['dp']:.3f} | {ratio['ilp']:.3f} |"
        )
    write_results("solver", meta, rows, lines)


if __name__ == "__main__":
    main()
