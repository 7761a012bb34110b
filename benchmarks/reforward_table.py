"""Feng & Huang's Re-forwarding table: a thin wrapper around ``remat bench reforward``.

The logic lives in :mod:`remat.bench.reforward`. This script is the same as::

    remat bench reforward --out docs/results/reforward            # ~30-40 min on 2 cores
    remat bench reforward --quick --out /tmp/reforward              # ~2 min

Options are passed through (``--quick``, ``--models alexnet,resnet50``, ``--out DIR``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from remat.cli import main  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--out" not in args:
        args += ["--out", "docs/results/reforward"]
    sys.exit(main(["bench", "reforward", *args]))
