"""``remat plan``: plan a chain (JSON file, built-in chain or model) with one or every planner."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from remat import zoo
from remat.api import Comparison, compare
from remat.capture.chain import capture_chain
from remat.core.chain import Chain
from remat.core.chain_simulate import simulate
from remat.core.plan import Plan
from remat.core.units import format_bytes, format_time, resolve_budget
from remat.measure.calibration import planning_device, time_model_for

__all__ = ["add_parser", "run", "load_chain", "format_comparison"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="plan which activations to keep and which to recompute",
        description=(
            "Plan SOURCE with one planner (--method) or all of them side by side (default). "
            "SOURCE is a chain JSON file (remat.Chain.to_json), 'homogeneous:N', "
            "'random:N[:SEED]', a zoo model name or package.module:factory (captured first)."
        ),
    )
    p.add_argument("source", help="chain JSON file, homogeneous:N, random:N[:SEED], or a model")
    p.add_argument("--method", help="one planner (default: every planner side by side)")
    p.add_argument(
        "--activation-budget",
        "--budget",
        dest="activation_budget",
        metavar="BYTES",
        help="peak activation budget (activations only, not the whole step: that is "
        "'remat fit --budget'), bytes, e.g. '512MiB', or '50%%' of the unplanned activation "
        "peak; --budget is an older alias",
    )
    p.add_argument("--batch", type=int, help="batch size when SOURCE is a model")
    p.add_argument(
        "--fake",
        action="store_true",
        help="capture the model under fake tensors, without running its training step (plans "
        "a model whose step does not fit this machine); times from the cost model calibrated "
        "once for the device (cached under $REMAT_CACHE_DIR or ~/.cache/remat)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--out", type=Path, help="write the plan (with --method) as JSON here")
    return p


def load_chain(source: str, batch: int | None = None, fake: bool = False) -> Chain:
    """A chain from a JSON file, a synthetic spec, or a model captured on its example batch
    (``fake``: under fake tensors, times from :func:`remat.measure.calibration.time_model_for`)."""
    path = Path(source)
    if fake and (path.suffix == ".json" or path.is_file() or source.startswith(_SYNTHETIC)):
        raise ValueError(f"--fake captures a model; {source!r} is already a chain (drop --fake)")
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"no chain file {source!r}")
        return Chain.from_json(path.read_text())
    kind, _, rest = source.partition(":")
    if kind == "homogeneous" and rest.isdigit():
        return Chain.homogeneous(int(rest), out_bytes=2**20, saved_bytes=4 * 2**20)
    if kind == "random" and rest:
        n, _, seed = rest.partition(":")
        return Chain.random(int(n), seed=int(seed) if seed else 0, max_bytes=2**20)

    entry = zoo.get(source, batch_size=batch)
    if not fake:
        return capture_chain(entry.model, entry.batch, loss_fn=entry.loss_fn)

    model = time_model_for(*planning_device(entry.model))
    return capture_chain(entry.model, entry.batch, entry.loss_fn, fake=True, time_model=model)


_SYNTHETIC = ("homogeneous:", "random:")


def format_comparison(
    chain: Chain, rows: list[Comparison], activation_budget_bytes: int | None = None
) -> str:
    """A text table: one row per planner, memory and time relative to storing everything,
    under the activation budget the planners were given (``None``: their defaults)."""
    base = simulate(chain, Plan.none(chain))
    unit = format_time if chain.time_unit == "s" else (lambda t: f"{t:.3g} flop")
    budget = (
        "none (each planner's default)"
        if activation_budget_bytes is None
        else format_bytes(activation_budget_bytes)
    )
    header = (
        f"{'planner':<15} {'peak':>12} {'memory':>7} {'time':>12} {'time':>6} "
        f"{'plan time':>10}  plan"
    )
    lines = [
        f"chain: {chain.n} stages, store-all activation peak {format_bytes(base.peak_bytes)}, "
        f"step {unit(base.total_time)}; activation budget {budget}",
        header,
        f"{'':<15} {'':>12} {'ratio':>7} {'':>12} {'ratio':>6}",
    ]
    for row in rows:
        if row.plan is None or row.peak_bytes is None or row.total_time is None:
            lines.append(
                f"{row.method:<15} {'-':>12} {'-':>7} {'-':>12} {'-':>6} "
                f"{row.plan_seconds:>9.3f}s  {row.error}"
            )
            continue
        describe = row.plan.describe()
        if len(describe) > 60:
            describe = describe[:57] + "..."
        lines.append(
            f"{row.method:<15} {format_bytes(row.peak_bytes):>12} "
            f"{row.peak_bytes / base.peak_bytes:>7.3f} {unit(row.total_time):>12} "
            f"{row.total_time / base.total_time:>6.3f} {row.plan_seconds:>9.3f}s  {describe}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    chain = load_chain(args.source, args.batch, args.fake)
    methods = [args.method] if args.method else None
    budget_bytes = None
    if args.activation_budget is not None:
        budget_bytes = resolve_budget(
            args.activation_budget,
            lambda: simulate(chain, Plan.none(chain)).peak_bytes,
            "the unplanned activation peak",
        )
    rows = compare(chain, methods, budget_bytes)
    if args.method and rows[0].plan is None:
        raise ValueError(rows[0].error)
    if args.out:
        if not args.method:
            raise ValueError("--out needs --method: it writes one plan")
        assert rows[0].plan is not None
        args.out.write_text(rows[0].plan.to_json(indent=1))
    if args.json:
        print(json.dumps([_row_json(r) for r in rows], indent=1))
    else:
        print(format_comparison(chain, rows, budget_bytes))
    return 0


def _row_json(row: Comparison) -> dict[str, Any]:
    return {
        "method": row.method,
        "peak_bytes": row.peak_bytes,
        "total_time": row.total_time,
        "recompute_time": row.recompute_time,
        "plan_seconds": row.plan_seconds,
        "plan": json.loads(row.plan.to_json()) if row.plan else None,
        "error": row.error,
    }
