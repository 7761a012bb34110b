"""Apply a chain :class:`~remat.core.plan.Plan` to a real PyTorch model: :func:`apply`.

The model is cut into stages (:mod:`remat.capture.stages`); the plan's segment tree becomes nested
**non-reentrant** ``torch.utils.checkpoint`` calls:

* a stored segment runs its stages plainly (autograd keeps what their backward needs);
* a checkpointed segment is ``checkpoint(run_children, *input_tensors)`` where
  ``run_children`` runs the segment's sub-plan (its ``children``), which may hold further
  checkpointed segments: nesting depth = plan depth.

This executes exactly what :func:`remat.simulate` assumes (forward counts are tested equal),
because torch's nested checkpoint recomputes a segment by re-running its function, in which the
inner checkpoints are respected again (NOTE [ Nestable Checkpoint ], Rule 3). With torch's *early
stop* (on by default) a recomputation ends once the tensors its backward needs exist, so the
executor runs at most what :func:`remat.simulate` counts (an upper bound of time and memory);
``early_stop=False`` runs exactly that (see ``docs/executor.md``).

Gradients equal the unplanned model's: random number generator state is restored for every
recomputation (dropout masks are identical), autocast state is re-entered by torch, and
batch-norm running statistics are updated once per step (recomputations update throw-away
copies of the statistics). In eval mode or under ``torch.no_grad()`` the model runs plainly with
no checkpoint machinery at all.

Example:
    >>> import torch, remat
    >>> from torch import nn
    >>> model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    >>> planned = remat.apply(model, remat.Plan.from_checkpoints(6, [2, 4]))
    >>> planned(torch.randn(4, 8)).sum().backward()
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import inspect
import logging
import time
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch._functorch.config as _functorch_config
from torch import nn
from torch.utils import checkpoint as _torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from remat.capture.chain import autocast_now, compile_stages, draws_random, no_autocast_cache
from remat.capture.stages import (
    Stages,
    StageWatch,
    _run_plain,
    around,
    split_stages,
    traceable,
)
from remat.core.errors import RematError
from remat.core.plan import ChainSegment, Plan, PlanError, span
from remat.guards import (
    InPlaceInputError,
    _versions,
    buffer_slots,
    check_no_own_checkpointing,
    check_not_wrapped,
    describe_signature,
    in_place_input_error,
    input_signature,
    pauses_update,
    running_stat,
    tensor_version,
)
from remat.measure.profile import loss_from_output

__all__ = [
    "apply",
    "as_one_graph",
    "describe_compiled",
    "eager_stages",
    "with_eager_stages",
    "partitioner_budget",
    "partitioner_solver",
    "with_partitioner_budget",
    "PlannedModule",
    "SignatureMismatchError",
    "InPlaceInputError",
    "SignaturePlans",
    "input_signature",
    "call_loss",
    "step_state",
    "replanning_state",
]


class SignatureMismatchError(RematError, ValueError):
    """The model was called with inputs of other shapes/dtypes than the plan was made for."""


# The checkpoint function the executor calls (a module attribute so tests can count calls).
checkpoint = _torch_checkpoint.checkpoint


def _example_args(example: Any) -> tuple[tuple, dict]:
    if (
        isinstance(example, tuple)
        and len(example) == 2
        and isinstance(example[0], tuple)
        and isinstance(example[1], Mapping)
    ):
        return example[0], dict(example[1])
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, Mapping):
        return (), dict(example)
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    raise TypeError(
        "example must be the model's input: a tensor, a tuple of positional arguments, a "
        "dict of keyword arguments, or (args_tuple, kwargs_dict); got "
        f"{type(example).__name__}"
    )


def call_loss(model: nn.Module, call: tuple[tuple, dict]) -> torch.Tensor:
    """The loss remat plans a new input shape with: ``call`` is the model's call arguments
    ``(args, kwargs)``; the loss is the output's ``.loss`` (a Hugging Face model given labels)
    or its sum (:func:`remat.measure.profile.loss_from_output`). A planned module sees the model's
    arguments only, not the batch a user's ``loss_fn`` takes."""

    args, kwargs = call
    return loss_from_output(model(*args, **kwargs))


StepState = tuple[bool, tuple[bool, ...], tuple[tuple[str, torch.dtype], ...]]
""":func:`step_state`: ``(gradients live, which parameters train, autocast regions)``."""


def step_state(model: nn.Module) -> StepState:
    """What a training step's memory depends on beside its inputs: whether parameter
    gradients are live when the forward starts (gradient accumulation over microbatches, a
    loop without ``zero_grad(set_to_none=True)``: every gradient is held through the whole
    step), which parameters train (a parameter unfrozen after planning gets a gradient), and
    the autocast regions the model is called in (:func:`remat.capture.chain.autocast_now`: a
    step in bfloat16 saves other bytes, and keeps 16-bit copies of the weights it reads).
    """
    # A walk of the module tree's own dicts, not ``model.parameters()`` (which names every
    # module on the way): called on every training step, 3-4x faster (GPT-2 tiny: 21 against
    # 78 us), and with no generator per module another 2x (10 us). A parameter shared by two
    # modules is listed twice, the same on every call.
    live = False
    trains = []
    todo: list[nn.Module | None] = [model]
    for module in todo:  # (grows as it goes: breadth first)
        if module is None:
            continue
        params = module._parameters
        if params:
            for p in params.values():
                if p is not None:
                    trains.append(trains_now := p.requires_grad)
                    if trains_now and not live and p.grad is not None:
                        live = True
        todo.extend(module._modules.values())
    return live, tuple(trains), autocast_now()


_REPLANNING_STATE: contextvars.ContextVar[Any] = contextvars.ContextVar("remat_replanning_state")


def replanning_state() -> StepState | None:
    """Inside a ``replan`` called by :class:`SignaturePlans`: the :func:`step_state` of the
    planned module being called (its own model's, also for a ``copy.deepcopy`` of it, whose
    ``replan`` still closes over the original model); None elsewhere."""
    return _REPLANNING_STATE.get(None)


def planned_state(model: nn.Module) -> StepState:
    """The :func:`step_state` a plan of :func:`remat.auto` is made for: no gradient live at
    the forward's start (``zero_grad(set_to_none=True)`` before the step), the parameters that
    train now, in the autocast regions in force now (:func:`remat.auto` builds the planned
    module in those its ``loss_fn`` called the model in)."""
    _, trains, autocast = step_state(model)
    return False, trains, autocast


NOT_PICKLED = (
    "This planned module was unpickled: remat.auto's re-plan (a closure over the model, its "
    "loss_fn, the optimizer and the capture) is not saved with it. Call remat.auto(loaded.model, "
    "batch, ...) again to plan for these inputs (or save planned.state_dict() and plan the "
    "rebuilt model)."
)
"""What a pickled planned module says where it would need :func:`remat.auto`'s re-plan."""


class SignaturePlans:
    """What a planned module runs for each input signature: the one place (chain and graph
    executors) where a training call with new input shapes is re-planned or refused.

    ``current`` is what runs for ``signature`` (None: the first training call's signature is
    adopted). For another signature, ``replan(*args, **kwargs)`` (the model's call arguments)
    makes a plan and ``build(plan, args, kwargs)`` what runs it; results are cached per
    signature. Without ``replan`` a new signature raises :class:`SignatureMismatchError`
    saying ``what_to_do``.

    With a ``replan`` marked ``replan.plans_for_step_state = True`` (:func:`remat.auto`'s),
    the ``state`` :meth:`lookup` is given (:func:`step_state`: gradients live at the forward's
    start, which parameters train) is part of the key too: a training call in another state
    than ``initial_state`` (the one ``current`` was planned for) is re-planned as well, and
    ``replan`` plans for that state (:func:`replanning_state`). Other ``replan`` callables are
    called for new input signatures only.
    """

    def __init__(
        self,
        current: Any,
        signature: tuple | None,
        replan: Callable[..., Any] | None,
        build: Callable[[Any, tuple, dict], Any],
        what_to_do: str,
        initial_state: Any = None,
    ) -> None:
        self.current = current
        self.signature: tuple | None = None
        self.replan = replan
        self.build = build
        self.what_to_do = what_to_do
        self.stateful = bool(getattr(replan, "plans_for_step_state", False))
        self.initial_state = initial_state
        self.key: Any = None
        self.cache: dict[Any, Any] = {}
        self.set(signature, current)

    replan_seconds = 0.0
    """Wall time spent in ``replan`` and ``build`` so far."""
    warned_many = False
    """Whether :meth:`_warn_if_many` warned."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save(planned)``, ``copy.deepcopy`` excepted: it keeps the state
        whole) without :func:`remat.auto`'s ``replan``, a closure over the model, its
        ``loss_fn``, the optimizer and the capture that pickle cannot save: the loaded module
        runs the plans it has (one per input signature and step state seen), and a training
        call that would need a new one raises :class:`SignatureMismatchError` saying
        :data:`NOT_PICKLED`. Another ``replan`` (given to :func:`remat.apply`) is pickled as it
        is."""
        state = self.__dict__.copy()
        if self.stateful:  # remat.auto's re-plan
            state["replan"] = None
            state["what_to_do"] = NOT_PICKLED
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> SignaturePlans:
        new = object.__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    def _key(self, signature: tuple, state: Any) -> Any:
        return (signature, state) if self.stateful else signature

    def set(self, signature: tuple | None, current: Any, state: Any = None) -> None:
        """``current`` runs ``signature`` (in ``state``; default: the initial state)."""
        self.current, self.signature = current, signature
        if signature is not None:
            self.key = self._key(signature, self.initial_state if state is None else state)
            self.cache[self.key] = current

    def lookup(self, args: tuple, kwargs: dict, state: Any = None) -> Any:
        """What runs a training call with these arguments (re-planned on a new signature, or
        in a new ``state``)."""
        sig = input_signature(*args, **kwargs)
        if self.signature is None:
            self.set(sig, self.current)
        key = self._key(sig, state)
        if key != self.key:
            cached = self.cache.get(key)
            if cached is not None:
                self.current, self.signature, self.key = cached, sig, key
            elif self.replan is None:
                what = (
                    f"inputs {describe_signature(self.signature)} but the model was called with "
                    f"{describe_signature(sig)}"
                    if sig != self.signature
                    else "another training state (which parameters train, gradients already "
                    "held at the forward's start: accumulation, no zero_grad(set_to_none=True), "
                    "or autocast on or off)"
                )
                raise SignatureMismatchError(
                    f"this plan was made for {what}; memory and time of a plan depend on the "
                    f"batch shape and on the gradients held, so remat does not run it there. "
                    f"{self.what_to_do}"
                )
            else:
                token = _REPLANNING_STATE.set(state)
                start = time.perf_counter()
                try:
                    plan = self.replan(*args, **kwargs)
                finally:
                    _REPLANNING_STATE.reset(token)
                self.set(sig, self.build(plan, args, kwargs), state)
                self.replan_seconds += time.perf_counter() - start
                self._warn_if_many()
        return self.current

    def _warn_if_many(self) -> None:
        """Warn once when :data:`MANY_SIGNATURES` input signatures were planned, or
        :data:`SLOW_SIGNATURES` whose re-plans took :data:`SLOW_REPLANNING_SECONDS` in all:
        batches padded to their longest sequence change shape almost every step, and each new
        shape costs a capture and a plan (with ``compile=``, compilations too: minutes)."""
        signatures = {key[0] for key in self.cache} if self.stateful else set(self.cache)
        slow = len(signatures) >= SLOW_SIGNATURES and self.replan_seconds >= SLOW_REPLANNING_SECONDS
        if self.warned_many or (len(signatures) < MANY_SIGNATURES and not slow):
            return
        self.warned_many = True
        warnings.warn(
            f"remat has planned this model for {len(signatures)} input shapes, re-planning "
            f"{self.replan_seconds:.1f} s in all: each new input shape gets its own plan (its "
            "memory and time depend on the shape; compiled, its graphs compile again for it). "
            "Batches padded to their longest sequence "
            "change shape almost every step; pad them to a few fixed lengths (transformers: "
            "DataCollatorWithPadding(tokenizer, pad_to_multiple_of=64), or padding='max_length') "
            "so that re-planning stops.",
            stacklevel=4,
        )


MANY_SIGNATURES = 8
"""After how many planned input signatures :class:`SignaturePlans` warns that re-planning for
each new shape is being paid (once per planned module)."""
SLOW_SIGNATURES = 3
"""How many planned input signatures make :class:`SignaturePlans` warn as soon as their
re-plans took :data:`SLOW_REPLANNING_SECONDS`: two shapes are common (an epoch's last, smaller
batch), a third says the shapes vary."""
SLOW_REPLANNING_SECONDS = 60.0
"""Re-planning seconds after which a third input signature warns: with ``compile=True`` each
new shape compiles its stages and up to a dozen one-graph trials, 46-203 s a shape for a tiny
GPT-2 under inductor on the shared CPU (docs/executor.md), so :data:`MANY_SIGNATURES` shapes
would be half an hour before the warning."""


# ---------------------------------------------------------------------- buffers
class _SegmentBuffers:
    """A checkpointed segment's buffer slots and which of them its forwards were seen to write
    (learned at its first forward, kept across steps: :class:`_BuffersWrittenOnce` copies only
    those before the next forwards)."""

    def __init__(self, slots: Sequence[tuple[nn.Module, str]]) -> None:
        self.slots = list(slots)
        self.written: set[int] | None = None
        """Indices of ``slots`` a forward wrote (batch norm's running statistics left out);
        None before the first forward."""


class _BuffersWrittenOnce:
    """A checkpoint's ``context_fn`` pair: buffers its forward writes are written once a step,
    and its recomputation reads them as the forward did.

    A forward may update buffers: batch norm's running statistics, an exponential moving
    average, a call counter, spectral norm's power-iteration vectors (in place, or by assigning
    a new tensor to the buffer's name). The forward context keeps a copy of the buffers the
    segment's forwards write from before the forward (at its first forward, of every buffer of
    the segment, the unwritten ones dropped at its end) and notes which the forward wrote
    (version counter or identity changed). A recomputation runs on throw-away copies of those
    values, so the real buffers keep the forward's single update and the recomputation starts
    where the forward started: spectral norm's recomputed power iteration gives the forward's
    weight (starting from the updated vector gave gradients 1.9e-4 off). Batch norm's running
    statistics are copied as the forward left them: a train-mode output does not depend on
    them (batch statistics). Copies, not ``track_running_stats=False``, keep the
    recomputation's saved tensors identical to the forward's: batch norm's backward node saves
    the running statistics as well. The copies from before the forward live until the
    segment's backward: the written buffers' bytes once per checkpointed segment (a moving
    average's or spectral norm's vectors), counted with the recomputation's throw-away copies
    (:attr:`remat.core.step.StepCosts.buffer_copy_bytes`). The
    recomputation's copies of batch norm's running statistics, which its backward saves, live
    until that backward: counted (:attr:`remat.core.step.StepCosts.recompute_kept_bytes`).
    With ``pause`` (the eager executor) torch's own batch norm needs no copies: its
    recomputation runs on the real statistics with the update paused (``momentum=None``, no
    batch count: :func:`remat.guards.pauses_update`), so its backward saves the buffers
    themselves, as the forward's did, and the recomputation holds no more than plain
    checkpointing (which updates the statistics twice). Not under per-stage compile: the
    compiled stage would be specialised on the paused attributes and compiled again.

    Re-enterable: torch enters a checkpoint's recompute context once per recomputation, and a
    segment is recomputed again by every backward that needs it (``backward(retain_graph=True)``
    twice, or the second backward of ``create_graph=True``).
    """

    def __init__(self, segment: _SegmentBuffers, pause: bool = False) -> None:
        self.segment = segment
        self.slots = segment.slots
        self.pause = pause
        self.written: list[tuple[nn.Module, str, torch.Tensor | None]] = []
        """Each buffer the forward wrote, with its values from before it (None: the forward's
        values are replayed, batch norm's running statistics)."""
        self._before: list[tuple[Any, int]] = []
        self._copies: dict[int, torch.Tensor] = {}
        self._entries: list[list[tuple[nn.Module, str, Any]]] = []

    def pair(self) -> tuple[Any, Any]:
        return _WriteWatch(self), self

    def __enter__(self) -> None:
        saved = []
        paused: dict[int, nn.Module] = {}
        for m, name, before in self.written:
            if before is None and self.pause and pauses_update(m):
                paused[id(m)] = m
                continue
            b = m._buffers[name]
            saved.append((m, name, b))
            m._buffers[name] = (b if before is None else before).clone()
        for m in paused.values():
            saved.append((m, "num_batches_tracked", m._buffers.get("num_batches_tracked")))
            m._buffers["num_batches_tracked"] = None
            saved.append((m, None, m.momentum))
            m.momentum = None
        self._entries.append(saved)

    def __exit__(self, *exc: object) -> None:
        for m, name, b in self._entries.pop():
            if name is None:
                m.momentum = b
            else:
                m._buffers[name] = b


class _WriteWatch:
    """The forward side of :class:`_BuffersWrittenOnce`: copies the buffers the forward may
    write, notes those it writes."""

    def __init__(self, guard: _BuffersWrittenOnce) -> None:
        self.guard = guard

    def __enter__(self) -> None:
        guard = self.guard
        known = guard.segment.written
        guard._before = [(b, tensor_version(b) if b is not None else 0) for b in self._now()]
        with torch.no_grad():
            guard._copies = {
                i: b.clone()
                for i, ((m, n), (b, _)) in enumerate(zip(guard.slots, guard._before, strict=True))
                if b is not None and not running_stat(m, n) and (known is None or i in known)
            }

    def __exit__(self, *exc: object) -> None:
        guard = self.guard
        # batch norm's running statistics count as written: the native kernel writes them
        # without moving their version counter
        written = [
            i
            for i, ((m, n), (b, version), now) in enumerate(
                zip(guard.slots, guard._before, self._now(), strict=True)
            )
            if now is not b
            or (b is not None and tensor_version(b) != version)
            or running_stat(m, n)
        ]
        guard.written = []
        for i in written:
            m, n = guard.slots[i]
            before: torch.Tensor | None = None
            if not running_stat(m, n):
                b, version = guard._before[i]
                before = guard._copies.get(i)
                if before is None and b is not None and tensor_version(b) == version:
                    before = b  # reassigned, the old tensor untouched: it is the value before
            guard.written.append((m, n, before))
        seen = {i for i in written if not running_stat(*guard.slots[i])}
        known = guard.segment.written
        guard.segment.written = seen if known is None else known | seen
        guard._before, guard._copies = [], {}

    def _now(self) -> list[Any]:
        return [m._buffers.get(n) for m, n in self.guard.slots]


# ---------------------------------------------------------------------- the executor
@dataclasses.dataclass(frozen=True, slots=True)
class _CheckpointedSegment:
    """A checkpointed segment as the executor runs it (NOTE [ The executor's program ])."""

    start: int
    name: str
    """The segment's first stage and its name (for errors)."""
    children: tuple[Any, ...]
    """The program of its sub-plan."""
    options: dict[str, Any]
    """``checkpoint``'s keyword arguments (with the buffer guard's ``context_fn`` where the
    segment has buffers: :func:`_buffer_contexts`)."""
    run_tensor: Callable[[torch.Tensor], Any]
    """What the checkpoint runs for a tensor input: the stage module itself for a segment of
    one stored stage (as a hand loop of ``checkpoint(module, a)`` does), else its program."""

    def __reduce__(self) -> tuple[Any, ...]:
        # (pickle and copy.deepcopy take a closure by reference: the copy's buffer guard is
        # made anew around the copy's buffers, so that a copy of a planned module guards its
        # own, and a saved one loads)
        options = dict(self.options)
        made_of = options.pop("context_fn").made_of if "context_fn" in options else None
        fields = (self.start, self.name, self.children, options, self.run_tensor)
        return (_rebuilt_segment, (*fields, made_of))


def _rebuilt_segment(
    start: int,
    name: str,
    children: tuple[Any, ...],
    options: dict[str, Any],
    run_tensor: Callable[[torch.Tensor], Any],
    made_of: tuple[_SegmentBuffers, bool] | None,
) -> _CheckpointedSegment:
    """A copied or loaded :class:`_CheckpointedSegment` (its ``__reduce__``)."""
    if made_of is not None:
        options = {**options, "context_fn": _buffer_contexts(*made_of)}
    return _CheckpointedSegment(start, name, children, options, run_tensor)


class _Executor:
    """Runs the stages under a plan's segment tree with nested non-reentrant checkpoints.

    With ``compile_options`` (``torch.compile``'s keyword arguments), :meth:`step` runs the
    stages each as their own ``torch.compile`` graph (NOTE [ One graph per stage ] in
    remat.capture.chain)."""

    def __init__(
        self,
        stages: Stages,
        plan: Plan,
        early_stop: bool,
        compile_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.stages = stages
        self.plan = plan
        self.tree = plan.chain_segments(stages.n)
        """The plan as the stage tree the nested checkpoints run."""
        self.early_stop = early_stop
        self.compile_options = compile_options
        self.pause_updates = compile_options is None
        """Whether a recomputation pauses batch norm's update rather than running on copies of
        its statistics (:class:`_BuffersWrittenOnce`): only when nothing is compiled, since a
        compiled frame would be specialised on the paused attributes and compiled again."""
        self._buffers: dict[tuple[int, int], _SegmentBuffers] = {}
        for seg in (s for top in self.tree for s in top.walk()):
            if seg.checkpoint:
                mods = stages.modules[seg.start - 1 : seg.stop]
                self._buffers[(seg.start, seg.stop)] = _SegmentBuffers(list(buffer_slots(*mods)))
        self.compiled: tuple[Callable[[Any], Any], ...] | None = None
        """Per stage, its compiled graph (per-stage mode), else None."""
        self.compiled_step: Callable[..., Any] | None = None
        """The whole training forward as one compiled graph (one-graph mode), else None."""
        self._compiled_once = False
        one_graph = compile_options is not None and one_graph_plan(plan)
        if compile_options is not None and not one_graph:
            # each stage its own graph (NOTE [ One graph per stage ]), inside the eager
            # checkpoints (nested ones too); one executor per plan:
            # a new input signature gets its own plan (static shapes: the plan is for these)
            self.compiled = compile_stages(stages, compile_options, eager_stages(plan))
        self.program = self._program(self.tree)
        """The tree as what :meth:`run` walks, made once (NOTE [ The executor's program ])."""
        self._ends = _untraceable_ends(self.program) if one_graph else ((), (), ())
        """``(head, middle, tail)``: in one-graph mode the program's parts at either end that
        torch.compile cannot trace (NOTE [ Stages outside the graph ]), run before and after
        the one graph of ``middle``; head and tail empty when there are none."""
        self._around: Any = None
        self._compiled_ends: tuple[Callable[..., Any], Callable[..., Any]] | None = None
        """The head (with ``prepare``) and the tail (with ``finish``), each compiled on its own
        (NOTE [ Stages outside the graph ]), where there are ends."""
        self._middle_breaks: dict[Any, int] = {}
        if one_graph:
            # NOTE [ One compiled graph ]: one compiled function per plan (static shapes: a
            # new input signature gets its own plan, so its own graph)
            options = {"dynamic": False, **compile_options}

            def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
                return torch.compile(types.MethodType(_own_code(fn), self), **options)

            self._around = _around_of(self._ends)
            """Where the plan stores both ends: what runs the model's own forward around the
            middle, in the one graph (NOTE [ The model's forward around the blocks ] in
            remat.capture.stages.families.blocks); None otherwise."""
            if self._around is not None:
                self._middle = self._traced_middle  # (one bound method: dynamo guards on it)
                self.compiled_step = compiled(_Executor._traced_around)
            elif self._ends[0] or self._ends[2]:
                self.compiled_step = compiled(_Executor._traced_middle)
                self._compiled_ends = (
                    compiled(_Executor._traced_head),
                    compiled(_Executor._traced_tail),
                )
            else:
                self.compiled_step = compiled(_Executor._traced_step)
            knob = partitioner_budget(plan)
            partitioner = (
                (_functorch_config, "activation_memory_budget", knob),
                (_functorch_config, "activation_memory_budget_solver", partitioner_solver(plan)),
                # (AOTAutograd's cache leaves the solver out of its key: the partition of the
                # other solver would be served, NOTE [ The partitioner's budget ]; inductor's
                # FX graph cache keys on the partitioned graphs, so it stays on)
                (_functorch_config, "enable_autograd_cache", False),
            )
            if knob is not None:
                pass_ = _SaveRandomOps(knob, _functorch_config.joint_custom_pass)
                partitioner += ((_functorch_config, "joint_custom_pass", pass_),)
            self._configs = (
                (torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", True),
                *(() if knob is None else partitioner),
            )
            """The compiler settings :meth:`_one_graph_step` runs under."""

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy (``copy.deepcopy``) or a loaded pickle is made anew from the stages and the
        plan: a compiled executor holds torch.compile's functions bound to this one (a copy
        would run the original's modules) and torch's config modules (which neither copy nor
        pickle); the copy compiles on its first step."""
        return (_Executor, (self.stages, self.plan, self.early_stop, self.compile_options))

    @property
    def compiles(self) -> bool:
        """Whether training forwards run compiled (either mode): :meth:`step` runs them."""
        return self.compiled is not None or self.compiled_step is not None

    # NOTE [ The executor's program ]: everything about a segment that does not change from
    # step to step is worked out once, when the executor is made: the modules a stored segment
    # runs, and for a checkpointed segment its checkpoint options, its buffer guard and the
    # program of its children. A step then runs the program with only what depends on its
    # values (the input's structure, the version checks): torch's checkpoint per segment plus
    # a few attribute reads, so that at equal plans remat runs no slower than a hand loop of
    # torch's checkpoints (benchmarks/executor_overhead.py).
    def _program(self, segments: Sequence[ChainSegment]) -> tuple[Any, ...]:
        """``segments`` as runnable items: a tuple of the modules of consecutive stored
        stages, or a :class:`_CheckpointedSegment`."""
        modules = self.compiled or self.stages.modules
        items: list[Any] = []
        for seg in segments:
            if seg.checkpoint:
                items.append(self._checkpointed_segment(seg))
            elif items and type(items[-1]) is tuple:
                items[-1] += tuple(modules[i - 1] for i in seg.stages())
            else:
                items.append(tuple(modules[i - 1] for i in seg.stages()))
        return tuple(items)

    def _checkpointed_segment(self, seg: ChainSegment) -> _CheckpointedSegment:
        options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": True}
        if not self.early_stop:
            options["early_stop"] = False
        buffers = self._buffers[(seg.start, seg.stop)]
        if buffers.slots:
            options["context_fn"] = _buffer_contexts(buffers, pause=self.pause_updates)
        children = self._program(seg.children)
        return _CheckpointedSegment(
            seg.start,
            self.stages.names[seg.start - 1],
            children,
            options,
            _tensor_runner(self, children),
        )

    def run(self, a: Any) -> Any:
        return self._run_program(self.program, a)

    def _run_program(self, program: tuple[Any, ...], a: Any) -> Any:
        for item in program:
            if type(item) is tuple:
                for module in item:
                    a = module(a)
            else:
                a = self._checkpointed(item, a)
        return a

    def _checkpointed(self, seg: _CheckpointedSegment, a: Any) -> Any:
        # Tensors go to checkpoint as positional arguments: torch saves only those through
        # saved-tensor hooks (so an enclosing checkpoint recomputes them, Rule 2); tensors
        # nested in a tuple argument would be held by reference instead. For the same reason
        # the function checkpointed must not capture any tensor of ``a``: the checkpoint keeps
        # it until its backward, and an inner checkpoint's input would never be freed.
        if isinstance(a, torch.Tensor):  # the common case: no flattening
            if torch.compiler.is_compiling():  # (see below)
                return checkpoint(seg.run_tensor, a, **seg.options)
            version = tensor_version(a)
            out = checkpoint(seg.run_tensor, a, **seg.options)
            if tensor_version(a) != version:  # the recomputation would start from other values
                raise in_place_input_error(seg.start, seg.name)
            return out
        # (a plain loop, no comprehension over ``leaves``: a name a nested scope reads
        # becomes a cell, and ``del`` of a cell is a graph break under torch.compile)
        leaves, spec = tree_flatten(a)
        positions: list[int] = []
        tensors: list[torch.Tensor] = []
        template: list[Any] = []
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                positions.append(k)
                tensors.append(leaf)
                template.append(None)
            else:
                template.append(leaf)
        del leaves
        run_children = _segment_runner(self, seg.children, positions, template, spec)
        del a
        if torch.compiler.is_compiling():
            # (traced by torch.compile: AOTAutograd functionalizes in-place ops, so the
            # recomputation reads the values the forward read, and applies a buffer mutation
            # once, NOTE [ The buffer guard under torch.compile ]; comparing versions would be
            # a graph break)
            return checkpoint(run_children, *tensors, **seg.options)
        versions = _versions(tensors)
        out = checkpoint(run_children, *tensors, **seg.options)
        if _versions(tensors) != versions:  # the recomputation would start from other values
            raise in_place_input_error(seg.start, seg.name)
        return out

    # NOTE [ One compiled graph ]: in one-graph mode (a flat plan whose ``params`` say
    # ``"compiled": "one-graph"``: remat.auto measured it so, or apply(one_graph=True)) the
    # whole training forward (``prepare``, the segments, ``finish``) is one torch.compile
    # graph. Dynamo traces each non-reentrant ``checkpoint`` as the ``tag_activation_checkpoint``
    # higher-order op; AOTAutograd tags the ops inside as recomputed, and the min-cut
    # partitioner saves only the segment's inputs for the backward and recomputes the rest
    # there. Outside checkpointed segments the partitioner is free as in any compiled model.
    # Faster than a graph per stage (fusion across stages, no eager checkpoint machinery), but
    # the step is not the stages measured alone: a recomputed segment's values live in the
    # backward graph until read (a GPT-2 tiny block: 8.1 MB against the 4.5 MB it saves
    # compiled alone), and the transients are the graph's. So its peak is not predicted from
    # the chain: remat.auto measures the compiled step (allocator events), moves the
    # prediction of the forward and backward by what it measured above or below the chain's
    # (remat.core.step.measured_step_peak: the optimizer step is not in the graph) and plans
    # again below the budget by any excess (remat.auto._fit_one_graph). One graph can also
    # hold less than the chain's least (the partitioner recomputes across stages what they
    # saved alone): a budget the chain refuses is tried with the least-memory plans as one
    # graph (remat.auto._StepModel.fit_below_least), and a refusal names their least too
    # (GPT-2 124M on an H100: 5,398,799,872 B measured, the stages' least 6,631,674,904 B;
    # an 8-block MLP on the CPU: 412,424 B against 448,856 B). Nested plans run
    # a graph per stage: in one graph the partitioner kept every activation of the outer
    # segment. The traced code is the executor's own program (:meth:`run`): traced, it skips
    # the version checks (the compiler functionalises in-place ops, and applies buffer updates
    # once per step); where dynamo cannot trace part of it (a graph break) that part runs as
    # the eager executor does, buffer guard included (NOTE [ The buffer guard under
    # torch.compile ]). A copy of the executor for tracing had no guard: RegNet's first stage
    # (the blocks family's, which runs hooks) sent its loop to eager, where batch norm's
    # statistics were updated twice.
    def _traced_step(self, args: tuple, kwargs: dict) -> Any:
        stages = self.stages
        return stages.finish(self.run(stages.prepare(*args, **kwargs)), *args, **kwargs)

    def _traced_middle(self, a: Any) -> Any:
        return self._run_program(self._ends[1], a)

    def _traced_around(self, args: tuple, kwargs: dict) -> Any:
        stages = self.stages
        return stages.finish(self._around.run(stages.prepare(*args, **kwargs)), *args, **kwargs)

    def _traced_head(self, args: tuple, kwargs: dict) -> Any:
        return self._run_program(self._ends[0], self.stages.prepare(*args, **kwargs))

    def _traced_tail(self, a: Any, args: tuple, kwargs: dict) -> Any:
        return self.stages.finish(self._run_program(self._ends[2], a), *args, **kwargs)

    def _compiled_call(self, args: tuple, kwargs: dict) -> Any:
        """The one-graph step's forward: the one graph, with the ends it cannot hold compiled
        on their own before and after it (NOTE [ Stages outside the graph ])."""
        assert self.compiled_step is not None
        if self._around is not None:
            with self._around.patched(self._middle):
                return self.compiled_step(args, kwargs)
        if self._compiled_ends is None:
            return self.compiled_step(args, kwargs)
        head, tail = self._compiled_ends
        a = head(args, kwargs)
        if self._compiled_once:
            a = self.compiled_step(a)
        else:  # (the graph breaks warned about are the one graph's: the ends break)
            before = _graph_breaks()
            a = self.compiled_step(a)
            self._middle_breaks = _new_breaks(before)
        return tail(a, args, kwargs)

    def step(self, args: tuple, kwargs: dict) -> Any:
        """A compiled training forward (:attr:`compiles` must be true): in one-graph mode the
        whole forward as one graph (NOTE [ One compiled graph ]), else ``prepare`` and
        ``finish`` eager, each stage its own compiled graph (NOTE [ One graph per stage ] in
        remat.capture.chain), the checkpointed segments eager checkpoints around them. The
        first call compiles; graph breaks are warned about once (the code around one runs
        eagerly)."""
        assert self.compiles
        if self.compiled_step is not None:
            return self._one_graph_step(args, kwargs)
        stages = self.stages
        if self._compiled_once:
            return stages.finish(self.run(stages.prepare(*args, **kwargs)), *args, **kwargs)
        before = _graph_breaks()
        out = stages.finish(self.run(stages.prepare(*args, **kwargs)), *args, **kwargs)
        self._compiled_once = True
        breaks = _new_breaks(before)
        if breaks:
            warnings.warn(
                f"compile=True: torch.compile split a stage at {sum(breaks.values())} graph "
                f"break(s) ({'; '.join(str(k).splitlines()[0] for k in breaks)}); code around "
                "a break runs eagerly (measured so when the stage was captured)",
                stacklevel=3,
            )
        return out

    def _one_graph_step(self, args: tuple, kwargs: dict) -> Any:
        assert self.compiled_step is not None
        # A segment's Python side effects happen once, in the forward (the eager executor keeps
        # buffer updates out of recomputations too); without this, a balanced one such as
        # transformers' mask code entering a TorchFunctionMode breaks the graph at the
        # checkpoint and dynamo runs the whole executor loop eagerly.
        # NOTE [ The partitioner's budget ]: set on every call, not only the first, so that
        # a recompilation dynamo makes later partitions at the same budget
        try:
            with _configs_set(self._configs):
                if self._compiled_once:
                    return self._compiled_call(args, kwargs)
                before = _graph_breaks()
                with _no_context_fn_advice():
                    out = self._compiled_call(args, kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as failed:
            if isinstance(failed.inner_exception, PlanError):  # (_SaveRandomOps)
                raise failed.inner_exception from None
            raise
        self._compiled_once = True
        breaks = _new_breaks(before) if self._compiled_ends is None else self._middle_breaks
        if breaks:
            warnings.warn(
                f"compile=True: torch.compile split the planned forward at {sum(breaks.values())}"
                f" graph break(s) ({'; '.join(str(k).splitlines()[0] for k in breaks)}); "
                "code around a break runs eagerly (a checkpointed segment that holds one is "
                "an eager checkpoint: still recomputed, not fused)",
                stacklevel=4,
            )
        return out


def _graph_breaks() -> dict[Any, int]:
    """Dynamo's graph-break counts so far, by reason."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def _new_breaks(before: dict[Any, int]) -> dict[Any, int]:
    """The graph breaks since ``before`` (:func:`_graph_breaks`), by reason."""
    return {k: n for k, v in _graph_breaks().items() if (n := v - before.get(k, 0)) > 0}


@contextlib.contextmanager
def _configs_set(settings: Sequence[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each ``(config module, name, value)`` set for the body and put back after it: what
    ``config.patch`` does, at a quarter of its cost (it builds its patch anew on every call:
    60 us for the two settings of a one-graph step, a tenth of a tiny model's step)."""
    saved = []
    try:
        for module, name, value in settings:
            old = getattr(module, name)
            if old != value:
                setattr(module, name, value)
                saved.append((module, name, old))
        yield
    finally:
        for module, name, old in reversed(saved):
            setattr(module, name, old)


class _DropContextFnAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in str(record.msg)


@contextlib.contextmanager
def _no_context_fn_advice() -> Iterator[None]:
    """Without torch's log line, while a one-graph step compiles, that a checkpoint's
    ``context_fn`` must not hold in-place ops: the advice is for selective checkpointing's
    saved ops, and remat's ``context_fn`` recomputes every op under torch.compile as compile's
    own default does (NOTE [ The buffer guard under torch.compile ])."""
    log = logging.getLogger("torch._higher_order_ops.wrap")
    drop = _DropContextFnAdvice()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


# NOTE [ Stages outside the graph ]: a stage module whose class says ``traceable = False`` is
# code torch.compile cannot trace: the blocks family's first and last stages
# (remat.capture.stages.families.blocks) run the model's own forward with hooks and patched
# blocks. In the one graph dynamo broke at them (BERT: 11 graphs at 9 breaks; RegNet: 16
# breaks) and ran the executor's loop eagerly, the blocks compiled frame by frame. At either
# end of the chain such stages, stored or in checkpointed segments of their own, now run
# outside the graph, each end (with ``prepare``, or ``finish``) compiled on its own: dynamo
# still compiles what it can of them frame by frame (a transformers mask is a vmap, slow
# eagerly: Qwen2's ends run eagerly took its step from 0.75 to 3.8x eager), and the program
# between them is one graph without a break. Such a stage checkpointed with a block stays in
# the graph and breaks it (correct, warned, not fused). Where the plan stores both ends (one
# stage each), the ends do not run apart at all: the one graph is the model's own forward
# around the middle (:func:`_around_of`; NOTE [ The model's forward around the blocks ] in
# remat.capture.stages.families.blocks).
def _untraceable_ends(program: tuple[Any, ...]) -> tuple[tuple[Any, ...], ...]:
    """``(head, middle, tail)`` of ``program``, each a program (NOTE [ Stages outside the
    graph ]): at its start and end, the stored stages torch.compile cannot trace and
    the checkpointed segments made of such stages alone; and the rest."""
    items = list(program)
    head: list[Any] = []
    tail: list[Any] = []
    while items:
        first = items[0]
        if type(first) is tuple:
            k = 0
            while k < len(first) and not traceable(first[k]):
                k += 1
            if k:
                head.append(first[:k])
            if k < len(first):
                items[0] = first[k:]
                break
            items.pop(0)
        elif _untraceable(first):
            head.append(items.pop(0))
        else:
            break
    while items:
        last = items[-1]
        if type(last) is tuple:
            k = len(last)
            while k > 0 and not traceable(last[k - 1]):
                k -= 1
            if k < len(last):
                tail.insert(0, last[k:])
            if k:
                items[-1] = last[:k]
                break
            items.pop()
        elif _untraceable(last):
            tail.insert(0, items.pop())
        else:
            break
    return tuple(head), tuple(items), tuple(tail)


def _around_of(ends: tuple[tuple[Any, ...], ...]) -> Any:
    """What runs the model's own forward around the middle of a one-graph program, where its
    head and its tail are one stored stage each and the first offers one for the last
    (remat.capture.stages.around); else None."""
    head, _middle, tail = ends
    if len(head) == len(tail) == 1 and type(head[0]) is tuple and type(tail[0]) is tuple:
        if len(head[0]) == len(tail[0]) == 1:
            return around(head[0][0], tail[0][0])
    return None


def _untraceable(item: Any) -> bool:
    """Whether every stage a program item runs is one torch.compile cannot trace."""
    if type(item) is tuple:
        return not any(traceable(module) for module in item)
    return all(_untraceable(child) for child in item.children)


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own. Dynamo keeps its compiled graphs per code object,
    at most ``torch._dynamo.config.recompile_limit`` (8) of them, and past that runs the frame
    eagerly: every executor's step shares ``_traced_step``'s code, so the ninth plan of a
    process (re-plans, one-graph trials) ran uncompiled. Each executor's step gets its own."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


ONE_GRAPH = "one-graph"
"""``Plan.params["compiled"]`` of a plan that runs compiled as one graph
(NOTE [ One compiled graph ])."""


def one_graph_plan(plan: Plan) -> bool:
    """Whether ``plan`` runs compiled as one graph: its ``params`` say so and it is flat (no
    checkpoint inside another)."""
    return plan.params.get("compiled") == ONE_GRAPH and plan.depth() <= 1


PARTITIONER_BUDGET = "partitioner_budget"
"""``Plan.params[PARTITIONER_BUDGET]``: the ``activation_memory_budget`` (0 to 1) inductor's
partitioner compiles a one-graph plan's stored stages with (NOTE [ The partitioner's budget ]);
absent: torch's setting (1 by default)."""


# NOTE [ The partitioner's budget ]: torch.compile's own memory lever is the min-cut
# partitioner's ``torch._functorch.config.activation_memory_budget``: below 1 it recomputes in
# the backward the ops its runtime estimate calls cheapest (pointwise ops before matmuls) until
# what the forward saves is at most that fraction of what it saved at 1. It is relative and not
# monotone in bytes (GPT-2 tiny on the CPU: 27.34 MiB at 1, 22.06 MiB at 0.5, 27.83 MiB at 0.2),
# so remat does not plan with it: a one-graph plan may carry a value
# (:func:`with_partitioner_budget`), the executor compiles and runs its one graph with it, and
# remat.auto measures such a plan like any other one-graph trial (remat.auto.PARTITIONER_TRIALS:
# the store-all plan at 0.7, 0.5, 0.2, 0.15, 0.1 in turn, before any plan that recomputes
# stages; the first that fits timed against the trial after it where that fits too,
# remat.auto.LOOK_AHEAD). Only with no checkpointed segment: under remat's checkpoints the
# budget raised GPT-2's peak by 1.2-2.2 MB (docs/results/compile/knob). Below its "aggressive"
# min-cut the partitioner picks what to save with a 0-1 knapsack (item cost: FLOPs); torch
# solves it by a DP over bytes quantized to 1e-4 of the budget's range, remat exactly first
# (PARTITIONER_SOLVERS, SciPy's HiGHS): at 0.5 on GPT-2 and Llama-tiny the exact set ran in
# 0.963-1.004 of torch.compile@0.5's time (median 0.979) within its memory, the DP's in
# 0.982-1.005 (median 0.994), in 9 paired runs
# (docs/results/compile/knob/costs.md, solver.md). The exact set fills the knapsack closer to
# its capacity, so it can hold a little more than torch's own partition at the same budget
# (DenseNet-121 at 0.1: 512 B more, so it missed torch.compile@0.1's peak and remat ran a slower
# plan of its own there, 1.10 of its time): where it does not fit, remat.auto measures the DP's,
# torch.compile's own point, next.
# Where the step draws random numbers (dropout; remat.capture.chain's Captured.random_stages),
# below budget 1 the partitioner may recompute a random op in the backward, where it draws
# fresh numbers, so the backward applies another dropout mask than the forward did and the
# gradients are silently wrong (pytorch/pytorch#190758, open in torch 2.14.1). A probe (an MLP
# with dropout, float64, a directional finite difference of the compiled step's loss against
# its gradient) found torch.compile at budget 0 off by 3.6 relative under inductor's random
# numbers, and at 0.5 and 0 under eager's (``fallback_random``); remat's checkpoints, whose
# recomputation torch replays with the forward's random state, and budget 1 agreed to 1e-10.
# So the executor compiles a one-graph plan with a partitioner budget with a joint-graph pass
# (:class:`_SaveRandomOps`, AOTAutograd's ``joint_custom_pass``, so under every backend that
# partitions: inductor, aot_eager, ...) that marks every op drawing random numbers MUST_SAVE,
# which the knapsack leaves saved: the probe's budgets 0.5 and 0.1 then agreed within 1e-9
# under aot_eager and under inductor with either random numbers (not inductor's
# ``joint_custom_pre_pass``, which runs under inductor only). At budget 0 torch returns before its
# knapsack and recomputes everything, random ops too: there the pass raises a PlanError (remat.auto
# never tries 0).
PARTITIONER_SOLVERS: tuple[str, ...] = ("ilp", "dp")
"""The knapsack solvers (``torch._functorch.config.activation_memory_budget_solver``) a one-graph
plan with a partitioner budget may compile with, its default first: torch's exact one (SciPy's
HiGHS MILP), then torch's quantized DP, torch.compile's own (NOTE [ The partitioner's budget ]).
AOTAutograd's cache leaves the solver out of its key, so such a graph compiles with that cache off
(``enable_autograd_cache``): neither served the partition of the other solver nor leaving one for
torch.compile's own."""
PARTITIONER_SOLVER = "partitioner_solver"
"""``Plan.params[PARTITIONER_SOLVER]``: the solver (one of :data:`PARTITIONER_SOLVERS`) of a
one-graph plan with a partitioner budget; absent: the first, the exact one."""


def partitioner_budget(plan: Plan) -> float | None:
    """The partitioner budget a one-graph ``plan`` compiles with (None: torch's setting)."""
    value = plan.params.get(PARTITIONER_BUDGET)
    return None if value is None else float(value)


def partitioner_solver(plan: Plan) -> str:
    """The knapsack solver ``plan``'s partitioner budget is compiled with
    (:data:`PARTITIONER_SOLVERS`); :class:`PlanError` for another (a plan loaded from a file)."""
    return _known_solver(plan.params.get(PARTITIONER_SOLVER, PARTITIONER_SOLVERS[0]))


def _known_solver(solver: Any) -> str:
    if solver not in PARTITIONER_SOLVERS:
        raise PlanError(
            f"partitioner solver {solver!r} is not one of {', '.join(PARTITIONER_SOLVERS)}"
        )
    return str(solver)


def describe_compiled(plan: Plan) -> str:
    """``plan.describe()``, with its partitioner budget when it has one (and its solver when it
    is not the default), or the stages that run eager among compiled ones."""
    knob = partitioner_budget(plan)
    eager = eager_stages(plan)
    if eager:
        return f"{plan.describe()} with stage{'s' * (len(eager) > 1)} {span(sorted(eager), ', ')} eager"
    if knob is None:
        return plan.describe()
    solver = partitioner_solver(plan)
    by = "" if solver == PARTITIONER_SOLVERS[0] else f" (solver {solver})"
    return f"{plan.describe()} at partitioner budget {knob:g}{by}"


def with_partitioner_budget(
    plan: Plan, budget: float | None, solver: str = PARTITIONER_SOLVERS[0]
) -> Plan:
    """``plan`` to be compiled as one graph with inductor's partitioner at
    ``activation_memory_budget=budget`` (None: torch's setting), its knapsack solved by
    ``solver`` (:data:`PARTITIONER_SOLVERS`); NOTE [ The partitioner's budget ].
    :class:`PlanError` outside 0..1 or for another solver. The ops that draw random numbers
    (dropout) stay saved (:class:`_SaveRandomOps`: torch's partitioner would recompute them with
    fresh ones, pytorch/pytorch#190758); at budget 0, where torch recomputes every op, the step
    raises a :class:`PlanError` on a model that draws random numbers."""
    params = {
        k: v for k, v in plan.params.items() if k not in (PARTITIONER_BUDGET, PARTITIONER_SOLVER)
    }
    if budget is not None:
        if not 0.0 <= float(budget) <= 1.0:
            raise PlanError(
                f"partitioner budget {budget!r} is not a fraction: torch's "
                "activation_memory_budget takes 0 to 1"
            )
        params[PARTITIONER_BUDGET] = float(budget)
        if _known_solver(solver) != PARTITIONER_SOLVERS[0]:
            params[PARTITIONER_SOLVER] = solver
    return dataclasses.replace(plan, params=params)


class _SaveRandomOps:
    """AOTAutograd's joint-graph pass (``torch._functorch.config.joint_custom_pass``, run before
    the partitioner, whatever the backend) that marks every op that draws random numbers
    (:func:`remat.capture.chain.draws_random`) ``MUST_SAVE``: below budget 1 the partitioner's
    knapsack would otherwise recompute it in the backward with fresh numbers
    (pytorch/pytorch#190758; NOTE [ The partitioner's budget ]). At ``budget`` 0 torch skips its
    knapsack and recomputes every op: :class:`PlanError` where one draws random numbers.
    ``then``: the pass set before, run after this one."""

    def __init__(self, budget: float, then: Any = None) -> None:
        self.budget = budget
        self.then = then

    def __call__(self, joint: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        for node in joint.graph.nodes:
            target = node.target
            if isinstance(target, torch._ops.OpOverload) and draws_random(
                target, node.args, node.kwargs
            ):
                if self.budget == 0:
                    raise PlanError(
                        f"partitioner budget 0 recomputes every op in the backward, and "
                        f"{target} draws its random numbers afresh there (pytorch/pytorch#190758):"
                        " the gradients would be wrong. Give a budget above 0 (remat keeps the "
                        "ops that draw random numbers saved there), or a plan of remat's own"
                    )
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        return joint if self.then is None else self.then(joint, joint_inputs)


EAGER_STAGES = "eager_stages"
"""``Plan.params[EAGER_STAGES]``: the stages (numbers from 1) of a plan run a graph per stage
(NOTE [ One graph per stage ] in remat.capture.chain) that run eager, as their modules, because
remat.auto measured them faster so (NOTE [ A stage compiled where it pays ] in remat.auto);
absent: every stage compiled. Not read in one-graph mode, where the forward is one graph."""


def eager_stages(plan: Plan) -> frozenset[int]:
    """The stages (numbers from 1) ``plan`` runs eager under per-stage compile
    (:data:`EAGER_STAGES`); :class:`PlanError` for anything but stage numbers of the plan."""
    value = plan.params.get(EAGER_STAGES, ())
    numbers = value if isinstance(value, list | tuple) else [value]
    n = plan.n
    if not all(
        isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= (n or i) for i in numbers
    ):
        raise PlanError(
            f"{EAGER_STAGES} {value!r} must list stage numbers from 1"
            + (f" to {n}" if n else "")
            + " (the stages that run eager under per-stage compile)"
        )
    return frozenset(numbers)


def with_eager_stages(plan: Plan, stages: Iterable[int]) -> Plan:
    """``plan`` run a graph per stage with ``stages`` (numbers from 1) eager
    (:data:`EAGER_STAGES`; none: every stage compiled)."""
    params = {k: v for k, v in plan.params.items() if k != EAGER_STAGES}
    if stages := sorted(set(stages)):
        params[EAGER_STAGES] = stages
    marked = dataclasses.replace(plan, params=params)
    eager_stages(marked)  # checked
    return marked


def as_one_graph(plan: Plan, one_graph: bool = True) -> Plan:
    """``plan`` marked to run compiled as one graph (or, with ``one_graph=False``, not, and
    without a partitioner budget); :class:`PlanError` for a nested plan (NOTE [ One compiled
    graph ])."""
    params = {k: v for k, v in plan.params.items() if k != "compiled"}
    if one_graph:
        params["compiled"] = ONE_GRAPH
        params.pop(EAGER_STAGES, None)
    else:
        params.pop(PARTITIONER_BUDGET, None)
        params.pop(PARTITIONER_SOLVER, None)
    marked = dataclasses.replace(plan, params=params)
    if one_graph and not one_graph_plan(marked):
        raise PlanError(
            f"plan {plan.describe()} nests a checkpoint inside another: it cannot run as one "
            "compiled graph (the partitioner keeps the outer segment's activations); run it "
            "with a graph per stage (one_graph=False)"
        )
    return marked


# What the executor's program holds (NOTE [ The executor's program ]) are objects, not
# closures: ``copy.deepcopy`` of a planned module copies an object's modules, and pickle saves
# it, where a closure would keep running the original model's modules in the copy.
class _RunModules:
    """Runs stored stages one after the other."""

    def __init__(self, modules: tuple[Callable[..., Any], ...]) -> None:
        self.modules = modules

    def __call__(self, t: torch.Tensor) -> Any:
        for module in self.modules:
            t = module(t)
        return t


class _RunProgram:
    """Runs a checkpointed segment's sub-plan from its tensor input."""

    def __init__(self, executor: _Executor, children: tuple[Any, ...]) -> None:
        self.executor = executor
        self.children = children

    def __call__(self, t: torch.Tensor) -> Any:
        return self.executor._run_program(self.children, t)


# NOTE [ The buffer guard under torch.compile ]: a checkpointed segment's ``context_fn`` is
# the same function in eager and compiled steps, and decides when it is called. Traced by
# torch.compile (``torch.compiler.is_compiling()``: dynamo hands the function to AOTAutograd,
# which calls it while it traces the checkpoint) it returns the contexts compile uses for a
# checkpoint without one (every op recomputed): AOTAutograd functionalizes the segment, so its
# buffer updates are applied once. Called in an eager step it returns the buffer guard
# (:class:`_BuffersWrittenOnce`). Both at once is why the choice waits for the call: when dynamo
# cannot trace a checkpoint (a graph break inside the segment) it runs that ``checkpoint`` call
# eagerly with the arguments it traced, so a guard left out while tracing would be left out of
# an eager recomputation too, and batch norm's statistics updated twice (a stage calling
# ``torch._dynamo.graph_break()``: num_batches_tracked 2). Dynamo takes a ``context_fn`` only
# as a plain function or a partial of constants, hence a closure; its segment makes it anew
# when copied or loaded (:meth:`_CheckpointedSegment.__reduce__`). Under torch.compile's
# ``backend="eager"`` (a debugging backend that runs dynamo's graph as it is) batch norm in a
# checkpoint fails in the backward, with or without remat: the graph holds the buffers.
# Given a ``context_fn``, torch logs once that the region must hold no in-place op; advice for
# selective checkpointing's saved ops, not for this one that recomputes every op: a one-graph
# step drops that line (:func:`_no_context_fn_advice`), ``torch.compile(planned)`` by hand
# shows it.
def _buffer_contexts(buffers: _SegmentBuffers, pause: bool) -> Callable[[], tuple[Any, Any]]:
    """A checkpointed segment's ``context_fn`` (NOTE [ The buffer guard under torch.compile ]):
    a new :class:`_BuffersWrittenOnce` pair for every eager forward."""

    def context_fn() -> tuple[Any, Any]:
        if torch.compiler.is_compiling():
            return create_selective_checkpoint_contexts(_recompute)
        return _BuffersWrittenOnce(buffers, pause=pause).pair()

    context_fn.made_of = (buffers, pause)  # type: ignore[attr-defined]  # (for deepcopy)
    return context_fn


def _recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective-checkpoint policy of a compiled checkpoint without one: every op
    recomputed (torch's own default)."""
    return CheckpointPolicy.PREFER_RECOMPUTE


def _tensor_runner(executor: _Executor, children: tuple[Any, ...]) -> Callable[..., Any]:
    """A checkpointed segment's ``run_tensor`` (:class:`_CheckpointedSegment`)."""
    if len(children) == 1 and type(children[0]) is tuple:  # stored stages only
        modules = children[0]
        return modules[0] if len(modules) == 1 else _RunModules(modules)
    return _RunProgram(executor, children)


def _segment_runner(
    executor: _Executor,
    children: tuple[Any, ...],
    positions: list[int],
    template: list[Any],
    spec: Any,
) -> Callable[..., Any]:
    """What a checkpointed segment runs for a structured activation: its children, from the
    segment's input tensors and the non-tensor leaves and tree structure (never a tensor; a
    tensor activation runs the segment's ``run_tensor``). A function of its own so that the
    checkpointing frame has no closure cells (``del`` of a cell is a graph break under
    torch.compile)."""

    def run_children(*ts: torch.Tensor) -> Any:
        rebuilt = list(template)
        for k, t in zip(positions, ts, strict=True):
            rebuilt[k] = t
        return executor._run_program(children, tree_unflatten(rebuilt, spec))

    return run_children


def _resolve_plan(plan: Plan, stages: Stages) -> Plan:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a remat.Plan, got {type(plan).__name__}")
    n = stages.n
    if plan.fingerprint and not plan.chain:
        # one plan type: a graph's plan would be read as stage numbers here
        raise PlanError(
            f"this plan was made for a graph of {plan.n} nodes (fingerprint "
            f"{plan.fingerprint}), not for a chain of stages: its segments name nodes, not "
            "stages; run it on that graph with remat.execute.graph.apply_graph, or make a plan "
            "of this model's chain with remat.capture_chain(model, batch) and remat.plan (or "
            "remat.auto)"
        )
    if plan.n is not None and plan.n != n:
        raise PlanError(
            f"the plan covers {plan.n} stages but the model has {n} stages "
            f"({stages.describe()}); make the plan for this model's chain (same stages), e.g. "
            "with remat.capture_chain on the same model"
        )
    if plan.stages_fingerprint and plan.stages_fingerprint != stages.fingerprint:
        raise PlanError(
            f"this plan was made for a model with other stages (structure fingerprint "
            f"{plan.stages_fingerprint}: module types and parameter shapes of its {plan.n} "
            f"stages), this model's stages are {stages.describe()} (fingerprint "
            f"{stages.fingerprint}); make a plan for this model with "
            "remat.capture_chain(model, batch) and remat.plan (or remat.auto)"
        )
    resolved = plan.for_chain(n)
    eager_stages(resolved)  # checked against the stages, whether or not it runs compiled
    return resolved


@torch.compiler.disable
def _outside_dynamo(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``module.forward(*args, **kwargs)``, run by Python where torch.compile is tracing the
    caller (a graph break around it)."""
    return module.forward(*args, **kwargs)


def _drop_model_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict
) -> None:
    """``state_dict``'s keys under ``prefix + "model."`` moved to ``prefix`` (NOTE [ The model's
    state_dict keys ]), in order; its ``_metadata`` too, the model's own in the wrapper's place."""
    inner = prefix + "model."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if k == inner[:-1] or k.startswith(inner)]:
            moved = prefix[:-1] if key == inner[:-1] else prefix + key[len(inner) :]
            metadata[moved] = metadata.pop(key)


def _add_model_prefix(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict,
    *_: Any,
) -> None:
    """The model's keys in ``state_dict`` under ``prefix`` moved under ``prefix + "model."``,
    where the wrapper's loading finds them (NOTE [ The model's state_dict keys ]). Other keys
    stay: saved with the prefix, they load as before; unknown, the error names them as given."""
    own = module._modules["model"].state_dict(keep_vars=True).keys()
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if key[len(prefix) :] in own:
            state_dict[prefix + "model." + key[len(prefix) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if k == prefix[:-1] or k.startswith(prefix)]:
            name = "" if key == prefix[:-1] else "." + key[len(prefix) :]
            metadata.setdefault(prefix + "model" + name, metadata[key])


def _forward_signature(model: nn.Module) -> inspect.Signature:
    """The signature of ``model.forward``; for a PEFT model (LoRA), whose forward takes
    ``(*args, **kwargs)`` and passes them on, its base model's, as Hugging Face's Trainer reads
    it (NOTE [ The model's forward signature ])."""
    signature = inspect.signature(model.forward)
    kinds = {p.kind for p in signature.parameters.values()}
    base = getattr(model, "get_base_model", None)
    if kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} and callable(
        base
    ):
        return inspect.signature(base().forward)
    return signature


class PlannedWrapper(nn.Module):
    """What the chain and graph planned modules (:class:`PlannedModule`,
    :class:`remat.execute.graph.GraphPlannedModule`) share: ``_plans``, what runs per input
    signature (:class:`SignaturePlans`), attributes the wrapper lacks fall through to the
    model, its submodule ``.model``, and the model's ``state_dict`` keys and forward signature
    (NOTE [ The model's state_dict keys ], NOTE [ The model's forward signature ])."""

    _plans: SignaturePlans

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        # NOTE [ The model's forward signature ]: libraries read which arguments a model takes
        # from inspect.signature(model.forward). Hugging Face's Trainer keeps only the batch's
        # columns named there, and with the wrapper's (*args, **kwargs) it dropped input_ids and
        # attention_mask ("The batch received was empty"). So forward is the wrapper's, bound,
        # with the model's signature (an instance attribute, as torch.compile's wrapper has one).
        # NOTE [ The model's state_dict keys ]: the wrapper's state_dict is the model's, keys
        # and all, and it loads the model's, so a checkpoint moves between the planned model
        # and the plain one. With the submodule's "model." prefix (as DDP's "module.",
        # torch.compile's "_orig_mod."), Hugging Face's Trainer saved a planned BERT's weights
        # under keys from_pretrained did not know, which then started the model afresh with a
        # warning. Keys with the prefix (saved so before) still load.
        self.register_state_dict_post_hook(_drop_model_prefix)
        self.register_load_state_dict_pre_hook(_add_model_prefix)
        try:
            signature = _forward_signature(model)
        except (TypeError, ValueError):  # (a forward inspect cannot read: the wrapper's stays)
            return
        forward = functools.partial(type(self).forward, self)
        forward.__signature__ = signature  # type: ignore[attr-defined]
        self.forward = forward

    @property
    def signature(self) -> tuple | None:
        """Input signature the current plan was made for (None: not known yet)."""
        return self._plans.signature

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or name == "model":
                raise
            return getattr(self._modules["model"], name)


class PlannedModule(PlannedWrapper):
    """A model that trains under a remat plan; made by :func:`apply`.

    It shares the original model's parameters and buffers: the model is its submodule
    ``.model``, and its ``state_dict()`` and forward's signature are the model's
    (:class:`PlannedWrapper`). Calling it equals calling
    the model; the plan is used only in training mode with grad enabled. Each call first
    checks that the model still holds the submodules its stages run (see :meth:`_follow_model`).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        stages: Stages,
        signature: tuple | None = None,
        replan: Callable[..., Plan] | None = None,
        early_stop: bool = True,
        compile: Mapping[str, Any] | None = None,
        one_graph: bool | None = None,
    ) -> None:
        super().__init__(model)
        # Stage modules are the model's own modules (or parameter-less wrappers around them):
        # kept out of the module tree so that parameters and state_dict are the model's only.
        object.__setattr__(self, "_stages", stages)
        object.__setattr__(self, "_early_stop", early_stop)
        object.__setattr__(self, "_compile", compile)
        object.__setattr__(self, "_one_graph", one_graph)
        plan = self._marked(plan)
        object.__setattr__(self, "_watch", StageWatch(model, stages))
        executor = _Executor(stages, _resolve_plan(plan, stages), early_stop, compile)
        plans = SignaturePlans(
            executor,
            signature,
            replan,
            self._build,
            "Make a plan for these inputs and call remat.apply again, or pass replan=callable "
            "(called with the new inputs, returning a Plan) to remat.apply.",
            initial_state=planned_state(model),
        )
        object.__setattr__(self, "_plans", plans)

    # -------------------------------------------------------------- public state
    @property
    def stages(self) -> Stages:
        return self._stages

    @property
    def plan(self) -> Plan:
        """The plan in use (for the last training input signature)."""
        return self._plans.current.plan

    @property
    def _executor(self) -> _Executor:
        return self._plans.current

    def _marked(self, plan: Plan) -> Plan:
        """``plan`` marked as apply's ``one_graph`` says (None: as the plan says)."""
        return plan if self._one_graph is None else as_one_graph(plan, self._one_graph)

    def _build(self, plan: Plan, args: tuple, kwargs: dict) -> _Executor:
        return _Executor(
            self._stages,
            _resolve_plan(self._marked(plan), self._stages),
            self._early_stop,
            self._compile,
        )

    def train(self, mode: bool = True) -> PlannedModule:
        super().train(mode)
        for m in self._stages.modules:
            m.train(mode)
        return self

    # -------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._compile is not None and torch.compiler.is_compiling():
            # torch.compile(planned) around a plan remat compiles itself: dynamo tracing into
            # remat's compiled step crashed inside dynamo (SpeculationLogDivergence; "Attempt to
            # trace forbidden callable set_stance"). remat's graphs run, outside the outer one
            return _outside_dynamo(self, args, kwargs)
        if not torch.compiler.is_compiling():  # (dynamo guards on the modules it traced)
            self._follow_model()
        stages = self._stages
        if stages.check is not None:
            stages.check(*args, **kwargs)
        if not (self.training and torch.is_grad_enabled()):
            return _run_plain(stages, args, kwargs)
        executor = self._executor_for(args, kwargs)
        with no_autocast_cache():  # each 16-bit weight copy lives as the capture measured it
            if executor.compiles:
                return executor.step(args, kwargs)
            a0 = stages.prepare(*args, **kwargs)
            return stages.finish(executor.run(a0), *args, **kwargs)

    def _follow_model(self) -> None:
        """Stages that hold a submodule the model no longer has (``model.fc = ...`` after
        :func:`apply`) are cut again, and the plans re-checked for them (a plan with a stages
        fingerprint needs the same structure); else :class:`PlanError` says to plan again."""
        what = self._watch.changed()
        if what is None:
            return
        again = "plan again for the changed model (remat.auto, or remat.apply with a new plan)"
        if self._stages.split_again is None:
            raise PlanError(
                f"the model's submodule {what} changed after remat.apply, and these hand-made "
                f"stages still run the old one; {again} with stages for it"
            )
        new = self._stages.split_again()
        rebuilt: dict[int, _Executor] = {}

        def rebuild(old: _Executor) -> _Executor:
            if id(old) not in rebuilt:
                rebuilt[id(old)] = _Executor(
                    new, _resolve_plan(old.plan, new), self._early_stop, self._compile
                )
            return rebuilt[id(old)]

        plans = self._plans
        try:
            current = rebuild(plans.current)
            cache = {sig: rebuild(old) for sig, old in plans.cache.items()}
        except PlanError as err:
            raise PlanError(
                f"the model's submodule {what} changed after remat.apply, and the plan does not "
                f"fit the model's new stages: {err}; {again}"
            ) from None
        object.__setattr__(self, "_stages", new)
        object.__setattr__(self, "_watch", StageWatch(self.model, new))
        plans.cache = cache
        plans.current = current

    def _executor_for(self, args: tuple, kwargs: dict) -> _Executor:
        return self._plans.lookup(args, kwargs, step_state(self.model))

    def extra_repr(self) -> str:
        plan = self.plan
        return (
            f"plan={plan.method}: {plan.describe()!r}, stages={self._stages.n} "
            f"({self._stages.kind})"
        )


def apply(
    model: nn.Module,
    plan: Plan,
    stages: Stages | Sequence[str] | None = None,
    example: Any = None,
    *,
    replan: Callable[..., Plan] | None = None,
    early_stop: bool = True,
    compile: bool | Mapping[str, Any] = False,
    one_graph: bool | None = None,
) -> PlannedModule:
    """Wrap ``model`` so that its training steps run under ``plan``.

    Args:
        model: the model; its parameters and buffers are shared, not copied.
        plan: a :class:`~remat.core.plan.Plan` for this model's chain (``plan.n`` = number of
            stages; a plan that records the structure of the stages it was made for,
            ``Plan.stages_fingerprint``, must match this model's: :class:`PlanError`
            otherwise) or a rule plan (``Plan.none()``, ``Plan.every_stage()``). A submodule
            of the model replaced later is followed (the model is cut again, the plan
            re-checked; :class:`PlanError` if it no longer fits).
        stages: how the model is cut: ``None`` (automatic, :func:`remat.capture.stages.split_stages`),
            a list of submodule names, or a :class:`~remat.capture.stages.Stages`.
        example: the input the plan was made for (a tensor, a tuple of positional arguments,
            a dict of keyword arguments, or ``(args_tuple, kwargs_dict)``). Its shapes/dtypes are recorded; a training call
            with other ones raises :class:`SignatureMismatchError` unless ``replan`` is given.
            Without it, the first training call's inputs are recorded.
        replan: ``replan(*args, **kwargs) -> Plan``, called for a new input signature; the
            plans are cached per signature.
        early_stop: let torch stop recomputations as soon as the saved tensors they need exist
            (torch's default, on by default since issue #19): the executor then runs at most
            what :func:`remat.simulate` counts, never more memory or time, and as fast as
            torch's own checkpoint at the same plan (``benchmarks/executor_overhead.py``).
            ``False`` runs exactly what the simulator predicts (forward counts equal; the
            tests of the cost model use it).
        compile: run training forwards compiled (inductor, static shapes). A plan marked
            one-graph (``plan.params["compiled"] == "one-graph"``: what :func:`remat.auto`
            chose after measuring it within the budget, or ``one_graph=True``) runs the whole
            forward as one ``torch.compile`` graph, the checkpointed segments as torch's
            checkpoint operator inside it (NOTE [ One compiled graph ]: faster, its peak
            measured, not predicted by the chain); any other plan runs each stage as its own
            compiled graph with the plan's checkpoints (eager ones, nested allowed) around
            them (NOTE [ One graph per stage ] in remat.capture.chain: predicted from the
            compiled capture). Graph breaks are warned about at the first call (code around
            one runs eagerly). Each input signature (a re-plan) is compiled once. Eval mode
            and ``torch.no_grad()`` run the eager model. A mapping instead of ``True`` is
            passed to ``torch.compile`` as keyword arguments (``{"mode": "max-autotune"}``,
            ``{"backend": ...}``).
        one_graph: with ``compile``, ``True`` runs every plan (re-plans too) as one graph
            (:class:`PlanError` for a nested plan), ``False`` a graph per stage; ``None``
            (default) as each plan says.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, PlannedModule):
        raise TypeError("this model already has a plan; apply it to planned.model instead")
    check_not_wrapped(model, "remat.apply")  # DDP/FSDP go around the planned model, not inside
    check_no_own_checkpointing(model)
    if stages is None or not isinstance(stages, Stages):
        stages = split_stages(model, stages)
    signature = None
    if example is not None:
        args, kwargs = _example_args(example)
        signature = input_signature(*args, **kwargs)
    return PlannedModule(
        model,
        plan,
        stages,
        signature,
        replan=replan,
        early_stop=early_stop,
        compile=compile_options(compile),
        one_graph=one_graph,
    )


def compile_options(compile: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """``torch.compile``'s keyword arguments for ``compile=`` (None: not compiled)."""
    if compile is True:
        return {}
    if compile is False or compile is None:
        return None
    if isinstance(compile, Mapping):
        return dict(compile)
    raise TypeError(
        "compile must be True, False or a mapping of torch.compile keyword arguments, got "
        f"{type(compile).__name__}"
    )
