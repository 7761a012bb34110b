"""What to keep and what to recompute on a :class:`~remat.graphs.Graph`: a :class:`GraphPlan`.

A graph plan is a list of disjoint **segments** (recomputation regions). Every node that is in
no segment is **stored**: it runs with autograd in the forward and keeps its ``saved_bytes``
(and the inputs its backward reads) until its backward. A node in a segment runs **without
grad** in the forward (it allocates only its output, freed as soon as nothing needs it) and is
**recomputed with grad** in the backward, together with the rest of its segment, just before
the backward of the segment's last node (the first of its nodes to need a gradient). A segment
keeps the forward copies of its **external inputs** (outputs of nodes outside it that its nodes
read) alive from the forward until the backward of its first node: they are the
**checkpoints**, the kept tensors from which the segment is recomputed. A segment may carry
``children``: a sub-plan used when it is recomputed (nested checkpointing, as in
:class:`remat.core.plan.Segment`); most planners make flat plans.

These are the semantics of non-reentrant ``torch.utils.checkpoint`` around each segment (the
checkpoint frame holds its inputs until its last node's backward), and exactly what
:func:`remat.graphs.simulate_graph` costs; ``docs/graphs.md`` has the full rules.

Example:
    >>> from remat.core.graph import Graph
    >>> g = Graph.from_edges([(), (0,), (1,), (2,)], out_bytes=[4, 4, 4, 4])
    >>> p = GraphPlan.from_segments([[0, 1], [2, 3]])
    >>> p.describe(), p.checkpoints(g)
    ('{0-1} {2-3}', (1,))
    >>> GraphPlan.from_json(p.to_json()) == p
    True
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from remat.core.plan import Plan, PlanError, Segment
from remat.core.schema import read_schema

if TYPE_CHECKING:
    from remat.core.graph import Graph

__all__ = ["GraphSegment", "GraphPlan", "GraphPlanError", "GRAPH_PLAN_SCHEMA_VERSION"]

GRAPH_PLAN_SCHEMA_VERSION = 1


class GraphPlanError(PlanError):
    """A graph plan that is malformed or does not fit its graph."""


@dataclass(frozen=True)
class GraphSegment:
    """A recomputation region: ``nodes`` (sorted indices) and an optional nested sub-plan."""

    nodes: tuple[int, ...]
    """The nodes recomputed together (sorted, unique, non-empty)."""
    children: tuple[GraphSegment, ...] = ()
    """Disjoint sub-segments of ``nodes`` that stay checkpointed when this one is recomputed."""

    def __post_init__(self) -> None:
        nodes = tuple(sorted(set(self.nodes)))
        if not nodes:
            raise GraphPlanError("a segment needs at least one node")
        if len(nodes) != len(self.nodes):
            raise GraphPlanError(f"segment {list(self.nodes)} lists a node twice")
        for v in nodes:
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise GraphPlanError(f"segment node {v!r} is not a node index")
        object.__setattr__(self, "nodes", nodes)
        children = tuple(self.children)
        object.__setattr__(self, "children", children)
        inside = set(nodes)
        seen: set[int] = set()
        for child in children:
            if not isinstance(child, GraphSegment):
                raise GraphPlanError(f"expected GraphSegment children, got {child!r}")
            if not set(child.nodes) <= inside:
                raise GraphPlanError(
                    f"child segment {_span(child.nodes)} is not inside its parent {_span(nodes)}"
                )
            if seen & set(child.nodes):
                raise GraphPlanError(f"child segments of {_span(nodes)} overlap")
            seen |= set(child.nodes)
            if child.nodes == nodes:
                raise GraphPlanError(
                    f"segment {_span(nodes)} is checkpointed twice over the same nodes; that "
                    "recomputes everything again for nothing"
                )

    @property
    def first(self) -> int:
        return self.nodes[0]

    @property
    def last(self) -> int:
        return self.nodes[-1]

    def is_interval(self) -> bool:
        """True when the nodes are consecutive indices (one contiguous checkpoint call)."""
        return self.nodes[-1] - self.nodes[0] + 1 == len(self.nodes)

    def depth(self) -> int:
        return 1 + max((c.depth() for c in self.children), default=0)

    def walk(self) -> Iterator[GraphSegment]:
        yield self
        for child in self.children:
            yield from child.walk()

    def external_inputs(self, graph: Graph) -> tuple[int, ...]:
        """Nodes outside the segment whose outputs its nodes read (the kept tensors it needs)."""
        inside = set(self.nodes)
        ext = {u for v in self.nodes for u in graph.nodes[v].inputs if u not in inside}
        return tuple(sorted(ext))

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"nodes": list(self.nodes)}
        if self.children:
            obj["children"] = [c.to_obj() for c in self.children]
        return obj

    @classmethod
    def from_obj(cls, obj: Any) -> GraphSegment:
        if not isinstance(obj, dict) or "nodes" not in obj:
            raise GraphPlanError(f"cannot read segment {obj!r}: expected {{'nodes': [...]}}")
        return cls(tuple(obj["nodes"]), tuple(cls.from_obj(c) for c in obj.get("children", [])))

    def describe(self) -> str:
        inner = " ".join(c.describe() for c in self.children)
        return "{" + _span(self.nodes) + (f": {inner}" if inner else "") + "}"


@dataclass(frozen=True)
class GraphPlan:
    """Disjoint recomputation segments over a graph plus what the planner predicted for it.

    Build one with :meth:`none`, :meth:`from_segments`, :meth:`from_checkpoints`,
    :meth:`from_chain_plan`, or a planner (:func:`remat.graphs.plan_graph`).
    """

    segments: tuple[GraphSegment, ...] = ()
    """Top-level segments (disjoint); nodes in none of them are stored."""
    method: str = "manual"
    """The planner that made the plan."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """The planner's parameters and diagnostics (budget, solver gap, ...), JSON-compatible."""
    predicted_peak_bytes: int | None = None
    """Peak bytes that :func:`remat.graphs.simulate_graph` predicts for the plan."""
    predicted_time: float | None = None
    """Forward + recomputation + backward time predicted by the simulator."""
    graph_fingerprint: str | None = None
    """Fingerprint of the graph the plan was made for (:attr:`Graph.fingerprint`)."""

    def __post_init__(self) -> None:
        segments = tuple(sorted(self.segments, key=lambda s: s.nodes))
        object.__setattr__(self, "segments", segments)
        object.__setattr__(self, "params", dict(self.params))
        seen: set[int] = set()
        for seg in segments:
            if not isinstance(seg, GraphSegment):
                raise GraphPlanError(f"expected GraphSegment objects, got {seg!r}")
            if seen & set(seg.nodes):
                raise GraphPlanError(
                    f"segments overlap on nodes {sorted(seen & set(seg.nodes))}: a node is in at "
                    "most one top-level segment"
                )
            seen |= set(seg.nodes)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def none(cls) -> GraphPlan:
        """Store every node: no recomputation (the unplanned model)."""
        return cls((), method="none")

    @classmethod
    def from_segments(cls, segments: Iterable[Iterable[int]], **kwargs: Any) -> GraphPlan:
        """A flat plan: each iterable of node indices is one segment."""
        return cls(tuple(GraphSegment(tuple(s)) for s in segments), **kwargs)

    @classmethod
    def from_checkpoints(cls, graph: Graph, kept: Iterable[int], **kwargs: Any) -> GraphPlan:
        """The plan of Re-forwarding (Feng & Huang): keep the outputs of ``kept``, recompute the rest.

        Every node is recomputed except the multi-input kept nodes, which are stored (the
        "transitions" of Feng & Huang: an add or concat joining branches runs outside the
        segments, so each incoming branch is its own segment). The sinks (outputs) are always
        kept. The segments are the connected pieces left when the edges out of kept nodes (and
        into stored ones) are cut: a kept single-input node closes the segment of its input,
        like a kept activation in :meth:`remat.core.plan.Plan.from_checkpoints`.
        """
        kept_set = set(kept) | set(graph.sinks)
        for v in kept_set:
            if not isinstance(v, int) or not 0 <= v < graph.n:
                raise GraphPlanError(f"checkpoint {v!r} is not a node index of this graph")
        stored = {v for v in kept_set if len(graph.nodes[v].inputs) >= 2}
        parent = list(range(graph.n))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for v, node in enumerate(graph.nodes):
            if v in stored:
                continue
            for u in node.inputs:
                if u not in kept_set:
                    parent[find(u)] = find(v)
        groups: dict[int, list[int]] = {}
        for v in range(graph.n):
            if v not in stored:
                groups.setdefault(find(v), []).append(v)
        params = {"checkpoints": sorted(set(kept) - set(graph.sinks))}
        params.update(kwargs.pop("params", {}))
        kwargs.setdefault("method", "checkpoints")
        return cls(tuple(GraphSegment(tuple(g)) for g in groups.values()), params=params, **kwargs)

    @classmethod
    def from_chain_plan(cls, plan: Plan, n: int, **kwargs: Any) -> GraphPlan:
        """The graph plan of a chain plan on :meth:`Graph.from_chain` (stage ``i`` = node ``i-1``)."""
        plan = plan.for_chain(n)

        def convert(segments: Sequence[Segment]) -> tuple[GraphSegment, ...]:
            out = []
            for seg in segments:
                if seg.checkpoint:
                    children = tuple(c for c in convert(seg.children))
                    nodes = tuple(range(seg.start - 1, seg.stop))
                    out.append(GraphSegment(nodes, children))
            return tuple(out)

        kwargs.setdefault("method", plan.method)
        kwargs.setdefault("params", dict(plan.params))
        return cls(convert(plan.segments), **kwargs)

    # ------------------------------------------------------------------ use
    def for_graph(self, graph: Graph) -> GraphPlan:
        """This plan validated for ``graph`` (raises :class:`GraphPlanError`)."""
        for seg in self.segments:
            if seg.last >= graph.n:
                raise GraphPlanError(
                    f"segment {_span(seg.nodes)} names node {seg.last} but the graph has "
                    f"{graph.n} nodes; make a new plan for this graph"
                )
        if self.graph_fingerprint and self.graph_fingerprint != graph.fingerprint:
            raise GraphPlanError(
                "this plan was made for other costs (graph fingerprint "
                f"{self.graph_fingerprint}, this graph {graph.fingerprint}): the batch shape or "
                "the model changed, so re-plan for it"
            )
        return self

    def walk(self) -> Iterator[GraphSegment]:
        """Every segment, parents before children."""
        for seg in self.segments:
            yield from seg.walk()

    def recomputed_nodes(self) -> tuple[int, ...]:
        """Nodes in some top-level segment (run without grad in the forward)."""
        return tuple(sorted(v for seg in self.segments for v in seg.nodes))

    def stored_nodes(self, graph: Graph) -> tuple[int, ...]:
        """Nodes in no segment: they keep their saved tensors from the forward."""
        recomputed = set(self.recomputed_nodes())
        return tuple(v for v in range(graph.n) if v not in recomputed)

    def checkpoints(self, graph: Graph) -> tuple[int, ...]:
        """Outputs of recomputed nodes kept past their forward use (inputs of other segments).

        Together with the stored nodes' outputs, these are the tensors kept from the forward.
        """
        recomputed = set(self.recomputed_nodes())
        kept = {u for seg in self.segments for u in seg.external_inputs(graph)}
        return tuple(sorted(kept & recomputed))

    def depth(self) -> int:
        """0 for a store-all plan, 1 for a flat plan, more with nesting."""
        return max((s.depth() for s in self.segments), default=0)

    def is_contiguous(self) -> bool:
        """True when every segment is a run of consecutive node indices."""
        return all(s.is_interval() for s in self.walk())

    def describe(self, graph: Graph | None = None) -> str:
        """Compact text, e.g. ``{0-3} {5,7}``; with ``graph``, node names at segment ends."""
        if not self.segments:
            return "<store all>"
        if graph is None:
            return " ".join(s.describe() for s in self.segments)
        return " ".join(
            "{" + f"{graph.nodes[s.first].name}..{graph.nodes[s.last].name} ({len(s.nodes)})" + "}"
            for s in self.segments
        )

    def to_chain_plan(self, n: int) -> Plan:
        """The chain plan of this plan on a path graph of ``n`` nodes (segments must be runs)."""

        def convert(segments: Sequence[GraphSegment], start: int, stop: int) -> list[Segment]:
            out: list[Segment] = []
            pos = start
            for seg in sorted(segments, key=lambda s: s.first):
                if not seg.is_interval():
                    raise GraphPlanError(
                        f"segment {_span(seg.nodes)} is not a run of consecutive nodes: no chain "
                        "plan has it"
                    )
                if seg.first > pos:
                    out.append(Segment(pos + 1, seg.first))
                children = tuple(convert(seg.children, seg.first, seg.last + 1))
                out.append(Segment(seg.first + 1, seg.last + 1, True, children))
                pos = seg.last + 1
            if pos < stop:
                out.append(Segment(pos + 1, stop))
            return out

        return Plan(
            tuple(convert(self.segments, 0, n)),
            method=self.method,
            params=dict(self.params),
            predicted_peak_bytes=self.predicted_peak_bytes,
            predicted_time=self.predicted_time,
        )

    # ------------------------------------------------------------------ JSON
    def to_json(self, indent: int | None = None) -> str:
        data = {
            "schema": "remat.graph_plan",
            "version": GRAPH_PLAN_SCHEMA_VERSION,
            "method": self.method,
            "params": dict(self.params),
            "segments": [s.to_obj() for s in self.segments],
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_time": self.predicted_time,
            "graph_fingerprint": self.graph_fingerprint,
        }
        return json.dumps(data, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> GraphPlan:
        """Read a plan written by :meth:`to_json` (checks the schema and its version)."""
        data = read_schema(
            text, "remat.graph_plan", GRAPH_PLAN_SCHEMA_VERSION, "remat graph plan", GraphPlanError
        )
        return cls(
            segments=tuple(GraphSegment.from_obj(s) for s in data.get("segments", [])),
            method=data.get("method", "manual"),
            params=data.get("params") or {},
            predicted_peak_bytes=data.get("predicted_peak_bytes"),
            predicted_time=data.get("predicted_time"),
            graph_fingerprint=data.get("graph_fingerprint"),
        )


def _span(nodes: Sequence[int]) -> str:
    """``0-3`` for a run, ``0,2,5`` otherwise (runs inside are compressed: ``0-3,7``)."""
    parts: list[str] = []
    i = 0
    while i < len(nodes):
        j = i
        while j + 1 < len(nodes) and nodes[j + 1] == nodes[j] + 1:
            j += 1
        parts.append(str(nodes[i]) if i == j else f"{nodes[i]}-{nodes[j]}")
        i = j + 1
    return ",".join(parts)
