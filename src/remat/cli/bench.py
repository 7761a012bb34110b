"""``remat bench SUITE``: measured comparisons written to JSON, Markdown and PNG."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from remat.bench.suites import SUITES, run_suite

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:

    p = sub.add_parser(
        "bench",
        help="benchmark remat against its peers and the papers",
        description="Run a benchmark suite; writes OUT/SUITE.json, OUT/SUITE.md and plots.",
    )
    p.add_argument("suite", choices=sorted(SUITES), help="which suite")
    p.add_argument("--models", help="comma-separated zoo models (default: the suite's)")
    p.add_argument("--quick", action="store_true", help="one small model, a few minutes")
    p.add_argument("--out", type=Path, default=Path("docs/results"), help="output folder")
    return p


def run(args: argparse.Namespace) -> int:
    import time

    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {message}", file=sys.stderr, flush=True)

    models = args.models.split(",") if args.models else None
    rows = run_suite(args.suite, args.out, models=models, quick=args.quick, progress=progress)
    failed = sum(1 for r in rows if r.get("error"))
    print(
        f"{args.suite}: {len(rows)} rows ({failed} with an error) -> "
        f"{args.out / (args.suite + '.json')}"
    )
    return 0
