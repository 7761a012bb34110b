"""The blocks family's one-graph step: the model's own forward around the blocks against the
ends run apart (issue #19; NOTE [ The model's forward around the blocks ] in
remat.capture.stages.families.blocks).

Most models take remat's generic blocks family (transformers' BERT, Qwen2, ViT; timm; most of
torchvision): its first stage runs the model's forward up to the first block, its last re-runs
it after the blocks. In a one-graph step whose plan stores both, remat now traces the model's
own forward once, the blocks answered by the plan's middle ("around"); before, the two ends ran
outside the graph, each compiled on its own ("apart", still what runs when a plan checkpoints
an end). Per model (the conformance suite's tiny configs, dropout off, ``loss_fn`` loop, SGD at
lr 0 so the weights stay put), in one process:

* four steps: ``eager`` (the unplanned model), ``torch.compile`` (``torch.compile(model)``),
  ``apart`` and ``around``: remat's plan as one graph (inductor), made the old way (the
  executor built with ``remat.execute.chain._around_of`` answering None) and the new;
* two plans: everything stored, and every block checkpointed (both ends stored);
* per step: its graph count and graph breaks on the first call, the largest gradient difference
  from eager's over the largest eager gradient, the exact peak (allocator events), and the
  time: all four steps of a plan timed in one interleaved loop (A B C D ...), ``--repeats``
  after a warm-up, the median of each over eager's.

Writes ``--out`` (JSON) and the same name with ``.md``::

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src .venv/bin/python \\
        benchmarks/compile_blocks_ends.py --out docs/results/compile/blocks-ends/run.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

import remat
import remat.execute.chain as executor_module
from remat.bench.conformance import COMPILED_GRAD_TOL, Loop, build
from remat.core.plan import ChainSegment, Plan
from remat.execute.chain import as_one_graph
from remat.measure.events import interleaved_times, step_peak_bytes

MODELS = ("hf-bert", "hf-qwen2", "hf-distilbert", "hf-vit", "timm-vit")
"""(Not RegNet: in one process with another RegNet instance compiled, a recompilation's backward
crashes inside inductor, ``Cannot convert expression to float``; each variant alone runs.)"""
BACKEND = {"backend": "inductor"}


def plans(n: int) -> dict[str, Plan]:
    every = [ChainSegment(1, 1)]
    every += [ChainSegment(i, i, checkpoint=True) for i in range(2, n)]
    every += [ChainSegment(n, n)]
    return {
        "store-all": as_one_graph(Plan.from_chain_segments([ChainSegment(1, n)])),
        "every-block": as_one_graph(Plan.from_chain_segments(every)),
    }


def step_of(loop: Loop, module: torch.nn.Module) -> tuple[Any, torch.optim.Optimizer]:
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.0)

    def step() -> None:
        loop.loss_fn(module, loop.batch).backward()  # type: ignore[misc]
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt


def first_grads(loop: Loop, module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    counters.clear()
    loop.loss_fn(module, loop.batch).backward()  # type: ignore[misc]
    graphs = {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "breaks": int(sum(counters["graph_break"].values())),
    }
    grads = {
        k: p.grad.clone() for k, p in loop.built.model.named_parameters() if p.grad is not None
    }
    loop.built.model.zero_grad(set_to_none=True)
    return grads, graphs


def planned(loop: Loop, plan: Plan, around: bool) -> torch.nn.Module:
    real = executor_module._around_of
    if not around:
        executor_module._around_of = lambda ends: None  # the ends run apart, as before
    try:
        module = remat.apply(loop.module, plan, compile=BACKEND)
        executor = module._executor_for(*call_of(loop.batch))  # (built while the switch holds)
    finally:
        executor_module._around_of = real
    assert (executor._around is not None) == around
    return module


def call_of(batch: Any) -> tuple[tuple, dict]:
    """The batch as the planned module's ``(args, kwargs)`` (remat.bench.conformance.call)."""
    if isinstance(batch, dict):
        return (), batch
    return (tuple(batch), {}) if isinstance(batch, tuple | list) else ((batch,), {})


def run_model(name: str, repeats: int, variants: tuple[str, ...]) -> list[dict[str, Any]]:
    def fresh() -> Loop:
        return Loop(build(name, dropout=False), "loss_fn")

    probe = fresh()
    n = remat.apply(probe.module, Plan.none(), compile=False)._stages.n
    rows = []
    for plan_name, plan in plans(n).items():
        torch._dynamo.reset()
        loops = {k: fresh() for k in ("eager", *variants)}
        modules = {"eager": loops["eager"].module}
        for k in variants:
            modules[k] = (
                torch.compile(loops[k].module, **BACKEND)
                if k == "torch.compile"
                else planned(loops[k], plan, around=k == "around")
            )
        ref, _ = first_grads(loops["eager"], modules["eager"])
        steps: dict[str, Any] = {}
        row: dict[str, Any] = {
            "model": name,
            "plan": plan_name,
            "stages": n,
            "plan_text": plan.describe(),
        }
        for k, module in modules.items():
            try:
                grads, graphs = first_grads(loops[k], module)
            except Exception as err:  # noqa: BLE001 - torch.compile's own failures, recorded
                row[k] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
                print(k, row[k]["error"], flush=True)
                continue
            scale = max(g.abs().max().item() for g in ref.values())
            diff = max((grads[p] - ref[p]).abs().max().item() for p in ref) / scale
            close = all(
                torch.allclose(
                    grads[p], ref[p], rtol=COMPILED_GRAD_TOL[0], atol=COMPILED_GRAD_TOL[1]
                )
                for p in ref
            )
            step, opt = step_of(loops[k], module)
            peak = step_peak_bytes(step, loops[k].built.model, opt, loops[k].data)
            steps[k] = step
            row[k] = {"peak_bytes": peak, "grad_rel_diff": diff, "grads_close": close, **graphs}
        times = interleaved_times(steps, repeats, warmup=3)
        base = statistics.median(times["eager"])
        for k in steps:
            row[k]["ms"] = statistics.median(times[k]) * 1e3
            row[k]["x_eager"] = statistics.median(times[k]) / base
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# The blocks family's one graph: the model's forward around the blocks vs the ends apart",
        "",
        f"{meta['date']}, commit {meta['commit']}, torch {meta['torch']}, {meta['machine']}, "
        f"inductor on the CPU, 1 torch thread, {meta['repeats']} interleaved steps per variant; "
        "torch.compile and around timed in one process, apart and around again in another "
        "(ratios to the eager step of the same process); "
        f"{meta['seconds']} s. `benchmarks/compile_blocks_ends.py`. Time: median step / eager's "
        "in the same loop. Peak: exact whole step (SGD). Grad: largest |difference from "
        "eager| over the largest eager gradient (all parameters), and whether every gradient is "
        "allclose to eager's at torch.compile's tolerance (rtol 1e-4, atol 1e-5).",
        "",
        "| model | plan | eager ms | torch.compile | around (now) | apart (before) / around, "
        "their process | "
        "peak apart / around / torch.compile (B) | graphs (breaks) apart / around | "
        "grad around (torch.compile) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, w, c = r["apart"], r["around"], r["torch.compile"]
        if "error" in c:  # torch.compile alone failed: its columns say so
            c = {"x_eager": float("nan"), "peak_bytes": 0, "grad_rel_diff": float("nan")}
            lines.append(
                f"<!-- {r['model']} {r['plan']}: torch.compile: {r['torch.compile']['error']} -->"
            )
        lines.append(
            f"| {r['model']} | {r['plan']} | {r['eager']['ms']:.2f} | {c['x_eager']:.3f} | "
            f"**{w['x_eager']:.3f}** | {a['x_eager']:.3f} / "
            f"{r['around_beside_apart']['x_eager']:.3f} | {a['peak_bytes']:,} / "
            f"{w['peak_bytes']:,} / {c['peak_bytes']:,} | {a['graphs']} ({a['breaks']}) / "
            f"{w['graphs']} ({w['breaks']}) | {w['grad_rel_diff']:.1e} "
            f"{'close' if w['grads_close'] else 'NOT close'} ({c['grad_rel_diff']:.1e}) |"
        )
    return "\n".join(lines) + "\n"


GROUPS = (("torch.compile", "around"), ("apart", "around"))
"""Each group in a process of its own: dynamo's cache is per code object, and the ends run
apart compile the model's own ``forward`` frame by frame, the frame torch.compile(model)
compiles too, so in one process each slowed the other (torch.compile(BERT tiny) measured
0.747 of eager beside them, 0.574-0.582 alone)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default="", help="one group, in this process (internal)")
    args = ap.parse_args()
    start = time.time()
    if args.variants:  # a group's process: its rows only
        rows = []
        for name in args.models.split(","):
            rows += run_model(name, args.repeats, tuple(args.variants.split(",")))
        args.out.write_text(json.dumps(rows))
        return
    rows = []
    for name in args.models.split(","):
        parts = []
        for group in GROUPS:
            part = args.out.with_name(f"{args.out.stem}-{name}-{group[0]}.part.json")
            cmd = [sys.executable, __file__, "--models", name, "--repeats", str(args.repeats)]
            cmd += ["--variants", ",".join(group), "--out", str(part)]
            subprocess.run(cmd, check=True)
            parts.append(json.loads(part.read_text()))
            part.unlink()
        for first, second in zip(*parts, strict=True):
            row = {**first, "apart": second["apart"], "eager_beside_apart": second["eager"]}
            row["around_beside_apart"] = second["around"]
            rows.append(row)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start)),
        "commit": commit,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread(s)",
        "repeats": args.repeats,
        "seconds": round(time.time() - start),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
