"""``remat profile MODEL``: exact memory of one training step and the per-stage costs.

MODEL is a zoo name (``remat.zoo.names()``) or ``package.module:factory``. Prints the memory
breakdown at the step's peak (:func:`remat.measure.profile.profile`), the modules with the highest
peaks, and the captured chain (:func:`remat.capture.chain.capture`) with the activation peak that
:func:`remat.simulate` predicts from it next to the measured one. ``--json`` prints the same as
JSON; ``--plot FILE.png`` draws the breakdown and the memory timeline.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from remat import zoo
from remat.capture.chain import capture
from remat.capture.stages import UnsupportedModelError
from remat.core.chain_simulate import simulate
from remat.core.plan import Plan
from remat.core.units import format_bytes
from remat.measure.profile import profile
from remat.report import format_chain, format_memory_report, format_module_peaks, plot_profile

__all__ = ["add_parser", "run"]

_OPTIMIZERS = ("adam", "sgd", "none")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "profile",
        help="measure one training step exactly: memory by category, per module, per stage",
        description=(
            "Measure one training step of MODEL (a zoo name such as resnet18, gpt2, "
            "mlp-chain, resnet1001, or package.module:factory): peak memory by category, "
            "per-module peaks, and the per-stage costs that the planners use. Use --fake for "
            "models larger than this machine (nothing is allocated)."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="zoo name or package.module:factory")
    p.add_argument("--batch", type=int, help="batch size (default: the model's)")
    p.add_argument(
        "--fake",
        action="store_true",
        help="measure under FakeTensorMode: exact bytes, no memory allocated, FLOPs for time",
    )
    p.add_argument(
        "--optimizer",
        choices=_OPTIMIZERS,
        default="adam",
        help="optimizer of the step (default adam; its state is created by a warm-up step)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="write a breakdown + timeline PNG")
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage capture")
    return p


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG: give a file name ending in .png, not {args.plot}")
    try:
        entry = zoo.get(args.model, batch_size=args.batch)
    except TypeError as err:
        raise ValueError(str(err)) from err
    model, batch, loss_fn = entry.model, entry.batch, entry.loss_fn
    optimizer = _optimizer(args.optimizer, model)
    chain = None
    stage_error = "skipped (--no-stages)" if args.no_stages else ""
    with tqdm(total=2, desc=f"profiling {entry.name}", unit="pass", leave=False) as bar:
        try:
            report = profile(model, batch, loss_fn, optimizer, fake=args.fake)
        except (RuntimeError, TypeError, IndexError) as err:
            raise ValueError(_batch_error(entry.name, batch, err)) from err
        bar.update(1)
        if not args.no_stages:
            try:
                chain = capture(model, batch, loss_fn, fake=args.fake, progress=True).chain
            except UnsupportedModelError as err:
                stage_error = str(err)
        bar.update(1)
    predicted = None if chain is None else simulate(chain, Plan.none(chain)).peak_bytes
    if args.plot is not None:
        plot_profile(report, args.plot, title=f"{entry.name}: {entry.description}")
    if args.json:
        print(
            json.dumps(
                {
                    "model": entry.name,
                    "description": entry.description,
                    "report": report.to_dict(),
                    "chain": None if chain is None else chain.to_dict(),
                    "predicted_activation_peak_bytes": predicted,
                    "stage_error": stage_error,
                }
            )
        )
        return 0
    print(f"{entry.name}: {entry.description}")
    print(format_memory_report(report))
    print()
    print(format_module_peaks(report, depth=1, top=8))
    print()
    if chain is None:
        print(f"per-stage costs: not captured. {stage_error}".rstrip())
    else:
        print(format_chain(chain))
        assert predicted is not None
        measured = report.activation_peak_bytes
        print(
            f"activation peak: measured {format_bytes(measured)}, predicted from the chain "
            f"{format_bytes(predicted)} ({predicted / max(1, measured):.3f}x)"
        )
    if args.plot is not None:
        print(f"plot written to {args.plot}")
    return 0


def _optimizer(name: str, model: Any) -> Any:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if name == "none" or not params:
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    return torch.optim.Adam(params)


def _batch_error(name: str, batch: Any, err: BaseException) -> str:
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "can't allocate memory" in message or "out of memory" in message:
        return (
            f"{name} does not fit in memory at this batch ({message}); try --fake (nothing "
            "is allocated) or a smaller --batch"
        )
    return (
        f"the example batch ({_describe(batch)}) does not fit {name}: {type(err).__name__}: "
        f"{message}. Return (module, batch) from your factory, or check --batch"
    )


def _describe(batch: Any) -> str:
    import torch

    if isinstance(batch, torch.Tensor):
        return f"tensor {tuple(batch.shape)}"
    if isinstance(batch, dict):
        return ", ".join(f"{k}: {_describe(v)}" for k, v in batch.items())
    if isinstance(batch, tuple | list):
        return ", ".join(_describe(v) for v in batch)
    return type(batch).__name__
