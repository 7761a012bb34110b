"""Does the chain simulator earn its place? The chain fast path against the one simulator.

``remat.simulate(chain, plan)`` (``core/chain_simulate.py``) walks a chain's stage tree;
``run_schedule(graph, lower_plan(graph, plan))`` (``core/simulate.py``) is the one simulator,
the symbolic interpreter, run here on the chain's path graph with the same plan object.
``tests/test_one_simulator.py`` holds the two equal event by event; this benchmark measures
what the fast path saves, per plan, on random chains of 16, 64 and 256 stages, for the plans
the planners' sweeps simulate most (store-all, every stage, Chen's sqrt(n), the least-memory
flat plan, optimal-time's nested plan at half the unplanned peak). Each figure is the median
of ``--repeats`` calls, the two simulators interleaved; the results are also checked equal.
A second table times what users wait for: the whole-step budget search
(:func:`remat.planning.plan_for_step`, which ``remat.auto`` runs on every call) at three budgets,
with the fast path and with every remat module's ``simulate`` swapped for the interpreter.

Writes ``benchmarks/results/simulator_fast_path.json`` and ``.md``::

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/simulator_fast_path.py
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import remat
from remat import BudgetTooSmallError, Chain, Plan, simulate
from remat import plan as make_plan
from remat.core.graph import Graph
from remat.core.simulate import lower_plan, run_schedule
from remat.core.step import StepCosts
from remat.planning import plan_for_step, step_peak_of


def plans_for(chain: Chain) -> dict[str, Plan]:
    top = simulate(chain, Plan.none(chain)).peak_bytes
    return {
        "none": Plan.none(chain),
        "every-stage": Plan.every_stage(chain),
        "chen-sqrt": make_plan(chain, "chen-sqrt"),
        "hong-dp": make_plan(chain, "hong-dp"),
        "optimal-time@50%": make_plan(chain, "optimal-time", top // 2)
        if chain.n <= 64
        else make_plan(chain, "chen-recursive"),
    }


def timed(fn, repeats: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interpreted(chain: Chain, plan: Plan):  # noqa: ANN201 (a Simulation)
    """``simulate`` without the fast path: the interpreter on the chain's path graph."""
    if not isinstance(chain, Chain):
        return simulate(chain, plan)
    graph = Graph.from_chain(chain)
    return run_schedule(graph, lower_plan(graph, plan))


def swap_simulator(new) -> int:  # noqa: ANN001
    """Make every loaded remat module that calls the chain simulator call ``new``."""
    swapped = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("remat") and getattr(module, "simulate", None) in (
            simulate,
            interpreted,
        ):
            module.simulate = new
            swapped += 1
    return swapped


def budget_search_seconds(n: int) -> float:
    """``plan_for_step`` at 50/70/90% of the unplanned step's peak of a random ``n``-stage chain
    (a refused budget planned again at the minimum it names)."""
    chain = Chain.random(n, seed=n)
    costs = StepCosts(persistent_bytes=10_000_000, grad_bytes=(100_000,) * n)
    top = step_peak_of(chain, Plan.none(chain), costs)
    start = time.perf_counter()
    for fraction in (0.5, 0.7, 0.9):
        try:
            plan_for_step(chain, costs, int(top * fraction))
        except BudgetTooSmallError as err:
            plan_for_step(chain, costs, err.minimum_bytes)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows = []
    for n in (16, 64, 256):
        chain = Chain.random(n, seed=n)
        graph = Graph.from_chain(chain)
        for name, plan in plans_for(chain).items():
            fast = simulate(chain, plan)
            slow = run_schedule(graph, lower_plan(graph, plan))
            assert fast == slow, (n, name)
            fast_s = slow_s = 0.0
            for _ in range(3):  # interleaved rounds, the best median of each
                f = timed(lambda: simulate(chain, plan), args.repeats)  # noqa: B023
                s = timed(lambda: run_schedule(graph, lower_plan(graph, plan)), args.repeats)  # noqa: B023
                fast_s = f if not fast_s else min(fast_s, f)
                slow_s = s if not slow_s else min(slow_s, s)
            rows.append(
                {
                    "stages": n,
                    "plan": name if name != "optimal-time@50%" or n <= 64 else "chen-recursive",
                    "depth": plan.depth(),
                    "chain_simulator_ms": round(fast_s * 1e3, 3),
                    "interpreter_ms": round(slow_s * 1e3, 3),
                    "speedup": round(slow_s / fast_s, 2),
                    "equal": True,
                }
            )
            print(rows[-1], flush=True)
    remat.plan(Chain.homogeneous(4), "optimal-time")  # load every planner module
    searches = []
    for n in (16, 64):
        swap_simulator(simulate)
        fast_s = budget_search_seconds(n)
        assert swap_simulator(interpreted) > 0
        slow_s = budget_search_seconds(n)
        swap_simulator(simulate)
        searches.append(
            {
                "stages": n,
                "chain_simulator_s": round(fast_s, 2),
                "interpreter_s": round(slow_s, 2),
                "speedup": round(slow_s / fast_s, 2),
            }
        )
        print(searches[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    (args.out / "simulator_fast_path.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "budget_search": searches}, indent=2) + "\n"
    )
    lines = [
        "# The chain simulator against the one simulator (the interpreter on the path graph)",
        "",
        f"{meta['date']}, {meta['machine']}, Python {meta['python']}, median of "
        f"{args.repeats} calls (best of 3 interleaved rounds). Every pair of results is equal.",
        "",
        "| stages | plan | depth | chain simulator (ms) | interpreter (ms) | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['stages']} | {r['plan']} | {r['depth']} | {r['chain_simulator_ms']} | "
        f"{r['interpreter_ms']} | {r['speedup']}x |"
        for r in rows
    ]
    lines += [
        "",
        "The whole-step budget search (`plan_for_step` at 50/70/90% of the unplanned step's peak,",
        "`optimal-time`), with the chain simulator and with the interpreter in its place:",
        "",
        "| stages | chain simulator (s) | interpreter (s) | speed-up |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['stages']} | {r['chain_simulator_s']} | {r['interpreter_s']} | {r['speedup']}x |"
        for r in searches
    ]
    (args.out / "simulator_fast_path.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
