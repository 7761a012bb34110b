"""Is there a faster partition than torch.compile's best point within its memory? (issue #19)

At ``activation_memory_budget=0.5`` remat's store-everything one graph runs torch.compile's own
partition (NOTE [ The partitioner's budget ] in remat.execute.chain), and on GPT-2 holds 1 MiB
less than ``torch.compile@0.5``. This measures the store-everything one graph at partitioner
budgets between 0.3 and 0.9 on the bench's GPT-2 (``remat bench compile``'s sizes): its exact
whole-step peak (Adam, allocator events) against torch.compile@0.5's, and its step time
against torch.compile@0.5's, the two interleaved in one loop (31 steps each).

Writes ``docs/results/compile/knob/store-all.json`` and ``store-all.md``::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src .venv/bin/python \\
        benchmarks/compile_knob_store_all.py
"""

from __future__ import annotations

import statistics
import time

import torch
from compile_knob import run_meta, write_results

from remat import Plan
from remat.bench.compile import BACKEND, _options, load_workload
from remat.bench.methods import compile_setup
from remat.bench.suites import training_step
from remat.capture.chain import capture
from remat.execute.chain import apply, as_one_graph, with_partitioner_budget
from remat.measure.events import interleaved_times, step_peak_bytes

KNOBS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3)
REPEATS = 31


def main() -> None:
    start = time.time()
    work = load_workload("gpt2", **_options("gpt2", False))
    stages = capture(work.model, work.batch, loss_fn=work.loss_fn).stages

    torch._dynamo.reset()
    setup = compile_setup(work, 0.5, backend=BACKEND)
    compile_step, compile_opt = training_step(setup.module, work, setup.context)
    compile_peak = step_peak_bytes(compile_step, work.model, compile_opt, work.batch)
    rows = []
    for knob in KNOBS:
        torch._dynamo.reset()
        plan = with_partitioner_budget(as_one_graph(Plan.none(stages.n)), knob)
        planned = apply(work.model, plan, stages=stages, compile={"backend": BACKEND})
        step, opt = training_step(planned, work)
        peak = step_peak_bytes(step, work.model, opt, work.batch)
        torch._dynamo.reset()  # (both compiled afresh: dynamo does not guard on the knob)
        times = interleaved_times({"compile": compile_step, "remat": step}, REPEATS, warmup=2)
        ratio = statistics.median(times["remat"]) / statistics.median(times["compile"])
        rows.append({"partitioner_budget": knob, "peak_bytes": peak, "paired_ratio": ratio})
        print(rows[-1], flush=True)
    meta = run_meta(start, repeats=REPEATS, **{"compile_0.5_peak_bytes": compile_peak})
    lines = [
        "# remat's store-everything one graph at partitioner budgets 0.3-0.9 (GPT-2)",
        "",
        f"{meta['date']}, torch {meta['torch']}, inductor on the CPU, 1 torch thread; "
        f"{meta['seconds']} s. `benchmarks/compile_knob_store_all.py`. torch.compile@0.5 peaks "
        f"at {compile_peak:,} B. Time: remat step / torch.compile@0.5 step, {REPEATS} steps "
        "each, interleaved in one loop.",
        "",
        "| partitioner budget | peak (B) | within torch.compile@0.5 | time / torch.compile@0.5 |",
        "|---|---|---|---|",
    ]
    for r in rows:
        fits = "yes" if r["peak_bytes"] <= compile_peak else "no"
        lines.append(
            f"| {r['partitioner_budget']:g} | {r['peak_bytes']:,} | {fits} | "
            f"{r['paired_ratio']:.3f} |"
        )
    write_results("store-all", meta, rows, lines)


if __name__ == "__main__":
    main()
