"""Shared test settings: hypothesis profiles, the `gpu` and `fresh_process` markers, the longest
tests first."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from hypothesis import HealthCheck, settings

# the examples are fixed (derandomize) and not timed (deadline=None); generating them is not
# timed either: on a loaded 2-core machine the too-slow health check failed a property test
# whose examples all pass
_UNTIMED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", derandomize=True, max_examples=60, **_UNTIMED)
settings.register_profile("dev", max_examples=20, **_UNTIMED)
settings.register_profile("thorough", max_examples=500, **_UNTIMED)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_DURATIONS = Path(__file__).parent / "data" / "durations.json"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The longest tests first (seconds from an earlier run's --durations), the rest in their
    # order after them: under pytest-xdist's worksteal (scripts/test) a worker that runs dry
    # takes the end of the other's queue, so a two-minute test no longer starts near the end.
    seconds = json.loads(_DURATIONS.read_text())["seconds"]
    items.sort(key=lambda item: -seconds.get(item.nodeid, 0.0))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_FRESH = "REMAT_TEST_FRESH_PROCESS"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a test marked ``fresh_process`` in a new interpreter (the same test, unchanged).

    For tests that compare two allocator-level measurements to the byte: oneDNN's CPU caches,
    filled by whatever earlier tests of the same worker ran, decide whether a convolution
    reorders its weight into a fresh buffer, so the scratch bytes such a test sees depend on the
    test order (seen under pytest-xdist, about once in seven full runs). A fresh process
    measures what a user's process does."""
    if pyfuncitem.get_closest_marker("fresh_process") is None or os.environ.get(_FRESH):
        return None
    done = subprocess.run(
        [sys.executable, "-m", "pytest", pyfuncitem.nodeid, "-q", "-p", "no:cacheprovider"]
        + ["-p", "no:xdist"],
        cwd=pyfuncitem.config.rootpath,
        env={**os.environ, _FRESH: "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"in a fresh process:\n{done.stdout[-6000:]}{done.stderr[-2000:]}", False)
    return True


# NOTE [ The test process's older objects frozen ]: a full garbage collection walks every object
# of the process, 524,000 once torch, transformers and timm are imported and more as compiled
# graphs pile up; the measurements' collections (NOTE [ Collect before measuring ] in
# remat.measure.events) and the automatic ones that torch.compile's object churn sets off took
# 565 s of the 1,065 s the compile and conformance tests ran. So each test starts with what the
# earlier ones left collected and frozen (gc.freeze: the collector skips them), as
# remat.measure.events.older_objects_frozen does around remat's own entry points: each test's
# collections walk what it made. Every FULL_COLLECTION_EVERY tests everything is unfrozen and
# collected, so that what an earlier test's objects left as garbage since (a compiled graph
# dynamo dropped) is freed.
FULL_COLLECTION_EVERY = 100
_tests_run = 0


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _tests_run
    _tests_run += 1
    if _tests_run % FULL_COLLECTION_EVERY == 0:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
