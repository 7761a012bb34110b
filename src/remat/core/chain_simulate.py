"""The single source of truth for what a plan costs: :func:`simulate`.

:func:`simulate` walks a :class:`~remat.core.plan.Plan` over a :class:`~remat.core.chain.Chain` the way the
executor (nested non-reentrant ``torch.utils.checkpoint``) runs it, with reference counts on
every activation, and returns the peak activation memory, the time, and a per-operation
timeline. Every planner is tested against it; the executor is tested against it.

It is the chain fast path of the one simulator, :func:`remat.graphs.lower_plan` +
:func:`remat.graphs.run_schedule` on the chain's path graph
(:meth:`remat.graphs.Graph.from_chain`; the same :class:`~remat.core.plan.Plan`):
several times faster, for the planners' sweeps, and equal to it, event by event
(``tests/test_one_simulator.py``, over every registered planner). Both return the same
:class:`Simulation` and :class:`Event` types.

The rules (docs/cost-model.md has them with pictures):

* ``a[0]`` (the input, ``input_bytes``) is live for the whole step.
* **Stored stage** ``i`` (forward with autograd, ``F_all``): allocates ``saved_bytes[i]`` (its
  output ``a[i]`` plus the internal tensors it saves); holds ``a[i-1]``, ``a[i]`` and the internal
  tensors until its backward. Peak during it: live + ``fwd_overhead_bytes[i]``.
* **Stage run without grad** (inside a checkpointed segment, ``F_none``): allocates ``a[i]``;
  ``a[i-1]`` is freed unless something holds it. Peak: live + ``fwd_none_overhead_bytes[i]``
  (what the forward without grad holds at once beyond its output, measured by capture).
* **Checkpointed segment**: holds its input ``a[start-1]`` from its forward to the backward of
  its first stage (the checkpoint frame dies with it; freed there unless something else holds
  it). Backward: recompute the segment under its sub-plan (the recomputed output is
  dropped unless a stored stage keeps it), then back-propagate the sub-plan.
* **Loss**: after the forward, the gradient ``δ[n]`` (``out_bytes[n]``) is allocated and the
  running output is released.
* **Backward of stage** ``i`` (``B``): allocates ``δ[i-1]`` (not for ``i = 1``: the input gets no
  gradient); peak: live + ``bwd_overhead_bytes[i]``; then frees ``δ[i]`` and releases what stage
  ``i`` held.
* **Frozen prefix** (``Chain.frozen_prefix = k``): stages ``1..k`` have no backward. Stored,
  such a stage holds nothing (as without grad); no ``δ[0..k]`` is allocated.

Example:
    >>> from remat import Chain, Plan
    >>> chain = Chain.homogeneous(4, out_bytes=10)
    >>> simulate(chain, Plan.none()).peak_bytes      # a0 + 4 activations + δ4 + δ3
    70
    >>> simulate(chain, Plan.every_stage()).recompute_time
    4.0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from remat.core.chain import Chain
from remat.core.plan import ChainSegment, Plan

__all__ = ["simulate", "Simulation", "Event", "register_simulator"]

# Cost models other than Chain that simulate() accepts: (type, its simulator). remat.graphs
# registers Graph -> simulate_graph when it is imported (which any Graph's existence implies),
# so that this module, below the graph planners, does not import the graphs package.
_SIMULATORS: list[tuple[type, Callable[[Any, Any], Any]]] = []


@dataclass(frozen=True)
class Event:
    """One operation of the simulated step: the one event type of the chain simulator and of
    the graph interpreter (:class:`remat.graphs.GraphEvent` is this class)."""

    op: str
    """``"F_all"`` (stored forward), ``"F_none"`` (forward without grad), ``"loss"``, ``"B"``."""
    node: int
    """Graph node, or chain stage - 1 (0-based: stage ``i`` is node ``i - 1``); -1 for the
    loss."""
    recompute: bool
    """True for a forward that repeats work already done (recomputation)."""
    peak_bytes: int
    """Highest live bytes during the operation (transients included)."""
    live_bytes: int
    """Live bytes right after the operation (after its frees)."""
    time: float
    """Time of the operation."""

    @property
    def stage(self) -> int:
        """Chain stage index (1-based, ``node + 1``); 0 for the loss."""
        return self.node + 1


@dataclass(frozen=True)
class Simulation:
    """What a plan costs on a chain (:func:`simulate`) or a graph (:func:`remat.graphs.
    simulate_graph`; :class:`remat.graphs.GraphSimulation` is this class). Stages are the
    nodes of a chain's path graph: ``forward_counts[i]`` is stage ``i + 1``'s."""

    peak_bytes: int
    """Peak activation memory over the whole step: input, activations, saved tensors,
    activation gradients and transients (parameters and optimizer state are not included)."""
    total_time: float
    """Forward + recomputation + backward time."""
    forward_time: float
    """Time of the first forward of every stage or node (no recomputation)."""
    backward_time: float
    """Time of every stage's or node's backward."""
    recompute_time: float
    """Time spent in recomputation (forwards beyond the first of each stage or node)."""
    forward_peak_bytes: int
    """Peak memory during the first forward pass alone."""
    forward_counts: tuple[int, ...]
    """How many times each stage's or node's forward runs (1 = never recomputed)."""
    timeline: tuple[Event, ...]
    """Every operation in execution order."""

    @property
    def overhead(self) -> float:
        """Recomputation time relative to one plain forward + backward (0.0 = none)."""
        base = self.forward_time + self.backward_time
        return self.recompute_time / base if base else 0.0


def simulate(chain: Chain, plan: Plan) -> Simulation:
    """Simulate one training step of ``chain`` under ``plan`` (see the module docstring).

    Given a :class:`remat.graphs.Graph` instead, it runs
    :func:`remat.graphs.simulate_graph` (same idea on a DAG; registered with
    :func:`register_simulator`).
    """
    if not isinstance(chain, Chain):
        for kind, simulator in _SIMULATORS:
            if isinstance(chain, kind):
                return simulator(chain, plan)
        raise TypeError(f"simulate takes a Chain or a Graph, got {type(chain).__name__}")
    return _Simulator(chain).run(plan.chain_segments(chain))


def register_simulator(kind: type, simulator: Callable[[Any, Any], Any]) -> None:
    """Make :func:`simulate` run ``simulator(model, plan)`` for a cost model of type ``kind``.

    :mod:`remat.core.simulate` registers :class:`~remat.graphs.Graph`; the dependency points
    from the graph simulator to this module, never back.
    """
    if not any(k is kind for k, _ in _SIMULATORS):
        _SIMULATORS.append((kind, simulator))


class _Simulator:
    """Reference-counted memory walk over the segment tree. Keys name buffers uniquely."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.size: dict[object, int] = {}
        self.refs: dict[object, int] = {}
        self.live = 0
        self.peak = 0
        self.events: list[Event] = []
        self.counts = [0] * chain.n
        self.time = 0.0
        # summed op by op in timeline order, as run_schedule sums them (bit-identical floats)
        self.forward_time = self.backward_time = self.recompute_time = 0.0
        self.version = 0
        # what a stored stage / checkpointed segment holds until its backward
        self.stage_holds: dict[int, tuple[object, ...]] = {}
        self.segment_input: dict[int, object] = {}
        # segment inputs released by the backward of a stage: a checkpointed segment holds its
        # input until the backward of its first stage (the checkpoint frame dies with it)
        self.release_at: dict[int, list[object]] = {}

    # -------------------------------------------------------------- buffers
    def _alloc(self, key: object, nbytes: int) -> object:
        self.size[key] = nbytes
        self.refs[key] = 1
        self.live += nbytes
        return key

    def _ref(self, key: object) -> None:
        self.refs[key] += 1

    def _unref(self, key: object) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.size.pop(key)
            del self.refs[key]

    def _new_key(self, kind: str, i: int) -> tuple[str, int, int]:
        self.version += 1
        return (kind, i, self.version)

    def _peak(self, transient: int) -> int:
        """Live bytes plus a transient, folded into the running peak."""
        peak = self.live + transient
        self.peak = max(self.peak, peak)
        return peak

    def _record(self, op: str, stage: int, recompute: bool, peak: int, t: float) -> None:
        """Append an event; call it after the operation's frees so live_bytes is 'after'."""
        self.time += t
        if op == "B":
            self.backward_time += t
        elif recompute:
            self.recompute_time += t
        else:
            self.forward_time += t
        self.events.append(Event(op, stage - 1, recompute, peak, self.live, t))

    # -------------------------------------------------------------- walk
    def run(self, segments: Sequence[ChainSegment]) -> Simulation:
        c = self.chain
        a0 = self._alloc(("a", 0, 0), c.input_bytes)
        self.peak = self.live
        self._ref(a0)  # the input stays live for the whole step (held by the caller)
        out = self._forward(segments, a0)
        forward_peak = self.peak
        grad = self._alloc(self._new_key("d", c.n), c.out_bytes[-1])
        peak = self._peak(0)
        self._unref(out)
        self._record("loss", 0, False, peak, 0.0)
        grad = self._backward(segments, grad)
        assert grad is None
        return Simulation(
            peak_bytes=self.peak,
            total_time=self.time,
            forward_time=self.forward_time,
            backward_time=self.backward_time,
            recompute_time=self.recompute_time,
            forward_peak_bytes=forward_peak,
            forward_counts=tuple(self.counts),
            timeline=tuple(self.events),
        )

    def _forward(self, segments: Sequence[ChainSegment], inp: object, drop: bool = False) -> object:
        """Run ``segments`` forward from ``inp`` (caller's running reference, consumed) and
        return the output; with ``drop`` (a recomputation, whose output nothing reads) release
        the output within the last stage's event instead."""
        cur = inp
        last = segments[-1].stop if drop else 0
        for seg in segments:
            store = not seg.checkpoint
            if seg.checkpoint:
                self._ref(cur)
                self.segment_input[id(seg)] = cur
            for i in seg.stages():
                cur = self._stage_forward(i, cur, store, drop=i == last)
        return cur

    def _stage_forward(self, i: int, inp: object, store: bool, drop: bool = False) -> object:
        c = self.chain
        out = self._alloc(self._new_key("a", i), c.out_bytes[i - 1])
        if store and i > c.frozen_prefix:  # a stage without backward keeps nothing
            internal = self._alloc(self._new_key("x", i), c.saved_bytes[i - 1] - c.out_bytes[i - 1])
            self._ref(inp)
            self._ref(out)
            self.stage_holds[i] = (inp, out, internal)
        recompute = self.counts[i - 1] > 0
        self.counts[i - 1] += 1
        over = c.fwd_overhead_bytes if store else c.fwd_none_overhead_bytes
        peak = self._peak(over[i - 1])
        self._unref(inp)
        if drop:
            self._unref(out)  # freed unless the stage stores it
        self._record("F_all" if store else "F_none", i, recompute, peak, c.fwd_time[i - 1])
        return out

    def _backward(self, segments: Sequence[ChainSegment], grad: object) -> object | None:
        """Back-propagate ``segments`` given the gradient of their output; return the input's."""
        for seg in reversed(segments):
            if seg.checkpoint:
                inp = self.segment_input.pop(id(seg))
                # the segment holds its input until the backward of its first stage (released
                # there, before that event is recorded: its live_bytes are 'after')
                self.release_at.setdefault(seg.start, []).append(inp)
                self._ref(inp)  # running reference for the recomputation
                self._forward(seg.children, inp, drop=True)  # its output is dropped
                grad = self._backward(seg.children, grad)
            else:
                for i in reversed(seg.stages()):
                    grad = self._stage_backward(i, grad)
        return grad

    def _stage_backward(self, i: int, grad: object | None) -> object | None:
        c = self.chain
        # a[i-1] gets a gradient unless it is the input or a frozen stage's output
        grad_in = i > c.frozen_prefix + 1
        new_grad = self._alloc(self._new_key("d", i - 1), c.out_bytes[i - 2]) if grad_in else None
        peak = self._peak(c.bwd_overhead_bytes[i - 1])
        if grad is not None:
            self._unref(grad)
        for key in self.stage_holds.pop(i, ()):
            self._unref(key)
        for key in self.release_at.pop(i, ()):
            self._unref(key)
        self._record("B", i, False, peak, c.bwd_time[i - 1])
        return new_grad
