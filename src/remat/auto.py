"""One line: ``planned, summary = remat.auto(model, batch, budget="4GiB")``.

:func:`auto` captures the model as a chain (measured costs), subtracts what no plan changes
(parameters, their gradients, buffers, optimizer state, and the model output the training loop
holds: ``loop="output-held"`` by default, see :mod:`remat.core.step`) from the budget, plans the
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
:class:`remat.execute.chain.SignaturePlans`), or raises
:class:`~remat.planners.BudgetTooSmallError` naming the minimum for that shape. A re-plan sees
only the model's arguments, so it measures the loss as :func:`remat.execute.chain.call_loss` does
(the output's ``.loss`` or its sum), not a ``loss_fn`` of the batch. A training call made with
every parameter gradient already held (gradient accumulation over microbatches, a loop without
``zero_grad(set_to_none=True)``), or after parameters were frozen or unfrozen, is re-planned
for that state too (:func:`remat.execute.chain.step_state`), or refused naming its minimum. A model that cannot be split into
stages (branches, skips across blocks) is planned as a module graph instead, with a warning:
``checkmate-milp`` under the budget, Re-forwarding without one, run by the graph executor
(that path counts every parameter gradient for the whole backward, and its plan is made for
the batch shape it was captured at). With ``stages=`` named, a model that does not split raises
:class:`remat.capture.stages.UnsupportedModelError` with what to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from remat.capture.chain import Captured, _model_call, autocast_now, autocast_regions, capture
from remat.capture.graph import GraphTrace, trace_graph
from remat.capture.stages.base import grad_parameters
from remat.capture.stages.families.blocks import KIND as GENERIC_KIND
from remat.core.chain import Chain
from remat.core.chain_simulate import simulate
from remat.core.errors import UnsupportedModelError
from remat.core.plan import Plan
from remat.core.step import LOOPS, StepCosts, check_loop, criterion_costs, output_held_bytes
from remat.core.units import format_bytes, parse_bytes, resolve_budget
from remat.execute.chain import (
    PARTITIONER_SOLVERS,
    apply,
    as_one_graph,
    call_loss,
    compile_options,
    describe_compiled,
    partitioner_budget,
    partitioner_solver,
    replanning_state,
    step_state,
    with_eager_stages,
    with_partitioner_budget,
)
from remat.execute.graph import apply_graph
from remat.graphs import graph_step_peak, simulate_graph
from remat.guards import (
    BatchCopy,
    BufferSnapshot,
    check_no_own_checkpointing,
    check_not_wrapped,
    describe_signature,
    input_signature,
    signature_no_smaller,
)
from remat.measure.calibration import planning_device, time_model_for
from remat.measure.events import (
    allocated_bytes,
    allocation_bytes,
    cuda_step_peak_bytes,
    device_library_bytes,
    garbage_collected,
    interleaved_times,
    older_objects_frozen,
    step_peak_bytes,
)
from remat.measure.profile import default_loss_fn, optimizer_costs
from remat.planners import BudgetTooSmallError, plan_chain
from remat.planning import (
    chain_timeline,
    measured_step_peak_of,
    plan_for_step,
    step_peak_of,
    unit_time_least_plan,
)

if TYPE_CHECKING:
    from remat.capture.chain import Captured

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
    "step_costs",
]


@dataclass(frozen=True)
class AutoSummary:
    """What :func:`auto` decided and what it predicts."""

    method: str
    """Planner used."""
    plan: Plan
    """The plan applied (its segments name the module graph's nodes when the model is not a chain)."""
    chain: Chain
    """The measured chain the plan was made for (a :class:`remat.graphs.Graph` when the
    model is not a chain)."""
    budget_bytes: int | None
    """The total budget asked for (None: least memory at <= one extra forward)."""
    fixed_bytes: int
    """Parameters + gradients + buffers + optimizer state (+ on a GPU the libraries' workspaces,
    :func:`remat.measure.events.device_library_bytes`): memory no plan changes."""
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
    """The training loop the prediction assumes (:data:`remat.core.step.LOOPS`): ``"output-held"``
    or ``"loss-only"``; None where the model output is not modelled."""
    output_held_bytes: int = 0
    """Bytes of the model output the assumed loop keeps through the step (in the peaks)."""
    criterion_bytes: int = 0
    """The bound counted at the loss for a criterion the loop applies to the output and remat
    did not see (no ``loss_fn``: :attr:`remat.core.step.StepCosts.criterion_peak_bytes`; 0 where
    the captured loss is the loop's)."""
    fake: bool = False
    """True when the costs were captured under fake tensors (``auto(..., fake=True)``: no
    eager step run, times from the calibrated cost model of :mod:`remat.measure.calibration`)."""
    compiled: str | None = None
    """How the planned step runs compiled (``compile=``): ``"one-graph"`` (the whole forward
    one graph, its peak measured: NOTE [ One compiled graph ]), ``"per-stage"`` (each stage
    its own graph, predicted from the chain), None when not compiled."""
    one_graph_over_bytes: int | None = None
    """With ``compile=``: the bytes the one-graph compiled step of the plan measured above the
    chain's prediction of the same step (negative: below it; in :attr:`predicted_peak_bytes`
    when ``compiled == "one-graph"``, on the forward and backward only:
    :func:`remat.core.step.measured_step_peak`). None when not measured."""
    compiled_note: str = ""
    """The one-graph trials that did not fit, with their bytes (why a compiled plan runs a
    graph per stage, or which plans one graph was tried on first; below the chain's least,
    the least plans measured as one graph)."""

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
        fake: bool = False,
        criterion_bytes: int = 0,
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
            fake=fake,
            criterion_bytes=criterion_bytes,
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
                "  costs: "
                + (
                    "fake tensors (no eager step run), times from the calibrated cost model"
                    if self.fake
                    else "measured on an eager step"
                ),
                *self._compiled_lines(),
            ]
        )

    def _compiled_lines(self) -> list[str]:
        if self.compiled is None:
            return []
        if self.compiled == "one-graph":
            over = self.one_graph_over_bytes or 0
            where = "above" if over >= 0 else "below"
            text = (
                f"one graph (its step measured: {format_bytes(abs(over))} {where} the stages' "
                "prediction, counted on the forward and backward)"
            )
            knob = partitioner_budget(self.plan)
            if knob is not None:
                solved = {"ilp": "exactly", "dp": "by torch's DP, as torch.compile does"}
                text += (
                    f", compiled with the partitioner's activation_memory_budget={knob:g} "
                    f"(its own recomputation, its knapsack solved {solved[partitioner_solver(self.plan)]})"
                )
            if self.compiled_note:
                text += f"; {self.compiled_note}"
        else:
            text = f"a graph per stage ({self.compiled_note or 'predicted from the stages'})"
        return [f"  compiled: {text}"]

    def _loop_text(self) -> str:
        if self.loop is None:
            return "not modelled (the model's output is not counted)"
        text = f"{self.loop!r}: {LOOPS.get(self.loop, '?')}"
        if self.loop == "output-held":
            text += f"; {format_bytes(self.output_held_bytes)} counted all step"
            text += " (loop='loss-only' if your loop keeps only the loss)"
        if self.criterion_bytes:
            text += (
                f"; {format_bytes(self.criterion_bytes)} counted at the loss for your criterion"
                " on the output, which remat did not see (pass loss_fn to have it measured)"
            )
        return text


def fixed_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes no plan changes: parameters, their gradients, buffers and optimizer state, and on a
    GPU the libraries' workspaces (:func:`remat.measure.events.device_library_bytes`).

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
            total += allocation_bytes(p)  # its gradient
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
    device = next((p.device for p in model.parameters()), None)
    return total + device_library_bytes(device)


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
    return copies * sum(allocation_bytes(p) for p in params) + (
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
) -> Plan:
    """Plan ``chain`` so that the whole training step's peak fits ``budget``: the
    :class:`~remat.core.step.StepCosts` of these numbers given to
    :func:`remat.planning.plan_for_step` (the one budget search; its docstring says which plans
    it weighs and what its :class:`~remat.planners.BudgetTooSmallError` names), with the
    executor's :func:`checkpoint_state_bytes` per checkpointed segment.

    ``fixed`` is what no plan changes (parameters, their gradients, buffers, optimizer state).
    ``grad_bytes``: the parameter-gradient bytes each stage's backward allocates
    (:func:`stage_grad_bytes`), counted as the backward makes them (during each stage's
    backward ``grad_rise_bytes`` of them, :attr:`remat.capture.chain.Captured.grad_rise_bytes`);
    without them every gradient is counted live all step (the safe reading).
    ``optimizer_step_bytes``: the temporaries of one optimizer step
    (:func:`remat.measure.profile.optimizer_costs`); ``output_held_bytes``: the model output the
    training loop keeps (:mod:`remat.core.step`). ``budget=None``: the plan with the least
    activation peak whose predicted time is at most the unplanned time plus one forward.
    """
    grads = tuple(grad_bytes) if grad_bytes is not None else (0,) * chain.n
    costs = StepCosts(
        persistent_bytes=fixed - sum(grads),
        grad_bytes=grads,
        grad_rise_bytes=tuple(grad_rise_bytes or ()) if grad_bytes is not None else (),
        optimizer_step_bytes=optimizer_step_bytes,
        output_held_bytes=output_held_bytes,
        input_bytes=chain.input_bytes,
        checkpoint_state_bytes=checkpoint_state_bytes(),
    )
    return plan_for_step(chain, costs, budget, method)  # type: ignore[return-value]


def total_peak_bytes(
    chain: Chain,
    plan: Plan,
    persistent: int,
    grad_bytes: Sequence[int],
    grad_rise_bytes: Sequence[int] | None = None,
    segment_state_bytes: int | None = None,
    optimizer_step_bytes: int = 0,
    output_held_bytes: int = 0,
    scalars: dict[str, Any] | None = None,
) -> int:
    """The whole step's predicted peak (:func:`remat.core.step.step_peak` over the chain's simulated
    timeline): ``persistent`` bytes (parameters, buffers, optimizer state) + the model output
    the loop holds (``output_held_bytes``, :mod:`remat.core.step`) + the parameter gradients made so
    far + the plan's live activation bytes, maximised over the simulated timeline, +
    ``segment_state_bytes`` per checkpointed segment (default: the CPU RNG state,
    :func:`checkpoint_state_bytes`, that the executor's checkpoints keep to replay dropout;
    counted from each segment's forward to its backward, :func:`remat.core.step.step_peak`). A stage's gradients count from its first backward on: during that backward they
    add ``grad_rise_bytes[i]`` (measured by :func:`remat.capture.chain.capture`: a weight gradient is
    often made after the backward's activation peak), after it all of ``grad_bytes[i]``;
    without ``grad_rise_bytes``, all of it during the backward too. The step ends with the
    optimizer step: every gradient, the batch, the held output and ``optimizer_step_bytes`` of
    its temporaries (:func:`remat.measure.profile.optimizer_costs`). ``scalars``:
    :func:`scalar_costs` of the capture (none: not counted)."""
    costs = StepCosts(
        persistent_bytes=persistent,
        grad_bytes=tuple(grad_bytes),
        grad_rise_bytes=tuple(grad_rise_bytes or ()),
        optimizer_step_bytes=optimizer_step_bytes,
        output_held_bytes=output_held_bytes,
        input_bytes=chain.input_bytes,
        **(scalars or {}),
    )
    return chain_step_peak(chain, plan, costs, segment_state_bytes)


def scalar_costs(
    captured: Captured | GraphTrace, device: torch.device | None = None
) -> dict[str, Any]:
    """The :class:`~remat.core.step.StepCosts` fields of the small tensors a capture's stage
    or node costs leave out, counted where they live (chain and graph paths alike): the
    wrapped scalars each stage's or node's forward keeps (``forward_kept_bytes``:
    :attr:`remat.capture.chain.Captured.forward_kept_bytes`,
    :attr:`remat.capture.graph.GraphTrace.forward_kept_bytes`), the allocator-only bytes below
    1 KiB at its peaks (``small_scratch_bytes``) and the loss with its gradient seed
    (``loss_bytes``, :attr:`remat.core.step.StepCosts.loss_bytes`; on CUDA ``device``'s
    allocator block each takes, :func:`remat.measure.events.allocated_bytes`)."""
    kept = captured.forward_kept_bytes
    small = captured.small_scratch_bytes
    graph = isinstance(captured, GraphTrace)
    return {
        "forward_kept_bytes": kept if any(kept) else (),
        "recompute_kept_bytes": () if graph else captured.recompute_kept_bytes,
        "buffer_copy_bytes": () if graph else captured.buffer_copy_bytes,
        "carried_grads": () if graph else captured.carried_grads,
        "forward_only_bytes": 0 if graph else captured.forward_only_bytes,
        "op_scratch_bytes": small if any(f or b for f, b in small) else (),
        "loss_bytes": allocated_bytes(captured.loss_bytes, device),
    }


def _device(model: nn.Module) -> torch.device | None:
    """The device of ``model``'s first parameter (None without parameters)."""
    return next((p.device for p in model.parameters()), None)


def chain_step_peak(
    chain: Chain, plan: Plan, costs: StepCosts, segment_state_bytes: int | None = None
) -> int:
    """:func:`remat.planning.step_peak_of` of ``plan`` on ``chain``, with
    ``segment_state_bytes`` per checkpointed segment (default: ``costs``' own
    ``checkpoint_state_bytes`` when set, else :func:`checkpoint_state_bytes`)."""
    if segment_state_bytes is None:
        segment_state_bytes = costs.checkpoint_state_bytes or checkpoint_state_bytes()
    costs = dataclasses.replace(costs, checkpoint_state_bytes=segment_state_bytes)
    return step_peak_of(chain, plan, costs)


def checkpoint_state_bytes() -> int:
    """Bytes each checkpointed segment of the executor keeps until its backward: the CPU RNG
    state (``torch.get_rng_state()``, 5,056 bytes), saved so that recomputed dropout draws the
    same masks (CUDA RNG states are a few bytes more, also in host memory). The graph executor
    keeps one per random call inside a checkpointed segment instead, and one while replaying
    (:attr:`remat.core.step.StepCosts.checkpoint_states`)."""
    return torch.get_rng_state().numel()


def predicted_step_peak_bytes(
    model: nn.Module,
    captured: Captured,
    plan: Plan,
    optimizer: torch.optim.Optimizer | None = None,
    loop: str = "loss-only",
) -> int:
    """The whole training step's predicted peak for ``plan`` on a model captured by
    :func:`remat.capture.chain.capture` (:func:`total_peak_bytes` with the model's fixed bytes and,
    with an optimizer, its step's temporaries; with ``loop="output-held"`` the model output the
    loop keeps, :data:`remat.core.step.LOOPS`); compare it with
    :func:`remat.measure.events.step_peak_bytes` of the planned step."""

    # the step runs the loss the capture ran: no criterion of the loop's own to add
    costs = step_costs(captured, model, optimizer, loop=loop, loss_fn=default_loss_fn)
    return step_peak_of(captured.chain, plan, costs)


def stage_grad_bytes(stages: Any, made: Sequence[Collection[int]] = ()) -> list[int]:
    """Parameter-gradient bytes each stage's backward allocates (a parameter shared by several
    stages, such as tied embeddings, is counted at the last of them: the backward reaches it
    first). ``made``: per stage, the ids of the parameters whose gradients its backward made
    as captured (:attr:`remat.capture.chain.Captured.grad_made`); a parameter among them is
    counted at the last stage that made it, the others at the last stage whose modules hold it
    (NOTE [ The gradients a stage's backward makes ] in remat.capture.chain)."""

    owner: dict[int, tuple[int, int]] = {}
    for index, module in enumerate(stages.modules):
        for p in grad_parameters(module):
            if p.requires_grad:
                owner[id(p)] = (index, allocation_bytes(p))
    for index, ids in enumerate(made):
        for key in ids:
            if key in owner:
                owner[key] = (index, owner[key][1])
    result = [0] * len(stages.modules)
    for index, nbytes in owner.values():
        result[index] += nbytes
    return result


def _criterion(loss_fn: Any, batch: Any, captured: Any, loop: str) -> dict[str, int]:
    """The :class:`~remat.core.step.StepCosts` fields of the loop's own criterion where remat
    did not capture it (no ``loss_fn``, no ``labels`` in a dict batch, no ``.loss`` in the
    output: a model that computes its own loss, a Hugging Face model given labels, ran it in
    the capture): an upper bound over the common criteria applied to the largest output tensor
    (:func:`remat.core.step.criterion_costs`)."""
    if (
        loss_fn is not None
        or (isinstance(batch, Mapping) and batch.get("labels") is not None)
        or captured.output_has_loss
    ):
        return {}
    peak, grad = criterion_costs(loop, captured.largest_output_bytes)
    return {"criterion_peak_bytes": peak, "output_grad_bytes": grad}


def step_costs(
    captured: Captured | GraphTrace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    loop: str = "loss-only",
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    batch: Any = None,
    now: _Trained | None = None,
) -> StepCosts:
    """The one whole-step model's costs (:class:`remat.core.step.StepCosts`) of a capture: the
    chain path's (:func:`remat.capture.chain.capture`) and the graph path's
    (:func:`remat.capture.graph.trace_graph`) alike, for :func:`auto`, :func:`remat.fit.fit`
    and :func:`remat.distributed.auto_distributed`.

    What no plan changes (:func:`fixed_bytes`), less the parameter gradients, counted as the
    backward makes them (per stage or node, with the capture's ``grad_rise_bytes``); the
    optimizer step's temporaries (:func:`remat.measure.profile.optimizer_costs`); the output
    ``loop`` holds; the capture's small tensors (:func:`scalar_costs`); the loop's own
    criterion where the capture did not run it (``loss_fn``, ``batch``); the executor's
    checkpoint states (the chain executor's one per checkpointed segment, the graph
    executor's one per random call). ``now``: the model as it is at a training call (a
    re-plan, :func:`_trained_now`) instead of ``model`` and ``optimizer`` before training."""
    graph = isinstance(captured, GraphTrace)
    if now is None:
        grads = (
            list(captured.param_grad_bytes)
            if graph
            else stage_grad_bytes(captured.stages, captured.grad_made)
        )
        now = _Trained(
            fixed_bytes(model, optimizer), grads, optimizer_costs(model, optimizer)[1], False
        )
    scalars = scalar_costs(captured, _device(model))
    criterion = _criterion(loss_fn, batch, captured, loop)
    if criterion:
        # the loop's loss is its own criterion's, in a dtype the capture did not see: at least
        # a float32 scalar (a bfloat16 model's cross-entropy on its logits made float measured
        # 4 B above the prediction that took the bfloat16 sum's loss and seed)
        scalars["loss_bytes"] = max(scalars["loss_bytes"], allocated_bytes(4, _device(model)))
    return StepCosts(
        # with what the program keeps of a step past its end (a hook's feature dict)
        persistent_bytes=now.fixed - sum(now.grads) + captured.held_past_step_bytes,
        grad_bytes=tuple(now.grads),
        grad_rise_bytes=tuple(captured.grad_rise_bytes or ()),
        optimizer_step_bytes=now.step_bytes,
        grads_live=now.live,
        output_held_bytes=output_held_bytes(loop, captured.output_bytes),
        input_bytes=captured.graph.input_bytes if graph else captured.chain.input_bytes,
        **scalars,
        checkpoint_state_bytes=checkpoint_state_bytes(),
        checkpoint_states="per-random-call" if graph else "per-segment",
        **criterion,
    )


def _auto_graph(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    budget: int | str | None,
    optimizer: torch.optim.Optimizer | None,
    why: str,
    loop: str = "output-held",
    fake: bool = False,
) -> tuple[nn.Module, AutoSummary]:
    """:func:`auto` for a model that is not a chain: capture its module graph, plan it with
    ``checkmate-milp`` under the activation budget, or, without a budget, take Re-forwarding's
    least-memory plan when it costs at most one extra forward (else the unplanned one), and run
    it with the graph executor (docs/graph-executor.md).

    With a budget, :func:`remat.planning.plan_for_step` (the one budget search) weighs the
    MILP's plans for the activation budget left beside what the step holds and for the safe
    reading, Re-forwarding's least-memory plan and the unplanned one, each checked exactly
    (gradients as the backward makes them). ``fake``: captured under fake tensors
    (:func:`_capture_options`)."""
    warnings.warn(
        f"remat.auto: {why.splitlines()[0]}; planning its "
        "module graph instead (checkmate-milp / reforward, graph executor)",
        stacklevel=3,
    )
    fixed = fixed_bytes(model, optimizer)
    _, step_bytes = optimizer_costs(model, optimizer)

    def costs_of(trace: Any, now: _Trained | None = None) -> StepCosts:
        before = _Trained(fixed, list(trace.param_grad_bytes), step_bytes, False)
        return step_costs(trace, model, loop=loop, loss_fn=loss_fn, batch=batch, now=now or before)

    def plan_traced(
        trace: Any, spec: int | float | str | None, now: _Trained | None = None
    ) -> tuple[Any, ...]:
        """``(method, plan, budget bytes, step peak, unplanned step peak)`` for ``trace``."""
        graph = trace.graph
        costs = costs_of(trace, now)
        unplanned = step_peak_of(graph, Plan.none(), costs)
        total = None if spec is None else resolve_budget(spec, unplanned)
        chosen = plan_for_step(graph, costs, total)  # checkmate-milp / reforward / none
        return chosen.method, chosen, total, step_peak_of(graph, chosen, costs), unplanned

    trace, options = _first_capture(
        model, fake, lambda o: trace_graph(model, batch, loss_fn=loss_fn, level="module", **o)
    )
    graph = trace.graph
    method, chosen, total, peak, unplanned = plan_traced(trace, budget)
    spec = _replan_budget(budget, total)

    call_args, call_kwargs, called = _model_call(model, loss_fn or default_loss_fn, batch)
    measured: dict[tuple, _Measured] = {}  # (NOTE [ A re-plan for the gradients held ])

    def traced(args: tuple, kwargs: dict) -> GraphTrace:
        # the step of the call (args, kwargs) with call_loss, as a re-plan plans it
        trace = lambda: trace_graph(model, (args, kwargs), call_loss, "module", **options)  # noqa: E731
        return _measured_for(measured, model, (args, kwargs), trace).captured

    def measure_loss() -> tuple[int, int]:
        # (as _auto's)
        user = unplanned
        if autocast_now() != called:
            again = trace_graph(model, batch, loss_fn=loss_fn, level="module", **options)
            user = graph_step_peak(again.graph, Plan.none(), costs_of(again))
        proxy = traced(call_args, call_kwargs)
        proxy_unplanned = graph_step_peak(proxy.graph, Plan.none(), costs_of(proxy))
        return user - proxy_unplanned, proxy.graph.input_bytes

    margin = _loss_margin(loss_fn, measure_loss)

    @older_objects_frozen()
    def replan(*args: Any, **kwargs: Any) -> tuple[Plan, Any]:
        # (always the call's arguments and call_loss: the graph executor runs a graph traced
        # from the call it is given, and checks it; _auto's re-plan takes the user's loss where
        # the shapes are the planning batch's)
        new = traced(args, kwargs)
        held = margin(new.graph.input_bytes)
        if held:
            more = dataclasses.replace(new.graph, input_bytes=new.graph.input_bytes + held)
            new = dataclasses.replace(new, graph=more)
        now = _trained_now(model, optimizer, list(new.param_grad_bytes))
        with _for_new_inputs(args, kwargs, now.live):
            return plan_traced(new, spec, now)[1], new.graph

    replan.plans_for_step_state = True  # type: ignore[attr-defined]

    with autocast_regions(called):  # (as in _auto's build)
        planned = apply_graph(model, chosen, graph, batch, loss_fn, replan=replan)
    sim = simulate_graph(graph, chosen)
    none = simulate_graph(graph, Plan.none())
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
        fake=bool(options),
        criterion_bytes=costs_of(trace).criterion_peak_bytes,
    )
    return planned, summary


def _replan_call(
    args: tuple, kwargs: dict, signature: tuple, batch: Any, loss_fn: Any
) -> tuple[Any, Any, bool]:
    """``(inputs, loss_fn, same)`` :func:`auto`'s re-plan for the model call ``(args, kwargs)``
    captures the step with (chain path). The planning batch's shapes (``signature``) in
    another step state (autocast on, a layer unfrozen, gradients accumulated: ``same``): the
    user's ``loss_fn`` on the planning batch, exactly. Other shapes: the call's arguments and
    :func:`~remat.execute.chain.call_loss`, the user's loss's bytes held back
    (:func:`_loss_margin`)."""
    if input_signature(*args, **kwargs) == signature:
        return batch, loss_fn, True
    return (args, kwargs), call_loss, False


@dataclass
class _Measured:
    """A step :func:`auto` captured (chain path: a :class:`Captured`; graph path: a
    :class:`GraphTrace`), and the peaks of the one-graph trials measured on it (compiled), by
    :func:`describe_compiled`. A re-plan whose step differs from one measured before only by
    the gradients held at its start reuses them (NOTE [ A re-plan for the gradients held ])."""

    captured: Any
    peaks: dict[str, int] = dataclasses.field(default_factory=dict)


# NOTE [ A re-plan for the gradients held ]: a training call with every parameter gradient
# already held (the second microbatch of gradient accumulation: Hugging Face's Trainer with
# gradient_accumulation_steps > 1, or a loop without zero_grad(set_to_none=True)) is planned
# again for that state (remat.execute.chain.step_state), with less room for activations. The
# capture and the one-graph trials' peaks do not depend on it: both run their steps with the
# gradients set aside (the capture stashes them, :func:`_trial_steps` sets them to None), and
# the held gradients enter the plan through the step's costs (``_Trained.live``). So such a
# re-plan reuses the capture and the peaks measured at the same inputs, parameters that train
# and autocast regions, with the model's modules in the same mode (train or eval) and its
# parameters of the same shapes, dtypes and devices (:func:`_measured_key`), and compiles and
# measures only the plans not measured there. Compiled (aot_eager_decomp_partition, a tiny BERT
# under the Trainer) the re-plan for the second microbatch captured and compiled the stages and
# nine one-graph trials again before.
def _measured_key(model: nn.Module, signature: tuple, trains: tuple, autocast: Any) -> tuple:
    """What a step's capture and its one-graph peaks depend on beside the gradients held at
    its start: the inputs' shapes, the parameters that train, the autocast regions, and the
    model's modes and parameters' layouts."""
    modes = tuple(m.training for m in model.modules())
    layouts = tuple((p.shape, p.dtype, p.device) for p in model.parameters())
    return signature, trains, autocast, modes, layouts


# NOTE [ A call again at the minimum named ]: a compiled refusal compiles and measures every
# one-graph plan to name the least whole step (:meth:`_StepModel.fit_below_least`), and the
# user's next call, at the minimum it named, used to capture the stages and compile and measure
# the same graphs again (a LoRA GPT-2 under aot_eager_decomp_partition: the refusal and the
# call at its minimum each measured every plan). A compiled call now starts from the capture
# and one-graph peaks of the model's last compiled call where both are made for the same step:
# the same loss_fn, modules, stages, compile options and capture options, and the same
# :func:`_measured_key` (inputs' shapes, parameters that train, autocast regions, modes,
# parameters' layouts). A plan measured there is not compiled again to be weighed; the graph
# that runs is compiled and measured in this call, and where it holds more than it did there
# (the model changed in a way the key does not see) the call starts again from a fresh capture.
# The record lives on the model (:class:`_LastCall`), so it goes with it, and neither a copy
# nor a pickle of the model carries it.
_LAST_CALL = "_remat_auto_last_call"


class _LastCall:
    """What the model's last compiled :func:`auto` call planned on: its key (:func:`_call_key`),
    the capture options, and its first step's :class:`_Measured` (NOTE [ A call again at the
    minimum named ]). Not copied with the model, nor pickled."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.options: dict[str, Any] = {}
        self.first: _Measured | None = None

    def __deepcopy__(self, memo: dict) -> _LastCall:
        return _LastCall()

    def __reduce__(self) -> tuple:
        return (_LastCall, ())

    def of(self, key: tuple) -> tuple[_Measured, dict[str, Any]] | None:
        """The step measured for ``key`` and its capture options, or None."""
        if self.first is None or self.key != key:
            return None
        return self.first, self.options

    def keep(self, key: tuple, first: _Measured, options: dict[str, Any]) -> None:
        self.key, self.first, self.options = key, first, options

    def forget(self) -> None:
        self.key, self.first, self.options = None, None, {}


def _last_call(model: nn.Module) -> _LastCall:
    """The model's :class:`_LastCall`, made on first use (an attribute that is neither a
    parameter, a buffer nor a module: not in the state dict)."""
    last = model.__dict__.get(_LAST_CALL)
    if not isinstance(last, _LastCall):
        last = _LastCall()
        object.__setattr__(model, _LAST_CALL, last)
    return last


def _call_key(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    stages: list[str] | None,
    options: Mapping[str, Any],
    fake: bool,
) -> tuple | None:
    """What a compiled :func:`auto` call's capture and one-graph peaks depend on (NOTE [ A
    call again at the minimum named ]); None where the loss never calls the model (the
    capture then says so)."""
    try:
        args, kwargs, called = _model_call(model, loss_fn or default_loss_fn, batch)
    except ValueError:
        return None
    _, trains, _ = step_state(model)
    measured = _measured_key(model, input_signature(*args, **kwargs), trains, called)
    compiled = tuple(sorted((k, repr(v)) for k, v in options.items()))
    # the modules themselves: one replaced by another of the same parameters (a ReLU by a
    # GELU) is another step (the record keeps the old one alive: its id is not reused)
    modules = tuple(map(id, model.modules()))
    return measured, modules, loss_fn, None if stages is None else tuple(stages), compiled, fake


def _measured_for(
    measured: dict[tuple, _Measured],
    model: nn.Module,
    call: tuple[tuple, dict],
    capture: Callable[[], Any],
) -> _Measured:
    """What a re-plan for the training call ``call`` (its arguments) plans on: the step
    measured before in the same state but for the gradients held (``measured``, by
    :func:`_measured_key`), else ``capture()``'s, kept there. Only the first step and the
    last re-plan's are kept, whatever the number of input shapes: an accumulation re-plans
    for the gradients held right after the state it follows."""
    _, trains, autocast = replanning_state() or step_state(model)
    key = _measured_key(model, input_signature(*call[0], **call[1]), trains, autocast)
    if key not in measured:
        for older in list(measured)[1:]:
            del measured[older]
        measured[key] = _Measured(capture())
    return measured[key]


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
    :func:`remat.execute.chain.call_loss` (the output's ``.loss`` or its sum); a ``loss_fn`` such as
    a cross-entropy on the logits keeps more (its log-softmax and the logits' gradient).
    ``measure()`` gives, at the planning batch, the unplanned step's peak with the user's loss
    minus that with ``call_loss`` (at least 0) and the inputs' bytes it was measured at; it is
    called once per autocast state (:func:`~remat.capture.chain.autocast_now`), at the first
    re-plan in it, and scaled linearly with the inputs' bytes (a loss's memory grows with the
    batch and the sequence). Counted as live all step (an input's bytes): an over-estimate,
    never an under-estimate, at the shapes it was measured for."""
    cache: dict[Any, tuple[int, int]] = {}

    def margin(input_bytes: int) -> int:
        if loss_fn is None:  # the default loss is call_loss on the batch's arguments
            return 0
        regions = autocast_now()
        if regions not in cache:
            cache[regions] = measure()
        extra, planning_bytes = cache[regions]
        if extra <= 0:
            return 0
        return -(-extra * input_bytes // max(1, planning_bytes))

    return margin


def _measured_on(new: Captured, plan: Plan, base: Captured | None) -> tuple[Captured, Plan]:
    """The capture a one-graph trial of ``plan`` (made for ``new``) is measured on, and the plan
    fitted to it. A re-plan's ``new`` is ``base`` with the bytes the user's loss holds added
    to its inputs (:func:`_loss_margin`), the same stages and costs otherwise: the plan runs
    on ``base`` as made, so the chain's fingerprint, which tells the two apart, is not checked
    there (it raised a ``PlanError`` on every compiled re-plan with a margin)."""
    if base is None or base.chain.fingerprint == new.chain.fingerprint:
        return new, plan
    return base, dataclasses.replace(plan, fingerprint=None)


class _Trained(NamedTuple):
    """What a re-plan reads from the model as it is at the training call (the
    :func:`remat.execute.chain.step_state` the plan is made for)."""

    fixed: int
    """:func:`fixed_bytes` now (the parameters that train now have gradients)."""
    grads: list[int]
    """Per stage or graph node, the gradient bytes of the parameters that train now."""
    step_bytes: int
    """The optimizer step's temporaries now."""
    live: bool
    """Gradients are live when the forward starts (accumulation, no ``zero_grad``)."""


def _trained_now(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, grads: list[int]
) -> _Trained:
    live = (replanning_state() or step_state(model))[0]
    return _Trained(
        fixed_bytes(model, optimizer), grads, optimizer_costs(model, optimizer)[1], live
    )


@contextlib.contextmanager
def _for_new_inputs(args: tuple, kwargs: dict, live: bool = False) -> Iterator[None]:
    """A budget too small for a re-planned input shape says which shape (and that the
    gradients were live, where they were)."""

    try:
        yield
    except BudgetTooSmallError as err:
        shape = describe_signature(input_signature(*args, **kwargs))
        held = (
            " with every parameter gradient already held (gradient accumulation, or no "
            "zero_grad(set_to_none=True) before the step)"
            if live
            else ""
        )
        regions = autocast_now()
        autocast = (
            " under autocast ("
            + ", ".join(f"{d} {str(t).removeprefix('torch.')}" for d, t in regions)
            + ": 16-bit copies of the weights read are kept for the backward)"
            if regions
            else ""
        )
        raise BudgetTooSmallError(
            err.budget_bytes,
            err.minimum_bytes,
            err.method,
            f"re-planning the training step for the new inputs {shape}{held}{autocast}: the plan "
            "depends on the batch shape, on the gradients held and on autocast; raise the budget "
            "to the minimum or call the model on smaller inputs",
            kind="whole-step",
        ) from err


@older_objects_frozen()
def auto(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    budget: int | str | None = None,
    method: str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    stages: list[str] | None = None,
    loop: str = "output-held",
    fake: bool = False,
    compile: bool | Mapping[str, Any] = False,
    progress: bool | None = None,
) -> tuple[nn.Module, AutoSummary]:
    """Capture, plan and apply in one call; returns ``(planned_model, summary)``.

    ``budget`` is the total peak of the training step (what the device must hold: parameters,
    gradients, optimizer state and activations), as bytes, a string like ``"4GiB"``, or a
    percentage of the unplanned step's predicted peak such as ``"50%"``
    (:func:`remat.core.units.resolve_budget`; ``float("inf")``: no limit, the unplanned peak). remat
    subtracts what no plan changes and plans the rest. With ``budget=None`` it picks the plan
    with the least memory whose time overhead stays at most one extra forward.

    The plan is for the model's arguments in ``batch`` (what ``loss_fn`` calls the model
    with); a training call with other input shapes re-plans for them under the same budget and
    planner (module docstring), or raises :class:`~remat.planners.BudgetTooSmallError` naming
    the minimum for that shape.

    ``method`` is the chain planner: ``"optimal-time"`` by default (with ``compile`` too; a
    plan run as one compiled graph is flat: where ``method``'s nests checkpoints,
    :data:`FLAT_METHOD`'s for the budget is tried, and ``summary.method`` names the planner of
    the plan that runs).

    ``loop`` is the training loop the budget must hold for (:data:`remat.core.step.LOOPS`):

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

    ``fake=True`` plans without running the eager step, so a step that does not fit the
    machine can still be planned: the model is captured under ``FakeTensorMode`` (shapes and
    bytes exact, nothing allocated; chain and module-graph paths alike, re-plans for new input
    shapes too), and times come from a cost model of FLOPs, bytes moved and ops calibrated once
    for the parameters' device and dtype (:mod:`remat.measure.calibration`, cached under
    ``$REMAT_CACHE_DIR`` or ``~/.cache/remat``). The parameters may be real or on
    ``torch.device("meta")`` (the batch is then read on ``"meta"`` too, and the time model is
    the CUDA device's, else the CPU's): materialise the planned model afterwards
    (``planned.to_empty(device=...)`` and initialise it) before training. Fake tensors
    allocate nothing, so kernel scratch memory (oneDNN convolution workspaces on the CPU) is
    not counted; a model whose forward reads tensor values in Python raises ``ValueError``.

    ``compile=True`` runs each training forward of the planned model compiled, the plan
    deciding what is recomputed (:func:`remat.apply`'s ``compile``); a mapping is passed to
    ``torch.compile`` as keyword arguments. The plan is made on what each compiled stage saves,
    allocates and takes, measured as it runs (:func:`remat.capture.chain.capture`'s
    ``compile``, by the allocator's events; any backend). Then the plan's whole forward is
    compiled as **one graph** (NOTE [ One compiled graph ] in :mod:`remat.execute.chain`:
    faster) and that step's peak measured (the allocator's events; the captured loss, no
    optimizer): what it measured above or below the chain's prediction of the same step moves
    the prediction of the forward and backward (the optimizer step, not in the graph, stays
    the chain's: :func:`remat.core.step.measured_step_peak`), and a plan over the budget is
    planned again below it by the excess (:func:`_fit_one_graph`, :data:`ONE_GRAPH_TRIALS`
    plans; nested plans replaced by :data:`FLAT_METHOD`'s). A budget below the chain's least
    is tried with the least-memory flat plans measured as one graph
    (:meth:`_StepModel.fit_below_least`): one graph can hold less than its stages compiled
    alone, so the minimum a refusal names is the least of the chain's and theirs (each
    refusal and each such budget compiles and measures up to :data:`ONE_GRAPH_TRIALS` graphs;
    the next compiled call on the model for the same step, at the minimum named, starts from
    the refusal's capture and graphs and compiles only the graph it runs: NOTE [ A call again
    at the minimum named ]);
    below those too, a graph per stage with the stages that hold less eager left eager
    (:meth:`_StepModel.eager_where_smaller`), whose least the refusal names as well.
    Where no plan fits, each stage runs as its own compiled graph (NOTE [ One graph per stage ]
    in :mod:`remat.capture.chain`), predicted as the eager step is.
    ``summary.compiled`` says which (chain path only: a model planned as a module graph raises
    :class:`~remat.core.errors.UnsupportedModelError`; and real captures only: ``fake=True``
    raises ``ValueError``). The compiled step can hold more than the eager one (inductor on
    the CPU: torchvision's ResNet-10 at 8 x 64², 75.5 MB unplanned against 49.7 MB eager): a
    compiled refusal then also names the least without compile, and whether the budget meets
    it.

    ``progress`` shows tqdm bars on stderr: the stages measured, and with ``compile`` each graph
    compiled and measured (the first call, and a re-plan for new inputs: minutes on a real model
    under inductor); ``None`` (default): when stderr is a terminal.
    """
    show = sys.stderr.isatty() if progress is None else progress
    args = (model, batch, loss_fn, budget, method, optimizer, stages, loop, fake)
    try:
        return _auto(*args, compile, show)
    except BudgetTooSmallError as err:
        if not compile:
            raise
        # compiled, the step may hold more than the eager one (inductor on the CPU: a
        # ResNet-10's unplanned step 75.5 MB against 49.7 MB eager): say what eager reaches
        try:
            _auto(model, batch, loss_fn, 1, method, optimizer, stages, loop, fake, False, show)
        except BudgetTooSmallError as eager:
            if eager.minimum_bytes < err.minimum_bytes:
                meets = (
                    ", which this budget meets" if eager.minimum_bytes <= err.budget_bytes else ""
                )
                hint = (
                    f"without compile (compile=False) the least is {eager.minimum_bytes:,} B"
                    f"{meets}: torch.compile's step holds more than the eager one here"
                )
                detail = f"{err.detail}; {hint}" if err.detail else hint
                raise BudgetTooSmallError(
                    err.budget_bytes, err.minimum_bytes, err.method, detail, kind=err.kind
                ) from None
        raise


def _auto(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    budget: int | str | None,
    method: str | None,
    optimizer: torch.optim.Optimizer | None,
    stages: list[str] | None,
    loop: str,
    fake: bool,
    compile: bool | Mapping[str, Any],
    progress: bool = False,
) -> tuple[nn.Module, AutoSummary]:
    """:func:`auto`'s body."""

    check_loop(loop)
    options = compile_options(compile)
    method = method or "optimal-time"
    # the compiled stages' costs, measured as they run (any backend)
    compiled_costs = options
    check_not_wrapped(model, "remat.auto")  # wrap the planned model in DDP/FSDP afterwards
    check_no_own_checkpointing(model)  # before the graph fallback below, which would hide it
    batch = _batch_for_meta_parameters(model, batch, fake)
    # compiled: the last call's capture and graphs, for the same step (NOTE [ A call again at
    # the minimum named ])
    last_call = _last_call(model) if options is not None else None
    call_key = None if options is None else _call_key(model, batch, loss_fn, stages, options, fake)
    before_now = None if last_call is None or call_key is None else last_call.of(call_key)
    try:
        captured, capture_options = (
            (before_now[0].captured, before_now[1])
            if before_now is not None
            else _first_capture(
                model,
                fake,
                lambda o: capture(
                    model,
                    batch,
                    loss_fn=loss_fn,
                    stages=stages,
                    compile=compiled_costs,
                    progress=progress,
                    **o,
                ),
            )
        )
    except UnsupportedModelError as err:
        if stages is not None:
            raise
        if options is not None:
            raise UnsupportedModelError(
                "compile=True needs a model that splits into a chain of stages; this one "
                "does not, and the module-graph executor it would be planned with replays "
                "torch calls from Python and cannot be compiled: use compile=False, or name "
                "stages= (submodule names) that split the model into a chain"
            ) from err
        why = f"the model is not a chain of stages ({str(err).splitlines()[0]})"
        return _auto_graph(model, batch, loss_fn, budget, optimizer, why, loop, fake)
    chain = captured.chain
    fixed = fixed_bytes(model, optimizer)
    _, step_bytes = optimizer_costs(model, optimizer)
    grads = stage_grad_bytes(captured.stages, captured.grad_made)
    step = _StepModel(
        model,
        batch,
        loss_fn,
        loop,
        method,
        fixed,
        grads,
        step_bytes,
    )

    refused: BudgetTooSmallError | None = None  # compiled: tried as one graph below its least
    try:
        chosen, total = step.plan(captured, budget)
    except BudgetTooSmallError as err:
        if options is not None:
            refused = err
            chosen, total = Plan.none(chain), err.budget_bytes
        elif captured.stages.kind != GENERIC_KIND or stages is not None:
            raise
        else:
            # the generic stages (remat.capture.stages.families.blocks) are one way to see the
            # model: the module graph may fit a budget they do not; the error names the lower
            # minimum
            try:
                why = (
                    "the model's chain of stages around its list of blocks cannot meet the "
                    f"budget ({str(err).splitlines()[0]})"
                )
                return _auto_graph(model, batch, loss_fn, budget, optimizer, why, loop, fake)
            except BudgetTooSmallError as graph_err:
                raise (err if err.minimum_bytes <= graph_err.minimum_bytes else graph_err) from None
            except UnsupportedModelError as graph_err:
                # the module graph cannot be captured (a custom autograd.Function): the chain's
                # least is the least, and the refusal says why nothing goes lower
                graph_why = (
                    "the module graph, which may go lower than the chain of stages, could not "
                    f"be planned: {str(graph_err).splitlines()[0]}"
                )
                raise BudgetTooSmallError(
                    err.budget_bytes,
                    err.minimum_bytes,
                    err.method,
                    f"{err.detail}; {graph_why}" if err.detail else graph_why,
                    kind=err.kind,
                ) from None
    spec = _replan_budget(budget, total)
    call_args, call_kwargs, called = _model_call(model, loss_fn or default_loss_fn, batch)
    example = (call_args, call_kwargs)

    def captured_as(inputs: Any, loss: Any, eager: Collection[int] | None = ()) -> Captured:
        # the costs of a step on ``inputs`` (eager: None, every stage eager; else, compiled,
        # the stages named eager: NOTE [ A stage compiled where it pays ])
        return capture(
            model,
            inputs,
            loss_fn=loss,
            stages=stages,
            compile=None if eager is None else compiled_costs,
            eager_stages=eager or (),
            **capture_options,
        )

    signature = input_signature(*call_args, **call_kwargs)

    def measure_loss() -> tuple[int, int]:
        # in the autocast regions of the training call re-planned: the user's loss holds other
        # bytes in 16 bits (a ``.float()`` of bfloat16 logits is a copy, of float32 ones not)
        user = captured if autocast_now() == called else captured_as(batch, loss_fn)
        proxy = captured_as(example, call_loss)
        return step.unplanned_peak(user) - step.unplanned_peak(proxy), proxy.chain.input_bytes

    margin = _loss_margin(loss_fn, measure_loss)
    first = before_now[0] if before_now is not None else _Measured(captured)
    if last_call is not None and call_key is not None:
        last_call.keep(call_key, first, capture_options)
    measured = {_measured_key(model, signature, step_state(model)[1], called): first}
    # the plan that ran last, its inputs and step state (NOTE [ The graph that ran, first ])
    last: list[Any] = [None, None, None]
    before = _GraphsBefore()  # every one graph measured, its whole step (the same NOTE)

    @older_objects_frozen()
    def replan(*args: Any, **kwargs: Any) -> Plan:
        def with_margin(new: Captured) -> Captured:
            held = margin(new.chain.input_bytes)
            if not held:
                return new
            chain = dataclasses.replace(new.chain, input_bytes=new.chain.input_bytes + held)
            return dataclasses.replace(new, chain=chain)

        inputs, loss, same = _replan_call(args, kwargs, signature, batch, loss_fn)
        # (NOTE [ A re-plan for the gradients held ])
        seen = _measured_for(measured, model, (args, kwargs), lambda: captured_as(inputs, loss))
        base = seen.captured
        new = base if same else with_margin(base)
        now = _trained_now(model, optimizer, stage_grad_bytes(new.stages, new.grad_made))

        built: dict[str, nn.Module] = {}  # the trials compiled, by describe_compiled
        ran: list[tuple[Plan, int]] = []  # the one graphs measured, with their peaks

        def trial_of(p: Plan) -> nn.Module:
            name = describe_compiled(p)
            if name not in built:
                built[name] = apply(model, as_one_graph(p), stages=new.stages, compile=compile)
            return built[name]

        def measure(p: Plan) -> int:
            name = describe_compiled(p)
            if name not in seen.peaks:
                seen.peaks[name] = _one_graph_peak(
                    model, trial_of(p), loss or default_loss_fn, inputs, new.external_bytes
                )
            ran.append((p, seen.peaks[name]))
            return seen.peaks[name]

        def timed(plans: Sequence[Plan]) -> list[float]:
            trials = [trial_of(p) for p in plans]
            return _one_graph_seconds(model, trials, loss or default_loss_fn, inputs)

        def mixed(eager: Collection[int] | None) -> Captured:
            again = captured_as(inputs, loss, eager)
            return again if same else with_margin(again)

        _, trains, autocast = replanning_state() or step_state(model)
        state, sig = (now.live, trains, autocast), input_signature(*args, **kwargs)
        ran_state, ran_sig, ran_plan = last
        incumbent = (
            ran_plan
            if ran_state == state and ran_sig is not None and signature_no_smaller(sig, ran_sig)
            else None
        )
        with _for_new_inputs(args, kwargs, now.live), _trials_shown(progress, measure) as measure:
            try:
                first: Plan | BudgetTooSmallError
                first, total_now = step.plan(new, spec, now)
            except BudgetTooSmallError as err:
                if options is None:
                    raise
                first, total_now = err, err.budget_bytes
            if options is None:
                return first  # type: ignore[return-value]
            try:
                _, fit = step.compiled_fit(
                    new,
                    first,
                    total_now,
                    now,
                    measure,
                    mixed,
                    base,
                    timed,
                    incumbent,
                    before.held_more(state, sig),
                )
            finally:
                before.add(state, sig, [(p, step.whole(new, p, m, now, base)) for p, m in ran])
        last[:] = [state, sig, fit.plan]
        return fit.plan

    replan.plans_for_step_state = True  # type: ignore[attr-defined]

    def build(plan: Plan) -> nn.Module:
        # (the step state it is planned for: autocast as the step runs it)
        with autocast_regions(called):
            return apply(
                model,
                plan,
                stages=captured.stages,
                example=example,
                replan=replan,
                compile=compile,
            )

    fit: _OneGraphFit | None = None
    if options is not None:
        trials: dict[str, nn.Module] = {}
        ran: list[tuple[Plan, int]] = []

        def trial_first(p: Plan) -> nn.Module:
            name = describe_compiled(p)
            if name not in trials:
                trials[name] = build(as_one_graph(p))
            return trials[name]

        def peak_first(p: Plan) -> int:
            loss = loss_fn or default_loss_fn
            return _one_graph_peak(model, trial_first(p), loss, batch, captured.external_bytes)

        def measure_first(p: Plan) -> int:
            name = describe_compiled(p)
            if name not in first.peaks:  # (else measured by the last call: not compiled again)
                first.peaks[name] = peak_first(p)
            ran.append((p, first.peaks[name]))
            return first.peaks[name]

        def timed_first(plans: Sequence[Plan]) -> list[float]:
            graphs = [trial_first(p) for p in plans]
            return _one_graph_seconds(model, graphs, loss_fn or default_loss_fn, batch)

        state = (False, step_state(model)[1], called)
        try:
            with _trials_shown(progress, measure_first) as measure_first:
                planned_on, fit = step.compiled_fit(
                    captured,
                    refused or chosen,
                    total,
                    None,
                    measure_first,
                    lambda eager: captured_as(batch, loss_fn, eager),
                    timed=timed_first,
                )
        finally:
            before.add(state, signature, [(p, step.whole(captured, p, m, None)) for p, m in ran])
        chosen = fit.plan
        last[:] = [state, signature, chosen]
        name = describe_compiled(chosen)
        if fit.one_graph and before_now is not None and name not in trials:
            # its peak is the last call's: the graph that runs is measured in this one
            if peak_first(chosen) > first.peaks[name]:
                assert last_call is not None
                last_call.forget()  # (the model changed in a way the key does not see)
                return _auto(
                    model, batch, loss_fn, budget, method, optimizer, stages, loop, fake,
                    compile, progress,
                )  # fmt: skip
        planned = trials.get(name) if fit.one_graph else None
        planned = planned or build(chosen)
        return planned, step.summary(planned_on, chosen, total, fit, fake=bool(capture_options))
    planned = build(chosen)
    return planned, step.summary(captured, chosen, total, fit, fake=bool(capture_options))


@dataclass
class _StepModel:
    """The whole training step of a chain-path model as :func:`auto` plans it: the step's costs
    for a capture (now, or after training started: ``_Trained``), the plan for a budget, and
    the fit of a plan run as one compiled graph."""

    model: nn.Module
    batch: Any
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None
    loop: str
    method: str
    fixed: int
    """:func:`fixed_bytes` of the model and its optimizer."""
    grads: list[int]
    """:func:`stage_grad_bytes`."""
    step_bytes: int
    """The optimizer step's own temporaries."""

    def costs(self, new: Captured, now: _Trained | None = None) -> StepCosts:
        before = _Trained(self.fixed, self.grads, self.step_bytes, False)
        return step_costs(
            new,
            self.model,
            loop=self.loop,
            loss_fn=self.loss_fn,
            batch=self.batch,
            now=now or before,
        )

    def unplanned_peak(self, new: Captured) -> int:
        return step_peak_of(new.chain, Plan.none(new.chain), self.costs(new))

    def plan(
        self, new: Captured, spec: int | float | str | None, now: _Trained | None = None
    ) -> tuple[Plan, int | None]:
        total = None if spec is None else resolve_budget(spec, lambda: self.unplanned_peak(new))
        return plan_for_step(new.chain, self.costs(new, now), total, self.method), total  # type: ignore[return-value]

    def loss_only_costs(self, new: Captured, now: _Trained | None = None) -> StepCosts:
        # the step a one-graph plan is measured on (_one_graph_peak): the captured loss, no
        # optimizer, nothing held after the loss, gradients made by the backward
        grads_now = now.grads if now is not None else self.grads
        return dataclasses.replace(
            self.costs(new, now),
            persistent_bytes=fixed_bytes(self.model) - sum(grads_now),
            optimizer_step_bytes=0,
            output_held_bytes=0,
            grads_live=False,
            criterion_peak_bytes=0,
            output_grad_bytes=0,
        )

    def summary(
        self,
        captured: Captured,
        chosen: Plan,
        total: int | None,
        fit: _OneGraphFit | None,
        fake: bool,
    ) -> AutoSummary:
        """What :func:`auto` planned for ``captured``: ``chosen`` under the whole-step budget
        ``total``, run compiled as ``fit`` says (None: not compiled)."""
        chain, costs = captured.chain, self.costs(captured)
        summary = AutoSummary.of(
            self.method,
            chosen,
            chain,
            total,
            self.fixed,
            simulate(chain, chosen),
            simulate(chain, Plan.none(chain)),
            step_peak_of(chain, chosen, costs),
            self.unplanned_peak(captured),
            loop=self.loop,
            output_held_bytes=costs.output_held_bytes,
            fake=fake,
            criterion_bytes=costs.criterion_peak_bytes,
        )
        if fit is None:
            return summary
        return dataclasses.replace(
            summary,
            method=chosen.method if fit.one_graph else self.method,
            predicted_peak_bytes=fit.predicted,
            compiled="one-graph" if fit.one_graph else "per-stage",
            one_graph_over_bytes=fit.over,
            compiled_note=fit.note,
        )

    def fit_one_graph(
        self,
        new: Captured,
        first: Plan,
        total_now: int | None,
        now: _Trained | None,
        measure: Callable[[Plan], int],
        base: Captured | None = None,
        timed: Callable[[Sequence[Plan]], Sequence[float]] | None = None,
        held_more: Callable[[Plan], int | None] = lambda plan: None,
    ) -> _OneGraphFit:
        """:func:`_fit_one_graph` for the step captured in ``new`` (``held_more``: the whole
        step a plan measured at inputs no larger, NOTE [ The graph that ran, first ])."""

        def plan_at(b: int) -> Plan:
            # the planner's plan, or where it nests checkpoints (one graph cannot run them)
            # the flat planner's for the same budget
            p = plan_for_step(new.chain, self.costs(new, now), b, self.method)
            return (
                plan_for_step(new.chain, self.costs(new, now), b, FLAT_METHOD) if _nested(p) else p
            )

        def candidates() -> list[Plan]:
            # the planner's plans from its least budget to the budget, fastest first, then the
            # least-memory flat plans (one graph may hold less than the chain predicts)
            if total_now is None:
                return []
            try:
                plan_at(0)
                return []
            except BudgetTooSmallError as err:
                least = err.minimum_bytes
            found: dict[str, Plan] = {}
            for k in range(CANDIDATE_BUDGETS):
                budget = least + (total_now - least) * k // max(1, CANDIDATE_BUDGETS - 1)
                p = _planned(plan_at, budget)
                if p is not None:
                    found.setdefault(p.describe(), p)
            fastest = sorted(found.values(), key=lambda p: simulate(new.chain, p).total_time)
            lowest = [p for p in _least_plans(new.chain, self.method) if p.describe() not in found]
            return fastest + lowest

        return _fit_one_graph(
            first,
            total_now,
            plan_at=plan_at,
            candidates=candidates,
            predicted=lambda p: step_peak_of(new.chain, p, self.costs(new, now)),
            baseline=lambda p: self.baseline(new, p, now, base),
            measure=measure,
            whole=lambda p, measured: self.whole(new, p, measured, now, base),
            store_all=_store_all_trials(new.chain),
            timed=timed,
            held_more=held_more,
        )

    def compiled_fit(
        self,
        new: Captured,
        first: Plan | BudgetTooSmallError,
        total: int | None,
        now: _Trained | None,
        measure: Callable[[Plan], int],
        captured_as: Callable[[Collection[int] | None], Captured],
        base: Captured | None = None,
        timed: Callable[[Sequence[Plan]], Sequence[float]] | None = None,
        incumbent: Plan | None = None,
        held_more: Callable[[Plan], int | None] = lambda plan: None,
    ) -> tuple[Captured, _OneGraphFit]:
        """How the step captured compiled in ``new`` runs within ``total``, from the planner's
        ``first`` plan for it or its refusal: as one graph where one fits
        (:meth:`fit_one_graph`, or below the stages' least :meth:`fit_below_least`), else a
        graph per stage with the stages that pay eager left eager (:meth:`per_stage_mix`),
        and below every compiled least with the stages that hold less eager left eager
        (:meth:`eager_where_smaller`); with the capture the fit's plan is made for.
        ``captured_as`` is :meth:`per_stage_mix`'s. The first plan and each re-plan of
        :func:`auto` go this one way.

        NOTE [ The graph that ran, first ]: with compile each new input shape compiles and
        measures the store-all graphs at the partitioner's budgets in turn, the first that
        fits timed against the next (:data:`LOOK_AHEAD`), then remat's plans (a tiny GPT-2
        under inductor on the CPU: 6 graphs, 98 s, at length 48 after 32; 12 graphs, 203 s,
        at 56). A re-plan for inputs no smaller than those of the plan that ran last (every
        size at least, the same step state) measures that plan first where it stored every
        stage as one graph (``incumbent``): the store-all graphs before it in turn held more at
        the smaller inputs, or were timed slower, and a step's memory grows with its inputs.
        Where it fits the budget it runs: one graph compiled and no timing, instead of two
        graphs or more. Else the trials go on (its peak kept). In them a plan whose one graph
        held more than the budget at inputs no smaller than these, in the same step state, is
        not measured again (``held_more``: the whole step it measured there; it counts as
        tried): here it would hold more still. So where the plan that ran last recomputes
        stages, no store-all graph is measured again (the same GPT-2 at 80 %: 12 graphs and
        about 200 s a new length before, 9 of them store-all), nor a recomputing plan that held
        more there (2 of 3 at length 34 after 32 where no one graph fit at 32). Below the
        stages' least every trial is measured, so a refusal names the least of them all. Only
        which graph runs rests on that guess, never the budget: the graph that runs is
        measured at the new inputs."""
        if incumbent is not None and total is not None and _one_graph_store_all(incumbent):
            plan = incumbent.made_for(new.chain)
            tried: list[str] = []
            fit = _trial(
                plan,
                total,
                lambda p: self.baseline(new, p, now, base),
                measure,
                lambda p, measured: self.whole(new, p, measured, now, base),
                tried,
            )[0]
            if fit is not None:
                note = "the graph that ran at inputs no larger, measured first, fits"
                return new, fit._replace(note=note)
        if isinstance(first, BudgetTooSmallError):
            try:
                return new, self.fit_below_least(new, first, now, measure, base, timed)
            except BudgetTooSmallError as err:
                return self.eager_where_smaller(new, err, now, captured_as)
        fit = self.fit_one_graph(new, first, total, now, measure, base, timed, held_more)
        if fit.one_graph:
            return new, fit
        return self.per_stage_mix(new, fit, total, now, captured_as)

    def eager_where_smaller(
        self,
        new: Captured,
        refused: BudgetTooSmallError,
        now: _Trained | None,
        captured_as: Callable[[Collection[int] | None], Captured],
    ) -> tuple[Captured, _OneGraphFit]:
        """A graph per stage within the budget ``refused`` names, every compiled plan tried
        (``refused``: :meth:`fit_below_least`'s refusal), with stages left eager where they hold
        less so; else that refusal, naming the least of its own and the mixes'.

        NOTE [ A stage eager where it holds less ]: a stage compiled can hold more than eager.
        Inductor on the CPU: torchvision's ResNet-10 (8 x 64²), its last block saved 14.6 MB
        compiled against 0.34 MB eager, and the compiled stages' least was 83,392,740 B where
        its plan storing all, with some stages eager because they ran faster so, measured
        73,931,296 B (docs/results/conformance/FINDINGS.md). A budget between was refused. So
        below every compiled least two mixes are captured and planned at the budget, the
        first that meets it runs: the stages that hold no more eager in each of their costs
        (:func:`_holds_no_more`: the mix holds no more than the compiled chain at any plan),
        then those that hold less in their costs summed (:func:`_holds_less`; the stages whose
        eager step holds less overall, even where one transient is larger). The plan is made
        on the mix as captured, so its prediction is measured. Three captures, only where
        every compiled plan was refused."""
        total = refused.budget_bytes
        eager_captured = captured_as(None)
        n = new.chain.n
        mixes: list[list[int]] = []
        for holds in (_holds_no_more, _holds_less):
            left = [i + 1 for i in range(n) if holds(eager_captured, new, i)]
            if left and left not in mixes:
                mixes.append(left)
        leasts: list[str] = []
        minimum = refused.minimum_bytes
        for left in mixes:
            mixed = captured_as(left)
            costs = self.costs(mixed, now)
            shown = describe_compiled(with_eager_stages(Plan.none(mixed.chain), left))
            shown = shown.removeprefix(Plan.none(mixed.chain).describe()).strip()
            try:
                plan = plan_for_step(mixed.chain, costs, total, self.method)
            except BudgetTooSmallError as err:
                minimum = min(minimum, err.minimum_bytes)
                leasts.append(f"{shown}: {err.minimum_bytes:,} B")
                continue
            note = (
                f"a graph per stage {shown}: they hold less so, and every compiled plan held "
                f"more than the budget ({refused.detail})"
            )
            return mixed, _OneGraphFit(
                with_eager_stages(plan, left), step_peak_of(mixed.chain, plan, costs), None, note
            )
        if not leasts:
            raise refused
        raise BudgetTooSmallError(
            total,
            minimum,
            refused.method,
            f"{refused.detail}; a graph per stage {'; '.join(leasts)}",
            kind="whole-step",
        ) from refused.__cause__ or refused  # (the stages' own refusal, as fit_below_least's)

    def per_stage_mix(
        self,
        new: Captured,
        fit: _OneGraphFit,
        total: int | None,
        now: _Trained | None,
        captured_as: Callable[[Collection[int] | None], Captured],
    ) -> tuple[Captured, _OneGraphFit]:
        """``fit`` (a plan run a graph per stage, its stages' costs captured compiled in
        ``new``) with the stages that run faster eager left eager, where the plan for the mix
        meets ``total`` and is predicted faster; else ``(new, fit)`` unchanged.
        ``captured_as(eager)`` captures the same step with every stage eager (None) or with the
        stages numbered in ``eager`` eager and the rest compiled.

        NOTE [ A stage compiled where it pays ]: a stage compiled on its own pays dynamo's
        guards and a compiled function's call around its kernels, about 0.1 ms forward and
        backward on the shared CPU, again at each recomputation; a small stage (an MLP chain's
        Linear or GELU alone) ran slower so than eager: at the least budget the same plan took
        181.3 ms a step a graph per stage against 155.5 ms eager (docs/results/compile). So
        where the step runs a graph per stage, the stages are captured eager too, and a stage
        runs eager where its forward and backward measured faster eager and it holds no more
        there (its output, saved bytes, transients and small scratch each at most the compiled
        ones): the chain of the mix then costs no more memory than the compiled one at any
        plan. The mix is captured again as it runs, and the faster of the planner's plan for it
        and the compiled step's plan (the planner's whole-step search is not monotone in the
        costs: the MLP's mix with smaller transients was refused at the compiled least) runs
        where it meets the budget and its predicted time is below the compiled plan's.

        Stages alike (the same module class, parameter shapes and input and output sizes: an
        MLP's 16 Linear layers) are judged on their times together: one stage's few timed runs
        on a shared machine are noisy. The MLP chain's Linear stages judged one by one were
        split by that noise, and the mix ran 0.92 of the all-compiled step's time; judged
        together all ran eager, 0.82 of it."""
        compiled = new.chain
        eager_captured = captured_as(None)
        eager = eager_captured.chain

        def took(chain: Chain, stages: list[int]) -> float:
            return sum(chain.fwd_time[i] + chain.bwd_time[i] for i in stages)

        left = [
            i + 1
            for like in _alike_stages(new).values()
            if took(eager, like) < took(compiled, like)
            for i in like
            if _holds_no_more(eager_captured, new, i)
        ]
        if not left:
            return new, fit
        mixed = captured_as(left)
        costs = self.costs(mixed, now)
        plans = [fit.plan.made_for(mixed.chain)]  # it holds no more on the mix
        with contextlib.suppress(BudgetTooSmallError):
            plans.append(plan_for_step(mixed.chain, costs, total, self.method))
        fitting = [
            p for p in plans if total is None or step_peak_of(mixed.chain, p, costs) <= total
        ]
        if not fitting:
            return new, fit
        plan = min(fitting, key=lambda p: simulate(mixed.chain, p).total_time)
        if simulate(mixed.chain, plan).total_time >= simulate(compiled, fit.plan).total_time:
            return new, fit
        plan = with_eager_stages(plan, left)
        shown = describe_compiled(plan).removeprefix(plan.describe()).strip()
        note = f"{shown}: faster so than compiled alone, measured"
        note = f"{fit.note}; {note}" if fit.note else note
        return mixed, _OneGraphFit(plan, step_peak_of(mixed.chain, plan, costs), fit.over, note)

    def baseline(
        self, new: Captured, plan: Plan, now: _Trained | None, base: Captured | None = None
    ) -> int:
        """The chain's prediction of the step a one-graph plan is measured on
        (:meth:`loss_only_costs`; ``base``: the capture without a re-plan's loss margin)."""
        measured_on, plan = _measured_on(new, plan, base)
        return step_peak_of(measured_on.chain, plan, self.loss_only_costs(measured_on, now))

    def whole(
        self,
        new: Captured,
        plan: Plan,
        measured: int,
        now: _Trained | None,
        base: Captured | None = None,
    ) -> int:
        """The whole step's peak of ``plan`` run as one graph whose step (:meth:`loss_only_costs`)
        measured ``measured``: the forward and backward moved by what the graph measured above
        or below the chain, the optimizer step as the chain model has it
        (:func:`remat.planning.measured_step_peak_of`)."""
        measured_on, plan = _measured_on(new, plan, base)
        return measured_step_peak_of(
            new.chain,
            plan,
            self.costs(new, now),
            measured,
            self.loss_only_costs(measured_on, now),
            measured_on.chain,
        )

    def fit_below_least(
        self,
        new: Captured,
        refused: BudgetTooSmallError,
        now: _Trained | None,
        measure: Callable[[Plan], int],
        base: Captured | None = None,
        timed: Callable[[Sequence[Plan]], Sequence[float]] | None = None,
    ) -> _OneGraphFit:
        """A one-graph plan for the budget the chain model refused (``refused``: its least,
        a graph per stage), or the refusal naming the least whole step of the plans tried.

        One graph can hold less than its stages compiled alone (the partitioner recomputes
        across stages what they saved: GPT-2 124M on an H100, 5,398,799,872 B measured where
        the stages' least was 6,631,674,904 B), so below the chain's least :func:`auto` measures
        as one graph the store-all plan at the partitioner budgets :data:`PARTITIONER_TRIALS`
        (NOTE [ The partitioner's budget ]) and the least-memory plans (:func:`_least_plans`,
        at most :data:`ONE_GRAPH_TRIALS`), in turn, and runs the fastest (by the chain's times)
        whose whole step (:meth:`whole`) fits: the first store-all trial that fits (storing all
        is the chain's fastest plan: no plan that recomputes stages is measured after it; with
        ``timed``, the fastest of it and the :data:`LOOK_AHEAD` trials after it that fit,
        :func:`_fastest`), else the fastest
        least plan that does. None fits: all were measured, whatever the budget (the minimum
        named does not depend on it), and the :class:`~remat.planners.BudgetTooSmallError`
        names the least of the chain's and theirs, a budget it then accepts."""
        total = refused.budget_bytes
        results = []

        def fit_of(p: Plan) -> _OneGraphFit | None:
            measured = measure(p)
            whole = self.whole(new, p, measured, now, base)
            over = measured - self.baseline(new, p, now, base)
            results.append((p, whole, over))
            return _OneGraphFit(as_one_graph(p), whole, over, "") if whole <= total else None

        stored = _in_turn(_partitioner_trials(new.chain), fit_of, timed)
        if not stored:  # (storing all is the chain's fastest plan: after a fit none recomputing)
            for p in _least_plans(new.chain, self.method):
                fit_of(p)
        shown = "; ".join(f"{describe_compiled(p)}: {w:,} B" for p, w, _ in results)
        note = (
            f"one graph below the stages' least {refused.minimum_bytes:,} B (least plans "
            f"measured as one graph: {shown})"
        )
        if stored:
            return _fastest([f._replace(note=note) for f in stored], timed)
        fitting = [_OneGraphFit(as_one_graph(p), w, o, note) for p, w, o in results if w <= total]
        if fitting:
            return min(fitting, key=lambda f: simulate(new.chain, f.plan).total_time)
        minimum = min([refused.minimum_bytes, *(w for _, w, _ in results)])
        raise BudgetTooSmallError(
            total,
            minimum,
            refused.method,
            f"compiled: a graph per stage needs {refused.minimum_bytes:,} B; the least plans "
            f"run as one graph need {shown}",
            kind="whole-step",
        ) from refused


ONE_GRAPH_TRIALS = 3
"""How many plans :func:`auto` (``compile=``) measures as one compiled graph before it runs a
graph per stage (NOTE [ One compiled graph ] in remat.execute.chain)."""
PARTITIONER_TRIALS: tuple[float, ...] = (0.7, 0.5, 0.2, 0.15, 0.1)
"""The partitioner budgets (torch's ``activation_memory_budget``) :func:`auto` (``compile=``)
measures the store-all one graph at, in turn, highest first (a higher budget recomputes less),
after storing all at torch's setting and before any plan that recomputes stages (NOTE [ The
partitioner's budget ] in remat.execute.chain), each with the knapsack solved exactly and, at
those of :data:`PARTITIONER_DP_TRIALS` where that does not fit, by torch's DP; empty: none tried
(remat's plans only). The knob is not monotone in bytes, so each is measured: torch.compile's
least peak was at 0.5 on GPT-2 and the MLP chain, at 0.1 on Llama and DenseNet-121. Budgets
between torch.compile's points reach partitions it does not: on DenseNet-121 the exact set at
0.7 ran in 0.945 of torch.compile@1's time with 69 MiB less, at 0.15 in 0.972 of
torch.compile@0.2's within its memory (docs/results/compile, session 29)."""
PARTITIONER_DP_TRIALS: frozenset[float] = frozenset({0.5, 0.2, 0.1})
"""The budgets of :data:`PARTITIONER_TRIALS` at which torch's DP's partition is measured where
the exact one does not fit: torch.compile's own points (the DP is its solver), so that remat
reaches the memory of each; elsewhere the exact set is the partitioner's best at that budget."""
LOOK_AHEAD = 1
"""How many store-all trials :func:`auto` (``compile=``) measures after the first that fits (in
the order of :data:`PARTITIONER_TRIALS`); those that fit are timed against it, and the fastest
runs. The order is the partitioner's estimate (a lower budget recomputes more), but the next
trial can run faster: the exact knapsack's partition at a budget where torch's DP's ran before
it (DenseNet-121: the exact set at 0.15 ran in 0.972 of torch.compile@0.2's time, within its
memory; docs/results/compile). One more compilation at most."""
TIMED_STEPS = 31
"""Steps of each store-all trial :func:`auto` (``compile=``) times, interleaved
(:data:`LOOK_AHEAD`). DenseNet-121's two trials above, 3 % apart, timed 11 steps each on the
shared CPU came out 0.958-1.003 in four runs; 41 steps gave 0.974 [0.961, 0.985]."""
CANDIDATE_BUDGETS = 12
"""Budgets (evenly from the planner's least to the budget) whose plans a one-graph fit tries
when lowering the budget by what the graph measured over gives no new plan."""
FLAT_METHOD = "hong-dp"
"""The flat planner (no checkpoint inside another) a one-graph trial uses where ``method``'s
plan nests checkpoints."""


class _GraphsBefore:
    """Every one graph :func:`auto` measured with compile, by step state and input signature:
    its whole step (:meth:`_StepModel.whole`), by :func:`describe_compiled` of its plan
    (NOTE [ The graph that ran, first ])."""

    def __init__(self) -> None:
        self.at: list[tuple[Any, tuple, dict[str, int]]] = []

    def add(self, state: Any, signature: tuple, steps: Sequence[tuple[Plan, int]]) -> None:
        """The plans measured as one graph in ``state`` on inputs of ``signature``, each with
        its whole step."""
        self.at.append((state, signature, {describe_compiled(p): w for p, w in steps}))

    def held_more(self, state: Any, signature: tuple) -> Callable[[Plan], int | None]:
        """For a plan, the largest whole step its one graph measured in ``state`` on inputs
        no larger than ``signature``'s (:func:`remat.guards.signature_no_smaller`), or None."""

        def held(plan: Plan) -> int | None:
            name = describe_compiled(plan)
            return max(
                (
                    steps[name]
                    for at_state, at, steps in self.at
                    if at_state == state and name in steps and signature_no_smaller(signature, at)
                ),
                default=None,
            )

        return held


class _OneGraphFit(NamedTuple):
    """What :func:`_fit_one_graph` chose."""

    plan: Plan
    """The plan, marked one-graph (:func:`remat.execute.chain.as_one_graph`) or not."""
    predicted: int
    """Its whole-step prediction: run as one graph, from what the graph measured
    (:meth:`_StepModel.whole`); else the chain's."""
    over: int | None
    """Bytes the one graph measured above the chain's prediction of the same step, negative
    below (of the plan run, or of the first plan tried); None when none was measured."""
    note: str
    """The trials that did not fit (empty when the first did)."""

    @property
    def one_graph(self) -> bool:
        return self.plan.params.get("compiled") == "one-graph"


def _fit_one_graph(
    first: Plan,
    total: int | None,
    plan_at: Callable[[int], Plan],
    predicted: Callable[[Plan], int],
    baseline: Callable[[Plan], int],
    measure: Callable[[Plan], int],
    candidates: Callable[[], Sequence[Plan]] = tuple,
    *,
    whole: Callable[[Plan, int], int],
    store_all: Sequence[Plan] = (),
    timed: Callable[[Sequence[Plan]], Sequence[float]] | None = None,
    held_more: Callable[[Plan], int | None] = lambda plan: None,
) -> _OneGraphFit:
    """A plan that runs as one compiled graph within ``total`` (NOTE [ One compiled graph ]).

    The chain predicts the step of the stages compiled one by one, not the one graph (its
    recomputations and transients are the graph's), so each plan tried is measured compiled:
    ``measure(plan)`` is the peak of its one-graph step with the captured loss and no
    optimizer, and ``baseline(plan)`` the chain's prediction of that same step (``over``: what
    the graph measured above it, negative below); ``whole(plan, measured)`` is the whole
    step's prediction from that measure (:meth:`_StepModel.whole`: the chain's forward and
    backward moved by ``over``, above or below, the optimizer step kept). When that exceeds
    ``total``, the next plan tried is the planner's for
    the budget lowered by the excess (``plan_at``), or, where that one was tried already or
    the budget is below the planner's least, the fastest of ``candidates()`` not tried yet
    (:func:`auto`: the planner's plans over budgets from its least to ``total``, fastest
    first); :data:`ONE_GRAPH_TRIALS` plans at most. A plan that nests checkpoints (one graph
    cannot run it: the partitioner keeps the outer segment's activations) is not tried; a
    nested ``first`` is replaced by ``plan_at(total)``, which :func:`auto` makes flat, or where
    there is none (the budget below the flat planner's least) by the first flat candidate
    (:func:`auto`'s end with the least-memory plans, :func:`_least_plans`). With a budget,
    the ``store_all`` plans (:func:`auto`: storing every stage at torch's partitioner budget,
    then at each of :data:`PARTITIONER_TRIALS`: torch.compile's own points, NOTE [ The partitioner's
    budget ]) are measured in turn before the first plan that recomputes a stage, each once
    and not counted in the trials, and the first that fits runs; with ``timed`` (the median
    seconds of a step of each plan given, compiled as one graph), the :data:`LOOK_AHEAD` after
    it are measured too, and the fastest of those that fit runs. If none fits the first plan
    runs a graph per stage, as the chain predicts it (``predicted(plan)``), and the note says
    what was measured. A plan for which ``held_more(plan)`` gives a whole step above ``total``
    (:func:`auto`: one it measured at inputs no larger, NOTE [ The graph that ran, first ]) is
    not measured: it counts as tried, that step taken for its own."""
    tried: list[str] = []
    seen: set[str] = set()
    first_over: int | None = None
    pool: list[Plan] | None = None
    plan: Plan | None = first
    # torch.compile's own points, tried once before a plan that recomputes stages
    rivals = list(store_all) if total is not None else []
    measured_rivals = 0
    if _nested(first) and total is not None:
        plan = _planned(plan_at, total)
        if plan is None:
            tried.append(f"{first.describe()} nests checkpoints, no flat plan for the budget")
            pool = list(candidates())
            plan = next((p for p in pool if not _nested(p)), None)
    while plan is not None and len(seen) - measured_rivals < ONE_GRAPH_TRIALS:
        if _nested(plan):
            tried.append(f"{plan.describe()} nests checkpoints")
            break
        if rivals and _recomputes(plan):
            # store everything first, then the partitioner's own recomputation (NOTE [ The
            # partitioner's budget ])
            assert total is not None

            def rival_fit(rival: Plan) -> _OneGraphFit | None:
                nonlocal measured_rivals
                seen.add(describe_compiled(rival))
                measured_rivals += 1
                if _held_more(rival, total, held_more, tried) is not None:
                    return None
                return _trial(rival, total, baseline, measure, whole, tried)[0]

            fits = _in_turn(
                [r for r in rivals if describe_compiled(r) not in seen], rival_fit, timed
            )
            if fits:
                return _fastest(fits, timed)
            rivals = []
        seen.add(describe_compiled(plan))
        step = _held_more(plan, total, held_more, tried)
        if step is None:
            fit, over, step = _trial(plan, total, baseline, measure, whole, tried)
            first_over = over if first_over is None else first_over
            if fit is not None:
                return fit
        assert total is not None  # (without a budget every plan fits)
        # (a plan measured over twice the budget leaves no budget to lower to: the candidates)
        plan = _planned(plan_at, max(0, total - (step - total)))
        if plan is None or describe_compiled(plan) in seen or _nested(plan):
            if pool is None:
                pool = list(candidates())
            plan = next(
                (p for p in pool if describe_compiled(p) not in seen and not _nested(p)), None
            )
    if plan is None and tried:
        tried.append("no other plan")
    note = "one graph over the budget: " + "; ".join(tried) if tried else ""
    return _OneGraphFit(first, predicted(first), first_over, note)


def _trial(
    plan: Plan,
    total: int | None,
    baseline: Callable[[Plan], int],
    measure: Callable[[Plan], int],
    whole: Callable[[Plan, int], int],
    tried: list[str],
) -> tuple[_OneGraphFit | None, int, int]:
    """:func:`_fit_one_graph`'s trial of ``plan``: ``(fit, over, step)``, the fit where its
    measured whole step ``step`` is within ``total`` (or there is none), else None and
    ``tried`` says what it measured; ``over``: what the graph measured above the stages."""
    measured = measure(plan)
    over = measured - baseline(plan)
    step = whole(plan, measured)
    if total is None or step <= total:
        note = "one graph after: " + "; ".join(tried) if tried else ""
        return _OneGraphFit(as_one_graph(plan), step, over, note), over, step
    tried.append(f"{describe_compiled(plan)}: {step:,} B ({over:,} B measured above the stages)")
    return None, over, step


def _held_more(
    plan: Plan, total: int | None, held_more: Callable[[Plan], int | None], tried: list[str]
) -> int | None:
    """:func:`_fit_one_graph`'s skip: the whole step ``held_more(plan)`` gives where it is
    above ``total`` (``tried`` says so), else None: the plan is measured."""
    step = None if total is None else held_more(plan)
    if step is None or step <= total:
        return None
    tried.append(f"{describe_compiled(plan)}: {step:,} B at inputs no larger, not measured again")
    return step


def _in_turn(
    trials: Sequence[Plan],
    fit_of: Callable[[Plan], _OneGraphFit | None],
    timed: Callable[[Sequence[Plan]], Sequence[float]] | None,
) -> list[_OneGraphFit]:
    """The fits of the store-all ``trials`` measured in turn (``fit_of``: a trial's fit, None
    where it does not fit) until the first that fits and, where they can be ``timed``, the
    :data:`LOOK_AHEAD` trials after it (:func:`_fastest` chooses among them); torch's DP is not
    measured at a budget where the exact set fit (:func:`_dp_not_needed`)."""
    fits: list[_OneGraphFit] = []
    after = 0  # trials measured after the first that fits
    for trial in trials:
        if _dp_not_needed(trial, [f.plan for f in fits]):
            continue
        if fits and after == (0 if timed is None else LOOK_AHEAD):
            break
        after += bool(fits)
        fit = fit_of(trial)
        if fit is not None:
            fits.append(fit)
    return fits


def _fastest(
    fits: Sequence[_OneGraphFit], timed: Callable[[Sequence[Plan]], Sequence[float]] | None
) -> _OneGraphFit:
    """The fastest of ``fits`` (store-all trials that fit, in the order measured) by ``timed``
    (the median seconds of a step of each plan), its note saying the times; the first where
    there is one or none can be timed."""
    if timed is None or len(fits) == 1:
        return fits[0]
    seconds = timed([f.plan for f in fits])
    best = min(range(len(fits)), key=lambda i: seconds[i])
    shown = "; ".join(
        f"{describe_compiled(f.plan)}: {s * 1e3:,.1f} ms"
        for f, s in zip(fits, seconds, strict=True)
    )
    note = f"the fastest of the graphs that fit, timed: {shown}"
    fit = fits[best]
    return fit._replace(note=f"{fit.note}; {note}" if fit.note else note)


def _store_all_trials(chain: Chain | int) -> list[Plan]:
    """The store-all plans a one-graph fit measures before recomputing stages: at torch's
    partitioner budget, then at each of :data:`PARTITIONER_TRIALS` (:func:`_partitioner_trials`)."""
    return [Plan.none(chain), *_partitioner_trials(chain)]


def _partitioner_trials(chain: Chain | int) -> list[Plan]:
    """The store-all plan at each of :data:`PARTITIONER_TRIALS`, each with the partitioner's
    knapsack solved exactly and then, at :data:`PARTITIONER_DP_TRIALS` (measured only where the
    exact one does not fit: :func:`_dp_not_needed`), by torch's DP, torch.compile's own
    partition (NOTE [ The partitioner's budget ]; the ops that draw random numbers stay saved)."""
    return [
        with_partitioner_budget(Plan.none(chain), k, solver)
        for k in PARTITIONER_TRIALS
        for solver in PARTITIONER_SOLVERS
        if solver == PARTITIONER_SOLVERS[0] or k in PARTITIONER_DP_TRIALS
    ]


def _dp_not_needed(trial: Plan, fits: Sequence[Plan]) -> bool:
    """Whether ``trial`` is torch's DP's partition at a partitioner budget where the exact one
    fit (one of ``fits``): measured only where that does not (:data:`PARTITIONER_DP_TRIALS`)."""
    knob = partitioner_budget(trial)
    return (
        knob is not None
        and partitioner_solver(trial) != PARTITIONER_SOLVERS[0]
        and any(partitioner_budget(f) == knob for f in fits)
    )


def _one_graph_store_all(plan: Plan) -> bool:
    """Whether ``plan`` runs as one compiled graph storing every stage (the partitioner's
    recomputation inside it only)."""
    return plan.params.get("compiled") == "one-graph" and not _recomputes(plan)


def _recomputes(plan: Plan) -> bool:
    """Whether ``plan`` recomputes a stage (a checkpointed segment or the every-stage rule)."""
    return plan.rule is not None or any(s.checkpoint for s in plan.chain_segments())


def _least_plans(chain: Chain, method: str) -> list[Plan]:
    """The flat least-memory plans a one-graph step below the chain's least is tried with
    (:meth:`_StepModel.fit_below_least`), at most :data:`ONE_GRAPH_TRIALS`: ``method``'s and
    :data:`FLAT_METHOD`'s least-activation plans made on unit times (they do not move with
    timing noise, so neither does the minimum named; a nested one left out) and every stage
    checkpointed."""
    found: dict[str, Plan] = {}
    for p in (
        unit_time_least_plan(chain, method),
        unit_time_least_plan(chain, FLAT_METHOD),
        plan_chain(chain, "every-stage"),
    ):
        if not _nested(p):
            found.setdefault(p.describe(), p)
    return list(found.values())[:ONE_GRAPH_TRIALS]


def _planned(plan_at: Callable[[int], Plan], budget: int) -> Plan | None:
    """``plan_at(budget)``, None below the planner's least budget."""
    try:
        return plan_at(budget)
    except BudgetTooSmallError:
        return None


def _nested(plan: Plan) -> bool:
    """Whether a checkpoint of ``plan`` holds another (one graph cannot run it)."""
    return plan.depth() > 1


@contextlib.contextmanager
def _trial_steps(
    model: nn.Module, loss: Callable[[nn.Module, Any], torch.Tensor], inputs: Any
) -> Iterator[tuple[Callable[[nn.Module], Callable[[], None]], Any]]:
    """Training steps of trials (planned modules of ``model``): ``(step_of, batch)``, where
    ``step_of(planned)()`` runs ``loss(planned, batch)`` and its backward on a private copy of
    ``inputs`` and sets the gradients to None. The steps draw from forked random streams; after
    them the model's gradients and buffers (batch norm's running statistics) are as before."""
    buffers = BufferSnapshot(model)
    grads = {p: p.grad for p in model.parameters()}
    private = BatchCopy(inputs)
    devices = sorted({t.device for t in buffers.tensors if t.device.type == "cuda"}, key=str)

    def step_of(planned: nn.Module) -> Callable[[], None]:
        def step() -> None:
            private.restore()
            loss(planned, private.batch).backward()
            for p in model.parameters():
                p.grad = None

        return step

    try:
        for p in grads:
            p.grad = None
        with torch.random.fork_rng(devices=devices), garbage_collected():
            yield step_of, private.batch
    finally:
        buffers.restore()
        for p, g in grads.items():
            p.grad = g


def _one_graph_peak(
    model: nn.Module,
    planned: nn.Module,
    loss: Callable[[nn.Module, Any], torch.Tensor],
    inputs: Any,
    external_bytes: int = 0,
) -> int:
    """The measured peak of one training step of ``planned`` (a one-graph compiled plan: an
    untimed first step compiles it; :func:`_trial_steps`): the allocator's events on a CPU,
    ``max_memory_allocated`` on CUDA. ``external_bytes``
    (:attr:`remat.capture.chain.Captured.external_bytes`: a target the loss reads from its
    closure) is added on a CPU: allocated before the step, the step's events do not show it,
    and the chain it is compared with counts it with its input."""
    cuda = any(p.device.type == "cuda" for p in model.parameters())
    with _trial_steps(model, loss, inputs) as (step_of, batch):
        if cuda:
            return cuda_step_peak_bytes(step_of(planned))  # (the device's all: the target too)
        return step_peak_bytes(step_of(planned), model, None, batch) + external_bytes


def _one_graph_seconds(
    model: nn.Module,
    planned: Sequence[nn.Module],
    loss: Callable[[nn.Module, Any], torch.Tensor],
    inputs: Any,
) -> list[float]:
    """The median seconds of a training step of each of ``planned`` (trials that were measured:
    compiled), :data:`TIMED_STEPS` steps each, interleaved (:func:`_trial_steps`,
    :func:`remat.measure.events.interleaved_times`)."""
    with _trial_steps(model, loss, inputs) as (step_of, _):
        times = interleaved_times(
            {str(i): step_of(p) for i, p in enumerate(planned)}, repeats=TIMED_STEPS
        )
    return [statistics.median(times[str(i)]) for i in range(len(planned))]


@contextlib.contextmanager
def _trials_shown(show: bool, measure: Callable[[Plan], int]) -> Iterator[Callable[[Plan], int]]:
    """``measure`` counted on a tqdm bar (shown where ``show``): each call compiles and
    measures one graph, the plan it runs named beside the bar."""
    from tqdm.auto import tqdm

    with tqdm(desc="remat.auto: compiling plans", unit="graph", disable=not show) as bar:

        def shown(plan: Plan) -> int:
            bar.set_postfix_str(describe_compiled(plan))
            try:
                return measure(plan)
            finally:
                bar.update()

        yield shown


def _first_capture(
    model: nn.Module, fake: bool, run: Callable[[dict[str, Any]], Any]
) -> tuple[Any, dict[str, Any]]:
    """``run(options)`` (a chain or graph capture) with :func:`_capture_options`, and those
    options, which the re-plans use too. An eager capture that runs out of memory (the step
    does not fit the device) is done again under fake tensors, with a warning: planning never
    needs more memory than the machine has."""
    import gc
    import warnings

    options = _capture_options(model, fake)
    try:
        return run(options), options
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if fake or not _out_of_memory(err):
            raise
        message = str(err).splitlines()[0][:200]
    gc.collect()  # the failed step's tensors (a traceback cycle may hold them)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    warnings.warn(
        f"remat.auto: the eager step ran out of memory while capturing ({message}); capturing "
        "under fake tensors instead, with times from the calibrated cost model (pass "
        "fake=True to skip the eager attempt)",
        stacklevel=3,
    )
    options = _capture_options(model, True)
    return run(options), options


_STAGE_BYTES = (
    "out_bytes",
    "saved_bytes",
    "fwd_overhead_bytes",
    "fwd_none_overhead_bytes",
    "bwd_overhead_bytes",
)
"""The per-stage memory costs of a chain a stage's eager and compiled captures are compared on
(with its small scratch)."""


def _holds_no_more(eager: Captured, compiled: Captured, i: int) -> bool:
    """Stage ``i`` (from 0) holds no more eager than compiled in any of its costs
    (:data:`_STAGE_BYTES` and its small scratch): left eager, it raises no plan's peak."""
    return all(
        getattr(eager.chain, f)[i] <= getattr(compiled.chain, f)[i] for f in _STAGE_BYTES
    ) and all(a <= b for a, b in zip(_scratch(eager, i), _scratch(compiled, i), strict=True))


def _holds_less(eager: Captured, compiled: Captured, i: int) -> bool:
    """Stage ``i`` (from 0) holds less eager than compiled in its costs summed
    (:data:`_STAGE_BYTES` and its small scratch): a guess of where the eager step holds less
    overall, which :meth:`_StepModel.eager_where_smaller` checks on the mix captured."""

    def held(c: Captured) -> int:
        return sum(getattr(c.chain, f)[i] for f in _STAGE_BYTES) + sum(_scratch(c, i))

    return held(eager) < held(compiled)


def _scratch(captured: Captured, i: int) -> tuple[int, int]:
    """Stage ``i``'s small scratch, forward and backward (:attr:`Captured.small_scratch_bytes`)."""
    return captured.small_scratch_bytes[i] if captured.small_scratch_bytes else (0, 0)


def _alike_stages(captured: Captured) -> dict[Any, list[int]]:
    """The stages (indices from 0) grouped by class, parameter shapes and the bytes they take
    in and give out (NOTE [ A stage compiled where it pays ] in :meth:`_StepModel.per_stage_mix`)."""
    chain = captured.chain
    groups: dict[Any, list[int]] = {}
    for i, module in enumerate(captured.stages.modules):
        shapes = tuple(tuple(p.shape) for p in module.parameters())
        taken = chain.out_bytes[i - 1] if i else chain.input_bytes
        groups.setdefault((type(module), shapes, taken, chain.out_bytes[i]), []).append(i)
    return groups


def _batch_for_meta_parameters(model: nn.Module, batch: Any, fake: bool) -> Any:
    """``batch`` on ``"meta"`` for a model whose parameters are there (built without memory
    under ``torch.device("meta")``): only its shapes and dtypes matter to a fake capture. Such
    a model cannot run an eager step: without ``fake=True`` it is refused, saying so."""
    from torch.utils._pytree import tree_map_only

    if not any(p.device.type == "meta" for p in model.parameters()):
        return batch
    if not fake:
        raise ValueError(
            "remat.auto: the model's parameters are on torch.device('meta') (no memory), so "
            "its step cannot run: plan it with fake=True, then materialise the planned model "
            "(planned.to_empty(device=...) and initialise it)"
        )
    return tree_map_only(torch.Tensor, lambda t: t.to("meta"), batch)


def _out_of_memory(err: BaseException) -> bool:
    """A device out of memory (CUDA's ``torch.OutOfMemoryError``; the CPU allocator raises a
    ``RuntimeError`` saying it can't allocate memory)."""
    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err)


def _capture_options(model: nn.Module, fake: bool) -> dict[str, Any]:
    """Keyword arguments of the chain and graph captures (and their re-plans): none (real
    tensors, measured times), or fake tensors with the time model calibrated for the model's
    device and dtype (:func:`remat.measure.calibration.time_model_for`)."""
    if not fake:
        return {}

    device, dtype = planning_device(model)
    return {"fake": True, "time_model": time_model_for(device, dtype)}
