"""README.md's Quick start, run as written: its budget binds (below the unplanned step's peak),
the planned step's measured peak fits it, and the planned model trains like the original."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from remat.core.units import parse_bytes
from remat.measure.events import step_peak_bytes

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start() -> str:
    """The first python block under the README's "Quick start" heading."""
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block under '## Quick start'"
    return match.group(1)


def step_peak(model: torch.nn.Module, params: torch.nn.Module, batch: torch.Tensor) -> int:
    def step() -> None:
        model(batch).sum().backward()
        params.zero_grad(set_to_none=True)

    return step_peak_bytes(step, params, None, batch)


@pytest.mark.slow
def test_quick_start_budget_binds_and_is_met(capsys: pytest.CaptureFixture[str]) -> None:
    code = quick_start()
    budget_text = re.search(r'budget="([^"]+)"', code)
    assert budget_text, "the quick start passes no budget"
    budget = parse_bytes(budget_text.group(1))
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    model, planned, batch, summary = (scope[k] for k in ("model", "planned", "batch", "summary"))
    assert "remat.auto" in capsys.readouterr().out  # it printed the summary

    # the gradients of the README's training calls (the lines that call ``planned``, one of
    # them at another batch size: a re-plan) equal the unplanned model's, bit for bit
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    calls = [line for line in code.splitlines() if line.startswith("planned(")]
    assert calls, "the quick start trains nothing"
    for line in calls:
        exec(line, {**scope, "planned": reference})
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    model.zero_grad(set_to_none=True)

    # the budget binds: the unplanned step's peak (measured and predicted) is above it
    unplanned = step_peak(model, model, batch)
    assert budget < unplanned, (budget, unplanned)
    # predicted for the default loop, which holds the output to the end of the step, and for
    # a criterion on it that remat did not see (no loss_fn: the bound of the common criteria at
    # the loss); the README's step frees the output after a sum: at most those above it
    held = summary.output_held_bytes + summary.criterion_bytes
    assert summary.output_held_bytes > 0
    assert unplanned * 0.99 <= summary.unplanned_peak_bytes <= unplanned * 1.01 + held
    # ... and the plan meets it, predicted and measured
    assert summary.predicted_peak_bytes <= budget
    assert step_peak(planned, model, batch) <= budget
    # the comment's figures: the unplanned peak in MiB, and the budget met
    mib = budget_text.group(1).removesuffix("MiB")
    assert f"{round(unplanned / 2**20)} MiB unplanned -> under {mib}" in code
