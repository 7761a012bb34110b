"""One line: ``planned, summary = remat.auto(model, batch, budget="4GiB")``.

:func:`auto` captures the model as a chain (measured costs), subtracts what no plan changes
(parameters, their gradients, buffers and optimizer state) from the budget, plans the rest with
a planner (``optimal-time`` by default), and applies the plan with nested non-reentrant
checkpointing. The returned module trains like the original, with equal gradients.

Example:
    >>> import torch, remat
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    >>> planned, summary = remat.auto(model, torch.randn(32, 64))  # doctest: +SKIP
    >>> print(summary)  # doctest: +SKIP

Known limitations: the batch shape is part of the plan (a new shape re-plans, through the
``replan`` hook of :class:`remat.runtime.PlannedModule`); models that cannot be split into
stages raise :class:`remat.stages.UnsupportedModelError` with what to do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.costs import Chain
from remat.plans import Plan
from remat.simulate import simulate
from remat.units import format_bytes, parse_bytes

__all__ = ["auto", "AutoSummary", "fixed_bytes", "plan_for_total_budget"]


@dataclass(frozen=True)
class AutoSummary:
    """What :func:`auto` decided and what it predicts."""

    method: str
    """Planner used."""
    plan: Plan
    """The plan applied."""
    chain: Chain
    """The measured chain the plan was made for."""
    budget_bytes: int | None
    """The total budget asked for (None: least memory at <= one extra forward)."""
    fixed_bytes: int
    """Parameters + gradients + buffers + optimizer state: memory no plan changes."""
    predicted_activation_peak_bytes: int
    """Simulated peak of activations, saved tensors, activation gradients and transients."""
    unplanned_activation_peak_bytes: int
    """The same for the unplanned model (store everything)."""
    predicted_time: float
    """Simulated forward + recomputation + backward time of the plan."""
    unplanned_time: float
    """Simulated time of the unplanned step."""

    @property
    def predicted_peak_bytes(self) -> int:
        """Predicted total peak of the training step: fixed part + activation peak."""
        return self.fixed_bytes + self.predicted_activation_peak_bytes

    @property
    def predicted_overhead(self) -> float:
        """Predicted step time relative to the unplanned step, minus one (0.25 = 25% slower)."""
        return self.predicted_time / self.unplanned_time - 1 if self.unplanned_time else 0.0

    def __str__(self) -> str:
        budget = "none (least memory at <= 1 extra forward)"
        if self.budget_bytes is not None:
            budget = format_bytes(self.budget_bytes)
        unplanned_total = self.fixed_bytes + self.unplanned_activation_peak_bytes
        plan_text = self.plan.describe()
        if len(plan_text) > 70:
            plan_text = plan_text[:67] + "..."
        return "\n".join(
            [
                f"remat.auto: {self.chain.n} stages, planner {self.method!r}, budget {budget}",
                f"  fixed (params, grads, buffers, optimizer): {format_bytes(self.fixed_bytes)}",
                f"  activations: {format_bytes(self.unplanned_activation_peak_bytes)} -> "
                f"{format_bytes(self.predicted_activation_peak_bytes)}",
                f"  predicted peak: {format_bytes(unplanned_total)} -> "
                f"{format_bytes(self.predicted_peak_bytes)} "
                f"({self.predicted_peak_bytes / max(1, unplanned_total):.2f}x)",
                f"  predicted time overhead: {100 * self.predicted_overhead:+.1f}%",
                f"  plan: {plan_text}",
            ]
        )


def fixed_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes no plan changes: parameters, their gradients, buffers and optimizer state.

    Gradients are counted for every parameter that requires grad (they exist after the first
    backward). Optimizer state is what ``optimizer.state`` holds now; a fresh optimizer without
    state is counted as the copies its first step allocates (Adam/AdamW two per parameter, three
    with amsgrad; SGD with momentum one; RMSprop/Adagrad one; others zero).
    """
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.data_ptr() else id(storage)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()

    for p in model.parameters():
        add(p)
        if p.requires_grad:
            total += p.numel() * p.element_size()  # its gradient
    for b in model.buffers():
        add(b)
    if optimizer is not None:
        if optimizer.state:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        add(value)
        else:
            total += _expected_state_bytes(optimizer)
    return total


def _expected_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer state a fresh optimizer will allocate at its first step (per-parameter copies)."""
    copies = 0
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        copies = 2 + int(any(g.get("amsgrad") for g in optimizer.param_groups))
    elif isinstance(optimizer, torch.optim.SGD):
        copies = int(any(g.get("momentum", 0) for g in optimizer.param_groups))
    elif isinstance(optimizer, torch.optim.RMSprop | torch.optim.Adagrad):
        copies = 1
    return copies * sum(
        p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"]
    )


def plan_for_total_budget(
    chain: Chain, fixed: int, budget: int | str | None, method: str = "optimal-time"
) -> Plan:
    """Plan ``chain`` so that ``fixed`` + the activation peak fits ``budget``.

    With ``budget=None``: the plan with the least activation peak whose predicted time is at
    most the unplanned time plus one extra forward.
    """
    from remat.api import plan as make_plan
    from remat.planners import BudgetTooSmallError

    if budget is None:
        return _least_memory_within_one_forward(chain, method)
    total = parse_bytes(budget)
    activation_budget = total - fixed
    if activation_budget <= chain.input_bytes:
        raise BudgetTooSmallError(
            total,
            fixed + simulate(chain, make_plan(chain, method)).peak_bytes,
            method,
            f"parameters, gradients, buffers and optimizer state alone take "
            f"{format_bytes(fixed)}; shrink them with the levers (precision, sparsity) first",
        )
    try:
        return make_plan(chain, method, activation_budget)
    except BudgetTooSmallError as err:
        raise BudgetTooSmallError(
            total, fixed + err.minimum_bytes, method, "total training-step peak"
        ) from None


def _least_memory_within_one_forward(chain: Chain, method: str) -> Plan:
    """Binary search on the activation budget for the least peak with time <= T + 1 forward."""
    from remat.api import plan as make_plan
    from remat.planners import BudgetTooSmallError

    store_all = make_plan(chain, "none")
    limit = (store_all.predicted_time or 0.0) + chain.total_fwd_time()
    high_plan = make_plan(chain, method, store_all.predicted_peak_bytes)
    lo = 0
    hi = high_plan.predicted_peak_bytes or 0
    best = high_plan
    # invariant: best fits `hi` and is within the time limit
    for _ in range(40):
        if hi - lo <= max(1, hi // 1000):
            break
        mid = (lo + hi) // 2
        try:
            candidate = make_plan(chain, method, mid)
        except BudgetTooSmallError as err:
            lo = max(mid, err.minimum_bytes - 1)
            continue
        if (candidate.predicted_time or 0.0) <= limit:
            best, hi = candidate, candidate.predicted_peak_bytes or mid
        else:
            lo = mid
    return best


def auto(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    budget: int | str | None = None,
    method: str = "optimal-time",
    optimizer: torch.optim.Optimizer | None = None,
    stages: list[str] | None = None,
) -> tuple[nn.Module, AutoSummary]:
    """Capture, plan and apply in one call; returns ``(planned_model, summary)``.

    ``budget`` is the total peak of the training step (what the device must hold: parameters,
    gradients, optimizer state and activations), as bytes or a string like ``"4GiB"``. remat
    subtracts what no plan changes and plans the rest. With ``budget=None`` it picks the plan
    with the least memory whose time overhead stays at most one extra forward.
    """
    from remat.capture import capture
    from remat.distributed import check_not_wrapped
    from remat.runtime import apply

    check_not_wrapped(model, "remat.auto")  # wrap the planned model in DDP/FSDP afterwards
    captured = capture(model, batch, loss_fn=loss_fn, stages=stages)
    chain = captured.chain
    fixed = fixed_bytes(model, optimizer)
    chosen = plan_for_total_budget(chain, fixed, budget, method)

    def replan(new_batch: Any) -> Plan:
        new_chain = capture(model, new_batch, loss_fn=loss_fn, stages=stages).chain
        return plan_for_total_budget(new_chain, fixed, budget, method)

    planned = apply(model, chosen, stages=captured.stages, replan=replan)
    none = simulate(chain, Plan.none(chain))
    sim = simulate(chain, chosen)
    summary = AutoSummary(
        method=method,
        plan=chosen,
        chain=chain,
        budget_bytes=None if budget is None else parse_bytes(budget),
        fixed_bytes=fixed,
        predicted_activation_peak_bytes=sim.peak_bytes,
        unplanned_activation_peak_bytes=none.peak_bytes,
        predicted_time=sim.total_time,
        unplanned_time=none.total_time,
    )
    return planned, summary
