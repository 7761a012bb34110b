"""Apply a :class:`~remat.core.plan.Plan` to the eager model: :func:`apply_graph`.

The returned :class:`GraphPlannedModule` runs the model's own ``forward`` (eager, Python
control flow, Hugging Face outputs, hooks: all unchanged) under a ``TorchFunctionMode`` that
numbers the torch calls exactly as :func:`remat.capture.graph.trace_graph` did, so it knows
the node of every call and hence its segment. For each segment of the plan it keeps a
**frame**, the op-level counterpart of one non-reentrant ``torch.utils.checkpoint`` call:

* **forward**: the segment's calls run with grad (the autograd graph is built as usual) under
  the frame's ``saved_tensors_hooks``, whose pack hook drops every saved tensor and returns a
  small holder; the frame records each call (function, arguments as references to earlier
  outputs of the segment, RNG state for random calls, autocast state) and keeps a reference to
  every tensor the segment reads from outside (its **checkpoints**). Calls of stored nodes run
  untouched, saving what autograd saves.
* **backward**: the first unpack of a holder **recomputes the segment**: its recorded calls are
  replayed in order from the kept inputs, with grad, and the tensors they save are matched to
  the holders by (call, order of the save), as torch's checkpoint matches them per region.
  Holders whose backward already ran are skipped; each recomputed tensor is freed when its
  holder dies. A child segment's calls run in the parent's replay without saving, and the
  child's inputs are taken from that replay (nested checkpointing).

This is what :func:`remat.graphs.simulate_graph` assumes: a segment's nodes run without keeping
saved tensors in the forward, are recomputed (with their children checkpointed) at the first
backward that needs one of them, and the segment's external inputs stay alive until its
backward ends. Segments need not be contiguous in the execution order (a frame can be entered
and left any number of times), which ``torch.utils.checkpoint`` regions cannot do
(``docs/graph-executor.md``).

What stays equal to the unplanned model (tested): loss and gradients; dropout masks (the CPU
and CUDA RNG states are stashed before each random call of a segment and restored around its
replay); batch-norm running statistics, updated once per step (a call that writes a tensor
from outside its segment in place, such as ``F.batch_norm`` on ``running_mean``, is replayed
on a throw-away copy); the RNG stream after the step.

Example:
    >>> import torch, torchvision
    >>> from remat.capture.graph import capture_graph
    >>> from remat.planners.graph import plan_graph
    >>> model = torchvision.models.resnet18(num_classes=10)
    >>> x = torch.randn(2, 3, 32, 32)
    >>> graph = capture_graph(model, x, fake=True)
    >>> planned = apply_graph(model, plan_graph(graph, "reforward"), graph, x)
    >>> planned(x).sum().backward()

Known limitations:
    * Nodes that run outside the model's forward (the loss computed by ``loss_fn``) cannot be
      recomputed by the module: they are removed from the plan's segments
      (:attr:`GraphPlannedModule.executed_plan`, which is what to simulate).
    * Each call of the model goes through a Python ``TorchFunctionMode`` (a few microseconds
      per torch call) and a recomputation replays calls from Python; ``torch.compile`` of the
      planned module runs it eagerly (its forward is ``torch.compiler.disable``-d: the plan is
      honoured, nothing is fused); to compile a plan, use the chain executor
      (``remat.apply(..., compile=True)``).
    * The model must make the same torch calls at every training step for the traced input
      signature (checked call by call: :class:`GraphExecutionError` otherwise).
    * A segment input that is modified in place after the segment read it (outside the
      segment) cannot be recomputed from; this raises :class:`GraphExecutionError` at the
      recomputation instead of computing a wrong gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from remat.capture.chain import _model_arguments, autocast_now, autocast_regions
from remat.capture.graph import GraphTrace, in_transform, is_tensor_call, trace_levels
from remat.core.errors import RematError
from remat.core.graph import Graph
from remat.core.plan import Plan, Segment
from remat.execute.chain import (
    PlannedWrapper,
    SignaturePlans,
    call_loss,
    planned_state,
    step_state,
)
from remat.guards import check_no_own_checkpointing, input_signature
from remat.guards import tensor_version as _version
from remat.measure.profile import LossFn, default_loss_fn

__all__ = ["apply_graph", "GraphPlannedModule", "GraphExecutionError", "executed_plan"]


class GraphExecutionError(RematError, RuntimeError):
    """The model ran differently from its trace, or a recomputation cannot be done."""


def apply_graph(
    model: nn.Module,
    plan: Plan,
    graph: Graph,
    batch: Any = None,
    loss_fn: LossFn | None = None,
    *,
    fake_trace: bool = True,
    replan: Callable[..., tuple[Plan, Graph]] | None = None,
) -> GraphPlannedModule:
    """Wrap ``model`` so that its training steps run under the graph plan ``plan``.

    Args:
        model: the eager model; parameters and buffers are shared, not copied.
        plan: a :class:`Plan` for ``graph`` (e.g. from :func:`remat.graphs.plan_graph`).
        graph: the graph the plan was made for, from :func:`remat.capture.graph.capture_graph`
            on this model (either level; the level is recognised from the node names).
        batch, loss_fn: what ``graph`` was captured with; the model is traced again on them
            (under fake tensors, nothing allocated) to number its calls. Without ``batch`` the
            first training call is traced with :func:`remat.measure.profile.loss_from_output` as the
            loss. The model's arguments in ``batch`` (what ``loss_fn`` calls it with) are the
            input signature the plan is for: a training call with other shapes re-plans
            through ``replan`` or raises :class:`remat.execute.chain.SignatureMismatchError`.
        fake_trace: trace under ``FakeTensorMode`` (default) or with real tensors.
        replan: ``replan(*args, **kwargs) -> (plan, graph)``, called with the model's
            arguments for a new input signature: a plan and the graph it was made for, traced
            on ``((args, kwargs), remat.execute.chain.call_loss)``; cached per signature
            (:class:`remat.execute.chain.SignaturePlans`, as :func:`remat.apply` does).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, GraphPlannedModule):
        raise TypeError("this model already has a plan; apply it to planned.model instead")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan, got {type(plan).__name__}")
    check_no_own_checkpointing(model)
    plan.for_graph(graph)
    module = GraphPlannedModule(model, plan, graph, fake_trace, replan)
    if batch is not None:
        loss_fn = loss_fn or default_loss_fn
        args, kwargs = _model_arguments(model, loss_fn, batch)
        program = module._prepare(plan, graph, batch, loss_fn)
        module._plans.set(input_signature(*args, **kwargs), _Planned(plan, graph, program))
    return module


def executed_plan(plan: Plan, node_inside: Sequence[bool]) -> Plan:
    """``plan`` without the nodes that run outside the model's forward (the loss)."""

    def strip(seg: Segment) -> Segment | None:
        nodes = tuple(v for v in seg.nodes if node_inside[v])
        if not nodes:
            return None
        children = tuple(c for c in (strip(c) for c in seg.children) if c is not None)
        children = tuple(c for c in children if c.nodes != nodes)
        return Segment(nodes, children)

    segments = tuple(s for s in (strip(s) for s in plan.segments) if s is not None)
    if segments == plan.segments:
        return plan
    params = dict(plan.params)
    params["executed_from"] = plan.describe()
    return Plan(segments, method=plan.method, params=params, fingerprint=None)


class GraphPlannedModule(PlannedWrapper):
    """A model that trains under a graph plan; made by :func:`apply_graph`.

    The model is its submodule ``.model`` (parameters, buffers and ``state_dict`` are the
    model's, keys prefixed with ``model.``); attributes it lacks fall through to the model.
    The plan is used only in training mode with grad enabled; otherwise the model runs as is.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        graph: Graph,
        fake_trace: bool,
        replan: Callable[..., tuple[Plan, Graph]] | None = None,
    ) -> None:
        super().__init__(model)
        object.__setattr__(self, "_fake_trace", fake_trace)
        plans = SignaturePlans(
            _Planned(plan, graph, None),
            None,
            replan,
            self._build,
            "Capture and plan the graph for these inputs and call apply_graph again, or pass "
            "replan=callable (called with the new inputs, returning (plan, graph)).",
            initial_state=planned_state(model),
        )
        object.__setattr__(self, "_plans", plans)

    @property
    def _plan(self) -> Plan:
        return self._plans.current.plan

    @property
    def _graph(self) -> Graph:
        return self._plans.current.graph

    @property
    def _program(self) -> _Program | None:
        return self._plans.current.program

    @property
    def plan(self) -> Plan:
        """The plan as given (for the last training input signature)."""
        return self._plan

    @property
    def graph(self) -> Graph:
        """The graph the plan in use was made for."""
        return self._graph

    @property
    def executed_plan(self) -> Plan:
        """The plan actually run (loss nodes removed); simulate this one."""
        if self._program is None:
            raise GraphExecutionError("the model has not been traced yet (call it once)")
        return self._program.plan

    @property
    def level(self) -> str:
        if self._program is None:
            raise GraphExecutionError("the model has not been traced yet (call it once)")
        return self._program.trace.level

    @property
    def trace(self) -> GraphTrace:
        if self._program is None:
            raise GraphExecutionError("the model has not been traced yet (call it once)")
        return self._program.trace

    # The executor replays the traced torch calls under a TorchFunctionMode, which dynamo would
    # trace into other calls (``mul.Tensor`` for ``mul``) and break: torch.compile of a graph-
    # planned module runs this forward eagerly (the plan honoured, nothing fused).
    @torch.compiler.disable(reason="remat's graph executor runs eagerly (compile the chain path)")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.model(*args, **kwargs)
        planned = self._plans.lookup(args, kwargs, step_state(self.model))
        if planned.program is None:  # no batch given: trace the first training call
            planned.program = self._prepare(planned.plan, planned.graph, (args, kwargs), call_loss)
        program = planned.program
        run = _Run(program)
        with run:
            out = self.model(*args, **kwargs)
        if run.k != len(program.calls):
            raise GraphExecutionError(
                f"the forward made {run.k} of the {len(program.calls)} traced torch calls: the "
                "model runs differently from its trace"
            )
        return out

    def _build(self, result: tuple[Plan, Graph], args: tuple, kwargs: dict) -> _Planned:
        """A re-plan's ``(plan, graph)`` for the call ``(args, kwargs)``, traced on it."""
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"replan must return (Plan, Graph), got {type(result).__name__}")
        plan, graph = result
        if not isinstance(plan, Plan):
            raise TypeError(f"replan must return (Plan, Graph), got a {type(plan).__name__}")
        plan.for_graph(graph)
        return _Planned(plan, graph, self._prepare(plan, graph, (args, kwargs), call_loss))

    def _prepare(self, plan: Plan, graph: Graph, batch: Any, loss_fn: LossFn) -> _Program:
        try:
            traces = trace_levels(self.model, batch, loss_fn, fake=self._fake_trace, costs=False)
        except Exception as err:  # noqa: BLE001 - fall back to a real trace, then fail clearly
            if not self._fake_trace:
                raise
            try:
                traces = trace_levels(self.model, batch, loss_fn, fake=False, costs=False)
            except Exception:
                raise err from None
        try:
            trace = _match(graph, traces)
        except GraphExecutionError:
            if not self._fake_trace:
                raise
            # fake tensors may take another kernel than the real ones the graph was captured
            # with (an LSTM on the CPU: a real step runs oneDNN's, which saves a 4.3 MB
            # workspace the fake one has not): trace it for real
            trace = _match(graph, trace_levels(self.model, batch, loss_fn, fake=False, costs=False))
        return _Program.build(trace, executed_plan(plan, trace.node_inside), self.model)

    def extra_repr(self) -> str:
        return f"plan={self._plan.method}: {self._plan.describe()!r}, nodes={self._graph.n}"


# ---------------------------------------------------------------------- implementation
@dataclass
class _Planned:
    """A graph plan, its graph, and the traced program that runs it (None until traced)."""

    plan: Plan
    graph: Graph
    program: _Program | None


def _structure(graph: Graph, inside: Sequence[bool] | None = None) -> list[tuple[Any, ...]]:
    """Per node, what :func:`_match` compares: name, edges and bytes; for the loss's nodes
    (``inside`` False) name and edges only. A loss kernel may return, on real tensors, a view
    of a larger buffer that a fake trace makes alone: ``F.mse_loss`` on the CPU returns a 0-d
    view of its elementwise buffer (4 KiB captured, 4 B traced fake), and an equal graph was
    refused. The model's nodes keep their bytes: they tell another batch shape apart."""
    return [
        (n.name, n.inputs, n.out_bytes, n.saved_bytes)
        if inside is None or inside[i]
        else (n.name, n.inputs)
        for i, n in enumerate(graph.nodes)
    ]


def _match(graph: Graph, traces: dict[str, GraphTrace]) -> GraphTrace:
    """The level whose traced graph is ``graph`` (same names, edges and bytes; the loss's
    nodes: names and edges, :func:`_structure`)."""
    for trace in traces.values():
        if len(trace.graph.nodes) == graph.n and _structure(
            trace.graph, trace.node_inside
        ) == _structure(graph, trace.node_inside):
            return trace
    want = _structure(graph)
    names = [n.name for n in graph.nodes]
    diffs = []
    for level, trace in traces.items():
        got = _structure(trace.graph)
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        where = (
            f"node {first}: traced {got[first]} vs given {want[first]}"
            if first is not None
            else f"{len(got)} traced nodes vs {len(want)} given"
        )
        diffs.append(f"{level} level: {where}")
    raise GraphExecutionError(
        "the graph does not match this model traced on this batch and loss ("
        + "; ".join(diffs)
        + f"; given nodes start {names[:3]}). Pass apply_graph the batch and loss_fn the graph "
        "was captured with."
    )


@dataclass(frozen=True)
class _CallSpec:
    func: Callable[..., Any]
    chain: tuple[int, ...]  # segment ids, outermost first; () for a stored call
    random: bool
    mutated: frozenset[int]
    expects_output: bool


@dataclass
class _Program:
    """The traced calls of the model's forward with their segments."""

    trace: GraphTrace
    plan: Plan
    calls: list[_CallSpec]
    parents: list[int]  # segment id -> parent id (-1 for top level)
    copy_ids: set[int]  # ids of running-statistics buffers (written without a version bump)

    @classmethod
    def build(cls, trace: GraphTrace, plan: Plan, model: nn.Module) -> _Program:
        chain_of: dict[int, tuple[int, ...]] = {}
        parents: list[int] = []

        def visit(seg: Segment, prefix: tuple[int, ...], parent: int) -> None:
            sid = len(parents)
            parents.append(parent)
            chain = (*prefix, sid)
            for v in seg.nodes:
                chain_of[v] = chain  # children overwrite with their longer chains
            for child in seg.children:
                visit(child, chain, sid)

        for seg in plan.segments:
            visit(seg, (), -1)
        calls = []
        for info in trace.calls:
            if not info.inside:
                continue
            chain = chain_of.get(info.node, ()) if info.node is not None else ()
            calls.append(
                _CallSpec(
                    func=info.func,
                    chain=chain,
                    random=info.random,
                    mutated=frozenset(info.mutated),
                    expects_output=not info.mutated,
                )
            )
        copy_ids = {
            id(b)
            for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase)
            for b in (m.running_mean, m.running_var)
            if b is not None
        }
        return cls(trace, plan, calls, parents, copy_ids)


class _Holder:
    """What a segment's forward saves instead of a tensor (weakly referenced by its frame)."""

    __slots__ = ("__weakref__",)


@dataclass
class _Recipe:
    """One recorded call of a segment: enough to run it again."""

    k: int
    func: Callable[..., Any]
    spec: Any  # pytree spec of (args, kwargs)
    leaves: list[Any]  # leaves with tensors replaced by _Ref
    mutated: frozenset[int]  # leaf positions written in place (or batch-norm statistics)
    buffers: frozenset[int]  # those that are running-statistics buffers
    rng: tuple[torch.Tensor, list[torch.Tensor]] | None
    autocast: tuple[Any, ...] | None


@dataclass(frozen=True)
class _Ref:
    """A tensor argument: an output of an earlier call ``(call, index)`` or a kept input."""

    key: tuple[Any, ...]


class _Frame:
    """The checkpoint frame of one segment in one forward (see the module docstring)."""

    def __init__(self, sid: int, parent: _Frame | None, top: _Frame | None) -> None:
        self.sid = sid
        self.parent = parent
        self._top = top  # None for a top-level frame: no reference to itself (below)
        self.children: list[weakref.ref[_Frame]] = []
        self.calls: set[int] = set()  # calls of this segment (its children's included)
        self.own: set[int] = set()  # calls whose innermost segment this is
        self.needs: set[_Ref] = set()  # tensors read from outside this segment
        self.inputs: dict[_Ref, torch.Tensor] | None = None
        # top-level frames only: the recorded calls and the kept outside tensors
        self.recipes: list[_Recipe] = []
        self.kept: dict[_Ref, tuple[torch.Tensor, int]] = {}
        # saved-tensor bookkeeping
        self.holders: dict[tuple[int, int], weakref.ref[_Holder]] = {}
        self.nsaves: dict[int, int] = {}
        self.recomputed: weakref.WeakKeyDictionary[_Holder, torch.Tensor] = (
            weakref.WeakKeyDictionary()
        )
        self.current = -1
        self.done = False

    @property
    def top(self) -> _Frame:
        """The top-level frame (``self`` for one). Not stored on a top-level frame: a frame
        that referred to itself would be a reference cycle, freed only by Python's garbage
        collector, so its recipes (an RNG state per random call) would outlive its backward."""
        return self._top or self

    # -- forward
    def pack(self, tensor: torch.Tensor) -> _Holder:
        holder = _Holder()
        k = self.current
        n = self.nsaves.get(k, 0)
        self.nsaves[k] = n + 1
        self.holders[(k, n)] = weakref.ref(holder)
        return holder

    def unpack(self, holder: _Holder) -> torch.Tensor:
        tensor = self.recomputed.get(holder)
        if tensor is None:
            self.recompute()
            tensor = self.recomputed.get(holder)
            if tensor is None:
                raise GraphExecutionError(
                    f"segment {self.sid}: a saved tensor was not recomputed (was the backward "
                    "run twice without retain_graph?)"
                )
        return tensor

    # -- backward
    def recompute(self) -> None:
        if self.done:
            return
        if self.inputs is None:
            if self.parent is None:
                self.inputs = {ref: _check_kept(ref, *kept) for ref, kept in self.kept.items()}
            else:
                self.parent.recompute()
            if self.inputs is None:
                raise GraphExecutionError(f"segment {self.sid}: its inputs were not recomputed")
        recipes = [r for r in self.top.recipes if r.k in self.calls]
        children = [c for c in (w() for w in self.children) if c is not None]
        hold = {ref.key for c in children for ref in c.needs}
        last: dict[tuple[Any, ...], int] = {}
        for i, r in enumerate(recipes):
            for leaf in r.leaves:
                if isinstance(leaf, _Ref):
                    last[leaf.key] = i
        values: dict[tuple[Any, ...], torch.Tensor] = {
            ref.key: _detached(t) for ref, t in self.inputs.items()
        }
        inputs = {ref.key for ref in self.inputs}
        counts: dict[int, int] = {}
        devices = _cuda_devices(recipes)
        rng = any(r.rng is not None for r in recipes)
        with torch.random.fork_rng(devices=devices, enabled=rng), torch.enable_grad():
            for i, r in enumerate(recipes):
                leaves = []
                originals: dict[int, torch.Tensor] = {}
                for pos, leaf in enumerate(r.leaves):
                    if isinstance(leaf, _Ref):
                        t = values[leaf.key]
                        if pos in r.mutated and leaf.key in inputs:
                            copy = t.clone()  # never write a kept input (batch-norm statistics)
                            if pos in r.buffers:
                                originals[id(copy)] = t
                            t = copy
                        leaves.append(t)
                    else:
                        leaves.append(leaf)
                args, kwargs = tree_unflatten(leaves, r.spec)
                del leaves
                if r.rng is not None:
                    torch.set_rng_state(r.rng[0])
                    for device, state in zip(devices, r.rng[1], strict=False):
                        torch.cuda.set_rng_state(state, device)
                hooks = self._collect(r.k, counts, originals) if r.k in self.own else _DISCARD
                with hooks, autocast_regions(r.autocast or ()):
                    out = r.func(*args, **kwargs)
                del args, kwargs
                for j, t in enumerate(_tensors(out)):
                    key = ("out", r.k, j)
                    if key in last or key in hold:
                        values[key] = t
                del out
                for leaf in r.leaves:
                    if isinstance(leaf, _Ref) and last.get(leaf.key) == i:
                        if leaf.key not in hold:
                            values.pop(leaf.key, None)
        for k in self.own:
            if counts.get(k, 0) != self.nsaves.get(k, 0):
                raise GraphExecutionError(
                    f"segment {self.sid}: call {k} saved {counts.get(k, 0)} tensors when "
                    f"recomputed but {self.nsaves.get(k, 0)} in the forward (a call whose saved "
                    "tensors depend on state that changed)"
                )
        for child in children:
            child.inputs = {ref: values[ref.key] for ref in child.needs}
        self.done = True
        if self.parent is None:
            self.kept.clear()
        self.inputs = None

    def _collect(
        self, k: int, counts: dict[int, int], originals: dict[int, torch.Tensor]
    ) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(x: torch.Tensor) -> torch.Tensor:
            n = counts.get(k, 0)
            counts[k] = n + 1
            # batch norm saves its running statistics: the buffer itself, as in the forward,
            # not the throw-away copy the replay updated (no memory for the copies)
            x = originals.get(id(x), x)
            x = x.detach() if x.requires_grad else x
            ref = self.holders.get((k, n))
            holder = ref() if ref is not None else None
            if holder is not None:
                self.recomputed[holder] = x
            return x

        return torch.autograd.graph.saved_tensors_hooks(pack, _identity)


def _identity(x: Any) -> Any:
    return x


def _discard(x: torch.Tensor) -> None:
    return None


_DISCARD = torch.autograd.graph.saved_tensors_hooks(_discard, _identity)


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def _detached(t: torch.Tensor) -> torch.Tensor:
    d = t.detach()
    if t.requires_grad:
        d.requires_grad_(True)
    return d


def _check_kept(ref: _Ref, tensor: torch.Tensor, version: int) -> torch.Tensor:
    if _version(tensor) != version:
        raise GraphExecutionError(
            f"a tensor that a checkpointed segment reads ({tuple(tensor.shape)}, "
            f"{tensor.dtype}) was modified in place after the segment read it; it cannot be "
            "recomputed from. Keep that node stored (out of every segment) or avoid the "
            "in-place operation"
        )
    return tensor


def _cuda_devices(recipes: Sequence[_Recipe]) -> list[int]:
    for r in recipes:
        if r.rng is not None and r.rng[1]:
            return list(range(len(r.rng[1])))
    return []


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    cuda: list[torch.Tensor] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())]
    return torch.get_rng_state(), cuda


class _Run(TorchFunctionMode):
    """One training forward under the plan: numbers the calls and runs segment calls in
    their frames."""

    def __init__(self, program: _Program) -> None:
        super().__init__()
        self.program = program
        self.k = 0
        self.frames: dict[int, _Frame] = {}
        self.vids = WeakIdKeyDictionary()
        self.chains: dict[tuple[Any, ...], tuple[int, ...]] = {}

    def frame(self, sid: int) -> _Frame:
        frame = self.frames.get(sid)
        if frame is None:
            parent_id = self.program.parents[sid]
            parent = self.frame(parent_id) if parent_id >= 0 else None
            frame = _Frame(sid, parent, parent.top if parent is not None else None)
            if parent is not None:
                parent.children.append(weakref.ref(frame))
            self.frames[sid] = frame
        return frame

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if in_transform(args, kwargs):
            return func(*args, **kwargs)  # inside torch.vmap: not traced (capture.in_transform)
        calls = self.program.calls
        k = self.k
        spec = calls[k] if k < len(calls) else None
        # (a property's __get__ is a new method-wrapper at each access: equal, not identical)
        if spec is None or (spec.func is not func and spec.func != func):
            out = func(*args, **kwargs)
            outs = _tensors(out)
            if is_tensor_call(func, outs, ()) and not in_transform(outs):
                expected = getattr(spec.func, "__name__", spec.func) if spec else "no more calls"
                raise GraphExecutionError(
                    f"torch call {k} of the forward is {getattr(func, '__name__', func)} but the "
                    f"trace has {expected}: the model runs differently from its trace"
                )
            return out
        if not spec.chain:
            out = func(*args, **kwargs)
            if spec.expects_output and not _tensors(out):
                return out  # the same function called for something else (a tool's hook)
            self.k += 1
            return out
        return self._segment_call(k, spec, func, args, kwargs)

    def _segment_call(
        self, k: int, spec: _CallSpec, func: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        chain = spec.chain
        frames = [self.frame(sid) for sid in chain]
        top, inner = frames[0], frames[-1]
        leaves, tree = tree_flatten((args, kwargs))
        recorded: list[Any] = []
        copies: list[int] = []  # positions to replay on a throw-away copy
        buffers: list[int] = []  # ... that are running statistics
        tensor_pos = 0
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                recorded.append(leaf)
                continue
            mutated = tensor_pos in spec.mutated
            if mutated or id(leaf) in self.program.copy_ids:
                copies.append(len(recorded))
                if id(leaf) in self.program.copy_ids:
                    buffers.append(len(recorded))
            tensor_pos += 1
            vid = self.vids.get(leaf)
            inside = (
                vid is not None
                and vid[1] == _version(leaf)
                and self.chains.get(vid[0], (None,))[0] == top.sid
            )
            if inside:
                ref = _Ref(vid[0])
                producer = self.chains[vid[0]]
            else:
                ref = _Ref(("kept", len(top.kept)))
                kept = leaf.detach().clone() if mutated else leaf
                if mutated and leaf.requires_grad:
                    kept.requires_grad_(True)
                top.kept[ref] = (kept, _version(kept))
                producer = ()
            for frame in frames:
                if frame.sid not in producer:
                    frame.needs.add(ref)
            recorded.append(ref)
        rng = _rng_state() if spec.random else None
        inner.current = k
        with torch.autograd.graph.saved_tensors_hooks(inner.pack, inner.unpack):
            out = func(*args, **kwargs)
        outs = _tensors(out)
        if spec.expects_output and not outs:
            inner.nsaves.pop(k, None)
            return out  # not the traced call after all (see __torch_function__)
        for j, t in enumerate(outs):
            key = ("out", k, j)
            self.vids[t] = (key, _version(t))
            self.chains[key] = chain
        for frame in frames:
            frame.calls.add(k)
        inner.own.add(k)
        top.recipes.append(
            _Recipe(
                k,
                func,
                tree,
                recorded,
                frozenset(copies),
                frozenset(buffers),
                rng,
                autocast_now() or None,
            )
        )
        self.k += 1
        return out
