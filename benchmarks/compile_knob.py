"""Does inductor's partitioner budget compose with remat's plan? (issue #19)

remat runs a flat plan compiled as one graph: its checkpointed segments are torch's checkpoint
higher-order op, which the partitioner respects, and the partitioner decides what the stored
segments save. Its knob, ``torch._functorch.config.activation_memory_budget``, could lower that
further. This measures, on the bench's GPT-2 (``remat bench compile``'s sizes), flat plans of
remat run as one compiled graph with the knob at 1 and at 0.5, beside ``torch.compile`` at 1
and 0.5: exact whole-step peaks (Adam) from the allocator's events and time ratios against eager
steps interleaved with them (``remat.bench.suites.measure_setup``, as the bench).

Writes ``docs/results/compile/knob/knob.json`` and ``knob.md``::

    OMP_NUM_THREADS=1 PYTHONPATH=src REMAT_BENCH_REPEATS=7 .venv/bin/python benchmarks/compile_knob.py
"""

from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config as functorch_config

from remat import ChainSegment, Plan
from remat.bench.compile import _compile_point, _grads, _options, load_workload
from remat.bench.suites import Setup, measure_setup
from remat.capture.chain import capture
from remat.execute.chain import apply, as_one_graph

OUT = Path("docs/results/compile/knob")
KNOBS = (1.0, 0.5)


def flat(*spans: tuple[int, int, bool]) -> Plan:
    return Plan.from_chain_segments(tuple(ChainSegment(a, b, c) for a, b, c in spans))


PLANS = {  # GPT-2's 6 stages: embedding, attention and MLP halves of 2 blocks, head
    "[1-6]": flat((1, 6, False)),
    "[1] (2) [3-6]": flat((1, 1, False), (2, 2, True), (3, 6, False)),
    "[1] (2) (3) [4-6]": flat((1, 1, False), (2, 2, True), (3, 3, True), (4, 6, False)),
    "[1] (2) (3) [4] (5) [6]": flat(
        (1, 1, False), (2, 2, True), (3, 3, True), (4, 4, False), (5, 5, True), (6, 6, False)
    ),
}


def main() -> None:
    repeats = int(os.environ.get("REMAT_BENCH_REPEATS", "7"))
    start = time.time()
    work = load_workload("gpt2", **_options("gpt2", False))
    eager_grads = _grads(work.model, work, nullcontext)
    rows = [measure_setup(Setup("eager", work.model), work, eager_grads, repeats)]
    rows += [_compile_point(work, knob, eager_grads, repeats) for knob in KNOBS]
    torch._dynamo.reset()
    stages = capture(work.model, work.batch, loss_fn=work.loss_fn).stages
    for name, plan in PLANS.items():
        for knob in KNOBS:
            torch._dynamo.reset()
            planned = apply(work.model, as_one_graph(plan), stages=stages, compile=True)

            def context(k: float = knob):  # noqa: ANN202
                return functorch_config.patch(activation_memory_budget=k)

            setup = Setup(f"remat {name} @{knob:g}", planned, context=context)
            rows.append(measure_setup(setup, work, eager_grads, repeats))
            print(rows[-1]["method"], rows[-1].get("peak_bytes"), flush=True)
    keep = ("method", "peak_bytes", "time_ratio", "max_grad_rel_diff", "error")
    table = [{k: r.get(k) for k in keep} for r in rows]
    meta = run_meta(start, repeats=repeats)
    lines = [
        "# remat's flat plans as one compiled graph, with inductor's partitioner budget",
        "",
        f"{meta['date']}, torch {meta['torch']}, inductor on the CPU, 1 torch thread, "
        f"{repeats} timed steps per point interleaved with eager's; {meta['seconds']} s. "
        "`benchmarks/compile_knob.py`. Peak: whole step with Adam, exact bytes.",
        "",
        "| point | peak (B) | peak (MiB) | time / eager |",
        "|---|---|---|---|",
    ]
    for r in table:
        peak = r["peak_bytes"]
        lines.append(
            f"| {r['method']} | {peak:,} | {peak / 2**20:.2f} | {r['time_ratio']:.3f} |"
            if peak
            else f"| {r['method']} | error: {r['error']} | | |"
        )
    write_results("knob", meta, table, lines)


def run_meta(start: float, **extra: Any) -> dict[str, Any]:
    """A run's date (UTC, from ``start``, a ``time.time()``), its seconds, torch's version and
    ``extra``."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start)),
        "seconds": round(time.time() - start),
        "torch": torch.__version__,
        **extra,
    }


def write_results(stem: str, meta: dict, rows: list[dict], lines: list[str]) -> None:
    """``OUT/STEM.json`` (``meta`` and ``rows``) and ``OUT/STEM.md`` (``lines``)."""
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
