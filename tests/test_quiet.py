"""A user of remat.auto sees remat's output and nothing else: no profiler chatter (Kineto's
``USDT ... profiler_start`` per allocator window, ``gpuGetDeviceCount failed`` without a GPU),
no solver log (HiGHS), on stdout or stderr, in a fresh process as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys
    import warnings

    import torch
    from torch import nn

    import remat


    def show(message, category, filename, lineno, file=None, line=None):
        # one line per warning, so the test can tell remat's own warnings from others
        text = " ".join(str(message).split())
        print(f"WARNING {category.__name__}: {text}", file=sys.stderr)


    warnings.showwarning = show


    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Linear(32, 64), nn.Tanh())
            self.a = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh())
            self.b = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.GELU())
            self.head = nn.Linear(64, 4)

        def forward(self, x):
            h = self.stem(x)
            return self.head(self.a(h) * self.b(h))


    torch.manual_seed(0)
    expected = []
    # the chain path (allocator windows per stage), under a budget that binds
    chain = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)])
    x = torch.randn(512, 64)
    planned, summary = remat.auto(chain, x, budget="1.3MiB")
    assert summary.predicted_peak_bytes < summary.unplanned_peak_bytes, summary
    expected.append(str(summary))
    print(summary)
    planned(x).sum().backward()
    # the graph path (one profiler over the step) with a checkmate-milp budget (HiGHS)
    model = Branchy()
    x = torch.randn(1024, 32)
    planned, summary = remat.auto(model, x, budget="2.2MiB")
    assert summary.method == "checkmate-milp", summary.method
    assert summary.predicted_peak_bytes < summary.unplanned_peak_bytes, summary
    expected.append(str(summary))
    print(summary)
    planned(x).sum().backward()
    sys.stdout.flush()
    with open(sys.argv[1], "w") as f:
        f.write("\\n".join(expected) + "\\n")
    """
)


def _run_as_a_user(script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` run in a fresh process with remat from src/ (no Kineto log level set, as a
    user's environment has none); it must succeed."""
    src = Path(__file__).resolve().parents[1] / "src"
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_auto_prints_only_what_remat_prints(tmp_path: Path) -> None:
    expected = tmp_path / "expected.txt"
    done = _run_as_a_user(SCRIPT, str(expected))
    for noise in ("USDT", "profiler_start", "gpuGetDeviceCount", "HiGHS"):
        assert noise not in done.stdout + done.stderr, noise
    # stdout: the two summaries the script printed, nothing around them (solver logs go here)
    assert done.stdout == expected.read_text()
    # stderr: remat's own warning (the graph path says so), nothing else
    lines = done.stderr.splitlines()
    assert lines, "the graph path warns that the model is not a chain"
    for line in lines:
        assert line.startswith("WARNING UserWarning: remat.auto: "), line


SOLVER_PRINTS = textwrap.dedent(
    """
    import ctypes
    import os

    import scipy.optimize

    from remat.core.synthetic import residual_chain
    from remat.planners.graph import plan_graph

    real = scipy.optimize.milp
    libc = ctypes.CDLL(None)


    def printing_milp(*args, **kwargs):
        # what HiGHS as SciPy bundles it does on some graphs (a timm ResNet-18-D's): a debug
        # line by C's printf, whatever disp says; and another thread's output meanwhile
        libc.printf(b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\\n")
        os.write(1, b"another thread's line\\n")
        return real(*args, **kwargs)


    scipy.optimize.milp = printing_milp
    print("before", flush=True)
    plan = plan_graph(residual_chain(2), "checkmate-milp", budget=110)
    print("after", plan.params["status"], flush=True)
    """
)


def test_the_solver_prints_nothing() -> None:
    """HiGHS's own debug lines (C's printf to descriptor 1) do not reach the user's standard
    output; what else was written there during the solve does, in order."""
    done = _run_as_a_user(SOLVER_PRINTS)
    assert "Highs" not in done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "before" and lines[-1] == "after optimal", lines
    assert "another thread's line" in lines[1:-1], lines
