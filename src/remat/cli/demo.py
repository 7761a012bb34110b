"""``remat demo``: the main job, end to end on an embedded default model.

1. Capture a built-in model as a chain of stages with measured costs.
2. Plan it with every planner, side by side (simulated memory and time).
3. ``remat.auto`` at a budget: apply the plan to the real model.
4. Run a training step unplanned and planned: same loss and gradients; measured peaks.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from remat import zoo
from remat.api import compare
from remat.auto import fixed_bytes, plan_for_total_budget
from remat.capture.chain import capture
from remat.cli.plan import format_comparison
from remat.core.chain_simulate import simulate
from remat.core.plan import Plan
from remat.core.units import format_bytes
from remat.execute.chain import apply
from remat.measure.profile import profile, training_step

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="end-to-end demo on a built-in model")
    p.add_argument("--model", default="mlp-chain", help="zoo model (default: mlp-chain)")
    p.add_argument("--batch", type=int, help="batch size (default: the model's)")
    p.add_argument(
        "--fraction",
        type=float,
        default=0.5,
        help="activation budget as a fraction of the unplanned activation peak (default 0.5)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    torch.manual_seed(0)
    entry = zoo.get(args.model, batch_size=args.batch)
    model, batch, loss_fn = entry.model, entry.batch, entry.loss_fn
    print(f"== 1. capture {entry.name}: {entry.description}")
    start = time.perf_counter()
    captured = capture(model, batch, loss_fn=loss_fn)
    chain = captured.chain
    print(f"   {chain.n} stages measured in {time.perf_counter() - start:.1f} s")

    print("\n== 2. every planner at its default (simulated)")
    print(format_comparison(chain, compare(chain)))
    unplanned = simulate(chain, Plan.none(chain)).peak_bytes
    budget = int(unplanned * args.fraction)
    print(
        f"\n== 3. every planner at an activation budget of {format_bytes(budget)} "
        f"({args.fraction:.0%} of the unplanned peak)"
    )
    print(format_comparison(chain, compare(chain, activation_budget=budget), budget))

    fixed = fixed_bytes(model)
    plan = plan_for_total_budget(chain, fixed, fixed + budget, "optimal-time")
    planned = apply(model, plan, stages=captured.stages)
    print(f"\n== 4. apply 'optimal-time' and train one step: {plan.describe()}")
    reference = profile(model, batch, loss_fn=loss_fn)
    loss_ref, grads_ref = _step(model, batch, loss_fn, training_step)
    measured = profile(planned, batch, loss_fn=loss_fn)
    loss_new, grads_new = _step(planned, batch, loss_fn, training_step)
    worst = max(float((grads_ref[k] - grads_new[k]).abs().max()) for k in grads_ref)
    print(
        f"   loss unplanned {loss_ref:.6f}, planned {loss_new:.6f}; "
        f"largest gradient difference {worst:.2e} over {len(grads_ref)} parameters"
    )
    act_ref = reference.activation_peak_bytes
    act_new = measured.activation_peak_bytes
    print(
        f"   measured activation peak: {format_bytes(act_ref)} -> {format_bytes(act_new)} "
        f"({act_new / act_ref:.2f}x); predicted {format_bytes(plan.predicted_peak_bytes or 0)}"
    )
    print(
        f"   measured step peak: {format_bytes(reference.peak_bytes)} -> "
        f"{format_bytes(measured.peak_bytes)}"
    )
    return 0


def _step(model: Any, batch: Any, loss_fn: Any, training_step: Any) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = training_step(model, batch, loss_fn)
    grads = {
        name.removeprefix("model."): p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return float(loss), grads
