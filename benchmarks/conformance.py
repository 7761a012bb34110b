"""Conformance table: every registry model x three loop shapes x three budgets through remat.auto.

The logic lives in :mod:`remat.bench.conformance`. Writes ``docs/results/conformance/
conformance.json`` and ``conformance.md`` (rewritten after each model, so a partial run leaves a
partial table). About 30-40 min on 2 shared cores. Options::

    python benchmarks/conformance.py --models hf-gpt2,tv-resnet10 --loops loss_fn
    python benchmarks/conformance.py --fractions 0.5 --no-time --out /tmp/conformance
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from remat.bench.conformance import main  # noqa: E402

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    sys.exit(main(sys.argv[1:]))
