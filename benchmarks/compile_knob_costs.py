"""Does the partitioner find a faster partition within torch.compile@0.5's memory when it is
given measured costs or an exact solver? (issue #19)

At ``activation_memory_budget=0.5`` remat's store-everything one graph runs torch.compile's own
partition and ties it in time (docs/results/compile). Below the "aggressive" min-cut the
partitioner picks what to save with a 0-1 knapsack whose item costs are FLOPs
(``activation_memory_budget_runtime_estimator="flops"``: every pointwise op costs 1, a softmax
as little as an add) and whose solver quantizes the bytes (``"dp"``). This measures remat's
store-everything one graph at partitioner budget 0.5 with each of:

* FLOPs and the quantized DP (torch's setting, what torch.compile@0.5 runs);
* ``cpu-time``: each candidate op timed on the CPU (median of 5 runs on random inputs of its
  shapes), a ``CustomRuntimeEstimator``;
* FLOPs with ``"ilp"`` (SciPy's HiGHS MILP, exact);
* ``cpu-time`` with ``"ilp"``;

on the bench's GPT-2, Llama-tiny and 32-layer MLP (``remat bench compile``'s sizes): the exact
whole-step peak (Adam, allocator events) against torch.compile@0.5's, and the step time against
torch.compile@0.5's, the two interleaved in one loop (31 steps each).

(The solver is the plan's: ``remat.execute.chain.with_partitioner_budget``'s ``solver``, which
remat's executor sets on every one-graph call.) Writes ``docs/results/compile/knob/costs.json`` and ``costs.md``::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 \\
        PYTHONPATH=src .venv/bin/python benchmarks/compile_knob_costs.py
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch._functorch.config as functorch_config
from compile_knob import run_meta, write_results
from torch._inductor.custom_graph_pass import CustomRuntimeEstimator
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_map

from remat import Plan
from remat.bench.compile import BACKEND, _options, load_workload
from remat.bench.methods import compile_setup
from remat.bench.suites import training_step
from remat.capture.chain import capture
from remat.execute.chain import apply, as_one_graph, with_partitioner_budget
from remat.measure.events import interleaved_times, step_peak_bytes

MODELS = ("gpt2", "llama-tiny", "mlp-chain")
KNOB = 0.5
REPEATS = 31


class CpuTime(CustomRuntimeEstimator):
    """An op's cost for the partitioner's knapsack: its median time on the CPU (us) over 5 runs
    on random inputs of the node's shapes."""

    def __call__(self, node: torch.fx.Node) -> float:
        def real(arg: Any) -> Any:
            if not isinstance(arg, torch.fx.Node):
                return arg
            val = arg.meta.get("val")
            if isinstance(val, torch.Tensor):
                shape = [int(s) for s in val.shape]
                if val.dtype.is_floating_point:
                    return torch.randn(shape, dtype=val.dtype)
                return torch.zeros(shape, dtype=val.dtype)  # (valid indices)
            return int(val) if isinstance(val, torch.SymInt) else val

        with no_dispatch():
            args, kwargs = tree_map(real, (node.args, node.kwargs))
            node.target(*args, **kwargs)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                node.target(*args, **kwargs)
                times.append(time.perf_counter() - start)
        return max(statistics.median(times) * 1e6, 1e-3)

    def uuid(self) -> str:
        return "remat-benchmark-cpu-time"


VARIANTS = (("flops", "dp"), ("cpu-time", "dp"), ("flops", "ilp"), ("cpu-time", "ilp"))


def main() -> None:
    start = time.time()
    models = sys.argv[1:] or MODELS
    rows = []
    peaks = {}
    for model in models:
        work = load_workload(model, **_options(model, False))
        stages = capture(work.model, work.batch, loss_fn=work.loss_fn).stages
        torch._dynamo.reset()
        setup = compile_setup(work, KNOB, backend=BACKEND)
        compile_step, compile_opt = training_step(setup.module, work, setup.context)
        peaks[model] = step_peak_bytes(compile_step, work.model, compile_opt, work.batch)
        for estimator, solver in VARIANTS:
            torch._dynamo.reset()
            plan = with_partitioner_budget(as_one_graph(Plan.none(stages.n)), KNOB, solver)
            planned = apply(work.model, plan, stages=stages, compile={"backend": BACKEND})
            costs = CpuTime() if estimator == "cpu-time" else estimator

            def context(costs: Any = costs) -> Any:
                return functorch_config.patch(activation_memory_budget_runtime_estimator=costs)

            step, opt = training_step(planned, work, context)
            peak = step_peak_bytes(step, work.model, opt, work.batch)
            torch._dynamo.reset()  # (both compiled afresh: dynamo does not guard on the knob)
            times = interleaved_times({"compile": compile_step, "remat": step}, REPEATS, warmup=2)
            ratio = statistics.median(times["remat"]) / statistics.median(times["compile"])
            rows.append(
                {
                    "model": model,
                    "estimator": estimator,
                    "solver": solver,
                    "peak_bytes": peak,
                    "compile_peak_bytes": peaks[model],
                    "paired_ratio": ratio,
                }
            )
            print(rows[-1], flush=True)
    meta = run_meta(start, partitioner_budget=KNOB, repeats=REPEATS)
    lines = [
        "# The partitioner's knapsack at 0.5 with measured costs and an exact solver",
        "",
        f"{meta['date']}, torch {meta['torch']}, inductor on the CPU, 1 torch thread; "
        f"{meta['seconds']} s. `benchmarks/compile_knob_costs.py`. remat's store-everything one "
        f"graph at partitioner budget {KNOB:g}, its knapsack's costs (`estimator`) and solver "
        "as named; flops/dp is torch's setting. Time: remat step / torch.compile@0.5 step, "
        f"{REPEATS} steps each, interleaved in one loop.",
        "",
        "| model | estimator | solver | peak (B) | torch.compile@0.5 (B) | within it | time / "
        "torch.compile@0.5 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fits = "yes" if r["peak_bytes"] <= r["compile_peak_bytes"] else "no"
        lines.append(
            f"| {r['model']} | {r['estimator']} | {r['solver']} | {r['peak_bytes']:,} | "
            f"{r['compile_peak_bytes']:,} | {fits} | {r['paired_ratio']:.3f} |"
        )
    write_results("costs", meta, rows, lines)


if __name__ == "__main__":
    main()
