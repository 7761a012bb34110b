"""The ``remat`` command line: one module per subcommand under ``remat.cli``.

Each subcommand module has ``add_parser(subparsers)`` and ``run(args) -> int``. ``main(argv)``
runs in-process (the tests call it directly).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]

COMMANDS = ("demo", "profile", "plan", "bench", "fit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat",
        description="Train networks that do not fit in memory: profile, plan, apply, measure.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"remat.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"remat.cli.{name}":
                continue  # not available in this build
            raise
        command = module.add_parser(sub)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        # user errors: one clear line, no traceback
        print(f"remat {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
