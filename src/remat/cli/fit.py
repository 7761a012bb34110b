"""``remat fit MODEL --budget B``: the fastest combination of levers that fits a memory budget.

MODEL is a zoo name (``remat.zoo.names()``) or ``package.module:factory``. Searches remat plans
x precision x microbatch count (:func:`remat.fit.fit`), applies the fastest combination whose
predicted peak fits, measures one whole step, and prints the chosen setup with its predicted
and measured peak (``--json``: the same as JSON). A budget that nothing reaches is an error
naming the smallest budget that some combination reaches.

Example::

    remat fit wrn-28-2 --budget 300MiB --batch 128
    remat fit mlp-chain --budget 200MiB --precision fp32 --option layers=16 --json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from remat import zoo
from remat.fit import fit

__all__ = ["add_parser", "run", "parse_options"]

_OPTIMIZERS = ("adam", "sgd", "none")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "fit",
        help="fit a training step into a memory budget (plans x precision x microbatching)",
        description=(
            "Search remat plans, precision (autocast) and microbatch counts for the fastest "
            "combination whose whole training step (parameters, gradients, optimizer state, "
            "batch, activations) fits BUDGET; print it with its predicted and measured peak."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="zoo name or package.module:factory")
    p.add_argument(
        "--budget",
        required=True,
        help="peak memory of the step, e.g. 512MiB, or 50%% of the unplanned step's peak",
    )
    p.add_argument("--batch", type=int, help="batch size (default: the model's)")
    p.add_argument(
        "--density",
        type=float,
        metavar="D",
        help=(
            "prune each Linear/Conv weight to density D (0 < D <= 1) by magnitude, masks kept "
            "through training; counted honestly: dense masked weights save nothing, the CSR "
            "size they would take is reported"
        ),
    )
    p.add_argument(
        "--precision",
        default="fp32,bf16",
        help="comma-separated precisions to search: fp32, bf16, fp16 (default fp32,bf16)",
    )
    p.add_argument(
        "--microbatches",
        help="comma-separated microbatch counts to search (default: every divisor of the batch)",
    )
    p.add_argument(
        "--optimizer",
        choices=_OPTIMIZERS,
        default="adam",
        help="optimizer of the step, part of the budget (default adam)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model option for the zoo (repeatable), e.g. --option layers=8",
    )
    p.add_argument("--no-measure", action="store_true", help="do not measure the chosen step")
    p.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    options = parse_options(args.option)
    try:
        entry = zoo.get(args.model, batch_size=args.batch, **options)
    except TypeError as err:
        raise ValueError(str(err)) from err
    model = entry.model
    optimizer: torch.optim.Optimizer | None = None
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    elif args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    microbatches = None
    if args.microbatches:
        microbatches = [int(k) for k in args.microbatches.split(",") if k.strip()]
    setup = fit(
        model,
        entry.batch,
        args.budget,
        entry.loss_fn,
        optimizer=optimizer,
        precisions=[p.strip() for p in args.precision.split(",") if p.strip()],
        microbatches=microbatches,
        density=args.density,
        measure=not args.no_measure,
    )
    if args.json:
        data = setup.to_dict()
        data["model"] = entry.description
        data["optimizer"] = args.optimizer
        print(json.dumps(data, indent=1))
    else:
        print(f"{entry.description}; optimizer {args.optimizer}")
        print(setup)
        print(setup.table())
    return 0


def parse_options(items: list[str]) -> dict[str, Any]:
    """``["layers=8", "dropout=0.1", "name=x"]`` -> ``{"layers": 8, "dropout": 0.1, ...}``."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--option takes KEY=VALUE, got {item!r}")
        options[key.strip()] = _value(value.strip())
    return options


def _value(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)
