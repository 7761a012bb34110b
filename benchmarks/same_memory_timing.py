"""At each PyTorch baseline's memory, is remat's optimal-time plan at least as fast? And at
each baseline's time, does remat use less memory? (issue 4)

The `peers` suite times every method against eager, one method at a time, 5 steps each: on a
shared machine that leaves about ±0.2 of noise between two runs of the same plan. Here every
eager-mode baseline (checkpoint_sequential with sqrt(n) segments, checkpointing each block,
selective checkpointing of matmuls, Hugging Face gradient checkpointing) and remat's
optimal-time plan made for that baseline's *measured* peak are timed in one interleaved loop
(eager A B C ... eager A B C ...), many repeats, so all see the same machine; memory is each
one's exact step peak. With ``--same-time`` the baselines are first timed (a short interleaved
loop) and, for each, remat's plan with the least predicted peak whose predicted time ratio
(simulate on the captured chain) is at most the baseline's measured one joins the final loop.
Results: docs/results/peers/<model>/same-memory.{json,md}.

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 .venv/bin/python benchmarks/same_memory_timing.py \\
        --model gpt2 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from remat.auto import total_peak_bytes  # noqa: E402
from remat.bench.methods import (  # noqa: E402
    Workload,  # noqa: E402
    peer_methods,
    remat_setup,
)
from remat.bench.suites import _model_options, load_workload, machine_info  # noqa: E402
from remat.core.chain_simulate import simulate  # noqa: E402
from remat.core.plan import Plan  # noqa: E402
from remat.core.units import format_bytes  # noqa: E402
from remat.execute.chain import apply  # noqa: E402
from remat.measure.events import interleaved_times, step_peak_bytes  # noqa: E402
from remat.planners import candidates  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--same-time",
        action="store_true",
        help="also remat's least-memory plan at each baseline's measured time",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    work = load_workload(args.model, **_model_options(args.model, False))
    steps, peaks, plans = {}, {}, {}

    def make_step(module: torch.nn.Module) -> tuple:
        opt = torch.optim.Adam(module.parameters(), lr=0.0)

        def step() -> None:
            torch.manual_seed(1234)
            work.loss_fn(module, work.batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step, opt

    pairs = []
    for setup in peer_methods(work):
        step, opt = make_step(setup.module)
        step()
        peaks[setup.method] = step_peak_bytes(step, setup.module, opt, work.batch)
        steps[setup.method] = step
        if setup.method == "eager":
            continue
        mine = remat_setup(work, "optimal-time", peaks[setup.method], f"remat@{setup.method}")
        if mine.module is None:
            print(f"{mine.method}: {mine.error}", file=sys.stderr)
            continue
        step, opt = make_step(mine.module)
        step()
        peaks[mine.method] = step_peak_bytes(step, mine.module, opt, work.batch)
        steps[mine.method] = step
        plans[mine.method] = mine.notes["plan"]
        pairs.append((setup.method, mine.method))
    same_time = []
    if args.same_time:
        baselines = {name: steps[name] for name in ["eager", *(peer for peer, _ in pairs)]}
        print(f"pre-timing {len(baselines)} baselines x 3, interleaved", file=sys.stderr)
        pre = interleaved_times(baselines, repeats=3)
        for peer, _ in pairs:
            target = statistics.median(pre[peer]) / statistics.median(pre["eager"])
            plan, predicted = _least_memory_within(work, target)
            name = f"remat@time:{peer}"
            module = apply(work.model, plan, stages=work.stages)
            step, opt = make_step(module)
            step()
            peaks[name] = step_peak_bytes(step, module, opt, work.batch)
            steps[name] = step
            plans[name] = plan.describe()
            same_time.append((peer, name, target, predicted))
    print(f"timing {len(steps)} steps x {args.repeats}, interleaved", file=sys.stderr)
    times = interleaved_times(steps, repeats=args.repeats)
    eager = statistics.median(times["eager"])

    def ratio(name: str) -> float:
        return statistics.median(times[name]) / eager

    rows = []
    for peer, mine in pairs:
        rows.append(
            {
                "model": args.model,
                "peer": peer,
                "peer_peak_bytes": peaks[peer],
                "peer_memory_ratio": peaks[peer] / peaks["eager"],
                "peer_time_ratio": ratio(peer),
                "remat_plan": plans[mine],
                "remat_peak_bytes": peaks[mine],
                "remat_memory_ratio": peaks[mine] / peaks["eager"],
                "remat_time_ratio": ratio(mine),
                "remat_within_peer_memory": peaks[mine] <= peaks[peer],
                "remat_at_least_as_fast": ratio(mine) <= ratio(peer),
                "remat_vs_peer_time": statistics.median(times[mine])
                / statistics.median(times[peer]),
            }
        )

    def least_memory_at_time(peer: str) -> str | None:
        """Among every remat step of this loop, the one with the least peak that is no slower
        than ``peer`` (medians of the same interleaved loop)."""
        limit = statistics.median(times[peer])
        fast = [n for n in times if n.startswith("remat@") and statistics.median(times[n]) <= limit]
        return min(fast, key=lambda n: peaks[n]) if fast else None

    time_rows = []
    for peer, mine, target, predicted in same_time:
        best = least_memory_at_time(peer)
        time_rows.append(
            {
                "model": args.model,
                "peer": peer,
                "peer_pretimed_ratio": target,
                "remat_predicted_time_ratio": predicted,
                "peer_memory_ratio": peaks[peer] / peaks["eager"],
                "peer_time_ratio": ratio(peer),
                "remat_plan": plans[mine],
                "remat_memory_ratio": peaks[mine] / peaks["eager"],
                "remat_time_ratio": ratio(mine),
                "remat_less_memory": peaks[mine] < peaks[peer],
                "remat_vs_peer_memory": peaks[mine] / peaks[peer],
                "remat_vs_peer_time": statistics.median(times[mine])
                / statistics.median(times[peer]),
                "best_remat_at_peer_time": best,
                "best_remat_vs_peer_memory": peaks[best] / peaks[peer] if best else None,
            }
        )
    out = args.out or Path("docs/results/peers") / args.model
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    result = {
        "model": args.model,
        "repeats": args.repeats,
        "machine": machine,
        "seconds": time.perf_counter() - start,
        "eager_peak_bytes": peaks["eager"],
        "eager_step_seconds": eager,
        "rows": rows,
        "same_time_rows": time_rows,
        "step_seconds": {k: v for k, v in times.items()},
    }
    (out / "same-memory.json").write_text(json.dumps(result, indent=1, default=str))
    lines = [
        f"# {args.model}: remat's optimal-time at each PyTorch baseline's memory",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {machine['device']} "
        f"({machine.get('cpus')} CPUs, 1 torch thread), torch {machine['torch']}; every step "
        f"below timed in one interleaved loop, {args.repeats} repeats (median); eager step "
        f"{eager:.3f} s, eager peak {format_bytes(peaks['eager'])}. Generated by "
        "`benchmarks/same_memory_timing.py`.",
        "",
        "| baseline | its memory | its time | remat at ≤ that memory | remat time | remat / "
        "baseline time | remat plan |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plan = _short(r["remat_plan"])
        lines.append(
            f"| {r['peer']} | {r['peer_memory_ratio']:.3f} | {r['peer_time_ratio']:.2f} | "
            f"{r['remat_memory_ratio']:.3f} | {r['remat_time_ratio']:.2f} | "
            f"{r['remat_vs_peer_time']:.2f} | `{plan}` |"
        )
    if time_rows:
        lines += [
            "",
            "At each baseline's time: remat's plan with the least predicted peak whose predicted "
            "time ratio is at most the baseline's (pre-timed, 3 interleaved repeats), then timed "
            "in the same loop as everything above.",
            "",
            "| baseline | its memory | its time | remat memory | remat time | remat / baseline "
            "memory | remat / baseline time | remat plan | least memory of any remat step "
            "here at ≤ its time |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in time_rows:
            plan = _short(r["remat_plan"])
            lines.append(
                f"| {r['peer']} | {r['peer_memory_ratio']:.3f} | {r['peer_time_ratio']:.2f} | "
                f"{r['remat_memory_ratio']:.3f} | {r['remat_time_ratio']:.2f} | "
                f"{r['remat_vs_peer_memory']:.3f} | {r['remat_vs_peer_time']:.2f} | `{plan}` | "
                + (
                    f"{r['best_remat_vs_peer_memory']:.3f} × its memory "
                    f"({r['best_remat_at_peer_time']}) |"
                    if r["best_remat_at_peer_time"]
                    else "none |"
                )
            )
    (out / "same-memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _short(plan: str) -> str:
    """A plan's description cut to fit a table cell."""
    return plan if len(plan) < 60 else plan[:57] + "..."


def _least_memory_within(work: Workload, time_ratio: float) -> tuple[Plan, float]:
    """The candidate plan (optimal-time over a grid of budgets, the flat planners) with the
    least predicted whole-step peak whose predicted time is at most ``time_ratio`` × the
    unplanned step's; the fastest candidate when none is that fast. Returns it and its
    predicted time ratio."""
    chain = work.chain
    unplanned = simulate(chain, Plan.none(chain)).total_time
    persistent = work.fixed_bytes - sum(work.grad_bytes)
    scored = []
    for plan in candidates(chain, "optimal-time"):
        ratio = simulate(chain, plan).total_time / unplanned
        peak = total_peak_bytes(chain, plan, persistent, work.grad_bytes, work.grad_rise_bytes)
        scored.append((ratio, peak, plan))
    fitting = [c for c in scored if c[0] <= time_ratio]
    best = min(fitting, key=lambda c: (c[1], c[0])) if fitting else min(scored, key=lambda c: c[0])
    ratio, _, plan = best
    return plan, ratio


if __name__ == "__main__":
    sys.exit(main())
