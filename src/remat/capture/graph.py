"""A model as a costed :class:`~remat.core.graph.Graph`: :func:`capture_graph`.

One training step (``loss_fn(model, batch)`` then ``backward``) runs under a recorder that sees
every call the Python program makes into torch: a ``TorchFunctionMode`` intercepts
``F.conv2d``, ``torch.cat``, ``Tensor.add_``, ``F.scaled_dot_product_attention``, ... (the ops
of ``torch.export``'s training IR, recorded in eager mode in a fraction of a second instead of
the 9-24 s ``torch.export`` takes on a ResNet-50 or a DenseNet-121 here). Calls are grouped into
**nodes** whose vertices are tensors, as in Feng & Huang's computation graphs
(``shared/papers/notes.md`` §4.2):

* **views and in-place ops join the node that made the storage they alias** (``x.view``,
  ``relu_`` after a batch norm, ResNet's ``out += identity``): a node is a storage, its value is
  final when its last call ends. An in-place op on a storage that another node has already
  read starts a new node (the old value was consumed; Known limitations).
* ``level="op"``: every remaining call is a node. ``level="module"``: all the calls made inside
  one call of a leaf module (a module without children) are one node named by its FQN
  (``layer1.0.conv1``); calls made in a container's own ``forward`` (ResNet's add, DenseNet's
  ``cat``, GPT-2's attention arithmetic) are nodes of their own named ``scope/op``.
* a node whose output no backward saves and that feeds exactly one other node is **merged into
  that node** (e.g. GPT-2's dropout before the residual add, ResNet's downsample batch norm
  before ``+=``): the simulator keeps a stored node's output until its backward, so a node whose
  output autograd does not keep would be over-counted. Not when the node's backward keeps
  tensors and another node runs between it and that consumer (RegNet's ``proj(x) + f(x)``:
  the engine runs the projection's batch-norm backward after the ``f`` branch's, so what it
  saved outlives the sum's backward). After merging every node's output is saved by some
  backward except the sinks, outputs read by several nodes and those kept apart so.
* calls whose outputs need no gradient (masks, position ids, integer arithmetic, a frozen
  prefix) are not nodes; the storages they make are ``Graph.constants``
  (:class:`~remat.core.graph.Constant`), from the call that makes them to the moment they are
  freed and, when backwards save them, to the last of those backwards (``saved_by``).
  Nodes from which the loss cannot be reached are dropped.
* a node's output that the program holds after its last reader (``h`` in
  ``h = block(h) * mask`` lives until the multiplication returns) gets
  :attr:`Node.held_until <remat.core.graph.Node.held_until>`: the last node whose first call
  ran before the output's last tensor object died. Autograd keeps the storages of saved
  tensors, so the pack hook hands it an alias, not the program's object.

Per node (the chain convention of ``docs/cost-model.md``, exact to the byte):

* ``out_bytes``: the node's storages that other nodes read (the sink: its last output);
* ``saved_bytes``: ``out_bytes`` plus the **residual**: every other storage that autograd saves
  for the node's own backward (``torch.autograd.graph.saved_tensors_hooks``, unique storages:
  batch-norm statistics, dropout masks, attention log-sum-exp, the log-softmax of a loss);
  parameters, buffers, the batch and the outputs of other nodes are excluded;
* ``saved_inputs``: the inputs whose storages the node's backward saves;
* ``fwd_time`` / ``bwd_time``: seconds (median of ``repeats`` timed steps; the backward of a
  node is the time of the autograd functions its calls created, seen through ``grad_fn`` hooks),
  or with ``fake=True`` the FLOPs of ``torch.utils.flop_counter.FlopCounterMode``, or, given a
  ``time_model`` (:class:`remat.measure.calibration.TimeModel`), the seconds it predicts from each
  ATen op's FLOPs, bytes moved and count;
* ``fwd_overhead_bytes`` / ``bwd_overhead_bytes``: the highest transient bytes inside one of the
  node's calls / autograd functions beyond what is live when it returns (MemTracker);
* ``fwd_none_overhead_bytes``: the same forward walked as it runs without grad (``F_none``): a
  tensor a call saves that is neither its input nor its output is freed on return, and is at
  the call's peak when one ATen op made it with the output (layer norm's statistics); an
  output of one call saved by a later one dies when the program drops it (``_WithoutGrad``);
  None when that equals ``fwd_overhead_bytes``.

The loss (``loss_fn``, default :func:`remat.measure.profile.default_loss_fn`) is part of the graph: its
calls are nodes (scope ``<loss>``), the loss scalar is the sink. ``fake=True`` runs everything
under ``FakeTensorMode`` (paper-size models in seconds, nothing allocated; bytes equal the real
run's). Capturing changes nothing: parameter gradients, buffers and the RNG state are restored,
and the step runs on a copy of the batch (:class:`remat.measure.profile.BatchCopy`), so a model that
writes into its input leaves the caller's batch as it was.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    >>> graph = capture_graph(model, torch.randn(4, 8), level="module", fake=True)
    >>> [node.name for node in graph.nodes]   # Linear 0 merged into the ReLU that reads it
    ['1', '2', '<loss>/sum']
    >>> graph.nodes[0].saved_bytes               # the ReLU's output, which its backward saves
    128

Known limitations:
    * Nodes are torch-level calls, not the ATen ops below them: a ``CompositeImplicit`` function
      such as ``F.linear`` or ``F.cross_entropy`` is one node (its internal intermediates are its
      residual or its overhead). Checkpoint regions can only open and close between such calls
      (autograd saves tensors above the dispatcher), so this is the finest level an eager
      executor can carry out exactly (``docs/graph-executor.md``).
    * An in-place op on a storage that another node already read becomes a node whose output
      aliases its input's storage: both count the bytes (an over-estimate, never seen in the
      torchvision and Hugging Face models tested).
    * An output read by several nodes and saved by none keeps ``out_bytes`` in ``saved_bytes``
      (over-estimate); :attr:`GraphTrace.output_saved` says which.
    * Data-dependent Python control flow is recorded for the batch given (like any trace); a
      ``loss_fn`` that calls the model several times is refused (``ValueError``).
    * Calls inside a ``torch.func`` transform (``torch.vmap``: Hugging Face builds its eager
      attention masks so) are not recorded: their tensors are wrappers without storage, and
      the transform's result enters the graph where a call reads it. A transform over tensors
      that need a gradient, or one that runs a module, is refused (``ValueError``).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from remat.capture.chain import draws_random, unhooked_saves
from remat.core.errors import UnsupportedModelError
from remat.core.graph import Constant, Graph, Node
from remat.guards import BatchCopy, BufferSnapshot, check_no_own_checkpointing
from remat.guards import tensor_version as _version
from remat.measure.calibration import TimeModel, WorkCounter
from remat.measure.events import (
    HeldPastStep,
    allocation_bytes,
    criterion_input_bytes,
    garbage_collected,
    older_objects_frozen,
    output_tensors,
    scratch_bytes,
    small_scratch_bytes,
)
from remat.measure.profile import ONE_MODEL_CALL, LossFn, StepTracker, default_loss_fn, fake_step
from remat.measure.scratch import ScratchProbe, ScratchWindow

__all__ = [
    "LEVELS",
    "LOSS_SCOPE",
    "capture_graph",
    "trace_graph",
    "trace_levels",
    "GraphTrace",
    "CallInfo",
    "is_tensor_call",
    "in_transform",
]

LEVELS = ("module", "op")
"""The node granularities :func:`capture_graph` offers."""

LOSS_SCOPE = "<loss>"
"""Scope of the calls made outside the model's forward (the loss)."""

ROOT_SCOPE = "<model>"
"""Scope of the calls made in the root module's own ``forward``."""


@dataclass(frozen=True)
class CallInfo:
    """One intercepted torch call of the traced step (what the executor replays)."""

    index: int
    """Position in the sequence of intercepted calls."""
    func: Callable[..., Any]
    """The function called (compared by identity when the executor runs the model)."""
    op: str
    """Its name (``conv2d``, ``add_``, ...)."""
    scope: str
    """FQN of the innermost module running (``<model>`` for the root, ``<loss>`` outside)."""
    inside: bool
    """True when made inside the model's forward (False: in ``loss_fn`` around it)."""
    node: int | None
    """The graph node the call belongs to, or ``None`` (sizes, masks, buffer updates)."""
    view: bool
    """True for a view or alias of an existing storage (no data read or written)."""
    random: bool
    """True when an ATen op that draws random numbers ran inside it
    (:func:`remat.capture.chain.draws_random`)."""
    mutated: tuple[int, ...]
    """Positions (in the flattened tensor arguments) of the tensors it modified in place."""


@dataclass(frozen=True)
class GraphTrace:
    """:func:`trace_graph`'s result: the graph and how the traced calls map onto it."""

    graph: Graph
    """The costed graph."""
    level: str
    """``"module"`` or ``"op"``."""
    calls: tuple[CallInfo, ...]
    """Every intercepted call in order (only those inside the model, ``inside=True``, are run
    by the planned module)."""
    node_calls: tuple[tuple[int, ...], ...]
    """Per node, the indices of its calls."""
    output_saved: tuple[bool, ...]
    """Per node, True when some backward saves its output (False for the sinks and for
    outputs read by several nodes that no backward keeps)."""
    node_inside: tuple[bool, ...]
    """Per node, True when its calls run inside the model's forward (False: loss nodes)."""
    saves_own_output: tuple[bool, ...]
    """Per node, True when the node's own backward saves its output (a ReLU, a softmax); when
    False only its consumers' backwards keep it (a convolution's output, saved by the next
    batch norm), so it dies with their saves, before the node's own backward."""
    batch_bytes: int
    """Unique bytes of the batch's tensors (part of ``graph.input_bytes``)."""
    saved_constant_bytes: int
    """Bytes of saved storages made by calls that need no gradient (``graph.constants`` with
    ``saved_by``, or part of ``graph.input_bytes``: :meth:`Graph.saved_constants_as_input`)."""
    real_saved_bytes: int = field(default=0)
    """Unique bytes autograd saved during the traced forward (parameters and batch excluded),
    counted directly from the hooks: ``sum(saved_bytes) - unsaved outputs`` equals it."""
    param_grad_bytes: tuple[int, ...] = field(default=())
    """Per node, the bytes of the parameter gradients that first appear at its backward
    (a parameter's gradient is made by the backward of the last node that reads it, and lives
    to the end of the step): :func:`remat.core.simulate.simulate_step_peak` adds them to
    predict the whole step's peak."""
    grad_rise_bytes: tuple[int, ...] = field(default=())
    """Per node, how much the parameter gradients raise its backward's peak above what the
    simulator counts for it (the input gradients it makes and ``bwd_overhead_bytes``): 0 when
    they appear after that peak (a linear layer's weight gradient, made once its input
    gradient is), at most about ``param_grad_bytes`` when they are all live at it. The
    whole-step model counts it during the node's backward in place of ``param_grad_bytes``
    (:attr:`remat.core.step.StepCosts.grad_rise_bytes`; the chain's:
    :attr:`remat.capture.chain.Captured.grad_rise_bytes`). Empty when not measured
    (``costs=False``): all of them are counted from the backward's start."""
    output_bytes: int = field(default=0)
    """Unique bytes of what the model's forward returned (parameters, buffers and the batch
    excluded): what a training loop that holds the output keeps through the step
    (:class:`remat.core.step.StepCosts`)."""
    largest_output_bytes: int = field(default=0)
    """Bytes of the largest tensor of that output (what a criterion on it may save)."""
    output_has_loss: bool = field(default=False)
    """The output has its own ``.loss`` tensor: the loss captured is the loop's
    (:attr:`remat.capture.chain.Captured.output_has_loss`)."""
    loss_bytes: int = field(default=0)
    """Bytes of the loss tensor (:attr:`remat.core.step.StepCosts.loss_bytes`)."""
    held_past_step_bytes: int = field(default=0)
    """Bytes of tensors the recorded step made that the program still held after it
    (:class:`remat.measure.events.HeldPastStep`: a hook's feature dict, a cached attribute):
    live all step whatever the plan (:func:`remat.auto.step_costs`)."""
    forward_kept_bytes: tuple[int, ...] = field(default=())
    """Per node, the wrapped scalars its forward saves without the saved-tensor hooks
    (:func:`remat.capture.chain.unhooked_saves`, NOTE [ Saved wrapped scalars ]), kept from
    every forward of it to its backward (:attr:`remat.core.step.StepCosts.
    forward_kept_bytes`); not in ``saved_bytes``. Empty when not measured (``costs=False``)."""
    small_scratch_bytes: tuple[tuple[int, int], ...] = field(default=())
    """Per node, ``(forward, backward)``: what the allocator saw above the tracked tensors at
    the node's peaks when it is below :data:`remat.measure.events.SCRATCH_MIN_BYTES` (left out
    of the overheads: :func:`remat.measure.events.small_scratch_bytes`), as
    :attr:`remat.core.step.StepCosts.op_scratch_bytes` reads it. Empty when not measured
    (fake tensors, ``costs=False``)."""


@older_objects_frozen()
def capture_graph(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    level: str = "module",
    fake: bool = False,
    repeats: int = 1,
    *,
    time_model: TimeModel | None = None,
) -> Graph:
    """Capture ``model`` on ``batch`` as a costed :class:`Graph` (see the module docstring).

    ``level`` is ``"module"`` (leaf modules and the functional calls between them) or ``"op"``
    (every torch call); ``fake=True`` measures under fake tensors with FLOPs as times, or the
    seconds ``time_model`` predicts; ``repeats`` timed steps give the median times (real
    tensors only).
    """
    return trace_graph(model, batch, loss_fn, level, fake, repeats, time_model=time_model).graph


def trace_graph(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    level: str = "module",
    fake: bool = False,
    repeats: int = 1,
    costs: bool = True,
    *,
    time_model: TimeModel | None = None,
) -> GraphTrace:
    """Like :func:`capture_graph`, also returning how the traced calls map onto the nodes.

    ``costs=False`` skips the backward, the memory tracker and the timing (the executor only
    needs the structure; node bytes are still exact, times are zero).
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    traces = trace_levels(
        model, batch, loss_fn, (level,), fake, repeats, costs, time_model=time_model
    )
    return traces[level]


def trace_levels(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    levels: tuple[str, ...] = LEVELS,
    fake: bool = False,
    repeats: int = 1,
    costs: bool = True,
    *,
    time_model: TimeModel | None = None,
) -> dict[str, GraphTrace]:
    """One recorded step grouped at several ``levels`` (the recording does not depend on the
    level; grouping is cheap). ``time_model`` (``fake=True`` only): node times in seconds
    from the work counted under fake tensors."""
    if time_model is not None and not fake:
        raise ValueError("time_model is for fake=True captures: a real capture times the nodes")
    for level in levels:
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    check_no_own_checkpointing(model)
    loss_fn = loss_fn or default_loss_fn
    with HeldPastStep(model, batch, fake) as held:
        traces = _trace_levels(model, batch, loss_fn, levels, fake, repeats, costs, time_model)
    return {
        level: replace(trace, held_past_step_bytes=held.bytes) for level, trace in traces.items()
    }


def _trace_levels(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    levels: tuple[str, ...],
    fake: bool,
    repeats: int,
    costs: bool,
    time_model: TimeModel | None,
) -> dict[str, GraphTrace]:
    """:func:`trace_levels`' recording and grouping."""
    if fake:
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
        )

        try:
            with fake_step(model, batch) as (mode, fake_batch, _), mode, ScratchProbe():
                state = _record(model, fake_batch, loss_fn, costs, True, time_model)
                unit = "flop" if time_model is None else "s"
                return {level: _build(state, level, unit) for level in levels}
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            raise ValueError(
                "the model reads tensor values in Python (e.g. a Hugging Face BERT checks the "
                "input ids for padding), which fake tensors cannot answer: capture it with "
                "fake=False (a smaller batch, then Graph.scaled, if memory is short)"
            ) from err
    private = BatchCopy(batch)  # the model may write into its input: never the caller's
    with _preserved(model) as replay, garbage_collected():  # NOTE [ Collect before measuring ]
        try:
            state = _record(model, private.batch, loss_fn, costs, flops=False)
        except _SavedOutsideCalls as err:
            replay()  # (a forward that checkpoints itself saves outside the calls too)
            raise _own_checkpoint(model, private, loss_fn) or err from None
        if costs:
            try:
                _time_calls(model, private, loss_fn, state, repeats, replay)
            except _CallsChanged:
                # a first forward that makes calls later ones do not (an attribute set lazily:
                # torchvision's MultiScaleRoIAlign infers its scales once): the steps the
                # executor runs are the later ones, so record one of those
                replay()
                state = _record(model, private.restore(), loss_fn, costs, flops=False)
                try:
                    _time_calls(model, private, loss_fn, state, repeats, replay)
                except _CallsChanged as err:
                    replay()
                    raise _not_repeatable(model, private, loss_fn, err) from err
    return {level: _build(state, level, "s") for level in levels}


_OWN_CHECKPOINT = "remat: the model's forward checkpoints part of itself"


def _not_repeatable(
    model: nn.Module, batch: BatchCopy, loss_fn: LossFn, err: _CallsChanged
) -> UnsupportedModelError:
    """The error for a step whose torch calls changed from one run to the next, saying why
    where it can: a forward that runs ``torch.utils.checkpoint`` itself (found by running it
    once more with saved-tensor hooks forbidden, which torch's non-reentrant checkpoint uses;
    its recomputation in the backward made the recorded step differ from the timed one)."""
    return _own_checkpoint(model, batch, loss_fn) or UnsupportedModelError(
        f"{err}, so remat cannot plan it: a forward that recomputes part of itself "
        "(reentrant torch.utils.checkpoint), or that branches on random numbers or on "
        "values, runs other calls each step"
    )


def _own_checkpoint(
    model: nn.Module, batch: BatchCopy, loss_fn: LossFn
) -> UnsupportedModelError | None:
    """The error for a forward that runs ``torch.utils.checkpoint`` itself (found by running it
    once more with saved-tensor hooks forbidden, which torch's non-reentrant checkpoint uses),
    or None."""
    try:
        with torch.autograd.graph.disable_saved_tensors_hooks(_OWN_CHECKPOINT):
            loss_fn(model, batch.restore())
    except RuntimeError as probe:
        if _OWN_CHECKPOINT in str(probe):
            return UnsupportedModelError(
                f"{type(model).__name__}'s forward checkpoints part of itself "
                "(torch.utils.checkpoint, or a library's gradient checkpointing): remat cannot "
                "plan around checkpoints it does not make. Call the layers directly (or turn "
                "that option off); remat plans the checkpointing itself"
            )
    return None


# ---------------------------------------------------------------------- recording
@dataclass
class _Rec:
    """A call as recorded (mutable while tracing)."""

    index: int
    func: Callable[..., Any]
    op: str
    scope: str
    group: tuple[Any, ...]
    inside: bool
    in_keys: list[int] = field(default_factory=list)
    arg_keys: frozenset[int] = frozenset()  # the inputs' storages, before the call
    out_keys: list[int] = field(default_factory=list)
    new: list[bool] = field(default_factory=list)
    mutated: tuple[int, ...] = ()
    requires_grad: bool = False
    saves: list[tuple[int, int]] = field(default_factory=list)
    ops: int = 0  # ATen ops run by the call (views left out)
    random: bool = False
    fwd_cost: float = 0.0
    bwd_cost: float = 0.0
    mem: tuple[int, int] = (-1, -1)  # tracker samples before and after the call
    span: int = -1  # the allocator range of the call (real tensors), see _Allocator
    times: list[float] = field(default_factory=list)
    bwd_times: list[float] = field(default_factory=list)


@dataclass
class _State:
    """Everything one recorded step produced."""

    root: nn.Module
    names: dict[int, str]
    calls: list[_Rec] = field(default_factory=list)
    current: _Rec | None = None
    stack: list[tuple[nn.Module, int]] = field(default_factory=list)
    serial: int = 0
    inside: int = 0
    entered: int = 0
    known: dict[int, int] = field(default_factory=dict)
    fixed: set[int] = field(default_factory=set)
    params: dict[int, int] = field(default_factory=dict)  # storage -> gradient bytes
    batch_keys: dict[int, int] = field(default_factory=dict)
    serials: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    next_key: int = 0
    backward: list[tuple[int, int, int, int]] = field(default_factory=list)  # call, pre, post, span
    memory: _Memory | None = None
    allocator: _Allocator | _ScratchSpans | None = None
    grad_fns: dict[Any, int] = field(default_factory=dict)
    loss_key: int = -1
    loss_bytes: int = 0
    packed: set[int] = field(default_factory=set)  # storages (_cdata) the pack hook saw
    kept_scalars: dict[int, int] = field(default_factory=dict)  # call -> unhooked saved bytes
    real_saved: dict[int, int] = field(default_factory=dict)
    stray_saves: int = 0
    dispatching: int = 0  # > 0 inside _RandomWatch's __torch_dispatch__
    output_bytes: int = 0  # the model's output (what a loop that holds it keeps)
    largest_output_bytes: int = 0  # its largest tensor (what a criterion on it may save)
    output_has_loss: bool = False  # the output has its own .loss (the loop's criterion)
    batch_ids: set[int] = field(default_factory=set)
    born: dict[int, int] = field(default_factory=dict)  # no-grad storage -> the call making it
    died: dict[int, int] = field(default_factory=dict)  # ... -> recorded calls when it was freed
    finalizers: list[weakref.finalize] = field(default_factory=list)
    # node outputs: the tensor objects the program holds (storage -> objects alive), and when
    # the last of them died (-> recorded calls by then); autograd keeps the storages of saved
    # tensors, so a storage finaliser cannot see the program let go of them
    holders: dict[int, int] = field(default_factory=dict)
    released: dict[int, int] = field(default_factory=dict)
    watched: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)

    def scope(self) -> str:
        if not self.inside:
            return LOSS_SCOPE
        for module, _ in reversed(self.stack):
            name = self.names.get(id(module))
            if name is not None:
                return name or ROOT_SCOPE
        return ROOT_SCOPE

    def group(self, index: int) -> tuple[Any, ...]:
        if self.inside and self.stack:
            module, serial = self.stack[-1]
            if module is not self.root and not any(True for _ in module.children()):
                return ("leaf", serial)
        return ("call", index)


def _key(st: _State, t: torch.Tensor) -> int:
    """A number for ``t``'s storage, unique over the whole step (addresses are reused)."""
    storage = t.untyped_storage()
    key = st.serials.get(storage)
    if key is None:
        st.next_key += 1
        key = st.serials[storage] = st.next_key
    return key


def _output_bytes(st: _State, out: Any) -> tuple[int, int]:
    """Bytes of the tensors in ``out`` that are not parameters, buffers or the batch, and of
    the largest of them as a criterion reads it (:func:`~remat.measure.events.
    criterion_input_bytes`; each tensor once; from its shape alone: touching its storage here
    perturbs the tracker)."""
    fixed = {id(t) for t in (*st.root.parameters(), *st.root.buffers())}
    seen: dict[int, int] = {}
    read: dict[int, int] = {}  # as a criterion reads them (criterion_input_bytes)
    for t in output_tensors(out):
        if id(t) not in fixed and id(t) not in st.batch_ids:
            seen[id(t)] = t.numel() * t.element_size()
            read[id(t)] = criterion_input_bytes(t)
    return sum(seen.values()), max(read.values(), default=0)


def _nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


class _Recorder(TorchFunctionMode):
    """Records every torch call: arguments' and outputs' storages, in-place writes, costs."""

    def __init__(self, state: _State, flops: Any) -> None:
        super().__init__()
        self.state = state
        self.flops = flops

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        st = self.state
        if st.dispatching:
            return func(*args, **kwargs)  # an ATen op below the program (see _RandomWatch)
        ins = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        versions = [_version(t) for t in ins]
        index = len(st.calls)
        rec = _Rec(index, func, _op_name(func), st.scope(), st.group(index), st.inside > 0)
        rec.arg_keys = frozenset(_key(st, t) for t in ins if not in_transform(t))
        memory = st.memory
        before = memory.mark() if memory is not None else -1
        flops0 = _total_flops(self.flops)
        prev, st.current = st.current, rec
        span = st.allocator.begin() if st.allocator is not None else -1
        try:
            out = func(*args, **kwargs)
        finally:
            st.current = prev
            if st.allocator is not None:
                st.allocator.end(span)
        outs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        if in_transform(ins, outs):
            _check_transform_call(func, ins, outs)
            return out  # inside torch.vmap (a Hugging Face mask): not part of the program
        mutated = tuple(i for i, t in enumerate(ins) if _version(t) != versions[i])
        if not is_tensor_call(func, outs, mutated):
            return out  # sizes, flags, hooks: not part of the program
        st.calls.append(rec)
        rec.mutated = mutated
        rec.fwd_cost = _total_flops(self.flops) - flops0
        if memory is not None:
            rec.mem = (before, memory.mark())
        rec.span = span
        for t in ins:
            key = _key(st, t)
            rec.in_keys.append(key)
            if key not in st.known:  # a tensor made outside any call (module attribute, ...)
                st.known[key] = _nbytes(t)
        for t in outs:
            key = _key(st, t)
            rec.out_keys.append(key)
            rec.new.append(key not in st.known)
            if key not in st.known:
                st.known[key] = _nbytes(t)
        changed = outs + [ins[i] for i in mutated]
        rec.requires_grad = any(t.requires_grad for t in changed)
        if not rec.requires_grad:  # a constant: when is it freed? (Graph.constants)
            for t, key, fresh in zip(outs, rec.out_keys, rec.new, strict=True):
                if fresh and key not in st.born:
                    st.born[key] = index
                    st.finalizers.append(
                        weakref.finalize(t.untyped_storage(), _freed, st.died, st.calls, key)
                    )
        else:  # a node's: when does the program let go of its outputs? (Node.held_until)
            for t, key in zip(outs, rec.out_keys, strict=True):
                if key in st.fixed or key in st.batch_keys or t in st.watched:
                    continue
                st.watched[t] = True
                st.holders[key] = st.holders.get(key, 0) + 1
                st.finalizers.append(
                    weakref.finalize(t, _let_go, st.holders, st.released, st.calls, key)
                )
        if rec.requires_grad and torch.is_grad_enabled():
            _claim_grad_fns(st, changed, index)
        return out


_UNCOUNTED_GETTERS = frozenset({"grad", "_grad", "_base"})


def in_transform(*objs: Any) -> bool:
    """True for a call made inside a ``torch.func`` transform (``torch.vmap``, as Hugging Face
    uses to build attention masks): its tensors are functorch wrappers, which have no storage.

    Such calls are not part of the program (neither the recorder nor the executor counts them):
    the transform's result, an ordinary tensor, enters the program where a call reads it,
    like a tensor made outside any call.
    """
    if torch._C._functorch.maybe_current_level() is None:  # no transform running: fast path
        return False
    return any(isinstance(t, torch.Tensor) and _functorch_wrapped(t) for t in tree_leaves(objs))


def _functorch_wrapped(t: torch.Tensor) -> bool:
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    while _functorch_wrapped(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def _check_transform_call(
    func: Callable[..., Any], ins: list[torch.Tensor], outs: list[torch.Tensor]
) -> None:
    """Refuse a call inside a transform that touches a tensor requiring grad: its autograd
    functions and saved tensors would be invisible to the graph (a silently wrong memory
    model). Masks and indices built under ``torch.vmap`` need no gradient and pass."""
    if not torch.is_grad_enabled():
        return
    if any(_unwrapped(t).requires_grad for t in (*ins, *outs)):
        raise _transform_error(_op_name(func))


def _transform_error(what: str) -> ValueError:
    return ValueError(
        f"the model runs {what} inside a torch.func transform (torch.vmap, torch.func.grad, "
        "...): the graph capture cannot measure it (it supports only calls that need no "
        "gradient under a transform, such as the masks Hugging Face builds with torch.vmap). "
        "Plan the model as a chain instead (remat.auto(..., stages=[...]) naming its blocks), "
        "or compute that part without the transform"
    )


def is_tensor_call(func: Callable[..., Any], outs: list[torch.Tensor], mutated: tuple) -> bool:
    """True for a call that is part of the program: it returns a tensor or writes one in place.

    Property reads that tools make (``.grad``, ``._base``) are not, nor are calls returning
    no tensor (``size``, ``dim``, ``register_hook``): profilers and trackers make those from
    their hooks, and they must not shift the numbering of the model's calls.
    """
    if not outs and not mutated:
        return False
    if getattr(func, "__name__", None) == "__get__":
        owner = getattr(func, "__self__", None)
        if getattr(owner, "__name__", None) in _UNCOUNTED_GETTERS:
            return False
    return True


class _RandomWatch(TorchDispatchMode):
    """Marks the current call random when an ATen op that draws random numbers runs
    (:func:`remat.capture.chain.draws_random`)."""

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        rec = self.state.current
        if rec is not None and draws_random(func, args, kwargs or {}):
            rec.random = True
        if rec is not None and not self.state.dispatching and not func.is_view:
            rec.ops += 1
        # ATen ops run from here are below the program (functorch's C++ _remove_batch_dim
        # dispatches its unsqueeze/expand here when a dispatch mode is active): the recorder
        # must not count them, since the executor, which has no dispatch mode, never sees them
        self.state.dispatching += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.state.dispatching -= 1


def _op_name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", None)
    if name in (None, "__get__", "__set__"):
        owner = getattr(func, "__self__", None) or getattr(func, "__objclass__", None)
        name = getattr(owner, "__name__", None) or str(func)
    return str(name).strip("_") or str(name)


def _total_flops(counter: WorkCounter | None) -> float:
    """FLOPs, or modelled seconds, counted so far (0 without a counter)."""
    return 0.0 if counter is None else counter.cost()


def _freed(died: dict[int, int], calls: list[_Rec], key: int) -> None:
    """A constant's storage was freed: note how many calls had been recorded by then."""
    died.setdefault(key, len(calls))


def _let_go(holders: dict[int, int], released: dict[int, int], calls: list[_Rec], key: int) -> None:
    """A tensor object of a node's output died: when it was the storage's last, note how many
    calls had been recorded by then."""
    holders[key] -= 1
    if not holders[key]:
        released[key] = len(calls)


def _claim_grad_fns(st: _State, tensors: list[torch.Tensor], index: int) -> None:
    """Assign the autograd functions this call created (reachable from its outputs through
    functions no earlier call owns) to the call."""
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in st.grad_fns or type(fn).__name__ == "AccumulateGrad":
            continue
        st.grad_fns[fn] = index
        stack.extend(nf for nf, _ in fn.next_functions if nf is not None)


def _record(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    costs: bool,
    flops: bool,
    time_model: TimeModel | None = None,
) -> _State:
    """Run ``loss_fn(model, batch)`` (and the backward when ``costs``) under the recorder."""
    names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    st = _State(root=model, names=names)
    for t in (*model.parameters(), *model.buffers()):
        st.fixed.add(_key(st, t))
        if isinstance(t, nn.Parameter) and t.requires_grad:
            st.params[_key(st, t)] = st.params.get(_key(st, t), 0) + allocation_bytes(t)
        st.known[_key(st, t)] = _nbytes(t)
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor):
            st.batch_keys[_key(st, t)] = _nbytes(t)
            st.batch_ids.add(id(t))
            st.known[_key(st, t)] = _nbytes(t)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _key(st, t)
        st.packed.add(t.untyped_storage()._cdata)
        if key not in st.fixed and key not in st.batch_keys:
            st.real_saved[key] = _nbytes(t)
        if st.current is None:
            st.stray_saves += 1
        else:
            st.current.saves.append((key, _nbytes(t)))
        # autograd is to keep the storage, not the program's tensor object (the pack hook is
        # handed that object): for a node's output, the object's death is the program letting
        # go (st.released). An input that is no node output is kept as it is: MemTracker would
        # count an alias of a storage no op made (a label tensor the loss holds) as new bytes.
        if key in st.holders or (st.current is not None and key not in st.current.arg_keys):
            # not a call of the model's: a custom autograd.Function's save_for_backward packs
            # while the recorder is on (BLOOM's GeLUFunction), and a recorded ``detach`` the
            # timed step does not make refused the model as not deterministic in its calls
            with torch._C.DisableTorchFunction():
                return t.detach()
        return t

    def pre_hook(module: nn.Module, args: Any) -> None:
        if in_transform(args):
            # a module run by torch.vmap (MemTracker's own hooks cannot read its arguments)
            raise _transform_error(f"the module {names.get(id(module)) or type(module).__name__}")
        st.serial += 1
        st.stack.append((module, st.serial))
        if module is model:
            st.inside += 1
            st.entered += 1
            if st.entered > 1:
                raise ValueError(ONE_MODEL_CALL)

    def post_hook(module: nn.Module, args: Any, out: Any) -> None:
        if st.stack and st.stack[-1][0] is module:
            st.stack.pop()
        if module is model:
            st.inside -= 1
            with torch._C.DisableTorchFunction():  # not a call of the model's: unrecorded
                st.output_bytes, st.largest_output_bytes = _output_bytes(st, out)
                st.output_has_loss = isinstance(getattr(out, "loss", None), torch.Tensor)

    counter = WorkCounter(time_model) if (costs and flops) else None
    tracker = StepTracker(timeline=False) if costs else None
    st.memory = _Memory(tracker) if tracker is not None else None
    if tracker is not None and flops:  # fake tensors: the scratch probe's ops
        st.allocator = _ScratchSpans(tracker.live_bytes)
    if costs and not flops:
        if torch.autograd.profiler._is_profiler_enabled:  # a second one would end the user's
            warnings.warn(
                "capture_graph runs inside a torch.profiler session: it cannot count the "
                "scratch memory of kernels (oneDNN convolutions, batch norms) and may "
                "under-predict such models; capture outside the profiler",
                stacklevel=5,
            )
        else:
            st.allocator = _Allocator(_device_of(model, batch))
    params = list(model.parameters())
    grads = {p: p.grad for p in params}
    for p in params:
        p.grad = None
    with ExitStack() as stack:
        stack.callback(lambda: [setattr(p, "grad", g) for p, g in grads.items()])
        pre = nn.modules.module.register_module_forward_pre_hook(pre_hook)
        stack.callback(pre.remove)
        post = nn.modules.module.register_module_forward_hook(post_hook, always_call=True)
        stack.callback(post.remove)
        if tracker is not None:
            tracker.track_external(model, batch)
            stack.enter_context(tracker)
            tracker.start()
        if st.allocator is not None:
            stack.enter_context(st.allocator)
        if counter is not None:
            stack.enter_context(counter)
        stack.enter_context(_RandomWatch(st))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with _Recorder(st, counter):
                loss = loss_fn(model, batch)
        if st.entered != 1:
            raise ValueError(ONE_MODEL_CALL)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("loss_fn(model, batch) must return a scalar tensor")
        if st.stray_saves:  # NOTE [ Tensors saved outside every call ]
            raise _SavedOutsideCalls(_saved_outside_calls(loss, st.stray_saves))
        st.loss_key = _key(st, loss)
        st.loss_bytes = _nbytes(loss)
        if costs and loss.requires_grad:
            _kept_scalars(st, loss, _device_of(model, batch))
            _backward_costs(st, loss, counter)
        del loss
    for finalizer in st.finalizers:  # still alive: held to the end of the step
        finalizer.detach()
    st.finalizers.clear()
    return st


# NOTE [ Tensors saved outside every call ]
# The recorder sees torch calls. A custom torch.autograd.Function's ``apply`` is not one: its
# forward's calls run without grad, so they look like constants, and what its forward saves
# (``ctx.save_for_backward``) is packed outside every recorded call. Its backward node, its
# saved tensors and its backward's temporaries were in no node of the graph: BLOOM's training
# GeLU (a Function saving its input) made the least plan of a tiny BLOOM run 56,332 B over its
# budget, while its gradients were right. So a step that saves a tensor outside every call is
# refused by the module-graph capture, naming the Functions; the chain path (which measures
# whole stages and checkpoints them with torch.utils.checkpoint) plans such models.


class _SavedOutsideCalls(UnsupportedModelError):
    """The step saved tensors outside every recorded call (NOTE [ Tensors saved outside every
    call ])."""


def _saved_outside_calls(loss: torch.Tensor, count: int) -> str:
    """The error for a step whose autograd saved ``count`` tensors outside every recorded
    call (NOTE [ Tensors saved outside every call ])."""
    names: list[str] = []
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if isinstance(fn, torch.autograd.function.BackwardCFunction):
            name = type(fn).__name__.removesuffix("Backward")
            if name not in names:
                names.append(name)
        stack.extend(nf for nf, _ in fn.next_functions)
    what = (
        f"custom torch.autograd.Function{'s' if len(names) > 1 else ''} {', '.join(names)}"
        if names
        else "code the graph capture does not see as torch calls"
    )
    return (
        f"the step saves {count} tensor{'s' if count > 1 else ''} for the backward from {what}: "
        "the module-graph capture records torch calls, and a Function's apply is not one, so "
        "its saved tensors and its backward would be missing from the memory model. Plan the "
        "model as a chain of stages (remat.auto(..., stages=[...]) naming its blocks, at a "
        "budget the chain meets), or write that part with torch operations"
    )


def _kept_scalars(st: _State, loss: torch.Tensor, device: torch.device) -> None:
    """Per call, the bytes its autograd functions save without the saved-tensor hooks (NOTE
    [ Saved wrapped scalars ] in :mod:`remat.capture.chain`): ``st.kept_scalars``."""
    known = set(st.packed)
    known.update(t.untyped_storage()._cdata for t in (*st.root.parameters(), *st.root.buffers()))
    with torch._C.DisableTorchFunction():
        for fn, _, nbytes in unhooked_saves([loss], known, device):
            call = st.grad_fns.get(fn)
            if call is not None:
                st.kept_scalars[call] = st.kept_scalars.get(call, 0) + nbytes


def _backward_costs(st: _State, loss: torch.Tensor, counter: Any) -> None:
    """Run the backward with hooks on every autograd function: FLOPs and memory samples."""
    handles = []
    calls = st.calls
    memory = st.memory
    allocator = st.allocator
    starts: dict[Any, tuple[float, int, int]] = {}

    def make_hooks(fn: Any, index: int) -> None:
        def pre(grad_outputs: Any) -> None:
            span = allocator.begin() if allocator is not None else -1
            starts[fn] = (_total_flops(counter), memory.mark() if memory is not None else -1, span)

        def post(grad_inputs: Any, grad_outputs: Any) -> None:
            flops, mark, span = starts.pop(fn, (0.0, -1, -1))
            if allocator is not None and span >= 0:
                allocator.end(span)
            calls[index].bwd_cost += _total_flops(counter) - flops
            if memory is not None:
                st.backward.append((index, mark, memory.mark(), span))

        handles.append(fn.register_prehook(pre))
        handles.append(fn.register_hook(post))

    for fn, index in st.grad_fns.items():
        make_hooks(fn, index)
    try:
        if memory is not None:
            memory.tracker.set_phase("backward")
        loss.backward()
    finally:
        for h in handles:
            h.remove()


class _Memory:
    """Activation-side bytes sampled by a :class:`~remat.measure.profile.StepTracker`, parameter
    gradients excluded (they are re-tagged when accumulated, after the operation that made
    them: the tracker corrects earlier samples)."""

    def __init__(self, tracker: StepTracker) -> None:
        self.tracker = tracker

    def mark(self) -> int:
        """Take a sample now; returns its index."""
        self.tracker.reset_window()
        return len(self.tracker._activation) - 1

    def peak(self, first: int, last: int) -> int:
        """Highest corrected sample in ``[first, last]``."""
        return int(self.tracker._corrected_max(first, last + 1, phases_only=False))

    def peak_with_grads(self, first: int, last: int) -> int:
        """Highest sample in ``[first, last]``, parameter gradients included."""
        return max(self.tracker._with_grads[first : last + 1], default=0)

    def rise_with_grads(self, first: int, last: int) -> int:
        """Highest sample in ``[first, last]`` above sample ``first``, parameter gradients
        included (what the allocator also counts)."""
        samples = self.tracker._with_grads
        return max(samples[first : last + 1], default=0) - samples[first]


class _Allocator:
    """The allocator's own events over the recorded step (real tensors only).

    A TorchDispatchMode (the tracker) sees tensors, not the scratch memory kernels allocate
    inside themselves (oneDNN's weight and input reorders in a CPU convolution, batch-norm and
    LSTM workspaces). One ``torch.profiler`` with ``profile_memory=True`` runs over the whole
    step; every recorded call and every autograd function is a named range (a
    ``_RecordFunctionFast``, which no torch-function mode sees), and :meth:`rises` gives, per
    range, the highest running sum of the allocation events inside it above its value at the
    range's start. On CUDA the caching allocator reports to the same profiler.
    """

    def __init__(self, device: torch.device) -> None:
        self.device_type = device.type
        self.profiler: Any = None
        self.ranges: list[Any] = []
        self.names: list[str] = []
        self._rises: list[int] | None = None

    def __enter__(self) -> _Allocator:
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.profiler.__exit__(*exc)

    def begin(self) -> int:
        from torch._C._profiler import _RecordFunctionFast

        span = len(self.ranges)
        name = f"remat.graph_capture.{span}"
        record = _RecordFunctionFast(name)
        record.__enter__()
        self.ranges.append(record)
        self.names.append(name)
        return span

    def end(self, span: int) -> None:
        record = self.ranges[span]
        if record is not None:
            record.__exit__(None, None, None)
            self.ranges[span] = None

    def excess(self, span: int, tracked: int) -> tuple[int, int]:
        """``(scratch, small scratch)`` of range ``span`` above its ``tracked`` rise."""
        rise = self.rise(span)
        return scratch_bytes(rise, tracked), small_scratch_bytes(rise, tracked)

    def rise(self, span: int) -> int:
        """Allocator bytes above the range's start at its highest point (0 if unknown)."""
        if span < 0:
            return 0
        if self._rises is None:
            self._rises = self._compute()
        return self._rises[span] if span < len(self._rises) else 0

    def _compute(self) -> list[int]:
        import bisect

        events = self.profiler.profiler.kineto_results.events()
        index = {name: k for k, name in enumerate(self.names)}
        bounds: list[tuple[int, int] | None] = [None] * len(self.names)
        memory: list[tuple[int, int]] = []
        for event in events:
            name = event.name()
            if name == "[memory]":
                if str(event.device_type()).rsplit(".", 1)[-1].lower() == self.device_type:
                    memory.append((event.start_ns(), event.nbytes()))
            elif name in index:
                start = event.start_ns()
                bounds[index[name]] = (start, start + event.duration_ns())
        memory.sort(key=lambda e: e[0])
        times = [t for t, _ in memory]
        running = [0]
        for _, nbytes in memory:
            running.append(running[-1] + nbytes)
        rises = []
        for bound in bounds:
            if bound is None:
                rises.append(0)
                continue
            lo = bisect.bisect_left(times, bound[0])
            hi = bisect.bisect_right(times, bound[1])
            top = max(running[lo + 1 : hi + 1], default=running[lo])
            rises.append(max(0, top - running[lo]))
        return rises


class _ScratchSpans:
    """:class:`_Allocator`'s stand-in under fake tensors (which allocate nothing): each range a
    :class:`remat.measure.scratch.ScratchWindow` of the capture's scratch probe over the
    tracker's bytes, rising where an op inside takes kernel scratch."""

    def __init__(self, level: Callable[[], int]) -> None:
        self.probe = ScratchProbe.current()
        self.level = level
        self.windows: list[ScratchWindow] = []

    def __enter__(self) -> _ScratchSpans:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def begin(self) -> int:
        window = ScratchWindow(self.probe, self.level).__enter__()
        self.windows.append(window)
        return len(self.windows) - 1

    def end(self, span: int) -> None:
        self.windows[span].__exit__(None, None, None)

    def excess(self, span: int, tracked: int) -> tuple[int, int]:
        """``(scratch, small scratch)`` of range ``span`` above its ``tracked`` rise."""
        return self.windows[span].excess(tracked) if span >= 0 else (0, 0)


def _device_of(model: nn.Module, batch: Any) -> torch.device:
    for t in (*model.parameters(), *tree_leaves(batch)):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


class _CallsChanged(RuntimeError):
    """A step run again made other torch calls than the recorded one."""


def _time_calls(
    model: nn.Module,
    batch: BatchCopy,
    loss_fn: LossFn,
    st: _State,
    repeats: int,
    replay: Callable[[], None],
) -> None:
    """Seconds per call: ``repeats`` steps under a light timing mode, medians (each on the
    recorded step's input, :meth:`~remat.measure.profile.BatchCopy.restore`, and its random
    numbers, ``replay``: the step timed is the step recorded). Raises :class:`_CallsChanged`
    when a step makes other calls than the recorded one."""
    calls = st.calls

    class Timer(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.index = 0
            self.grad_fns: dict[Any, int] = {}
            self.seconds = [0.0] * len(calls)

        def __torch_function__(
            self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
        ) -> Any:
            kwargs = kwargs or {}
            ins = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            versions = [_version(t) for t in ins]
            start = time.perf_counter()
            out = func(*args, **kwargs)
            seconds = time.perf_counter() - start
            outs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
            if in_transform(ins, outs):
                return out
            mutated = tuple(i for i, t in enumerate(ins) if _version(t) != versions[i])
            if not is_tensor_call(func, outs, mutated):
                return out
            index = self.index
            self.index += 1
            if index < len(self.seconds):
                self.seconds[index] += seconds
            if torch.is_grad_enabled():
                stack = [t.grad_fn for t in outs if t.grad_fn is not None]
                while stack:
                    fn = stack.pop()
                    if fn in self.grad_fns or type(fn).__name__ == "AccumulateGrad":
                        continue
                    self.grad_fns[fn] = index
                    stack.extend(nf for nf, _ in fn.next_functions if nf is not None)
            return out

    params = list(model.parameters())
    for _ in range(repeats):
        timer = Timer()
        inputs = batch.restore()
        replay()
        with timer:
            loss = loss_fn(model, inputs)
        if timer.index != len(calls):
            raise _CallsChanged(
                f"the timed step made {timer.index} torch calls, the recorded one {len(calls)}: "
                "the model's forward is not deterministic in its calls"
            )
        bwd = [0.0] * len(calls)
        handles = _timing_hooks(timer.grad_fns, bwd)
        try:
            if loss.requires_grad:
                loss.backward()
        finally:
            for h in handles:
                h.remove()
            for p in params:
                p.grad = None
        del loss
        for rec, fwd, back in zip(calls, timer.seconds, bwd, strict=True):
            rec.times.append(fwd)
            rec.bwd_times.append(back)
    for rec in calls:
        rec.fwd_cost = statistics.median(rec.times)
        rec.bwd_cost = statistics.median(rec.bwd_times)


def _timing_hooks(grad_fns: dict[Any, int], seconds: list[float]) -> list[Any]:
    """Hooks adding each autograd function's backward seconds to its call's entry."""
    starts: dict[Any, float] = {}
    handles = []
    for fn, index in grad_fns.items():

        def pre(grad_outputs: Any, fn: Any = fn) -> None:
            starts[fn] = time.perf_counter()

        def post(grad_inputs: Any, grad_outputs: Any, fn: Any = fn, index: int = index) -> None:
            seconds[index] += time.perf_counter() - starts.pop(fn, time.perf_counter())

        handles.append(fn.register_prehook(pre))
        handles.append(fn.register_hook(post))
    return handles


@contextmanager
def _preserved(model: nn.Module) -> Iterator[Callable[[], None]]:
    """Restore buffers, parameter gradients and the RNG state afterwards. The gradients are
    set aside first: a trace's backward must not add into the caller's (a re-plan while
    gradients accumulate over microbatches). Yields a function that sets the RNG state back
    to what it was on entry (a step run again draws the same numbers)."""
    buffers = BufferSnapshot(model)
    grads = {p: p.grad for p in model.parameters()}
    for p in grads:
        p.grad = None
    devices = sorted({t.device for t in buffers.tensors if t.device.type == "cuda"}, key=str)
    try:
        with torch.random.fork_rng(devices=devices):
            cpu = torch.get_rng_state()
            cuda = [torch.cuda.get_rng_state(d) for d in devices]

            def replay() -> None:
                torch.set_rng_state(cpu)
                for d, state in zip(devices, cuda, strict=True):
                    torch.cuda.set_rng_state(state, d)

            yield replay
    finally:
        buffers.restore()
        for p, g in grads.items():
            p.grad = g


# ---------------------------------------------------------------------- calls to nodes
@dataclass
class _N:
    """A provisional node while grouping."""

    calls: list[int] = field(default_factory=list)
    name_call: int = -1
    order: int = -1
    inputs: set[int] = field(default_factory=set)
    saved_inputs: set[int] = field(default_factory=set)
    storages: list[int] = field(default_factory=list)
    read: set[int] = field(default_factory=set)
    own_saved: dict[int, int] = field(default_factory=dict)
    saved_outputs: set[int] = field(default_factory=set)
    self_saved: set[int] = field(default_factory=set)
    inside: bool = True


@dataclass
class _Grouping:
    """The provisional nodes of one level and how the recorded calls map onto them."""

    nodes: list[_N]
    owner: dict[int, int]
    """Storage -> the node whose calls last wrote it."""
    constants: set[int]
    """Storages made by calls that need no gradient (masks, indices, ...)."""
    saved_constants: dict[int, int]
    """Of those and of the known storages no node owns, the bytes of each a backward saves."""
    constant_savers: dict[int, set[int]]
    """Per saved constant, the provisional nodes whose backward saves it."""
    call_node: list[int | None]
    """Per call, its provisional node (None: a call that is no node's)."""
    is_view: list[bool]
    """Per call, True when it only makes a view of a node's storage."""


def _build(st: _State, level: str, time_unit: str) -> GraphTrace:
    """The recorded step ``st`` grouped at ``level`` as a costed graph and its call map."""
    calls = st.calls
    grouping = _group(st, level)
    nodes, owner, call_node = grouping.nodes, grouping.owner, grouping.call_node
    outs = _node_outputs(nodes)
    output_saved = [any(k in node.saved_outputs for k in outs[v]) for v, node in enumerate(nodes)]
    loss_node = owner.get(st.loss_key)
    saves_constants = {v for savers in grouping.constant_savers.values() for v in savers}
    roots = _merge_unsaved(nodes, outs, output_saved, loss_node, saves_constants)
    final = _loss_ancestors(nodes, roots, loss_node)
    index = {x: i for i, x in enumerate(final)}
    for c in range(len(calls)):
        v = call_node[c]
        call_node[c] = index.get(roots[v]) if v is not None else None
    graph_nodes, node_calls = _graph_nodes(st, level, nodes, outs, roots, index)
    own = [any(k in nodes[x].self_saved for k in outs[x]) for x in final]
    # before the overheads: what a backward holds of its own, so the least it can free
    # (Node.bwd_overhead_floor), depends on it
    graph_nodes = [replace(node, keeps_output=own[v]) for v, node in enumerate(graph_nodes)]
    small: tuple[tuple[int, int], ...] = ()
    peak_calls: list[int | None] = [None] * len(graph_nodes)
    if st.memory is not None:
        graph_nodes, small, peak_calls = _overheads(st, graph_nodes, call_node)
    kept = [0] * len(graph_nodes)
    for c, nbytes in st.kept_scalars.items():
        if call_node[c] is not None:
            kept[call_node[c]] += nbytes
    param_grads = _param_grad_bytes(st, call_node, len(graph_nodes))
    rise = _grad_rise_bytes(st, graph_nodes, call_node) if st.memory is not None else []
    random_calls = [0] * len(graph_nodes)  # what the graph executor saves an RNG state for
    for rec in calls:
        if rec.random and rec.inside and call_node[rec.index] is not None:
            random_calls[call_node[rec.index]] += 1
    held = _held_until(
        st, [[k for k in outs[x] if roots[owner[k]] == x] for x in final], node_calls, graph_nodes
    )
    merged: list[list[int]] = [[] for _ in final]  # the outputs of the nodes merged into each
    for v in range(len(nodes)):
        if roots[v] != v and roots[v] in index:
            merged[index[roots[v]]].extend(k for k in outs[v] if owner[k] == v)
    graph_nodes = [
        replace(node, random_calls=random_calls[v], held_until=held[v])
        for v, node in enumerate(graph_nodes)
    ]
    batch_bytes = sum(st.batch_keys.values())
    const_bytes = sum(grouping.saved_constants.values())
    unsaved_constants = grouping.constants - grouping.saved_constants.keys()
    # a saved constant lives until the backwards that save it (Constant.saved_by); one saved
    # by a dropped node or made before the recorded calls is counted all step, with the batch
    savers = {k: [index.get(roots[u]) for u in us] for k, us in grouping.constant_savers.items()}
    timed = {
        k: {v for v in vs if v is not None}
        for k, vs in savers.items()
        if None not in vs and k in st.born
    }
    graph = Graph(
        tuple(graph_nodes),
        input_bytes=batch_bytes
        + sum(b for k, b in grouping.saved_constants.items() if k not in timed),
        time_unit=time_unit,
        constants=_constants(st, unsaved_constants | timed.keys(), node_calls, call_node, timed)
        + _held_inside(st, merged, node_calls, peak_calls),
    )
    infos = tuple(
        CallInfo(
            index=rec.index,
            func=rec.func,
            op=rec.op,
            scope=rec.scope,
            inside=rec.inside,
            node=call_node[rec.index],
            view=grouping.is_view[rec.index],
            random=rec.random,
            mutated=rec.mutated,
        )
        for rec in calls
    )
    return GraphTrace(
        graph=graph,
        level=level,
        calls=infos,
        node_calls=tuple(node_calls),
        output_saved=tuple(output_saved[x] for x in final),
        node_inside=tuple(nodes[x].inside for x in final),
        saves_own_output=tuple(own),
        batch_bytes=batch_bytes,
        saved_constant_bytes=const_bytes,
        real_saved_bytes=sum(st.real_saved.values()),
        param_grad_bytes=tuple(param_grads),
        grad_rise_bytes=tuple(rise),
        output_bytes=st.output_bytes,
        largest_output_bytes=st.largest_output_bytes,
        output_has_loss=st.output_has_loss,
        loss_bytes=st.loss_bytes,
        forward_kept_bytes=tuple(kept) if st.kept_scalars else (),
        small_scratch_bytes=small if st.allocator is not None else (),
    )


def _group(st: _State, level: str) -> _Grouping:
    """The calls that make or write a storage needing a gradient, as provisional nodes: at
    ``level="module"`` one per leaf-module call (``rec.group``), at ``"op"`` one per call;
    views and in-place writes join the node that owns the storage (a write to a storage
    another node has read since starts a new node). Records the edges (inputs read, inputs
    saved) and the bytes each node's backward saves."""
    calls = st.calls
    owner: dict[int, int] = {}  # storage -> node
    readers: dict[int, set[int]] = {}  # storage -> foreign nodes that read it since its last write
    nodes: list[_N] = []
    by_group: dict[tuple[Any, ...], int] = {}
    constants: set[int] = set()
    saved_constants: dict[int, int] = {}
    constant_savers: dict[int, set[int]] = {}
    call_node: list[int | None] = [None] * len(calls)
    is_view = [False] * len(calls)

    def new_node(rec: _Rec) -> int:
        nodes.append(_N(name_call=rec.index, inside=rec.inside))
        return len(nodes) - 1

    for rec in calls:
        if not rec.out_keys and not rec.mutated:
            continue  # sizes, flags, ...
        prior = [owner.get(k) for k in rec.in_keys]
        written = [rec.in_keys[i] for i in rec.mutated if rec.in_keys[i] in owner]
        new = [k for k, fresh in zip(rec.out_keys, rec.new, strict=True) if fresh]
        reads = True
        if new and rec.requires_grad:
            group = rec.group if level == "module" else ("call", rec.index)
            v = by_group.get(group)
            if v is None:
                v = by_group[group] = new_node(rec)
            for k in new:
                owner[k] = v
                nodes[v].storages.append(k)
            for k in written:
                owner[k], readers[k] = v, set()
        elif written:
            u = owner[written[0]]
            foreign = readers.get(written[0], set()) - {u}
            v = new_node(rec) if foreign else u
            for k in written:
                if k not in nodes[v].storages:
                    nodes[v].storages.append(k)
                owner[k], readers[k] = v, set()
        elif new:
            constants.update(new)  # needs no gradient: masks, indices, ...
            continue
        else:
            owned = [owner[k] for k in rec.out_keys if k in owner]
            if not owned:
                continue  # a view of a parameter, buffer, batch or constant
            v, reads, is_view[rec.index] = owned[0], False, True
        call_node[rec.index] = v
        node = nodes[v]
        node.calls.append(rec.index)
        if not is_view[rec.index]:
            node.order = rec.index
        if reads:
            for k, u in zip(rec.in_keys, prior, strict=True):
                if u is None or u == v:
                    continue
                node.inputs.add(u)
                nodes[u].read.add(k)
                readers.setdefault(k, set()).add(v)
        for k, nbytes in rec.saves:
            if k in st.fixed or k in st.batch_keys:
                continue
            if k in constants or (k not in owner and k in st.known):
                saved_constants[k] = nbytes
                constant_savers.setdefault(k, set()).add(v)
                continue
            u = owner.get(k)
            if u is None or u == v:  # own output, or a storage made inside the call
                node.own_saved[k] = nbytes
                if u == v:
                    node.saved_outputs.add(k)
                    node.self_saved.add(k)
            else:
                node.saved_inputs.add(u)
                nodes[u].saved_outputs.add(k)
    return _Grouping(nodes, owner, constants, saved_constants, constant_savers, call_node, is_view)


def _node_outputs(nodes: list[_N]) -> list[list[int]]:
    """Per node, its output storages: those other nodes read (a sink: its last storage)."""
    outs: list[list[int]] = []
    for node in nodes:
        read = [k for k in node.storages if k in node.read]
        outs.append(read or node.storages[-1:])
    return outs


def _merge_unsaved(
    nodes: list[_N],
    outs: list[list[int]],
    output_saved: list[bool],
    loss_node: int | None,
    saves_constants: set[int],
) -> list[int]:
    """Merge each node whose output nobody saves into its only consumer (latest first), in
    place, unless one runs inside the model and the other not, or ``runs_between`` forbids it.
    Returns per node the node it ended in (itself when not merged)."""
    parent = list(range(len(nodes)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    consumers: list[set[int]] = [set() for _ in nodes]
    for v, node in enumerate(nodes):
        for u in node.inputs:
            consumers[u].add(v)
    by_order = sorted((node.order, x) for x, node in enumerate(nodes))
    orders = [o for o, _ in by_order]

    def runs_between(v: int, w: int) -> bool:
        """True when ``v``'s backward keeps tensors (a residual, saved inputs, a saved
        constant) and a node of neither group runs between ``v`` and ``w``: the engine runs
        that node's backward between theirs too, so ``v``'s saved tensors outlive ``w``'s
        backward (RegNet's projection batch norm, then the residual branch, then the sum).
        A constant counts: a BERT attention on frozen inputs had its value projection, which
        saves only the frozen hidden states, merged into the product with the probabilities
        across the scores' calls; the two nodes then ran by turns, and the value's gradient,
        made by the product's backward before the softmax's and freed by the projection's
        after it, was live through the softmax's backward, where a plan measured 3,968 B above
        its prediction (the simulator runs a node's backward at once)."""
        if not (nodes[v].own_saved or nodes[v].saved_inputs or v in saves_constants):
            return False
        lo = bisect.bisect_right(orders, nodes[v].order)
        hi = bisect.bisect_left(orders, nodes[w].order)
        return any(find(x) not in (w, find(v)) for _, x in by_order[lo:hi])

    for v in sorted(range(len(nodes)), key=lambda x: -nodes[x].order):
        if output_saved[v] or v == loss_node or not outs[v]:
            continue
        targets = {find(c) for c in consumers[v]} - {find(v)}
        if len(targets) != 1:
            continue
        w = targets.pop()
        if nodes[w].inside != nodes[v].inside or runs_between(v, w):
            continue
        parent[v] = w
        keep, gone = nodes[w], nodes[v]
        keep.calls.extend(gone.calls)
        keep.inputs |= gone.inputs
        keep.saved_inputs |= gone.saved_inputs
        keep.own_saved.update(gone.own_saved)
        keep.order = max(keep.order, gone.order)
        for k in outs[v]:  # now internal: nobody saves them, so not counted
            keep.own_saved.pop(k, None)
    return [find(v) for v in range(len(nodes))]


def _loss_ancestors(nodes: list[_N], roots: list[int], loss_node: int | None) -> list[int]:
    """The merged nodes from which the loss can be reached, in forward order."""
    alive: set[int] = set()
    if loss_node is not None:
        stack = [roots[loss_node]]
        while stack:
            x = stack.pop()
            if x in alive:
                continue
            alive.add(x)
            stack.extend(roots[u] for u in nodes[x].inputs if roots[u] != x)
    return sorted(alive, key=lambda x: nodes[x].order)


def _graph_nodes(
    st: _State,
    level: str,
    nodes: list[_N],
    outs: list[list[int]],
    roots: list[int],
    index: dict[int, int],
) -> tuple[list[Node], list[tuple[int, ...]]]:
    """The costed :class:`Node` of each merged node kept (``index``: merged node -> its
    index in the graph): a unique name, its edges, summed times, output and saved bytes;
    and the calls each one ran."""
    calls = st.calls
    names: dict[str, int] = {}
    graph_nodes = []
    node_calls = []
    for x in index:
        node = nodes[x]
        rec = calls[node.name_call]
        if level == "module" and rec.group[0] == "leaf":
            base = rec.scope
        else:
            base = f"{rec.scope}/{rec.op}"
        count = names.get(base, 0)
        names[base] = count + 1
        name = base if count == 0 else f"{base}#{count}"
        out_keys = set(outs[x])
        out_bytes = sum(st.known[k] for k in out_keys)
        residual = sum(b for k, b in node.own_saved.items() if k not in out_keys)
        inputs = sorted({index[roots[u]] for u in node.inputs if roots[u] != x})
        saved_inputs = sorted({index[roots[u]] for u in node.saved_inputs if roots[u] != x})
        mine = sorted(node.calls)
        graph_nodes.append(
            Node(
                name=name,
                inputs=tuple(inputs),
                fwd_time=float(sum(calls[c].fwd_cost for c in mine)),
                bwd_time=float(sum(calls[c].bwd_cost for c in mine)),
                out_bytes=out_bytes,
                saved_bytes=out_bytes + residual,
                fwd_overhead_bytes=0,
                bwd_overhead_bytes=0,
                saved_inputs=tuple(saved_inputs),
            )
        )
        node_calls.append(tuple(mine))
    if not graph_nodes:
        raise ValueError(
            "the traced step has no node with a gradient: does the loss depend on parameters "
            "or on inputs that require grad?"
        )
    return graph_nodes, node_calls


def _param_grad_bytes(st: _State, call_node: list[int | None], n: int) -> list[int]:
    """Per node of ``n``, the bytes of the parameter gradients its backward makes: each
    parameter's at the last node that reads it."""
    grad_node: dict[int, int] = {}  # parameter storage -> the last node that reads it
    for rec in st.calls:
        v = call_node[rec.index]
        if v is None:
            continue
        for k in rec.in_keys:
            if k in st.params:
                grad_node[k] = max(grad_node.get(k, -1), v)
    param_grads = [0] * n
    for k, v in grad_node.items():
        param_grads[v] += st.params[k]
    return param_grads


def _grad_rise_bytes(st: _State, nodes: list[Node], call_node: list[int | None]) -> list[int]:
    """Per node (``nodes`` with their overheads), how much the parameter gradients raise its
    backward's peak above what the simulator counts for that backward (the input gradients it
    makes and ``bwd_overhead_bytes``): the backward's walk (:func:`_backward_peaks`) over the
    samples with the parameter gradients, minus that. A weight gradient made after the
    backward's peak (a linear layer's, after its input gradient and once the output gradient
    is freed) raises it by nothing; every gradient made before it, by its bytes
    (:attr:`GraphTrace.grad_rise_bytes`; :attr:`remat.capture.chain.StageCost.grad_rise_bytes`
    on the chain path)."""
    memory = st.memory
    assert memory is not None
    with_grads, _ = _backward_peaks(st, call_node, len(nodes), memory.peak_with_grads)
    new_grads = _new_input_grads(nodes)
    return [
        max(0, peak - new_grads[v] - node.bwd_overhead_bytes)
        for v, (node, peak) in enumerate(zip(nodes, with_grads, strict=True))
    ]


def _backward_peaks(
    st: _State, call_node: list[int | None], n: int, value: Callable[[int, int], int]
) -> tuple[list[int], list[int]]:
    """Per node, the highest bytes its backward holds above what was live when its first
    autograd function started, walking its autograd functions in the order the engine ran
    them (``grown``: what they hold so far, frees between two of them counted when no other
    node's ran in between) with the kernel scratch only the allocator saw; and the same with
    the allocator-only bytes below 1 KiB. ``value(first, last)`` is the highest tracked sample
    in ``[first, last]`` (:class:`_Memory`: without or with the parameter gradients)."""
    peak = [0] * n
    small = [0] * n
    grown = [0] * n
    last_end = [0] * n
    gaps = _Gaps(n, backward=True)
    for index, pre, post, span in st.backward:
        v = call_node[index]
        if v is None or pre < 0:
            continue
        grown[v] += gaps.change(v, value(pre, pre) - value(last_end[v], last_end[v]))
        big, little = _scratch(st, span, pre, post)
        excess = value(pre, post) - value(pre, pre) + big
        peak[v] = max(peak[v], grown[v] + excess)
        small[v] = max(small[v], grown[v] + excess + little)
        grown[v] += value(post, post) - value(pre, pre)
        last_end[v] = post
    return peak, small


def _new_input_grads(nodes: list[Node]) -> list[int]:
    """Per node, the input gradients the simulator allocates at its backward: those of the
    inputs whose last reader, in node order, is this node."""
    last_reader = [-1] * len(nodes)
    for v, node in enumerate(nodes):
        for u in node.inputs:
            last_reader[u] = max(last_reader[u], v)
    return [
        sum(nodes[u].out_bytes for u in node.inputs if last_reader[u] == v)
        for v, node in enumerate(nodes)
    ]


def _scratch(st: _State, span: int, first: int, last: int) -> tuple[int, int]:
    """What only the allocator saw inside one call / autograd function (kernel scratch), and
    the part of it below 1 KiB that this leaves out (0, 0 without the allocator's events; under
    fake tensors, what the scratch probe's ops would have added: :class:`_ScratchSpans`)."""
    if st.allocator is None or st.memory is None:
        return 0, 0
    return st.allocator.excess(span, st.memory.rise_with_grads(first, last))


def _held_until(
    st: _State,
    out_keys: list[list[int]],
    node_calls: list[tuple[int, ...]],
    nodes: list[Node],
) -> list[int | None]:
    """Per node, the last node whose first forward runs while the program still holds the
    node's output (:attr:`Node.held_until`), when that is after its last reader: a variable
    reassigned only after a later call, as ``h`` in ``h = block(h) * mask``. The program
    holds a storage while one of its tensor objects lives (``st.released``: the calls recorded
    when the last died; one still alive at the end is held through the last node)."""
    n = len(nodes)
    last_reader = [-1] * n
    for v, node in enumerate(nodes):
        for u in node.inputs:
            last_reader[u] = max(last_reader[u], v)
    held_through = _held_through(st, [min(c) for c in node_calls])
    held: list[int | None] = []
    for v, keys in enumerate(out_keys):
        w = held_through(keys)
        if last_reader[v] < 0:  # a sink (the loss reads it)
            held.append(None)
            continue
        held.append(w if w > last_reader[v] else None)
    return held


def _held_through(st: _State, moments: list[int]) -> Callable[[list[int]], int]:
    """A function giving, for storages of node outputs, the last node whose ``moments`` call
    (its first, or the one at which its forward peaks) runs while the program still holds one
    of them (``-1``: none watched). The program holds a storage while one of its tensor
    objects lives (``st.released``: the calls recorded when the last died; one still alive at
    the end is held through the last node)."""
    by_moment = sorted((c, v) for v, c in enumerate(moments))
    starts = [c for c, _ in by_moment]
    latest = list(itertools.accumulate((v for _, v in by_moment), max))

    def through(keys: list[int]) -> int:
        watched = [k for k in keys if k in st.holders]
        if not watched:
            return -1
        let_go = max(st.released[k] if not st.holders[k] else len(st.calls) for k in watched)
        started = bisect.bisect_left(starts, let_go)  # nodes whose moment ran before
        return latest[started - 1] if started else -1

    return through


def _held_inside(
    st: _State,
    merged: list[list[int]],
    node_calls: list[tuple[int, ...]],
    peak_calls: list[int | None],
) -> tuple[Constant, ...]:
    """The outputs of calls merged into a node (``merged``: per node, their storages; no
    backward saves them) that the program holds past that node's forward, as constants from
    the next node to the last whose forward peaks (``peak_calls``; its first call where not
    measured) while held: Hugging Face BERT's ``h = self.dense(h); h = self.LayerNorm(h + x)``
    keeps the dense output (merged into the sum) through the layer norm's forward (a step
    checkpointing up to the sum measured 8,176 B above its prediction without it). The peak,
    not the first call: nodes interleave, and a Llama attention node's first call (the query
    projection) runs before the rotary embedding's temporaries of the key node, which die
    before the attention's product where it peaks (counted through it, LoRA-Llama's least
    plan was predicted 39,700 B above what it measured). During the node's own forward it is
    in the node's overhead. Like a node's output held past its last reader
    (:attr:`Node.held_until`), only the first forward holds it: a recomputation replays the
    calls, not the program."""
    moments = [min(c) if p is None else p for c, p in zip(node_calls, peak_calls, strict=True)]
    held_through = _held_through(st, moments)
    out = []
    for v, keys in enumerate(merged):
        for k in keys:
            w = held_through([k])
            if w > v:
                out.append(Constant(st.known[k], v + 1, w))
    return tuple(out)


def _constants(
    st: _State,
    keys: set[int],
    node_calls: list[tuple[int, ...]],
    call_node: list[int | None],
    saved_by: dict[int, set[int]],
) -> tuple[Constant, ...]:
    """The storages made without gradient that are live while a node runs forward
    (:class:`~remat.core.graph.Constant`): from the call that made each to the moment it was
    freed (the recorded calls by then; Python may hold it past its last read, as a Hugging
    Face model holds its input embeddings to the end of its forward), and for those in
    ``saved_by``, until the backwards of the nodes that save them."""
    first_call = [min(c) for c in node_calls]
    last_call = [max(c) for c in node_calls]
    readers: dict[int, set[int]] = {}
    for rec in st.calls:
        v = call_node[rec.index]
        if v is None:
            continue
        for k in rec.in_keys:
            if k in keys:
                readers.setdefault(k, set()).add(v)
    out = []
    for k in sorted(keys, key=lambda k: st.born.get(k, -1)):
        born = st.born.get(k)
        if born is None:
            continue
        died = st.died.get(k, len(st.calls))
        mine = readers.get(k, set())
        savers = saved_by.get(k, set())
        live = [
            v
            for v in range(len(node_calls))
            if v in mine or v in savers or (born < last_call[v] and died > first_call[v])
        ]
        if live:
            out.append(
                Constant(
                    st.known[k], min(live), max(live), tuple(sorted(mine)), tuple(sorted(savers))
                )
            )
    return tuple(out)


class _Gaps:
    """What the bytes live between two calls (or autograd functions) of one node add to its
    walk, in the order the walk visits them. With no other node's in between: the change.
    Otherwise the other nodes' work is theirs, but when two nodes' calls interleave (a BERT
    attention's query-key node and its value node: the value's projection runs between the
    keys' and the scores'), what one leaves is live through the other's calls, which the
    simulator runs one after the other: a rise left by a node the simulator runs after this
    one (``later``) is counted, an upper bound. In the forward that is a node of a higher
    index (one of a lower index has run, its bytes are live there); in the backward any node,
    since the simulator counts the other's state when its backward is done, not while it runs
    (the value's gradient, made by the product's backward before the softmax's and freed by
    the value projection's after it: a frozen BERT's plan measured 3,968 B above its
    prediction at the softmax's backward)."""

    def __init__(self, n: int, backward: bool) -> None:
        self.backward = backward
        self.owners: list[int] = []
        self.last = [-1] * n  # per node, the position of its last call in ``owners``

    def change(self, v: int, change: int) -> int:
        """The gap's ``change`` as it counts for node ``v``, whose call is the next."""
        start = self.last[v]
        self.last[v] = len(self.owners)
        others = self.owners[start + 1 :] if start >= 0 else []
        self.owners.append(v)
        if start < 0 or not others:
            return change if start >= 0 else 0
        later = self.backward or min(others) > v
        return max(0, change) if later else 0


class _WithoutGrad:
    """The forward walk of :func:`_overheads` as the node runs without grad (``F_none``): what
    autograd keeps only for the backward is gone there. A tensor a call saves that is neither
    its input nor its output (batch norm's and layer norm's statistics, a dropout mask made
    inside ``F.dropout``) dies with the call; an output of the node's calls that a later call
    of it saves (a linear's output saved by the GELU after it) dies when the program lets go
    of its last tensor object (``st.released``), not at the backward. Everything else is as
    recorded, so the walk is the grad-mode one less those bytes: a layer norm recomputed
    without grad still peaks with its statistics, which it frees on return (the walk that
    took the grad-mode peak less the saved bytes had a frozen BERT's checkpointed layer
    norm 512 B low, and a plan at its least budget 1,044 B over it)."""

    def __init__(self, st: _State, n: int) -> None:
        self.st = st
        self.peak = [0] * n
        self.grown = [0] * n
        self.made: list[set[int]] = [set() for _ in range(n)]  # storages the node's calls made
        self.pending: list[dict[int, int]] = [{} for _ in range(n)]  # saved outputs still held

    def call(self, v: int, rec: _Rec, excess: int, rise: int) -> None:
        """One call of node ``v``: its peak ``excess`` over its start, its recorded ``rise``."""
        made = self.made[v]
        made.update(k for k, new in zip(rec.out_keys, rec.new, strict=True) if new)
        inside = 0  # made and saved inside the call: freed on return
        seen: set[int] = set()
        for k, nbytes in rec.saves:
            if k in seen:
                continue
            seen.add(k)
            if k in made:
                self.pending[v].setdefault(k, nbytes)
            elif k not in rec.arg_keys and k not in rec.out_keys:
                inside += nbytes
        # the call's peak without grad: one ATen op makes what it saves with its output (layer
        # norm's statistics), all there at its peak; what the ops of a call that runs several
        # saved for the backward only (the scores and probabilities of an attention computed
        # op by op) is taken as gone, as each is freed once the next op has read it
        self.peak[v] = max(self.peak[v], self.grown[v] + excess - (inside if rec.ops > 1 else 0))
        self.grown[v] += rise - inside
        released = self.st.released
        for k in [
            k for k in self.pending[v] if released.get(k, len(self.st.calls) + 1) <= rec.index + 1
        ]:
            if not self.st.holders.get(k, 0):
                self.grown[v] -= self.pending[v].pop(k)


def _overheads(
    st: _State, nodes: list[Node], call_node: list[int | None]
) -> tuple[list[Node], tuple[tuple[int, int], ...], list[int | None]]:
    """Transient bytes per node, in the simulator's terms (docs/cost-model.md), per node
    what the allocator-only bytes below 1 KiB add to them (``(forward, backward)``:
    :attr:`GraphTrace.small_scratch_bytes`), and per node the call at which its forward peaks
    (``None``: none of its calls was measured).

    Forward: walking the node's calls, ``grown`` is what they hold so far (frees between two
    of its calls counted when no other node ran in between); the node's peak is the highest
    ``grown`` plus the excess of one call's peak over its start. The simulator allocates
    ``saved_bytes`` at once, so the overhead is that peak minus ``saved_bytes``. Backward: the
    same walk over the node's autograd functions in the order the engine ran them, minus the
    input gradients the simulator allocates at the node's backward (the inputs whose last
    reader, in node order, is this node).
    """
    memory = st.memory
    assert memory is not None
    value = memory.peak

    n = len(nodes)
    fwd_peak = [0] * n
    fwd_small = [0] * n  # the peak with the small scratch
    peak_call: list[int | None] = [None] * n
    grown = [0] * n
    last_end = [0] * n
    gaps = _Gaps(n, backward=False)
    without_grad = _WithoutGrad(st, n)
    for rec in st.calls:
        v = call_node[rec.index]
        if v is None or rec.mem[0] < 0:
            continue
        start, end = rec.mem
        gap = gaps.change(v, value(start, start) - value(last_end[v], last_end[v]))
        grown[v] += gap
        without_grad.grown[v] += gap
        big, little = _scratch(st, rec.span, start, end)
        excess = value(start, end) - value(start, start) + big
        if peak_call[v] is None or grown[v] + excess > fwd_peak[v]:
            fwd_peak[v], peak_call[v] = max(fwd_peak[v], grown[v] + excess), rec.index
        fwd_small[v] = max(fwd_small[v], grown[v] + excess + little)
        grown[v] += value(end, end) - value(start, start)
        without_grad.call(v, rec, excess, value(end, end) - value(start, start))
        last_end[v] = end
    bwd_peak, bwd_small = _backward_peaks(st, call_node, n, value)
    input_grads = _new_input_grads(nodes)
    out = []
    small = []
    for v, node in enumerate(nodes):
        new_grads = input_grads[v]
        fwd = max(0, fwd_peak[v] - node.saved_bytes)
        bwd = max(node.bwd_overhead_floor, bwd_peak[v] - new_grads)
        none = max(0, without_grad.peak[v] - node.out_bytes) if peak_call[v] is not None else None
        out.append(
            replace(
                node,
                fwd_overhead_bytes=fwd,
                bwd_overhead_bytes=bwd,
                fwd_none_overhead_bytes=None if none == fwd else none,
            )
        )
        # in the simulator's terms too: what the small scratch adds to each overhead
        small.append(
            (
                max(0, fwd_small[v] - node.saved_bytes) - fwd,
                max(node.bwd_overhead_floor, bwd_small[v] - new_grads) - bwd,
            )
        )
    return out, tuple(small), peak_call
