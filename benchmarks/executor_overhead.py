"""Executor overhead at equal plans (issue #19): remat's chain executor against plain
``torch.utils.checkpoint(use_reentrant=False)`` per stage, running the *same* plan on the same
stages (every block checkpointed, as Hugging Face's gradient checkpointing does).

Variants, timed in one interleaved loop (A B C ... A B C ...), forward + backward per step:

* ``torch``: a loop over remat's stages calling ``checkpoint(stage, a, use_reentrant=False)``
  on every checkpointed stage (torch's defaults: early stop on, RNG state preserved);
* ``torch-tensor-inputs``: the same, a structured activation's tensors passed as checkpoint's
  own arguments, as remat passes them (GPT-2's blocks take a tuple; on the MLP chains the same
  as ``torch``);
* ``torch-no-early-stop``: the same as ``torch`` with ``early_stop=False``;
* ``remat-no-early-stop``: ``remat.apply(model, plan, early_stop=False)`` (the default before
  issue #19);
* ``remat-early-stop``: ``remat.apply(model, plan, early_stop=True)``;
* ``hf-gradient-checkpointing`` (GPT-2): Hugging Face's own loop, the same blocks checkpointed.

Models: ``mlp-chain`` (16 x (Linear 256->256, GELU), batch 256: 32 stages, each
checkpointed), ``mlp-chain-tiny`` (the same at width 8, batch 2: next to no compute, so its
step is torch's checkpoint machinery and remat's Python around it) and ``gpt2`` (zoo GPT-2, its
blocks checkpointed).

Each round runs every variant once in a random order; a variant's ratio is the median over
rounds of its step time / the ``torch`` step time of the same round, and the time it adds the
median over rounds of the difference. Run with one thread:

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src .venv/bin/python \\
        benchmarks/executor_overhead.py --repeats 21
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from remat import zoo
from remat.capture.stages import split_stages
from remat.core.plan import ChainSegment, Plan
from remat.execute.chain import apply


class TorchEach(nn.Module):
    """The plan run by hand with torch's checkpoint: what a user writes today."""

    def __init__(
        self, model: nn.Module, stages: Any, plan: Plan, early_stop: bool, tensors: bool = False
    ) -> None:
        super().__init__()
        self.model = model
        self._stages = stages
        self._ckpt = {v + 1 for v in plan.recomputed_nodes()}
        self._early_stop = early_stop
        self._tensors = tensors

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        st = self._stages
        a = st.prepare(*args, **kwargs)
        for i, m in enumerate(st.modules, 1):
            if i not in self._ckpt:
                a = m(a)
            elif self._tensors and not isinstance(a, torch.Tensor):
                a = _checkpoint_tensors(m, a, self._early_stop)
            else:
                a = checkpoint(m, a, use_reentrant=False, early_stop=self._early_stop)
        return st.finish(a, *args, **kwargs)


def _checkpoint_tensors(m: nn.Module, a: Any, early_stop: bool) -> Any:
    """``checkpoint(m, a)`` with the tensors of a structured activation as checkpoint's own
    arguments, as remat passes them (so that checkpoint saves them: an enclosing checkpoint
    recomputes them, and an in-place write to one before the backward is caught) rather than
    inside a tuple, which checkpoint holds by reference."""
    leaves, spec = tree_flatten(a)
    positions = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[k] for k in positions]
    template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    del a, leaves

    def run(*ts: torch.Tensor) -> Any:
        rebuilt = list(template)
        for k, t in zip(positions, ts, strict=True):
            rebuilt[k] = t
        return m(tree_unflatten(rebuilt, spec))

    return checkpoint(run, *tensors, use_reentrant=False, early_stop=early_stop)


def block_plan(n: int, blocks: range) -> Plan:
    """Checkpoint each stage in ``blocks`` on its own, store every other stage."""
    return Plan.from_chain_segments(tuple(ChainSegment(i, i, i in blocks) for i in range(1, n + 1)))


def setups(name: str) -> tuple[dict[str, nn.Module], Any, Any]:
    if name == "gpt2":
        entry = zoo.get("gpt2", batch_size=4, seq_len=128)
    elif name == "mlp-chain-tiny":  # next to no compute: the step is the Python around it
        entry = zoo.get("mlp-chain", batch_size=2, layers=16, width=8)
    else:
        entry = zoo.get("mlp-chain", batch_size=256, layers=16, width=256)
    model = entry.model
    stages = split_stages(model)
    n = stages.n
    blocks = range(2, n) if name == "gpt2" else range(1, n + 1)
    plan = block_plan(n, blocks)
    variants = {
        "torch": TorchEach(model, stages, plan, early_stop=True),
        "torch-tensor-inputs": TorchEach(model, stages, plan, early_stop=True, tensors=True),
        "torch-no-early-stop": TorchEach(model, stages, plan, early_stop=False),
        "remat-no-early-stop": apply(model, plan, stages=stages, early_stop=False),
        "remat-early-stop": apply(model, plan, stages=stages, early_stop=True),
    }
    if hasattr(model, "gradient_checkpointing_enable"):  # Hugging Face's own block loop
        hf = copy.deepcopy(model)
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        variants["hf-gradient-checkpointing"] = hf
    return variants, entry.batch, entry.loss_fn


def make_step(m: nn.Module, batch: Any, loss_fn: Any) -> Any:
    def step() -> None:
        loss_fn(m, batch).backward()
        for p in m.parameters():
            p.grad = None

    return step


def shuffled_times(steps: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """Every step once per round, in a new random order each round (no variant always
    follows the same one), after two warm-up rounds."""
    names = list(steps)
    for _ in range(2):
        for name in names:
            steps[name]()
    rng = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        rng.shuffle(names)
        for name in names:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp-chain-tiny,mlp-chain,gpt2")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {"torch": torch.__version__, "models": {}}
    for name in args.models.split(","):
        variants, batch, loss_fn = setups(name)

        steps = {k: make_step(m, batch, loss_fn) for k, m in variants.items()}
        times = shuffled_times(steps, args.repeats)
        base = statistics.median(times["torch"])
        # per round, each variant against the torch step of the same round; median over rounds
        ratios = {
            k: statistics.median(t / b for t, b in zip(v, times["torch"], strict=True))
            for k, v in times.items()
        }
        # and the time each variant adds to torch's step: median over rounds of the difference
        extra = {
            k: statistics.median(t - b for t, b in zip(v, times["torch"], strict=True))
            for k, v in times.items()
        }
        result["models"][name] = {
            "torch_step_seconds": base,
            "ratio_vs_torch": ratios,
            "seconds_over_torch": extra,
            "repeats": args.repeats,
        }
        print(
            name,
            f"torch step {base * 1e3:.2f} ms",
            {k: round(v, 3) for k, v in ratios.items()},
            {k: f"{v * 1e6:+.0f} us" for k, v in extra.items()},
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
