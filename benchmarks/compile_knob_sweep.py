"""Peaks of remat's store-everything one graph at partitioner budgets between torch.compile's
points (issue #19): is there a partition within a compile point's memory that torch.compile's
five points do not reach?

Each argument is ``KNOB:SOLVER`` (SOLVER: ``ilp``, ``dp``, or ``torch`` for torch.compile itself
at that budget); one row per argument, appended to
``docs/results/compile/knob/sweep-MODEL.jsonl``: the exact whole-step peak (Adam, allocator
events), the compile seconds and a rough step time (3 steps, not a comparison: see
``compile_knob_pairs.py``)::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src .venv/bin/python \
        benchmarks/compile_knob_sweep.py densenet121 0.45:ilp 0.15:ilp 0.15:dp 0.7:ilp
"""

import json
import sys
import time
from pathlib import Path

import torch

from remat import Plan
from remat.bench.compile import BACKEND, _options, load_workload
from remat.bench.methods import compile_setup
from remat.bench.suites import training_step
from remat.capture.chain import capture
from remat.execute.chain import apply, as_one_graph, with_partitioner_budget
from remat.measure.events import step_peak_bytes

model = sys.argv[1]
pts = [(float(a.split(":")[0]), a.split(":")[1]) for a in sys.argv[2:]]
work = load_workload(model, **_options(model, False))
stages = capture(work.model, work.batch, loss_fn=work.loss_fn).stages
OUT = Path(__file__).parents[1] / "docs" / "results" / "compile" / "knob"
out = open(OUT / f"sweep-{model}.jsonl", "a")
for knob, solver in pts:
    t = time.time()
    torch._dynamo.reset()
    if solver == "torch":
        setup = compile_setup(work, knob, backend=BACKEND)
        step, opt = training_step(setup.module, work, setup.context)
    else:
        plan = with_partitioner_budget(as_one_graph(Plan.none(stages.n)), knob, solver)
        planned = apply(work.model, plan, stages=stages, compile={"backend": BACKEND})
        step, opt = training_step(planned, work)
    peak = step_peak_bytes(step, work.model, opt, work.batch)
    t1 = time.time()
    for _ in range(3):
        step()
    row = {
        "knob": knob,
        "solver": solver,
        "peak": peak,
        "MiB": round(peak / 2**20, 2),
        "compile_s": round(t1 - t, 1),
        "step_s": round((time.time() - t1) / 3, 3),
    }
    print(row, flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()
