"""remat's store-everything one graph at a partitioner budget against a torch.compile point,
timed in one interleaved loop (issue #19).

Each argument is ``REF:KNOB:SOLVER``: torch.compile at ``activation_memory_budget=REF`` against
remat's store-everything one graph at ``KNOB`` with the knapsack solved by ``SOLVER`` (``ilp``:
exact, ``dp``: torch's). One row per argument, appended to
``docs/results/compile/knob/pairs-MODEL.jsonl``: both exact whole-step peaks (Adam, allocator
events) and remat's step time over torch.compile's (medians of 41 interleaved steps each) with
its 95 % interval (the rounds resampled)::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src .venv/bin/python \
        benchmarks/compile_knob_pairs.py densenet121 0.2:0.15:ilp 1:0.7:ilp
"""

import json
import sys
from pathlib import Path

import torch

from remat import Plan
from remat.bench.compile import BACKEND, _options, load_workload
from remat.bench.methods import compile_setup
from remat.bench.suites import training_step
from remat.capture.chain import capture
from remat.execute.chain import apply, as_one_graph, with_partitioner_budget
from remat.measure.events import (
    interleaved_times,
    median_ratio,
    median_ratio_interval,
    step_peak_bytes,
)

model = sys.argv[1]
pairs = [(float(a.split(":")[0]), float(a.split(":")[1]), a.split(":")[2]) for a in sys.argv[2:]]
work = load_workload(model, **_options(model, False))
stages = capture(work.model, work.batch, loss_fn=work.loss_fn).stages
OUT = Path(__file__).parents[1] / "docs" / "results" / "compile" / "knob"
out = open(OUT / f"pairs-{model}.jsonl", "a")
for ref, knob, solver in pairs:
    torch._dynamo.reset()
    setup = compile_setup(work, ref, backend=BACKEND)
    cstep, copt = training_step(setup.module, work, setup.context)
    plan = with_partitioner_budget(as_one_graph(Plan.none(stages.n)), knob, solver)
    planned = apply(work.model, plan, stages=stages, compile={"backend": BACKEND})
    rstep, ropt = training_step(planned, work)
    cpeak = step_peak_bytes(cstep, work.model, copt, work.batch)
    rpeak = step_peak_bytes(rstep, work.model, ropt, work.batch)
    times = interleaved_times({"c": cstep, "r": rstep}, repeats=41, warmup=2)
    row = {
        "ref": ref,
        "knob": knob,
        "solver": solver,
        "ref_MiB": round(cpeak / 2**20, 2),
        "MiB": round(rpeak / 2**20, 2),
        "ratio": round(median_ratio(times, "r", "c"), 4),
        "interval": [round(v, 4) for v in median_ratio_interval(times, "r", "c")],
    }
    print(row, flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()
