"""The simulator: what a plan costs, :func:`simulate_graph` (:func:`remat.simulate` is its
chain fast path, equal to it on the path graph event by event: ``tests/test_one_simulator.py``).

Two steps, both public so that an executor can be checked against them:

1. :func:`lower_plan` turns a :class:`~remat.core.plan.Plan` into an explicit
   **schedule**: the forward ops, the loss, the backward ops with the recomputations inserted,
   and after each op the tensors it is the last to need (reference counting: a tensor is freed
   as soon as no later forward, recomputation, backward or checkpoint frame needs it).
2. :func:`run_schedule` is a symbolic interpreter: it runs any schedule, checks it (no read
   before compute, no use after free, every gradient produced before its backward, every node's
   backward run once, nothing left allocated) and raises :class:`InfeasibleScheduleError` with
   the op and tensor at fault; it returns the peak memory, the times and a timeline.

The rules (``docs/graphs.md`` has them with an example):

* The graph input (``input_bytes``) is live for the whole step.
* A **constant** (``Graph.constants``: a tensor without gradient, such as a frozen layer's
  output) is allocated at the first forward of its ``first`` node, freed after the first forward
  of its ``last`` node, and kept for every later forward of a node that reads it (a
  recomputation reads the copy its checkpoint frame kept) and until the backward of every node
  that saves it (``saved_by``).
* Forward, in ``order`` (default: node order). A **stored** node (in no segment) runs with grad
  (``F_all``): it allocates ``saved_bytes`` (output + residual) and keeps them, plus the inputs
  its backward reads, until its backward. A node in a segment runs without grad (``F_none``):
  it allocates its output only. Peak during an op: live + ``fwd_overhead_bytes`` (without
  grad: ``Node.none_overhead_bytes``).
* A node's first-forward output is also kept through the first forward of its
  ``held_until`` node (:attr:`Node.held_until <remat.core.graph.Node.held_until>`: the
  program's variable still holds it), when that node runs later in ``order``.
* A **segment** keeps the forward copies of its external inputs until its first node's
  backward (the non-reentrant checkpoint frame).
* **Loss**: allocates one gradient per sink (``out_bytes``), then the outputs are released.
* Backward, in reverse ``order``. Before the backward of node ``v``, every segment whose last
  node (in ``order``) is ``v`` is **recomputed**, outermost first: its nodes run forward again
  under its ``children`` sub-plan, reading the recomputed copies of its own nodes and the kept
  copies of its external inputs. **Backward of** ``v`` (``B``): allocates the gradient of each
  input that has none yet (gradients accumulate in place), peak = live +
  ``bwd_overhead_bytes``, then frees ``v``'s gradient, its saved tensors and whatever else it
  was the last to need.

Example:
    >>> from remat.core.graph import Graph
    >>> from remat.core.plan import Plan
    >>> g = Graph.from_edges([(), (0,), (1,), (2,)], out_bytes=[10, 10, 10, 10], input_bytes=10)
    >>> simulate_graph(g, Plan.none()).peak_bytes      # input + 4 outputs + 2 gradients
    70
    >>> simulate_graph(g, Plan.from_segments([[0, 1]])).recompute_time
    2.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat.core.chain_simulate import Event, Simulation, register_simulator
from remat.core.errors import InfeasibleScheduleError
from remat.core.graph import Graph
from remat.core.plan import Plan, Segment
from remat.core.step import StepCosts, StepEvent, step_peak

__all__ = [
    "simulate_graph",
    "simulate_step_peak",
    "graph_step_peak",
    "checkpoint_spans",
    "lower_plan",
    "run_schedule",
    "GraphSimulation",
    "GraphEvent",
    "ScheduleOp",
    "Tensor",
    "InfeasibleScheduleError",
]

Tensor = tuple[str, int, int]
"""A tensor of the schedule: ``(kind, node, version)``; kind is ``"out"`` (a node's output),
``"res"`` (its saved residual, ``saved_bytes - out_bytes``), ``"grad"`` (its gradient) or
``"const"`` (``Graph.constants[node]``); version 0 is the first forward, each recomputation pass has its own number."""

GRAPH_INPUT: Tensor = ("input", -1, 0)


@dataclass(frozen=True)
class ScheduleOp:
    """One operation of a lowered schedule (see :func:`lower_plan`)."""

    op: str
    """``"F_all"`` (forward with grad), ``"F_none"`` (without grad), ``"loss"`` or ``"B"``."""
    node: int
    """Node index; -1 for the loss."""
    recompute: bool
    """True for a forward that repeats one already done."""
    allocs: tuple[tuple[Tensor, int], ...]
    """Tensors the op creates, with their bytes."""
    reads: tuple[Tensor, ...]
    """Tensors that must be live while the op runs (inputs, held tensors it releases)."""
    frees: tuple[Tensor, ...]
    """Tensors released right after the op."""
    transient_bytes: int
    """Extra bytes while the op runs (workspace)."""
    time: float
    """Time of the op."""


GraphEvent = Event
"""One operation of the simulated step: :class:`remat.core.chain_simulate.Event` (one type for chains and
graphs; ``node`` is the node index, -1 for the loss)."""

GraphSimulation = Simulation
"""What a plan costs on a graph: :class:`remat.core.chain_simulate.Simulation` (one type for chains and
graphs)."""


def simulate_graph(graph: Graph, plan: Plan, order: Sequence[int] | None = None) -> GraphSimulation:
    """Simulate one training step of ``graph`` under ``plan`` (see the module docstring).

    ``order`` is the forward execution order (any topological order of the nodes; default the
    node order); the backward runs in reverse. Raises :class:`InfeasibleScheduleError` when the
    order is not topological.
    """
    return run_schedule(graph, lower_plan(graph, plan, order))


def simulate_step_peak(
    graph: Graph,
    plan: Plan,
    fixed_bytes: int,
    param_grad_bytes: Sequence[int],
    order: Sequence[int] | None = None,
    output_held_bytes: int = 0,
    grad_rise_bytes: Sequence[int] = (),
) -> int:
    """The whole training step's peak: ``fixed_bytes`` (parameters, buffers, optimizer state:
    whatever lives all step besides ``graph.input_bytes``) + ``output_held_bytes`` (the model
    output the training loop keeps, :mod:`remat.core.step`) + the parameter gradients made so far +
    the plan's live bytes, maximised over the simulated timeline. ``param_grad_bytes[v]`` (from
    :attr:`remat.capture.graph.GraphTrace.param_grad_bytes`) is counted from the backward of
    ``v`` on; during that backward ``grad_rise_bytes[v]`` of them
    (:attr:`remat.capture.graph.GraphTrace.grad_rise_bytes`; empty: all of them). Compare with
    :func:`remat.measure.events.step_peak_bytes` of a step that starts with no parameter
    gradient (``fixed_bytes`` then excludes them). :func:`graph_step_peak` with
    :class:`remat.core.step.StepCosts` adds the optimizer step.
    """
    costs = StepCosts(
        persistent_bytes=fixed_bytes,
        grad_bytes=tuple(param_grad_bytes),
        grad_rise_bytes=tuple(grad_rise_bytes),
        output_held_bytes=output_held_bytes,
    )
    return graph_step_peak(graph, plan, costs, order)


def graph_step_peak(
    graph: Graph, plan: Plan, costs: StepCosts, order: Sequence[int] | None = None
) -> int:
    """:func:`remat.core.step.step_peak` of ``plan`` over the graph's simulated timeline
    (``costs.grad_bytes`` per node; ``costs.checkpoint_state_bytes`` per checkpointed segment,
    nested ones included, from the segment's forward to its backward: :func:`checkpoint_spans`).

    With ``costs.checkpoint_states == "per-random-call"`` (the graph executor), a top-level
    segment keeps one state per random call of its nodes (:attr:`Node.random_calls
    <remat.core.graph.Node.random_calls>`, nested segments included) instead, and every
    recomputation of a node whose top-level segment has random calls holds one more (the state
    ``torch.random.fork_rng`` saves around a replay): an upper bound where a nested segment
    without random calls is replayed inside a parent with some."""
    if len(costs.grad_bytes) != graph.n:
        raise ValueError(
            f"param_grad_bytes has {len(costs.grad_bytes)} entries; the graph has {graph.n} nodes"
        )
    timeline = simulate_graph(graph, plan, order).timeline
    if costs.checkpoint_states != "per-random-call":
        return step_peak(
            (StepEvent(e.op == "B", e.node, e.peak_bytes, e.live_bytes) for e in timeline),
            costs,
            checkpoint_spans(plan, order),
        )
    random_calls = [node.random_calls for node in graph.nodes]
    replayed = {v for s in plan.segments if sum(random_calls[u] for u in s.nodes) for v in s.nodes}
    fork = costs.checkpoint_state_bytes
    return step_peak(
        (
            StepEvent(  # only a forward's peak is read; the replay's state is gone by the backward
                e.op == "B",
                e.node,
                e.peak_bytes + (fork if e.recompute and e.node in replayed else 0),
                e.live_bytes,
            )
            for e in timeline
        ),
        costs,
        checkpoint_spans(plan, order, random_calls),
    )


def checkpoint_spans(
    plan: Plan,
    order: Sequence[int] | None = None,
    random_calls: Sequence[int] | None = None,
    copy_bytes: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Per top-level segment of ``plan``, ``(its first node in ``order``, the checkpointed
    segments in its subtree)``: what :func:`remat.core.step.segment_state_bytes` reads. The
    segment's checkpoint lives from that node's first forward to its backward, the segment's
    last (as :func:`lower_plan` keeps the segment's frame); on a chain's path graph
    (one plan type: :meth:`Plan.chain_segments`) node ``i`` is stage ``i + 1``. With ``random_calls``
    (per node), the count is the random calls of the segment's nodes instead: the states the
    graph executor saves. With ``copy_bytes`` (per node: the chain executor's copies of the
    buffers each forward writes, :attr:`remat.core.step.StepCosts.buffer_copy_bytes`), a
    third number: those bytes summed over the nodes of every segment in the subtree."""
    pos = {v: i for i, v in enumerate(order)} if order is not None else None

    def first(seg: Segment) -> int:
        return seg.nodes[0] if pos is None else min(seg.nodes, key=pos.__getitem__)

    def count(seg: Segment) -> int:
        if random_calls is None:
            return sum(1 for _ in seg.walk())
        return sum(random_calls[v] for v in seg.nodes)

    if not copy_bytes or not any(copy_bytes):
        return tuple((first(s), count(s)) for s in plan.segments)

    def copies(seg: Segment) -> int:
        return sum(copy_bytes[v] for inner in seg.walk() for v in inner.nodes)

    return tuple((first(s), count(s), copies(s)) for s in plan.segments)


def lower_plan(
    graph: Graph, plan: Plan, order: Sequence[int] | None = None
) -> tuple[ScheduleOp, ...]:
    """The explicit schedule of ``plan``: every op in order with the tensors it frees."""
    plan = plan.for_graph(graph)
    return _Lowering(graph, plan, order).run()


def run_schedule(graph: Graph, schedule: Sequence[ScheduleOp]) -> GraphSimulation:
    """Interpret ``schedule`` symbolically, check it, and return its cost.

    Raises :class:`InfeasibleScheduleError` on a read of a tensor that was never computed or
    was already freed, a backward before its gradient exists, a node whose backward is missing
    or runs twice, or tensors still allocated at the end.
    """
    nodes = graph.nodes
    live_size: dict[Tensor, int] = {GRAPH_INPUT: graph.input_bytes}
    freed: set[Tensor] = set()
    live = graph.input_bytes
    peak = live
    forward_peak = live
    seen_loss = False
    counts = [0] * graph.n
    backward_done = [False] * graph.n
    events: list[Event] = []
    total = fwd_first = bwd = recompute = 0.0

    def where(i: int, op: ScheduleOp) -> str:
        name = "the loss" if op.node < 0 else f"node {op.node} ({nodes[op.node].name!r})"
        return f"op {i} ({op.op} of {name})"

    for i, op in enumerate(schedule):
        for tensor in op.reads:
            if tensor not in live_size:
                what = _describe(graph, tensor)
                if tensor in freed:
                    raise InfeasibleScheduleError(f"{where(i, op)} uses {what} after it was freed")
                if tensor[0] == "grad":
                    raise InfeasibleScheduleError(
                        f"{where(i, op)} reads {what} before it is produced (the backward must "
                        "follow the reverse of a topological order, after the loss)"
                    )
                raise InfeasibleScheduleError(
                    f"{where(i, op)} reads {what} before it is computed (is the order "
                    "topological, and is every segment input kept?)"
                )
        if op.op == "B":
            grad = ("grad", op.node, 0)
            if grad not in live_size:
                raise InfeasibleScheduleError(
                    f"{where(i, op)} runs before the gradient of its output is produced "
                    "(the backward must follow the reverse of a topological order)"
                )
            if backward_done[op.node]:
                raise InfeasibleScheduleError(f"{where(i, op)}: this node's backward ran twice")
            backward_done[op.node] = True
            bwd += op.time
        elif op.op in ("F_all", "F_none"):
            if counts[op.node]:
                recompute += op.time
            else:
                fwd_first += op.time
            counts[op.node] += 1
        elif op.op == "loss":
            seen_loss = True
        else:
            raise InfeasibleScheduleError(f"op {i}: unknown operation {op.op!r}")
        for tensor, nbytes in op.allocs:
            if tensor in live_size or tensor in freed:
                raise InfeasibleScheduleError(
                    f"{where(i, op)} allocates {_describe(graph, tensor)} a second time"
                )
            live_size[tensor] = nbytes
            live += nbytes
        op_peak = live + op.transient_bytes
        peak = max(peak, op_peak)
        if not seen_loss:
            forward_peak = peak
        for tensor in op.frees:
            if tensor == GRAPH_INPUT:
                raise InfeasibleScheduleError(f"{where(i, op)} frees the graph input")
            if tensor not in live_size:
                raise InfeasibleScheduleError(
                    f"{where(i, op)} frees {_describe(graph, tensor)}, which is not allocated"
                )
            live -= live_size.pop(tensor)
            freed.add(tensor)
        total += op.time
        events.append(Event(op.op, op.node, op.recompute, op_peak, live, op.time))

    missing = [v for v in range(graph.n) if not backward_done[v]]
    if missing:
        raise InfeasibleScheduleError(
            f"the backward of nodes {missing[:10]} never runs: every gradient must be produced"
        )
    leaked = sorted(t for t in live_size if t != GRAPH_INPUT)
    if leaked:
        shown = ", ".join(_describe(graph, t) for t in leaked[:5])
        raise InfeasibleScheduleError(f"{len(leaked)} tensors are never freed: {shown}")
    return Simulation(
        peak_bytes=peak,
        total_time=total,
        forward_time=fwd_first,
        backward_time=bwd,
        recompute_time=recompute,
        forward_peak_bytes=forward_peak,
        forward_counts=tuple(counts),
        timeline=tuple(events),
    )


def _describe(graph: Graph, tensor: Tensor) -> str:
    kind, v, version = tensor
    if kind == "input":
        return "the graph input"
    if kind == "const":
        return f"constant {v} (no gradient, {graph.constants[v].nbytes} bytes)"
    name = graph.nodes[v].name if 0 <= v < graph.n else "?"
    what = {"out": "the output", "res": "the saved residual", "grad": "the gradient"}[kind]
    copy = "" if kind == "grad" else (" (first forward)" if version == 0 else f" (pass {version})")
    return f"{what} of node {v} ({name!r}){copy}"


class _Lowering:
    """Builds the schedule of a plan; see the rules in the module docstring."""

    def __init__(self, graph: Graph, plan: Plan, order: Sequence[int] | None) -> None:
        self.graph = graph
        self.order = list(range(graph.n)) if order is None else list(order)
        graph.check_order(self.order)
        self.pos = [0] * graph.n
        for i, v in enumerate(self.order):
            self.pos[v] = i
        self.plan = plan
        self.ops: list[
            tuple[str, int, bool, list[tuple[Tensor, int]], list[Tensor], int, float]
        ] = []
        self.top: dict[int, Tensor] = {}
        self.last_use: dict[Tensor, int] = {}
        self.holds: dict[int, list[Tensor]] = {}  # what B(v) needs: saved tensors, inputs
        self.frame_release: dict[int, list[Tensor]] = {}  # segment frames ending at B(v)
        self.frame_env: dict[int, dict[int, Tensor]] = {}  # id(segment) -> its kept inputs
        self.recompute_at: dict[int, list[Segment]] = {}
        self.passes = 0
        self.computed = [0] * graph.n
        # constants (Graph.constants): allocated at the first forward of the earliest node
        # (in ``order``) of their span, read by the first forward of the latest and by every
        # forward of a reader (a recomputation reads the copy its checkpoint kept)
        self.const_new: dict[int, list[tuple[Tensor, int]]] = {}
        self.const_last: dict[int, list[Tensor]] = {}
        self.const_reads: dict[int, list[Tensor]] = {}
        self.const_saved: dict[int, list[Tensor]] = {}
        for i, c in enumerate(graph.constants):
            tensor: Tensor = ("const", i, 0)
            span = (c.first, c.last, *c.readers)
            self.const_new.setdefault(min(span, key=lambda x: self.pos[x]), []).append(
                (tensor, c.nbytes)
            )
            self.const_last.setdefault(max(span, key=lambda x: self.pos[x]), []).append(tensor)
            for v in c.readers:
                self.const_reads.setdefault(v, []).append(tensor)
            for v in c.saved_by:  # kept until the backward of each node that saves it
                self.const_saved.setdefault(v, []).append(tensor)
        # outputs the program holds past their last reader (Node.held_until): read by the
        # first forward of that node, when it runs later
        self.held_at: dict[int, list[Tensor]] = {}
        for u, node in enumerate(graph.nodes):
            w = node.held_until
            if w is not None and self.pos[w] > self.pos[u]:
                self.held_at.setdefault(w, []).append(("out", u, 0))
        for seg in plan.segments:
            self._index(seg, 0)
        for segs in self.recompute_at.values():
            segs.sort(key=lambda s: -len(s.nodes))  # a parent is larger than its children

    def _index(self, seg: Segment, depth: int) -> None:
        last = max(seg.nodes, key=lambda v: self.pos[v])
        self.recompute_at.setdefault(last, []).append(seg)
        for child in seg.children:
            self._index(child, depth + 1)

    def _emit(
        self,
        op: str,
        node: int,
        recompute: bool,
        allocs: list[tuple[Tensor, int]],
        reads: list[Tensor],
        transient: int,
        time: float,
    ) -> None:
        idx = len(self.ops)
        self.ops.append((op, node, recompute, allocs, reads, transient, time))
        last_use = self.last_use
        for tensor, _ in allocs:
            last_use[tensor] = idx
        for tensor in reads:
            last_use[tensor] = idx

    def _forward_pass(
        self, nodes: Sequence[int], children: Sequence[Segment], env: dict[int, Tensor]
    ) -> None:
        """Run ``nodes`` forward (one pass: the first forward or a recomputation)."""
        version = self.passes
        self.passes += 1
        graph = self.graph
        local = dict(env)
        child_of = {v: id(c) for c in children for v in c.nodes}
        for v in sorted(nodes, key=lambda x: self.pos[x]):
            node = graph.nodes[v]
            grad = v not in child_of
            reads = [local[u] if u in local else ("out", u, -1) for u in node.inputs]
            out: Tensor = ("out", v, version)
            allocs: list[tuple[Tensor, int]] = [(out, node.out_bytes)]
            if grad:
                res: Tensor = ("res", v, version)
                allocs.append((res, node.residual_bytes))
                inputs = {u: t for u, t in zip(node.inputs, reads, strict=True)}
                held = [out, res] if node.keeps_output else [res]
                self.holds[v] = [*held, *(inputs[u] for u in node.backward_inputs)]
            reads.extend(self.const_reads.get(v, ()))
            if version == 0:
                reads.extend(self.held_at.get(v, ()))
                made = self.const_new.get(v, [])
                allocs = [*made, *allocs]
                reads.extend(self.const_last.get(v, ()))
                if made:  # allocated by this op: not a read (its last use all the same)
                    reads = [t for t in reads if t not in {m for m, _ in made}]
            recompute = self.computed[v] > 0
            self.computed[v] += 1
            op = "F_all" if grad else "F_none"
            over = node.fwd_overhead_bytes if grad else node.none_overhead_bytes
            self._emit(op, v, recompute, allocs, reads, over, node.fwd_time)
            local[v] = out
        for child in children:
            ext = child.external_inputs(graph)
            kept = {u: local.get(u, ("out", u, -1)) for u in ext}
            self.frame_env[id(child)] = kept
            first = min(child.nodes, key=lambda x: self.pos[x])
            self.frame_release.setdefault(first, []).extend(kept.values())
        if version == 0:
            self.top = local

    def run(self) -> tuple[ScheduleOp, ...]:
        graph = self.graph
        self._forward_pass(range(graph.n), self.plan.segments, {})
        sinks = graph.sinks
        grads_made = set(sinks)
        self._emit(
            "loss",
            -1,
            False,
            [(("grad", o, 0), graph.nodes[o].out_bytes) for o in sinks],
            [self.top[o] for o in sinks],
            0,
            0.0,
        )
        for v in reversed(self.order):
            for seg in self.recompute_at.get(v, ()):
                self._forward_pass(seg.nodes, seg.children, self.frame_env[id(seg)])
            node = graph.nodes[v]
            allocs: list[tuple[Tensor, int]] = []
            for u in node.inputs:
                if u not in grads_made:
                    grads_made.add(u)
                    allocs.append((("grad", u, 0), graph.nodes[u].out_bytes))
            reads = [
                ("grad", v, 0),
                *self.holds.pop(v, ()),
                *self.frame_release.pop(v, ()),
                *self.const_saved.get(v, ()),
            ]
            self._emit("B", v, False, allocs, reads, node.bwd_overhead_bytes, node.bwd_time)
        frees: list[list[Tensor]] = [[] for _ in self.ops]
        for tensor, idx in self.last_use.items():
            if tensor[2] >= 0 or tensor[0] == "grad":
                frees[idx].append(tensor)
        return tuple(
            ScheduleOp(op, node, rec, tuple(al), tuple(rd), tuple(sorted(f)), tr, t)
            for (op, node, rec, al, rd, tr, t), f in zip(self.ops, frees, strict=True)
        )


register_simulator(Graph, simulate_graph)  # remat.simulate(graph, plan) runs simulate_graph
