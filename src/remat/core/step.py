"""The whole training step's peak: :class:`StepCosts` and :func:`step_peak`, the one model of
the step that the chain and graph paths of :func:`remat.auto`, :func:`remat.fit` and
:func:`remat.distributed.auto_distributed` share (their costs built in one place,
:func:`remat.auto.step_costs`).

A simulator (:func:`remat.simulate`, :func:`remat.graphs.simulate_graph`) gives the plan's
activation timeline; this module adds what lives beside the activations:

* ``persistent_bytes``: parameters, buffers and optimizer state, live all step;
* the parameter gradients, as the backward makes them (``grad_bytes[i]`` from the first
  backward of stage/node ``i`` on; during that backward ``grad_rise_bytes[i]`` of them), or,
  when ``.grad`` already holds them all (``grads_live``: the second microbatch on, a step
  without an optimizer), all of them plus the new gradient of the stage being back-propagated;
* ``output_held_bytes``: **the model output the user's loop keeps**. The loop of PyTorch's own
  examples, ``out = model(x); loss = crit(out, y); loss.backward(); opt.step()``, holds ``out``
  through the backward and the optimizer step, and across iterations until the next forward
  returns; so it is counted over the whole step. A loop that keeps only the loss
  (``loss = crit(model(x), y)``, ``loss = model(**batch).loss``, ``loss_fn(model, batch)``)
  holds nothing: 0;
* **the loop's own criterion**, where remat captured another loss than the one the loop
  computes (no ``loss_fn``: remat plans with the output's sum): ``criterion_peak_bytes``, its
  highest bytes beside the output, once at the end of the forward (where its forward and
  backward run), and ``output_grad_bytes``, the output's gradient its backward makes, from then
  to the end of the model's first backward operation (the last stage's or node's, after any
  recomputation of it): :func:`criterion_costs`, an upper bound over :data:`CRITERIA`;
* the small tensors no stage cost sees, where they live: the wrapped scalars each forward
  keeps to its backward (``forward_kept_bytes``) and the loss with the gradient its backward
  is seeded with (``loss_bytes``), through the whole backward;
* the optimizer step, the step's last phase: persistent state, every gradient, the batch
  (``input_bytes``), the held output, the loss and ``optimizer_step_bytes`` of the step's
  temporaries.

Pure Python: no torch (the layer rule of /work/shared/architecture.md).

Example:
    >>> costs = StepCosts(persistent_bytes=100, grad_bytes=(10, 20), output_held_bytes=5)
    >>> timeline = [StepEvent(False, 0, 40, 30), StepEvent(False, 1, 60, 50),
    ...             StepEvent(True, 1, 70, 40), StepEvent(True, 0, 45, 0)]
    >>> step_peak(timeline, costs)      # 100 + 5 + 20 (B of stage 1 makes its grads) + 70
    195
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "LOOPS",
    "CHECKPOINT_STATES",
    "StepCosts",
    "StepEvent",
    "StepPhases",
    "step_peak",
    "step_phases",
    "measured_step_peak",
    "event_step_bytes",
    "segment_state_bytes",
    "output_held_bytes",
    "check_loop",
    "CRITERIA",
    "CRITERION_PEAK_OUTPUTS",
    "criterion_costs",
]

LOOPS: dict[str, str] = {
    "output-held": (
        "the model's output held to the end of the step "
        "(out = model(x); loss = crit(out, y); loss.backward(); opt.step())"
    ),
    "loss-only": (
        "only the loss held; the output is freed once the loss is computed "
        "(loss = crit(model(x), y) / model(**batch).loss / loss_fn(model, batch))"
    ),
}
"""The training loops a whole-step budget can be made for (``loop=`` of :func:`remat.auto`)."""

CHECKPOINT_STATES: dict[str, str] = {
    "per-segment": (
        "one RNG state per checkpointed segment, from its forward to its backward, and one "
        "more while a segment is recomputed (torch.random.fork_rng): torch.utils.checkpoint, "
        "the chain executor"
    ),
    "per-random-call": (
        "one RNG state per random call (dropout) inside a checkpointed segment, from the "
        "top-level segment's forward to its backward, and one more while a segment with random "
        "calls is replayed (torch.random.fork_rng): the graph executor"
    ),
}
"""What :attr:`StepCosts.checkpoint_states` may say."""


def check_loop(loop: str) -> str:
    """``loop`` if it is one of :data:`LOOPS`, else a ValueError that names them."""
    if loop not in LOOPS:
        shown = "; ".join(f"{k!r}: {v}" for k, v in LOOPS.items())
        raise ValueError(f"loop must be one of {sorted(LOOPS)}, got {loop!r} ({shown})")
    return loop


CRITERIA: dict[str, int] = {
    "F.cross_entropy(out, y) (class indices, probabilities, label smoothing)": 3,
    "F.nll_loss(F.log_softmax(out, -1), y)": 3,
    "F.kl_div(F.log_softmax(out, -1), p)": 4,
    "F.mse_loss(out, t)": 2,
    "(out - t).pow(2).mean()": 5,
    "out.pow(2).mean(), (out ** 2).mean(), (out * out).mean()": 4,
    "F.l1_loss(out, t), out.abs().mean()": 4,
    "F.smooth_l1_loss(out, t), F.huber_loss(out, t)": 2,
    "F.binary_cross_entropy_with_logits(out, t)": 2,
    "F.binary_cross_entropy(out.sigmoid(), t)": 4,
    "out.sum(), out.mean(), out.norm()": 2,
}
"""Criteria a training loop applies to the model's output, and the most bytes each holds beside
that output while its forward and backward run, in output-sized tensors (the output's own
dtype; the output's gradient included, which the backward then passes to the model), measured
with the allocator's events on the CPU (``tests/test_step_criteria.py`` checks every entry):
cross-entropy's log-softmax, the gradient of its negative log-likelihood and the logits'
gradient are 3; a squared error by hand saves the difference, and its backward makes the mean's
gradient, the power's derivative and its product. Half-precision logits count at float32 (the
captures' ``largest_output_bytes``: :func:`remat.measure.events.criterion_input_bytes`), which
covers a criterion on them made float (cross-entropy of bfloat16 logits ``.float()``: the copy,
its log-softmax and gradients, 3.5 float32 outputs). Not covered: one that makes more
output-sized temporaries than these; pass ``loss_fn`` then (its memory is measured)."""

CRITERION_PEAK_OUTPUTS = max(CRITERIA.values())
"""The most output-sized tensors any of :data:`CRITERIA` holds at once: the bound
:func:`criterion_costs` counts for a criterion remat did not see."""


def output_held_bytes(loop: str, model_output_bytes: int) -> int:
    """Bytes of the model's output that ``loop`` keeps alive beside the step's activations
    (the criterion the loop applies to it: :func:`criterion_costs`)."""
    if check_loop(loop) != "output-held":
        return 0
    return model_output_bytes


def criterion_costs(loop: str, largest_output_bytes: int) -> tuple[int, int]:
    """``(criterion_peak_bytes, output_grad_bytes)`` of :class:`StepCosts` for a loop whose
    criterion remat did not capture (planned with the output's sum, no ``loss_fn``), applied to
    the largest tensor of the output (the logits, ``largest_output_bytes``): at most
    :data:`CRITERION_PEAK_OUTPUTS` of it at the end of the forward (:data:`CRITERIA`; with
    ``loop="loss-only"`` the output itself too, which the criterion may save and the loop does
    not hold), and one of it, the output's gradient, until the model's first backward has read
    it. ``(0, 0)`` where the captured loss is the loop's own: pass 0 then."""
    check_loop(loop)
    if largest_output_bytes <= 0:
        return 0, 0
    output = largest_output_bytes if loop == "loss-only" else 0
    return CRITERION_PEAK_OUTPUTS * largest_output_bytes + output, largest_output_bytes


class StepEvent(NamedTuple):
    """One operation of a simulated timeline, as the whole-step model reads it."""

    backward: bool
    """True for the backward of ``index``."""
    index: int
    """The stage (0-based) or graph node the operation runs."""
    peak_bytes: int
    """Highest activation-side bytes during the operation."""
    live_bytes: int
    """Activation-side bytes right after it."""


@dataclass(frozen=True)
class StepCosts:
    """What the whole step holds beside the plan's activations (module docstring)."""

    persistent_bytes: int
    """Parameters, buffers and optimizer state (no gradients; the batch only where the
    simulator does not count it as its input)."""
    grad_bytes: tuple[int, ...]
    """Per stage (0-based) or graph node, the parameter-gradient bytes its first backward
    makes."""
    grad_rise_bytes: tuple[int, ...] = ()
    """Per stage or node, how much those gradients raise that backward's peak (empty: all of
    them): :attr:`remat.capture.chain.Captured.grad_rise_bytes`,
    :attr:`remat.capture.graph.GraphTrace.grad_rise_bytes`."""
    optimizer_step_bytes: int = 0
    """Temporaries of one optimizer step (:func:`remat.measure.profile.optimizer_costs`)."""
    output_held_bytes: int = 0
    """The model output the user's training loop keeps through the step
    (:func:`output_held_bytes`)."""
    input_bytes: int = 0
    """The batch as the simulator counts it (live at the optimizer step too)."""
    grads_live: bool = False
    """True when every parameter gradient is live from the step's start (accumulation)."""
    forward_kept_bytes: tuple[int, ...] = ()
    """Per stage (0-based) or node, bytes that every forward of it keeps until its backward,
    whether the forward stores its activations or runs inside a checkpoint: the wrapped
    scalars autograd saves without the saved-tensor hooks (NOTE [ Saved wrapped scalars ] in
    :mod:`remat.capture.chain`; 24 B per GPT-2 block; per node:
    :attr:`remat.capture.graph.GraphTrace.forward_kept_bytes`). :func:`step_peak` counts them from the
    first forward through the backward's peak, and once more on each recomputation, until the
    next backward (the recomputed graph that holds them dies with the recomputation). Empty:
    none."""
    buffer_copy_bytes: tuple[int, ...] = ()
    """Per stage (0-based), bytes of the buffers its forward writes (batch norm's running
    statistics left out: a moving average, spectral norm's vectors, a call counter): the
    chain executor keeps a copy of them from before a checkpointed segment's forward to the
    segment's backward, and a recomputation runs on a throw-away copy of that copy, so that
    the step writes them once (:class:`remat.execute.chain._BuffersWrittenOnce`).
    :func:`segment_state_bytes` counts, per top-level checkpointed segment, the copies of its
    checkpointed segments (nested ones included, an upper bound) from its forward to its
    backward, and once more while it recomputes. An exponential
    moving average in each of 8 blocks, planned nested at the least budget, measured 2.1x
    that budget before they were counted. Empty: none."""
    recompute_kept_bytes: tuple[int, ...] = ()
    """Per stage (0-based), bytes the chain executor copies when it recomputes the stage and
    that live until the stage's backward: batch norm's running statistics, which a
    recomputation reads from throw-away copies (so that the step updates them once) and whose
    backward saves them (:class:`remat.execute.chain._BuffersWrittenOnce`;
    :attr:`remat.capture.chain.Captured.recompute_kept_bytes`). A recomputation makes the
    copies of every stage it recomputes at its start. Empty: none."""
    op_scratch_bytes: tuple[tuple[int, int], ...] = ()
    """Per stage or node, ``(forward, backward)``: the allocator-only bytes below 1 KiB its
    forward's and backward's peaks had beside the tracked tensors when captured on real tensors
    (a kernel's small workspace: layer norm's backward, 512 B; the scalars of Python numbers),
    which the stage costs leave out so that real and fake captures agree
    (:attr:`remat.capture.chain.StageCost.small_scratch_bytes`; per node:
    :attr:`remat.capture.graph.GraphTrace.small_scratch_bytes`). :func:`step_peak` adds them to
    the peak of each forward (recomputations too) and backward event of that index. Empty:
    none."""
    loss_bytes: int = 0
    """The loss tensor's bytes. The simulator frees the loss and its gradient at the last
    stage's backward; in a step, ``loss.backward()`` holds the loss and
    ``torch.autograd.backward`` the gradient it seeds (``ones_like(loss)``) until the whole
    backward returns, and the loop's ``loss`` lives through the optimizer step:
    :func:`step_peak` counts two of it from the first backward event on and one at the
    optimizer step."""
    loss_held: int = 2
    """How many tensors of :attr:`loss_bytes` the backward holds: the loss and the gradient it
    is seeded with (2); :mod:`remat.levers.microbatch`'s loop also keeps the weighted loss
    ``loss * w`` it calls ``backward`` on (3)."""
    checkpoint_state_bytes: int = 0
    """What the executor keeps per checkpointed segment until its backward (the RNG states
    saved to replay dropout: :func:`remat.auto.checkpoint_state_bytes`), measured on the torch
    side and passed in as a number; :func:`step_peak` counts it for each checkpointed segment
    from the segment's forward to its backward (:func:`segment_state_bytes`)."""
    criterion_peak_bytes: int = 0
    """A criterion the loop applies to the output and remat did not capture
    (:func:`criterion_costs`): its highest bytes, counted once at the end of the forward (the
    timeline's last event before its first backward or recomputation)."""
    output_grad_bytes: int = 0
    """That criterion's gradient of the output, counted from the end of the forward through the
    timeline's first backward event (the model's first backward, which reads it; a
    recomputation before it included)."""
    forward_only_bytes: int = 0
    """Of ``input_bytes``, the tensors that live only through the forward unless a checkpoint
    keeps them as a segment's input: what a stage makes and every later stage is handed, and
    no stage saves (a causal mask). Left out from the first backward event on in a timeline
    with no recomputation, and at the optimizer step (NOTE [ Carried tensors no stage saves ]
    in :mod:`remat.capture.chain`). Chains only."""
    carried_grads: tuple[tuple[int, int, int], ...] = ()
    """``(maker, last, bytes)`` per tensor a stage (0-based) makes and every later stage is
    handed, that requires grad (DeBERTa's relative-position embeddings, made before the blocks
    and read by each): its gradient, which each reading stage's backward adds to, lives from
    the backward of ``last`` (the last stage whose backward gave it one) through the backward
    of ``maker``; no stage's own cost holds it (NOTE [ The gradient of a carried tensor ] in
    :mod:`remat.capture.chain`). Chains only; empty: none."""
    checkpoint_states: str = "per-segment"
    """How many of those states the executor keeps (:data:`CHECKPOINT_STATES`):
    ``"per-segment"``, one per checkpointed segment (torch's checkpoint: the chain executor), or
    ``"per-random-call"``, one per random call inside a checkpointed segment plus one while a
    segment with random calls is replayed (the graph executor; read on a graph only,
    :func:`remat.core.simulate.graph_step_peak`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "grad_bytes", tuple(int(b) for b in self.grad_bytes))
        object.__setattr__(self, "grad_rise_bytes", tuple(int(b) for b in self.grad_rise_bytes))
        if self.grad_rise_bytes and len(self.grad_rise_bytes) != len(self.grad_bytes):
            raise ValueError(
                f"grad_rise_bytes has {len(self.grad_rise_bytes)} entries, grad_bytes "
                f"{len(self.grad_bytes)}"
            )
        if self.checkpoint_state_bytes < 0:
            raise ValueError(
                f"checkpoint_state_bytes must be >= 0, got {self.checkpoint_state_bytes}"
            )
        if self.checkpoint_states not in CHECKPOINT_STATES:
            raise ValueError(
                f"checkpoint_states must be one of {sorted(CHECKPOINT_STATES)}, got "
                f"{self.checkpoint_states!r}"
            )
        for name in ("forward_kept_bytes", "recompute_kept_bytes", "buffer_copy_bytes"):
            values = tuple(int(b) for b in getattr(self, name))
            object.__setattr__(self, name, values)
            if values and len(values) != len(self.grad_bytes):
                raise ValueError(
                    f"{name} has {len(values)} entries, grad_bytes {len(self.grad_bytes)}"
                )
        object.__setattr__(
            self, "op_scratch_bytes", tuple((int(f), int(b)) for f, b in self.op_scratch_bytes)
        )
        if self.op_scratch_bytes and len(self.op_scratch_bytes) != len(self.grad_bytes):
            raise ValueError(
                f"op_scratch_bytes has {len(self.op_scratch_bytes)} entries, grad_bytes "
                f"{len(self.grad_bytes)}"
            )
        for name in (
            "output_held_bytes",
            "criterion_peak_bytes",
            "output_grad_bytes",
            "loss_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def held_bytes(self) -> int:
        """Live all step whatever the plan: persistent state and the held output."""
        return self.persistent_bytes + self.output_held_bytes

    @property
    def fixed_bytes(self) -> int:
        """What no plan changes at the end of the backward: held bytes and every gradient."""
        return self.held_bytes + sum(self.grad_bytes)

    @property
    def optimizer_phase_bytes(self) -> int:
        """The optimizer step: every gradient, the batch, the held output, the loss, its
        temporaries."""
        return (
            self.fixed_bytes
            + self.input_bytes
            - self.forward_only_bytes
            + self.loss_bytes
            + self.optimizer_step_bytes
        )


class StepPhases(NamedTuple):
    """The whole step's peak by phase (:func:`step_phases`): a plan changes the first, not the
    second."""

    backward_bytes: int
    """The forward and backward's peak: the timeline's, with what :func:`step_peak` adds."""
    optimizer_bytes: int
    """The optimizer step's: :attr:`StepCosts.optimizer_phase_bytes`."""

    @property
    def peak_bytes(self) -> int:
        """The whole step's peak: the larger phase."""
        return max(self.backward_bytes, self.optimizer_bytes)


def step_peak(
    timeline: Iterable[StepEvent], costs: StepCosts, segments: Sequence[tuple[int, int]] = ()
) -> int:
    """The whole step's peak: :attr:`StepCosts.held_bytes` + the checkpoint states live (each
    top-level checkpointed segment of ``segments``, ``(first index, checkpointed segments in
    its subtree)``, keeps ``costs.checkpoint_state_bytes`` per checkpoint from its forward to
    its backward: :func:`segment_state_bytes`) + the parameter gradients made so far + the
    timeline's bytes, maximised over the timeline, and the optimizer step
    (:attr:`StepCosts.optimizer_phase_bytes`). The one whole-step model of chains and graphs:
    ``segments`` comes from :func:`remat.core.simulate.checkpoint_spans` for both."""
    return step_phases(timeline, costs, segments).peak_bytes


def step_phases(
    timeline: Iterable[StepEvent], costs: StepCosts, segments: Sequence[tuple[int, int]] = ()
) -> StepPhases:
    """:func:`step_peak` by phase: the forward and backward's peak (the most of
    :func:`event_step_bytes`) and the optimizer step's."""
    return StepPhases(
        max(event_step_bytes(timeline, costs, segments), default=0), costs.optimizer_phase_bytes
    )


def measured_step_peak(
    timeline: Sequence[StepEvent],
    costs: StepCosts,
    measured_bytes: int,
    measured_costs: StepCosts,
    measured_timeline: Sequence[StepEvent] | None = None,
    segments: Sequence[tuple[int, int]] = (),
) -> int:
    """The whole step's peak of a plan whose forward and backward were measured, not only
    simulated: the plan ran (compiled as one graph, NOTE [ One compiled graph ] in
    :mod:`remat.execute.chain`) with ``measured_costs`` beside it (the captured loss, no
    optimizer, nothing held: no optimizer phase) and peaked at ``measured_bytes``, where the
    simulation of that step (``measured_timeline``, default ``timeline``: the plan's timeline
    on the structure it was measured with) peaks at ``simulated`` bytes.

    The step of ``costs`` holds at each event what ``costs`` adds there to ``measured_costs``
    (:func:`event_step_bytes` of the two, event by event): persistent state, the held output,
    all step; an uncaptured criterion, at the end of the forward. So its forward and backward
    peak at most at ``measured_bytes`` plus the most it adds at any event; where it adds the
    same bytes all through, that is its simulated forward and backward moved by what the graph
    measured above or below the simulation (``measured_bytes - simulated``). Where it adds
    more at some events than at the simulated peak, that bound can exceed the simulated peak
    moved by a measured excess (the excess counted at the simulated peak): the lower of the
    two is taken, which is never above what the simulation plus the excess, if any, gives.
    The optimizer step is not in the measured step and neither shrinks nor grows with the
    plan's activations: it stays :attr:`StepCosts.optimizer_phase_bytes`. Below
    :func:`step_peak` where the graph measured below the simulation.

    Example (the module's timeline; the measured step without the optimizer's state, the held
    output and the optimizer step, which its simulation puts at 150):
        >>> import dataclasses
        >>> costs = StepCosts(100, (10, 20), output_held_bytes=5, optimizer_step_bytes=40)
        >>> timeline = [StepEvent(False, 0, 40, 30), StepEvent(False, 1, 60, 50),
        ...             StepEvent(True, 1, 70, 40), StepEvent(True, 0, 45, 0)]
        >>> measured = dataclasses.replace(
        ...     costs, persistent_bytes=60, output_held_bytes=0, optimizer_step_bytes=0)
        >>> step_phases(timeline, costs)
        StepPhases(backward_bytes=195, optimizer_bytes=175)
        >>> [measured_step_peak(timeline, costs, b, measured) for b in (160, 140, 100)]
        [205, 185, 175]
    """
    measured_timeline = timeline if measured_timeline is None else measured_timeline
    if len(measured_timeline) != len(timeline):
        raise ValueError(
            f"the measured step's timeline has {len(measured_timeline)} events, the step's "
            f"{len(timeline)}: not the same plan"
        )
    step = event_step_bytes(timeline, costs, segments)
    simulated = event_step_bytes(measured_timeline, measured_costs, segments)
    added = max((a - b for a, b in zip(step, simulated, strict=True)), default=0)
    over = measured_bytes - max(simulated, default=0)
    backward = min(measured_bytes + added, max(step, default=0) + max(0, over))
    return StepPhases(backward, costs.optimizer_phase_bytes).peak_bytes


def event_step_bytes(
    timeline: Iterable[StepEvent], costs: StepCosts, segments: Sequence[tuple[int, int]] = ()
) -> list[int]:
    """Per event of ``timeline``, the whole step's highest bytes during it, before the optimizer
    step (:func:`step_peak`'s terms: held bytes, checkpoint states, the gradients made so far,
    the event's bytes with everything the costs add to them)."""
    timeline = list(timeline)
    if (costs.checkpoint_state_bytes or any(costs.buffer_copy_bytes)) and segments:
        states = segment_state_bytes(
            timeline,
            segments,
            costs.checkpoint_state_bytes,
            forks=costs.checkpoint_states == "per-segment",
        )
        timeline = [
            e._replace(peak_bytes=e.peak_bytes + b, live_bytes=e.live_bytes + b)
            for e, b in zip(timeline, states, strict=True)
        ]
    if any(costs.forward_kept_bytes):
        timeline = _with_forward_kept(timeline, costs.forward_kept_bytes)
    if any(costs.recompute_kept_bytes):
        timeline = _with_recompute_kept(timeline, costs.recompute_kept_bytes)
    if costs.loss_bytes:
        # the loss and the gradient its backward was seeded with
        timeline = _from_backward(timeline, costs.loss_held * costs.loss_bytes)
    if costs.carried_grads:
        timeline = _with_carried_grads(timeline, costs.carried_grads)
    if costs.forward_only_bytes and not any(_recomputations(timeline)):
        timeline = _from_backward(timeline, -costs.forward_only_bytes)
    if any(f or b for f, b in costs.op_scratch_bytes):
        scratch = costs.op_scratch_bytes
        timeline = [
            e if e.index < 0 else e._replace(peak_bytes=e.peak_bytes + scratch[e.index][e.backward])
            for e in timeline
        ]
    if costs.criterion_peak_bytes or costs.output_grad_bytes:
        timeline = _with_criterion(timeline, costs)
    grads_of = costs.grad_bytes
    rise = costs.grad_rise_bytes or grads_of
    held = costs.held_bytes
    if costs.grads_live:
        # NOTE [ Gradients that accumulate ]: .grad already holds every gradient; a stage's
        # backward still makes its new gradients as temporaries before adding them in place
        return [
            held + sum(grads_of) + e.peak_bytes + (grads_of[e.index] if e.backward else 0)
            for e in timeline
        ]
    out = []
    made = [False] * len(grads_of)
    grads = 0
    for e in timeline:
        if e.backward and not made[e.index]:
            made[e.index] = True
            during = held + grads + rise[e.index] + e.peak_bytes
            grads += grads_of[e.index]
            out.append(max(during, held + grads + e.live_bytes))
            continue
        out.append(held + grads + e.peak_bytes)
    return out


def _with_forward_kept(timeline: list[StepEvent], kept: Sequence[int]) -> list[StepEvent]:
    """``timeline`` with :attr:`StepCosts.forward_kept_bytes`: ``kept[i]`` from the first
    forward of ``i`` through the peak of its backward (gone in that backward's live bytes),
    and on each recomputation of ``i`` once more, summed over the recomputations since the
    last backward event."""
    live = 0
    burst = 0  # the copies the recomputation running now has made
    seen: set[int] = set()
    out = []
    for e in timeline:
        if e.backward:
            burst = 0
            after = live - kept[e.index] if e.index in seen else live
            out.append(e._replace(peak_bytes=e.peak_bytes + live, live_bytes=e.live_bytes + after))
            live = after
            continue
        if e.index < 0:  # the chain's loss event
            pass
        elif e.index in seen:
            burst += kept[e.index]
        else:
            seen.add(e.index)
            live += kept[e.index]
        extra = live + burst
        out.append(e._replace(peak_bytes=e.peak_bytes + extra, live_bytes=e.live_bytes + extra))
    return out


def _recomputations(timeline: Sequence[StepEvent]) -> list[bool]:
    """Per event, whether it is a recomputation: a forward of a stage or node that ran before
    (the chain's loss event, index -1, is none)."""
    ran: set[int] = set()
    out = []
    for e in timeline:
        out.append(not e.backward and e.index >= 0 and e.index in ran)
        if not e.backward:
            ran.add(e.index)
    return out


def _with_recompute_kept(timeline: list[StepEvent], kept: Sequence[int]) -> list[StepEvent]:
    """``timeline`` with :attr:`StepCosts.recompute_kept_bytes`: a recomputation (a run of
    forward events of stages that ran before) makes ``kept[i]`` for each stage ``i`` it
    recomputes at its first event, live until the peak of ``i``'s next backward."""
    n = len(timeline)
    extra = [0] * n  # at each event's peak
    after = [0] * n  # in its live bytes
    again = _recomputations(timeline)
    pos = 0
    while pos < n:
        if not again[pos]:
            pos += 1
            continue
        start = pos  # a recomputation: the run of forward events of stages that ran before
        stages = set()
        while pos < n and again[pos]:
            stages.add(timeline[pos].index)
            pos += 1
        for i in stages:
            end = next(
                (q for q in range(pos, n) if timeline[q].backward and timeline[q].index == i), n - 1
            )
            for q in range(start, end + 1):
                extra[q] += kept[i]
                after[q] += kept[i] if q < end else 0
    return [
        e._replace(peak_bytes=e.peak_bytes + x, live_bytes=e.live_bytes + a)
        for e, x, a in zip(timeline, extra, after, strict=True)
    ]


def _from_backward(timeline: list[StepEvent], held_bytes: int) -> list[StepEvent]:
    """``timeline`` with ``held_bytes`` on every event from the first backward event on: the
    loss and its seed (:attr:`StepCosts.loss_held` of :attr:`StepCosts.loss_bytes`), or, less,
    :attr:`StepCosts.forward_only_bytes`."""
    out = []
    held = 0
    for e in timeline:
        if e.backward:
            held = held_bytes
        out.append(e._replace(peak_bytes=e.peak_bytes + held, live_bytes=e.live_bytes + held))
    return out


def _with_carried_grads(
    timeline: list[StepEvent], carried: Sequence[tuple[int, int, int]]
) -> list[StepEvent]:
    """``timeline`` with :attr:`StepCosts.carried_grads`: each gradient in the bytes of every
    event from the first backward event of its ``last`` stage through the first backward
    event of its ``maker``, and in the live bytes after each of them but that last. (A stage
    measured alone counts the gradients its backward gives its inputs as gradients, not as
    its own bytes, and the chain counts only its hidden state's: ``delta``.)"""
    peak = [0] * len(timeline)
    live = [0] * len(timeline)
    for maker, last, nbytes in carried:
        start = next(
            (q for q, e in enumerate(timeline) if e.backward and e.index == last), len(timeline)
        )
        end = next(
            (q for q, e in enumerate(timeline) if q > start and e.backward and e.index == maker),
            len(timeline),
        )
        for q in range(start, min(end + 1, len(timeline))):
            peak[q] += nbytes
            live[q] += nbytes if q < end else 0
    return [
        e._replace(peak_bytes=e.peak_bytes + p, live_bytes=e.live_bytes + v)
        for e, p, v in zip(timeline, peak, live, strict=True)
    ]


def _with_criterion(timeline: list[StepEvent], costs: StepCosts) -> list[StepEvent]:
    """``timeline`` with the uncaptured criterion (:attr:`StepCosts.criterion_peak_bytes`, at
    the forward's last event, above its live bytes: the event's peak is the higher of its own
    and that; the events stay one per operation, as :func:`measured_step_peak` pairs them) and
    the output's gradient
    (:attr:`StepCosts.output_grad_bytes`, on every event from there through the first
    backward; after that backward it is freed) added. The forward ends at the last event before
    the first backward or the first forward of an index already run (a recomputation)."""
    seen: set[int] = set()
    end = -1
    for i, e in enumerate(timeline):
        if e.backward or e.index in seen:
            break
        seen.add(e.index)
        end = i
    if end < 0:
        return timeline
    last = timeline[end]
    grad = costs.output_grad_bytes
    out = timeline[:end]
    criterion = last.live_bytes + costs.criterion_peak_bytes
    out.append(last._replace(peak_bytes=max(last.peak_bytes, criterion)))
    after = iter(timeline[end + 1 :])
    for e in after:
        if e.backward:
            out.append(e._replace(peak_bytes=e.peak_bytes + grad))
            break
        out.append(e._replace(peak_bytes=e.peak_bytes + grad, live_bytes=e.live_bytes + grad))
    out.extend(after)
    return out


def segment_state_bytes(
    timeline: Sequence[StepEvent],
    segments: Sequence[tuple[int, ...]],
    state_bytes: int,
    forks: bool = True,
) -> list[int]:
    """Per event of a chain's or graph's ``timeline``, the bytes of checkpoint state live
    during it: a checkpointed top-level segment whose first stage or node (in forward order,
    0-based) is ``start``, with ``count`` checkpointed segments in its subtree (``segments``:
    ``(start, count)`` pairs) keeps ``count * state_bytes`` (the RNG state each checkpoint
    saves) from that first forward to the end of ``start``'s backward (the segment's last),
    when autograd frees the checkpoint with the segment's nodes. Its nested segments are
    counted with it, an upper bound: a nested one only exists while its parent recomputes.
    With ``forks``, during a recomputation (a forward of a stage or node that ran before) one
    more state is live: torch's checkpoint forks the RNG (``torch.random.fork_rng``) around it,
    keeping the current state aside (a DistilBERT step recomputing one layer measured 968 B
    above its prediction without it). The graph executor's replays are counted by
    :func:`remat.core.simulate.graph_step_peak` instead.

    A third number, ``(start, count, copies)``, is the bytes of written buffers the segment's
    checkpoints copy (:attr:`StepCosts.buffer_copy_bytes`): held over the same span, and held
    once more while the segment recomputes (the recomputation's throw-away copies; all of the
    subtree's, an upper bound)."""
    weight = {s[0]: s[1] * state_bytes + (s[2] if len(s) > 2 else 0) for s in segments}
    copies = {s[0]: s[2] for s in segments if len(s) > 2 and s[2]}
    live = 0
    started: set[int] = set()  # once: a segment's recomputation runs its first stage again
    out = []
    for e, again in zip(timeline, _recomputations(timeline), strict=True):
        if not e.backward and e.index in weight and e.index not in started:
            started.add(e.index)
            live += weight[e.index]
        extra = state_bytes if forks and again else 0
        if again and copies:
            # the recomputing segment: the live one that starts last at or before the event
            owner = max((i for i in copies if i in started and i <= e.index), default=None)
            extra += copies[owner] if owner is not None else 0
        out.append(live + extra)
        if e.backward and e.index in weight:
            live -= weight[e.index]
            started.discard(e.index)
    return out
