"""One line: ``planned, summary = remat.auto(model, batch, budget="4GiB")``.

:func:`auto` captures the model as a chain (measured costs), subtracts what no plan changes
(parameters, their gradients, buffers, optimizer state, and the model output the training loop
holds: ``loop="output-held"`` by default, see :mod:`remat.step`) from the budget, plans the
rest with a planner (``optimal-time`` by default), and applies the plan with nested
non-reentrant checkpointing. The returned module trains like the original, with equal gradients.

Example:
    >>> import torch, remat
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    >>> planned, summary = remat.auto(model, torch.randn(32, 64))  # doctest: +SKIP
    >>> print(summary)  # doctest: +SKIP

Known limitations: the batch shape is part of the plan. The plan is recorded for the model's
arguments in the planning batch; a training call with other shapes (a last partial batch,
another sequence length, an added ``attention_mask``) captures the model again on those
arguments and re-plans it under the same budget and planner (chain and graph paths alike:
:class:`remat.runtime.SignaturePlans`), or raises
:class:`~remat.planners.BudgetTooSmallError` naming the minimum for that shape. A re-plan sees
only the model's arguments, so it measures the loss as :func:`remat.runtime.call_loss` does
(the output's ``.loss`` or its sum), not a ``loss_fn`` of the batch. A model that cannot be split into
stages (branches, skips across blocks) is planned as a module graph instead, with a warning:
``checkmate-milp`` under the budget, Re-forwarding without one, run by the graph executor
(that path counts every parameter gradient for the whole backward, and its plan is made for
the batch shape it was captured at). With ``stages=`` named, a model that does not split raises
:class:`remat.stages.UnsupportedModelError` with what to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.costs import Chain
from remat.errors import UnsupportedModelError
from remat.guards import check_no_own_checkpointing, check_not_wrapped
from remat.measure import SCRATCH_MIN_BYTES
from remat.plans import Plan
from remat.simulate import simulate
from remat.step import LOOPS, StepCosts, StepEvent, check_loop, output_held_bytes, step_peak
from remat.units import format_bytes, parse_bytes, resolve_budget

if TYPE_CHECKING:
    from remat.capture import Captured

__all__ = [
    "auto",
    "AutoSummary",
    "chain_step_peak",
    "chain_timeline",
    "checkpoint_state_bytes",
    "fixed_bytes",
    "plan_for_total_budget",
    "predicted_step_peak_bytes",
    "total_peak_bytes",
    "stage_grad_bytes",
]


@dataclass(frozen=True)
class AutoSummary:
    """What :func:`auto` decided and what it predicts."""

    method: str
    """Planner used."""
    plan: Plan
    """The plan applied (a :class:`remat.graphs.GraphPlan` when the model is not a chain)."""
    chain: Chain
    """The measured chain the plan was made for (a :class:`remat.graphs.Graph` when the
    model is not a chain)."""
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
    predicted_peak_bytes: int = 0
    """Predicted total peak of the step (:func:`total_peak_bytes`: persistent state, parameter
    gradients as the backward makes them, and activations)."""
    unplanned_peak_bytes: int = 0
    """The same for the unplanned step."""
    loop: str | None = None
    """The training loop the prediction assumes (:data:`remat.step.LOOPS`): ``"output-held"``
    or ``"loss-only"``; None where the model output is not modelled."""
    output_held_bytes: int = 0
    """Bytes of the model output the assumed loop keeps through the step (in the peaks)."""

    @classmethod
    def of(
        cls,
        method: str,
        plan: Any,
        chain: Any,
        budget: int | str | None,
        fixed: int,
        sim: Any,
        none: Any,
        predicted_peak_bytes: int = 0,
        unplanned_peak_bytes: int = 0,
        loop: str | None = None,
        output_held_bytes: int = 0,
    ) -> AutoSummary:
        """The summary of ``plan`` from its simulation ``sim`` and the unplanned one ``none``
        (chain or graph simulations: both have ``peak_bytes`` and ``total_time``)."""
        return cls(
            method=method,
            plan=plan,
            chain=chain,
            budget_bytes=None if budget is None else parse_bytes(budget),
            fixed_bytes=fixed,
            predicted_activation_peak_bytes=sim.peak_bytes,
            unplanned_activation_peak_bytes=none.peak_bytes,
            predicted_time=sim.total_time,
            unplanned_time=none.total_time,
            predicted_peak_bytes=predicted_peak_bytes,
            unplanned_peak_bytes=unplanned_peak_bytes,
            loop=loop,
            output_held_bytes=output_held_bytes,
        )

    @property
    def predicted_overhead(self) -> float:
        """Predicted step time relative to the unplanned step, minus one (0.25 = 25% slower)."""
        return self.predicted_time / self.unplanned_time - 1 if self.unplanned_time else 0.0

    def __str__(self) -> str:
        budget = "none (least memory at <= 1 extra forward)"
        if self.budget_bytes is not None:
            budget = format_bytes(self.budget_bytes)
        unplanned_total = self.unplanned_peak_bytes
        plan_text = self.plan.describe()
        if len(plan_text) > 70:
            plan_text = plan_text[:67] + "..."
        size = (
            f"{self.chain.n} stages"
            if isinstance(self.chain, Chain)
            else f"a graph of {len(self.chain.nodes)} nodes (not a chain)"
        )
        return "\n".join(
            [
                f"remat.auto: {size}, planner {self.method!r}, whole-step budget {budget}",
                f"  fixed (params, grads, buffers, optimizer): {format_bytes(self.fixed_bytes)}",
                f"  activations: {format_bytes(self.unplanned_activation_peak_bytes)} -> "
                f"{format_bytes(self.predicted_activation_peak_bytes)}",
                f"  predicted peak: {format_bytes(unplanned_total)} -> "
                f"{format_bytes(self.predicted_peak_bytes)} "
                f"({self.predicted_peak_bytes / max(1, unplanned_total):.2f}x)",
                f"  predicted time overhead: {100 * self.predicted_overhead:+.1f}%",
                f"  plan: {plan_text}",
                f"  loop: {self._loop_text()}",
            ]
        )

    def _loop_text(self) -> str:
        if self.loop is None:
            return "not modelled (the model's output is not counted)"
        text = f"{self.loop!r}: {LOOPS.get(self.loop, '?')}"
        if self.loop == "output-held":
            text += f"; {format_bytes(self.output_held_bytes)} counted all step"
            text += " (loop='loss-only' if your loop keeps only the loss)"
        return text


def fixed_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes no plan changes: parameters, their gradients, buffers and optimizer state.

    Gradients are counted for every parameter that requires grad (they exist after the first
    backward). Optimizer state is what ``optimizer.state`` holds now; a fresh optimizer without
    state is counted as the copies its first step allocates (Adam/AdamW two per parameter, three
    with amsgrad; SGD with momentum one; RMSprop/Adagrad one; others zero) and the per-parameter
    ``step`` counters of those that keep one (4 bytes each).
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
                    if isinstance(value, torch.Tensor):
                        add(value)  # the 0-dim step counters too (a few bytes per parameter)
        else:
            total += _expected_state_bytes(optimizer)
    return total


def _expected_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer state a fresh optimizer will allocate at its first step (per-parameter copies,
    and the per-parameter ``step`` counters of Adam/AdamW/RMSprop/Adagrad: a 0-dim float32
    tensor each, float64 under a float64 default dtype)."""
    copies = 0
    counters = False
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        copies = 2 + int(any(g.get("amsgrad") for g in optimizer.param_groups))
        counters = True
    elif isinstance(optimizer, torch.optim.SGD):
        copies = int(any(g.get("momentum", 0) for g in optimizer.param_groups))
    elif isinstance(optimizer, torch.optim.RMSprop | torch.optim.Adagrad):
        copies = 1
        counters = True
    # a frozen parameter gets no gradient, so no state
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    step_bytes = 8 if torch.get_default_dtype() == torch.float64 else 4
    return copies * sum(p.numel() * p.element_size() for p in params) + (
        step_bytes * len(params) if counters else 0
    )


def plan_for_total_budget(
    chain: Chain,
    fixed: int,
    budget: int | str | None,
    method: str = "optimal-time",
    grad_bytes: Sequence[int] | None = None,
    grad_rise_bytes: Sequence[int] | None = None,
    optimizer_step_bytes: int = 0,
    output_held_bytes: int = 0,
    slack_bytes: int = 0,
) -> Plan:
    """Plan ``chain`` so that the whole training step's peak fits ``budget``.

    ``fixed`` is what no plan changes (parameters, their gradients, buffers, optimizer state).
    Without ``grad_bytes`` the activation budget is ``budget - fixed`` (safe: it counts every
    parameter gradient as live during the whole backward). With ``grad_bytes`` (the parameter
    gradient bytes each stage's backward allocates, :func:`stage_grad_bytes`), the step's total
    peak is evaluated exactly over the plan's timeline (:func:`total_peak_bytes`: gradients
    appear as the backward reaches their stage) and the largest activation budget whose plan
    fits is used — a lower, still honest, reading of the same budget. ``grad_rise_bytes``
    (:attr:`remat.capture.Captured.grad_rise_bytes`) makes that evaluation exact during each
    stage's backward. ``optimizer_step_bytes`` (the temporaries of one optimizer step,
    :func:`remat.profile.optimizer_costs`) with ``fixed`` and the batch is the step's last
    phase, which no plan changes: a budget below it raises at once. ``output_held_bytes`` is
    the model output the training loop keeps through the step (:mod:`remat.step`), live all
    step beside the activations; ``slack_bytes`` (:attr:`remat.step.StepCosts.slack_bytes`)
    too.

    With ``budget=None``: the plan with the least activation peak whose predicted time is at
    most the unplanned time plus one extra forward.

    A :class:`~remat.planners.BudgetTooSmallError` names a ``minimum_bytes`` that this function
    accepts when called again with it as the budget.
    """
    from remat.api import plan as make_plan
    from remat.planners import BudgetTooSmallError

    if budget is None:
        return _least_memory_within_one_forward(chain, method)
    total = parse_bytes(budget)
    held = fixed + output_held_bytes + slack_bytes
    costs = None
    if grad_bytes is not None:
        costs = StepCosts(
            persistent_bytes=fixed - sum(grad_bytes),
            grad_bytes=tuple(grad_bytes),
            grad_rise_bytes=tuple(grad_rise_bytes or ()),
            optimizer_step_bytes=optimizer_step_bytes,
            output_held_bytes=output_held_bytes,
            input_bytes=chain.input_bytes,
            slack_bytes=slack_bytes,
        )
    optimizer_phase = held + chain.input_bytes + optimizer_step_bytes
    if optimizer_step_bytes and optimizer_phase > total:
        least = (
            _least_step_peak(chain, method, costs)[1]
            if costs is not None
            else held + _least_activation_peak(chain, method)
        )
        raise _optimizer_step_too_large(
            total, max(optimizer_phase, least), method, optimizer_phase, optimizer_step_bytes
        )
    if costs is not None:
        return _largest_fitting_plan(chain, costs, total, method)
    activation_budget = total - held
    if activation_budget <= chain.input_bytes:
        raise BudgetTooSmallError(
            total,
            held + simulate(chain, make_plan(chain, method)).peak_bytes,
            method,
            f"parameters, gradients, buffers and optimizer state alone take "
            f"{format_bytes(fixed)}"
            + (
                f" and the output the loop holds {format_bytes(output_held_bytes)}"
                if output_held_bytes
                else ""
            )
            + "; shrink them with the levers (precision, sparsity) first",
            kind="whole-step",
        )
    try:
        return make_plan(chain, method, activation_budget)
    except BudgetTooSmallError as err:
        raise BudgetTooSmallError(
            total, held + err.minimum_bytes, method, "total training-step peak", kind="whole-step"
        ) from None


def total_peak_bytes(
    chain: Chain,
    plan: Plan,
    persistent: int,
    grad_bytes: Sequence[int],
    grad_rise_bytes: Sequence[int] | None = None,
    segment_state_bytes: int | None = None,
    optimizer_step_bytes: int = 0,
    output_held_bytes: int = 0,
) -> int:
    """The whole step's predicted peak (:func:`remat.step.step_peak` over the chain's simulated
    timeline): ``persistent`` bytes (parameters, buffers, optimizer state) + the model output
    the loop holds (``output_held_bytes``, :mod:`remat.step`) + the parameter gradients made so
    far + the plan's live activation bytes, maximised over the simulated timeline, +
    ``segment_state_bytes`` per checkpointed segment (default: the CPU RNG state,
    :func:`checkpoint_state_bytes`, that the executor's checkpoints keep to replay dropout;
    counted for every segment at once during the forward and backward, an upper bound of a few
    KiB each). A stage's gradients count from its first backward on: during that backward they
    add ``grad_rise_bytes[i]`` (measured by :func:`remat.capture.capture`: a weight gradient is
    often made after the backward's activation peak), after it all of ``grad_bytes[i]``;
    without ``grad_rise_bytes``, all of it during the backward too. The step ends with the
    optimizer step: every gradient, the batch, the held output and ``optimizer_step_bytes`` of
    its temporaries (:func:`remat.profile.optimizer_costs`)."""
    costs = StepCosts(
        persistent_bytes=persistent,
        grad_bytes=tuple(grad_bytes),
        grad_rise_bytes=tuple(grad_rise_bytes or ()),
        optimizer_step_bytes=optimizer_step_bytes,
        output_held_bytes=output_held_bytes,
        input_bytes=chain.input_bytes,
    )
    return chain_step_peak(chain, plan, costs, segment_state_bytes)


def chain_step_peak(
    chain: Chain, plan: Plan, costs: StepCosts, segment_state_bytes: int | None = None
) -> int:
    """:func:`remat.step.step_peak` of ``plan`` on ``chain`` (the chain's simulated timeline),
    with ``segment_state_bytes`` (default :func:`checkpoint_state_bytes`) per checkpointed
    segment."""
    from remat.step import segment_state_bytes as live_states

    if segment_state_bytes is None:
        segment_state_bytes = checkpoint_state_bytes()

    def checkpoints(seg: Any) -> int:
        return int(seg.checkpoint) + sum(checkpoints(c) for c in seg.children)

    top = [(s.start - 1, checkpoints(s)) for s in plan.for_chain(chain).segments if s.checkpoint]
    timeline = chain_timeline(chain, plan)
    return step_peak(timeline, costs, live_states(timeline, top, segment_state_bytes))


def chain_timeline(chain: Chain, plan: Plan) -> list[StepEvent]:
    """The simulated timeline of ``plan`` as :class:`remat.step.StepEvent` (0-based stages)."""
    return [
        StepEvent(e.op == "B", e.stage - 1, e.peak_bytes, e.live_bytes)
        for e in simulate(chain, plan).timeline
    ]


def checkpoint_state_bytes() -> int:
    """Bytes each checkpointed segment of the executor keeps until its backward: the CPU RNG
    state (``torch.get_rng_state()``, 5,056 bytes), saved so that recomputed dropout draws the
    same masks (CUDA RNG states are a few bytes more, also in host memory)."""
    return torch.get_rng_state().numel()


def predicted_step_peak_bytes(
    model: nn.Module,
    captured: Captured,
    plan: Plan,
    optimizer: torch.optim.Optimizer | None = None,
    loop: str = "loss-only",
) -> int:
    """The whole training step's predicted peak for ``plan`` on a model captured by
    :func:`remat.capture.capture` (:func:`total_peak_bytes` with the model's fixed bytes and,
    with an optimizer, its step's temporaries; with ``loop="output-held"`` the model output the
    loop keeps, :data:`remat.step.LOOPS`); compare it with
    :func:`remat.measure.step_peak_bytes` of the planned step."""
    from remat.profile import optimizer_costs

    grads = stage_grad_bytes(captured.stages)
    persistent = fixed_bytes(model, optimizer) - sum(grads)
    _, step_bytes = optimizer_costs(model, optimizer)
    return total_peak_bytes(
        captured.chain,
        plan,
        persistent,
        grads,
        captured.grad_rise_bytes,
        optimizer_step_bytes=step_bytes,
        output_held_bytes=output_held_bytes(loop, captured.output_bytes),
    )


def _largest_fitting_plan(chain: Chain, costs: StepCosts, total: int, method: str) -> Plan:
    """The plan whose whole-step peak (:func:`chain_step_peak`) fits ``total``, each candidate
    checked exactly.

    If the plan made for the activation budget ``total - costs.held_bytes`` fits, it is the
    answer (no fitting plan keeps more activations). Otherwise the fastest fitting plan among
    ``method``'s candidates (:func:`remat.planners.candidates`: its plans at a fixed grid of
    activation budgets, one DP table for optimal-time, which adds the baselines' plans) and the
    plans of a binary search on the activation budget: the step's peak is not a monotone
    function of the activation peak (a parameter gradient made early in the backward can meet a
    recomputation), so the largest activation budget that fits is not always the fastest plan.
    When none fits, the least-activation plan (:func:`_least_step_peak`) is the last candidate;
    the error names its whole-step peak, a budget this function accepts."""
    from remat.api import plan as make_plan
    from remat.planners import BudgetTooSmallError, candidates

    pool: list[Plan] = []

    def fits(activation_budget: int) -> Plan | None:
        try:
            candidate = make_plan(chain, method, activation_budget)
        except BudgetTooSmallError:
            return None
        ok = chain_step_peak(chain, candidate, costs) <= total
        if ok:
            pool.append(candidate)
        return candidate if ok else None

    lo = max(0, total - costs.fixed_bytes)  # the safe reading
    hi = max(lo, total - costs.held_bytes)
    best = fits(hi)
    if best is not None:
        return best
    best = fits(lo) if lo > 0 else None
    for _ in range(30):
        if hi - lo <= max(1, hi // 2000):
            break
        mid = (lo + hi) // 2
        candidate = fits(mid)
        if candidate is not None:
            best, lo = candidate, mid
        else:
            hi = mid
    for candidate in candidates(chain, method):
        if chain_step_peak(chain, candidate, costs) <= total:
            pool.append(candidate)
    if pool:
        timed = [(simulate(chain, p).total_time, p) for p in pool]
        best = min(timed, key=lambda tp: tp[0])[1]
    if best is None:
        least, need = _least_step_peak(chain, method, costs)
        if need <= total:
            return least
        output = (
            f" and the output the loop holds {format_bytes(costs.output_held_bytes)}"
            if costs.output_held_bytes
            else ""
        )
        raise BudgetTooSmallError(
            total,
            need,
            method,
            f"parameters, buffers and optimizer state take {format_bytes(costs.persistent_bytes)}"
            f", parameter gradients {format_bytes(sum(costs.grad_bytes))}{output}",
            kind="whole-step",
        )
    return best


def _least_step_peak(chain: Chain, method: str, costs: StepCosts) -> tuple[Plan, int]:
    """``method``'s least-activation plan (:func:`_least_activation_peak`) and its whole-step
    peak: a budget :func:`_largest_fitting_plan` always accepts (checkpoint RNG states, the
    held output and the optimizer step included)."""
    from remat.api import plan as make_plan
    from remat.planners import least_peak

    least = make_plan(chain, method, least_peak(chain, method))
    return least, chain_step_peak(chain, least, costs)


def _optimizer_step_too_large(
    budget: int, minimum: int, method: str, phase: int, step_bytes: int
) -> Exception:
    """The error for a budget below the optimizer step (``phase`` bytes, no plan changes it)."""
    from remat.planners import BudgetTooSmallError

    return BudgetTooSmallError(
        budget,
        minimum,
        method,
        f"the optimizer step alone needs {format_bytes(phase)} (parameters, gradients, buffers, "
        f"state, the batch and {format_bytes(step_bytes)} of its own temporaries); shrink them "
        "with the levers (precision, sparsity) or use an optimizer with foreach=False",
        kind="whole-step",
    )


def _least_activation_peak(chain: Chain, method: str) -> int:
    """The least activation peak ``method`` reaches (time-independent for optimal-time: the
    least peak of any nested plan); with every gradient and the fixed bytes added, a whole-step
    budget that is always feasible."""
    from remat.planners import least_peak

    return least_peak(chain, method)


def stage_grad_bytes(stages: Any) -> list[int]:
    """Parameter-gradient bytes each stage's backward allocates (a parameter shared by several
    stages, such as tied embeddings, is counted at the last of them: the backward reaches it
    first)."""
    from remat.stages.base import grad_parameters

    owner: dict[int, tuple[int, int]] = {}
    for index, module in enumerate(stages.modules):
        for p in grad_parameters(module):
            if p.requires_grad:
                owner[id(p)] = (index, p.numel() * p.element_size())
    result = [0] * len(stages.modules)
    for index, nbytes in owner.values():
        result[index] += nbytes
    return result


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


def _criterion_bytes(loss_fn: Any, batch: Any, captured: Any) -> int:
    """What the loop's own criterion may save beside the held output, where remat did not
    capture it (no ``loss_fn``, and no ``labels`` in a dict batch: a Hugging Face model given
    labels computes its own loss, which the capture ran): the largest output tensor's bytes
    (:func:`remat.step.output_held_bytes`)."""
    if loss_fn is not None or (isinstance(batch, Mapping) and batch.get("labels") is not None):
        return 0
    return captured.largest_output_bytes


def _fastest_fitting_graph_plan(
    graph: Any, costs: StepCosts, total: int, step_peak: Callable[[Any], int]
) -> tuple[str, Any]:
    """The fastest plan of a module graph whose whole-step peak (``step_peak``) fits ``total``
    bytes, as ``(planner, plan)``.

    Candidates: ``checkmate-milp`` for the activation budget left beside what the step always
    holds (gradients as the backward makes them), then, only if that plan does not fit, for
    the budget left with every gradient live all step (the safe reading) — for its own least
    activation peak where a budget is below it; Re-forwarding's
    least-memory plan; and the unplanned one. Each is checked exactly by ``step_peak``. When
    none fits, the error names the least whole-step peak among them: a budget that one of these
    plans meets is never refused, and the minimum named is accepted when passed back.
    """
    from remat.graphs import GraphPlan, plan_graph, simulate_graph
    from remat.planners import BudgetTooSmallError

    candidates: list[tuple[str, Any]] = []
    for activation_budget in (total - costs.held_bytes, total - costs.fixed_bytes):
        if activation_budget <= 0:
            continue
        try:
            plan = plan_graph(graph, "checkmate-milp", activation_budget)
        except BudgetTooSmallError as err:  # the MILP's least activation peak is a candidate
            plan = plan_graph(graph, "checkmate-milp", err.minimum_bytes)
        candidates.append(("checkmate-milp", plan))
        if step_peak(plan) <= total:
            break
    candidates += [("reforward", plan_graph(graph, "reforward")), ("none", GraphPlan.none())]
    fitting = [(name, plan) for name, plan in candidates if step_peak(plan) <= total]
    if not fitting:
        raise BudgetTooSmallError(
            total,
            min(step_peak(plan) for _, plan in candidates),
            "checkmate-milp",
            "total training-step peak (graph)",
            kind="whole-step",
        )
    return min(fitting, key=lambda item: simulate_graph(graph, item[1]).total_time)


def _auto_graph(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    budget: int | str | None,
    optimizer: torch.optim.Optimizer | None,
    why: str,
    loop: str = "output-held",
) -> tuple[nn.Module, AutoSummary]:
    """:func:`auto` for a model that is not a chain: capture its module graph, plan it with
    ``checkmate-milp`` under the activation budget, or, without a budget, take Re-forwarding's
    least-memory plan when it costs at most one extra forward (else the unplanned one), and run
    it with the graph executor (docs/graph-executor.md).

    With a budget, the MILP first gets ``budget`` minus the parameters, buffers, optimizer
    state and the output the loop holds (parameter gradients appear during the backward); the
    whole step's peak of its plan is then checked exactly
    (:func:`remat.graphs.graph_step_peak`, gradients as the backward makes them) and, if it
    does not fit, the MILP plans again with every gradient counted as live all step (the safe
    reading)."""
    import warnings

    from remat.capture import _model_arguments
    from remat.graphs import GraphPlan, graph_step_peak, plan_graph, simulate_graph
    from remat.graphs.capture import trace_graph
    from remat.graphs.runtime import apply_graph
    from remat.profile import optimizer_costs
    from remat.runtime import call_loss

    warnings.warn(
        f"remat.auto: the model is not a chain of stages ({why.splitlines()[0]}); planning its "
        "module graph instead (checkmate-milp / reforward, graph executor)",
        stacklevel=3,
    )
    fixed = fixed_bytes(model, optimizer)
    _, step_bytes = optimizer_costs(model, optimizer)

    def costs_of(trace: Any) -> StepCosts:
        grads = list(trace.param_grad_bytes)
        return StepCosts(
            persistent_bytes=fixed - sum(grads),
            grad_bytes=tuple(grads),
            optimizer_step_bytes=step_bytes,
            output_held_bytes=output_held_bytes(
                loop, trace.output_bytes, _criterion_bytes(loss_fn, batch, trace)
            ),
            input_bytes=trace.graph.input_bytes,
            slack_bytes=SCRATCH_MIN_BYTES,  # allocator-only bytes no capture counts
        )

    def plan_traced(trace: Any, spec: int | float | str | None) -> tuple[Any, ...]:
        """``(method, plan, budget bytes, step peak, unplanned step peak)`` for ``trace``."""
        graph = trace.graph
        costs = costs_of(trace)
        held = costs.fixed_bytes  # parameters, gradients, buffers, state, held output, slack

        def step_peak(plan: GraphPlan) -> int:
            return graph_step_peak(graph, plan, costs)

        unplanned = step_peak(GraphPlan.none())
        total = None if spec is None else resolve_budget(spec, unplanned)
        # the optimizer step: every gradient, the batch and the step's temporaries (no plan)
        optimizer_phase = costs.optimizer_phase_bytes
        if total is not None and step_bytes and optimizer_phase > total:
            # named minimum: feasible with every gradient counted live (reforward's least peak)
            least = simulate_graph(graph, plan_graph(graph, "reforward")).peak_bytes
            raise _optimizer_step_too_large(
                total,
                max(optimizer_phase, held + least),
                "checkmate-milp",
                optimizer_phase,
                step_bytes,
            )
        if total is None:
            method = "reforward"
            chosen = plan_graph(graph, method)
            forward = sum(node.fwd_time for node in graph.nodes)
            none_time = simulate_graph(graph, GraphPlan.none()).total_time
            if simulate_graph(graph, chosen).total_time > none_time + forward:
                method, chosen = "none", GraphPlan.none()
        else:
            method, chosen = _fastest_fitting_graph_plan(graph, costs, total, step_peak)
        return method, chosen, total, step_peak(chosen), unplanned

    trace = trace_graph(model, batch, loss_fn=loss_fn, level="module")
    graph = trace.graph
    method, chosen, total, peak, unplanned = plan_traced(trace, budget)
    spec = _replan_budget(budget, total)

    def measure_loss() -> tuple[int, int]:
        proxy = trace_graph(model, _model_arguments(model, loss_fn, batch), call_loss, "module")
        proxy_unplanned = graph_step_peak(proxy.graph, GraphPlan.none(), costs_of(proxy))
        return unplanned - proxy_unplanned, proxy.graph.input_bytes

    margin = _loss_margin(loss_fn, measure_loss)

    def replan(*args: Any, **kwargs: Any) -> tuple[GraphPlan, Any]:
        new = trace_graph(model, (args, kwargs), loss_fn=call_loss, level="module")
        held = margin(new.graph.input_bytes)
        if held:
            more = dataclasses.replace(new.graph, input_bytes=new.graph.input_bytes + held)
            new = dataclasses.replace(new, graph=more)
        with _for_new_inputs(args, kwargs):
            return plan_traced(new, spec)[1], new.graph

    planned = apply_graph(model, chosen, graph, batch, loss_fn, replan=replan)
    sim = simulate_graph(graph, chosen)
    none = simulate_graph(graph, GraphPlan.none())
    summary = AutoSummary.of(
        method,
        chosen,
        graph,
        total,
        fixed,
        sim,
        none,
        peak,
        unplanned,
        loop=loop,
        output_held_bytes=costs_of(trace).output_held_bytes,
    )
    return planned, summary


def _replan_budget(budget: Any, total: int | None) -> int | float | None:
    """The budget a new input shape is planned for: the same bytes (a percentage is read
    once, against the planning batch's unplanned peak), or no limit again for ``inf``."""
    if isinstance(budget, float) and budget == float("inf"):
        return budget
    return total


def _loss_margin(
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    measure: Callable[[], tuple[int, int]],
) -> Callable[[int], int]:
    """Bytes a re-plan holds back for the user's ``loss_fn``, as a function of the new inputs'
    bytes (chain and graph paths).

    A re-plan sees only the model's arguments, so it measures the step with
    :func:`remat.runtime.call_loss` (the output's ``.loss`` or its sum); a ``loss_fn`` such as
    a cross-entropy on the logits keeps more (its log-softmax and the logits' gradient).
    ``measure()`` gives, at the planning batch, the unplanned step's peak with the user's loss
    minus that with ``call_loss`` (at least 0) and the inputs' bytes it was measured at; it is
    called once, at the first re-plan, and scaled linearly with the inputs' bytes (a loss's
    memory grows with the batch and the sequence). Counted as live all step (an input's
    bytes): an over-estimate, never an under-estimate, at the shapes it was measured for."""
    cache: list[tuple[int, int]] = []

    def margin(input_bytes: int) -> int:
        if loss_fn is None:  # the default loss is call_loss on the batch's arguments
            return 0
        if not cache:
            cache.append(measure())
        extra, planning_bytes = cache[0]
        if extra <= 0:
            return 0
        return -(-extra * input_bytes // max(1, planning_bytes))

    return margin


@contextlib.contextmanager
def _for_new_inputs(args: tuple, kwargs: dict) -> Iterator[None]:
    """A budget too small for a re-planned input shape says which shape."""
    from remat.planners import BudgetTooSmallError
    from remat.runtime import _describe_signature, input_signature

    try:
        yield
    except BudgetTooSmallError as err:
        shape = _describe_signature(input_signature(*args, **kwargs))
        raise BudgetTooSmallError(
            err.budget_bytes,
            err.minimum_bytes,
            err.method,
            f"re-planning the training step for the new inputs {shape}: the plan depends on "
            "the batch shape; raise the budget to the minimum or call the model on smaller "
            "inputs",
            kind="whole-step",
        ) from err


def auto(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    budget: int | str | None = None,
    method: str = "optimal-time",
    optimizer: torch.optim.Optimizer | None = None,
    stages: list[str] | None = None,
    loop: str = "output-held",
) -> tuple[nn.Module, AutoSummary]:
    """Capture, plan and apply in one call; returns ``(planned_model, summary)``.

    ``budget`` is the total peak of the training step (what the device must hold: parameters,
    gradients, optimizer state and activations), as bytes, a string like ``"4GiB"``, or a
    percentage of the unplanned step's predicted peak such as ``"50%"``
    (:func:`remat.units.resolve_budget`; ``float("inf")``: no limit, the unplanned peak). remat
    subtracts what no plan changes and plans the rest. With ``budget=None`` it picks the plan
    with the least memory whose time overhead stays at most one extra forward.

    The plan is for the model's arguments in ``batch`` (what ``loss_fn`` calls the model
    with); a training call with other input shapes re-plans for them under the same budget and
    planner (module docstring), or raises :class:`~remat.planners.BudgetTooSmallError` naming
    the minimum for that shape.

    ``loop`` is the training loop the budget must hold for (:data:`remat.step.LOOPS`):

    * ``"output-held"`` (default): the loop keeps the model's output through the backward and
      the optimizer step, as PyTorch's own examples do
      (``out = model(x); loss = crit(out, y); loss.backward(); opt.step()``, or
      ``out = model(**batch); out.loss.backward()``, which keeps ``out.logits``); its bytes
      (measured at capture: the logits of a language model) are counted for the whole step;
    * ``"loss-only"``: the loop keeps only the loss (``loss = crit(model(x), y)``,
      ``loss = model(**batch).loss``, ``loss = loss_fn(model, batch)``); the output is freed
      once the loss is computed. A budget made for it is exceeded by a loop that holds the
      output.

    The summary says which loop was assumed.
    """
    from remat.capture import _model_arguments, capture
    from remat.profile import default_loss_fn, optimizer_costs
    from remat.runtime import apply, call_loss

    check_loop(loop)
    check_not_wrapped(model, "remat.auto")  # wrap the planned model in DDP/FSDP afterwards
    check_no_own_checkpointing(model)  # before the graph fallback below, which would hide it
    try:
        captured = capture(model, batch, loss_fn=loss_fn, stages=stages)
    except UnsupportedModelError as err:
        if stages is not None:
            raise
        return _auto_graph(model, batch, loss_fn, budget, optimizer, str(err), loop)
    chain = captured.chain
    fixed = fixed_bytes(model, optimizer)
    _, step_bytes = optimizer_costs(model, optimizer)
    grads = stage_grad_bytes(captured.stages)
    slack = SCRATCH_MIN_BYTES  # allocator-only bytes no capture counts (wrapped scalars)

    def costs_of(new: Captured) -> StepCosts:
        return StepCosts(
            persistent_bytes=fixed - sum(grads),
            grad_bytes=tuple(grads),
            grad_rise_bytes=tuple(new.grad_rise_bytes or ()),
            optimizer_step_bytes=step_bytes,
            output_held_bytes=output_held_bytes(
                loop, new.output_bytes, _criterion_bytes(loss_fn, batch, new)
            ),
            input_bytes=new.chain.input_bytes,
            slack_bytes=slack,
        )

    def unplanned_peak(new: Captured) -> int:
        return chain_step_peak(new.chain, Plan.none(new.chain), costs_of(new))

    def plan_captured(new: Captured, spec: int | float | str | None) -> tuple[Plan, int | None]:
        total = None if spec is None else resolve_budget(spec, lambda: unplanned_peak(new))
        plan = plan_for_total_budget(
            new.chain,
            fixed,
            total,
            method,
            grads,
            new.grad_rise_bytes,
            step_bytes,
            output_held_bytes(loop, new.output_bytes, _criterion_bytes(loss_fn, batch, new)),
            slack,
        )
        return plan, total

    from remat.planners import BudgetTooSmallError
    from remat.stages.families.blocks import KIND as GENERIC_KIND

    try:
        chosen, total = plan_captured(captured, budget)
    except BudgetTooSmallError as err:
        if captured.stages.kind != GENERIC_KIND or stages is not None:
            raise
        # the generic stages (remat.stages.families.blocks) are one way to see the model: the
        # module graph may fit a budget they do not; the error names the lower minimum
        try:
            why = f"its stages around a list of blocks do not fit the budget: {err}"
            return _auto_graph(model, batch, loss_fn, budget, optimizer, why, loop)
        except BudgetTooSmallError as graph_err:
            raise (err if err.minimum_bytes <= graph_err.minimum_bytes else graph_err) from None
    spec = _replan_budget(budget, total)
    example = _model_arguments(model, loss_fn or default_loss_fn, batch)

    def measure_loss() -> tuple[int, int]:
        proxy = capture(model, example, loss_fn=call_loss, stages=stages)
        return unplanned_peak(captured) - unplanned_peak(proxy), proxy.chain.input_bytes

    margin = _loss_margin(loss_fn, measure_loss)

    def replan(*args: Any, **kwargs: Any) -> Plan:
        new = capture(model, (args, kwargs), loss_fn=call_loss, stages=stages)
        held = margin(new.chain.input_bytes)
        if held:
            chain = dataclasses.replace(new.chain, input_bytes=new.chain.input_bytes + held)
            new = dataclasses.replace(new, chain=chain)
        with _for_new_inputs(args, kwargs):
            return plan_captured(new, spec)[0]

    planned = apply(model, chosen, stages=captured.stages, example=example, replan=replan)
    none = simulate(chain, Plan.none(chain))
    sim = simulate(chain, chosen)
    summary = AutoSummary.of(
        method,
        chosen,
        chain,
        total,
        fixed,
        sim,
        none,
        chain_step_peak(chain, chosen, costs_of(captured)),
        unplanned_peak(captured),
        loop=loop,
        output_held_bytes=costs_of(captured).output_held_bytes,
    )
    return planned, summary
