"""What to keep and what to recompute: the one :class:`Plan` type, for chains and graphs alike.

A plan is a list of disjoint **segments** (recomputation regions) over the nodes of a
:class:`~remat.core.graph.Graph`; a :class:`~remat.core.chain.Chain` is the path graph whose
node ``i`` is stage ``i + 1`` (:meth:`Graph.from_chain`), so a chain's plan is the same object.
Every node that is in no segment is **stored**: it runs with autograd in the forward and keeps
its ``saved_bytes`` (and the inputs its backward reads) until its backward. A node in a segment
runs **without grad** in the forward (it allocates only its output, freed as soon as nothing
needs it) and is **recomputed with grad** in the backward, together with the rest of its
segment, just before the backward of the segment's last node. A segment keeps the forward
copies of its **external inputs** alive from the forward until the backward of its first node:
they are the **checkpoints**. A segment may carry ``children``: the sub-segments that stay
checkpointed when it is recomputed (nested checkpointing: the recursive and rotor plans).

These are the semantics of non-reentrant ``torch.utils.checkpoint`` around each segment, and
exactly what :func:`remat.simulate` costs (``docs/graphs.md``, ``docs/cost-model.md``).

On a chain the segments are runs of stages, and the papers' notation reads best: the view
:meth:`Plan.chain_segments` gives the plan as the stage tree that nested ``checkpoint`` calls
execute (:class:`ChainSegment`: stages ``start..stop``, 1-based, stored or checkpointed with a
sub-plan), and :meth:`Plan.from_chain_segments` builds a plan from one. Both are views of the
same plan: a chain's plan and its path graph's plan are one object, with one JSON schema and
one fingerprint.

Example:
    >>> from remat import Chain
    >>> chain = Chain.homogeneous(6)
    >>> plan = Plan.from_checkpoints(chain, [2, 4])   # keep a[2] and a[4]
    >>> plan.describe(), [s.nodes for s in plan.segments]
    ('(1-2) (3-4) (5-6)', [(0, 1), (2, 3), (4, 5)])
    >>> [(s.start, s.stop, s.checkpoint) for s in plan.chain_segments()]
    [(1, 2, True), (3, 4, True), (5, 6, True)]
    >>> Plan.from_json(plan.to_json()) == plan
    True
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from remat.core.chain import Chain
from remat.core.errors import PlanError
from remat.core.graph import Graph
from remat.core.schema import read_schema

__all__ = [
    "Segment",
    "ChainSegment",
    "Plan",
    "PlanError",
    "PLAN_SCHEMA_VERSION",
    "check_made_for",
]

PLAN_SCHEMA_VERSION = 2
"""2: one schema for chains and graphs (segments of nodes). Files of version 1 (``remat.plan``,
a chain's stage tree) and of ``remat.graph_plan`` version 1 are still read."""

Structure = Chain | Graph | int
"""What a plan is made for: a chain, a graph, or a number of stages (a chain of that length)."""


# ---------------------------------------------------------------------------------- segments
@dataclass(frozen=True)
class Segment:
    """A recomputation region: ``nodes`` (sorted indices) and an optional nested sub-plan."""

    nodes: tuple[int, ...]
    """The nodes recomputed together (sorted, unique, non-empty)."""
    children: tuple[Segment, ...] = ()
    """Disjoint sub-segments of ``nodes`` that stay checkpointed when this one is recomputed."""

    def __post_init__(self) -> None:
        if isinstance(self.nodes, int) or not isinstance(self.nodes, Iterable):
            raise PlanError(
                f"Segment({self.nodes!r}, ...): a segment is a collection of node indices "
                "(node i is stage i + 1 of a chain); for a chain's stage tree use "
                "ChainSegment(start, stop, checkpoint) and Plan.from_chain_segments"
            )
        nodes = tuple(sorted(set(self.nodes)))
        if not nodes:
            raise PlanError("a segment needs at least one node")
        if len(nodes) != len(tuple(self.nodes)):
            raise PlanError(f"segment {list(self.nodes)} lists a node twice")
        for v in nodes:
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise PlanError(f"segment node {v!r} is not a node index")
        object.__setattr__(self, "nodes", nodes)
        children = tuple(self.children)
        object.__setattr__(self, "children", children)
        inside = set(nodes)
        seen: set[int] = set()
        for child in children:
            if not isinstance(child, Segment):
                raise PlanError(f"expected Segment children, got {child!r}")
            if not set(child.nodes) <= inside:
                raise PlanError(
                    f"child segment {span(child.nodes)} is not inside its parent {span(nodes)}"
                )
            if seen & set(child.nodes):
                raise PlanError(f"child segments of {span(nodes)} overlap")
            seen |= set(child.nodes)
            if child.nodes == nodes:
                raise PlanError(
                    f"segment {span(nodes)} is checkpointed twice over the same nodes; that "
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

    def walk(self) -> Iterator[Segment]:
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
    def from_obj(cls, obj: Any) -> Segment:
        if not isinstance(obj, dict) or "nodes" not in obj:
            raise PlanError(f"cannot read segment {obj!r}: expected {{'nodes': [...]}}")
        return cls(tuple(obj["nodes"]), tuple(cls.from_obj(c) for c in obj.get("children", [])))

    def describe(self) -> str:
        inner = " ".join(c.describe() for c in self.children)
        return "{" + span(self.nodes) + (f": {inner}" if inner else "") + "}"


@dataclass(frozen=True)
class ChainSegment:
    """A plan read as a chain's stage tree (:meth:`Plan.chain_segments`): stages
    ``start..stop`` (1-based, inclusive), stored or checkpointed with a sub-plan.

    A stored segment's stages run with autograd and keep what their backward needs; a
    checkpointed one keeps only its input in the forward and is recomputed in the backward
    under ``children`` (which cover ``start..stop``), then back-propagated: what nested
    non-reentrant ``torch.utils.checkpoint`` executes (``remat.execute.chain``)."""

    start: int
    """First stage of the segment (1-based)."""
    stop: int
    """Last stage of the segment (inclusive)."""
    checkpoint: bool = False
    """True: keep only the segment's input in the forward and recompute it in the backward."""
    children: tuple[ChainSegment, ...] = ()
    """Sub-plan used when a checkpointed segment is recomputed; default: store every stage."""

    def __post_init__(self) -> None:
        if not (isinstance(self.start, int) and isinstance(self.stop, int)):
            raise PlanError(f"segment bounds must be ints, got {self.start!r}..{self.stop!r}")
        if self.start < 1 or self.stop < self.start:
            raise PlanError(f"segment {self.start}..{self.stop} is empty or starts before stage 1")
        children = tuple(self.children)
        if not self.checkpoint and children:
            raise PlanError(
                f"stored segment {self.start}..{self.stop} has children: only checkpointed "
                "segments have a sub-plan"
            )
        if self.checkpoint and not children:
            children = (ChainSegment(self.start, self.stop),)
        if children:
            _check_cover(children, self.start, self.stop, f"segment {self.start}..{self.stop}")
            only = children[0]
            if len(children) == 1 and only.checkpoint and only.stages() == self.stages():
                raise PlanError(
                    f"segment {self.start}..{self.stop} is checkpointed twice over the same "
                    "stages; that recomputes everything again for nothing"
                )
        object.__setattr__(self, "children", children)

    @property
    def length(self) -> int:
        return self.stop - self.start + 1

    def stages(self) -> range:
        return range(self.start, self.stop + 1)

    def depth(self) -> int:
        """Nesting depth: 0 for a stored segment, 1 for a one-level checkpoint, ..."""
        if not self.checkpoint:
            return 0
        return 1 + max(c.depth() for c in self.children)

    def walk(self) -> Iterator[ChainSegment]:
        """This segment and every segment below it, parents before children."""
        yield self
        for child in self.children:
            yield from child.walk()

    def describe(self) -> str:
        """Compact text: ``[1-3]`` stored, ``(4-6)`` checkpointed, nesting shown inside."""
        stages = f"{self.start}" if self.start == self.stop else f"{self.start}-{self.stop}"
        if not self.checkpoint:
            return f"[{stages}]"
        inner = self.children
        if len(inner) == 1 and not inner[0].checkpoint:
            return f"({stages})"
        return f"({stages}: {' '.join(c.describe() for c in inner)})"

    @classmethod
    def from_obj(cls, obj: Any) -> ChainSegment:
        """A segment of a version-1 plan file: ``[start, stop, 'store']`` or
        ``[start, stop, 'checkpoint', [children]]``."""
        if not isinstance(obj, list) or len(obj) not in (3, 4) or obj[2] not in _KINDS:
            raise PlanError(
                f"cannot read segment {obj!r}: expected [start, stop, 'store'] or "
                "[start, stop, 'checkpoint', [children]]"
            )
        if obj[2] == "store":
            return cls(obj[0], obj[1])
        children = tuple(cls.from_obj(c) for c in (obj[3] if len(obj) == 4 else []))
        return cls(obj[0], obj[1], True, children)


_KINDS = ("store", "checkpoint")


# ---------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Plan:
    """Disjoint recomputation segments over a graph's nodes (or a chain's stages) plus what the
    planner predicted for it.

    Build one with :meth:`none`, :meth:`every_stage`, :meth:`from_checkpoints` (a chain's kept
    activations), :meth:`from_kept` (a graph's kept nodes), :meth:`from_segments`,
    :meth:`from_chain_segments`, or a planner (:func:`remat.plan`). ``Plan.none()`` and
    ``Plan.every_stage()`` may be made without a chain or graph; they are fitted to the one they
    are used with (:meth:`for_graph`).
    """

    segments: tuple[Segment, ...] = ()
    """Top-level segments (disjoint, sorted); nodes in none of them are stored."""
    rule: str | None = None
    """``"every-stage"`` for the plan that checkpoints each node alone, made without knowing how
    many there are (expanded by :meth:`for_graph`); None otherwise."""
    method: str = "manual"
    """The planner that made the plan."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """The planner's parameters and diagnostics (budget, solver gap, ...), JSON-compatible."""
    predicted_peak_bytes: int | None = None
    """Peak activation bytes that :func:`remat.simulate` predicts for the plan."""
    predicted_time: float | None = None
    """Forward + recomputation + backward time predicted by :func:`remat.simulate`."""
    n: int | None = None
    """Number of nodes (a chain's stages) of what the plan was made for; None if unknown."""
    chain: bool = False
    """Made for a chain: described by its stages (``(1-3) [4-6]``, 1-based), not its nodes."""
    fingerprint: str | None = None
    """Fingerprint of the chain or graph the plan was made for (a chain and its path graph
    share one): :meth:`for_graph` refuses the plan for other costs."""
    stages_fingerprint: str | None = None
    """Structure of the model's stages the plan was made for
    (:attr:`remat.capture.stages.Stages.fingerprint`), when its chain was captured from a model:
    :func:`remat.apply` refuses the plan for a model with other stages. None otherwise."""

    def __post_init__(self) -> None:
        segments = tuple(self.segments)
        for seg in segments:
            if not isinstance(seg, Segment):
                hint = (
                    ": a chain's stage tree is built with Plan.from_chain_segments"
                    if isinstance(seg, ChainSegment)
                    else ""
                )
                raise PlanError(f"expected Segment objects, got {seg!r}{hint}")
        segments = tuple(sorted(segments, key=lambda s: s.nodes))
        object.__setattr__(self, "segments", segments)
        object.__setattr__(self, "params", dict(self.params))
        if self.rule == "none":  # the store-all rule of version-1 files: no segment at all
            object.__setattr__(self, "rule", None)
        if self.rule is not None:
            if self.rule != "every-stage":
                raise PlanError(f"unknown plan rule {self.rule!r}: use 'every-stage' or none")
            if segments:
                raise PlanError("a rule plan has no explicit segments")
        seen: set[int] = set()
        for seg in segments:
            if seen & set(seg.nodes):
                raise PlanError(
                    f"segments overlap on nodes {sorted(seen & set(seg.nodes))}: a node is in at "
                    "most one top-level segment"
                )
            seen |= set(seg.nodes)
        if self.n is not None:
            if not isinstance(self.n, int) or self.n < 1:
                raise PlanError(f"a plan is made for at least one node, got n={self.n!r}")
            if segments and max(s.last for s in segments) >= self.n:
                raise PlanError(
                    f"segment {span(segments[-1].nodes)} names node {segments[-1].last} of a "
                    f"plan made for {self.n} nodes"
                )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def none(cls, structure: Structure | None = None) -> Plan:
        """Store every activation: no recomputation (the unplanned model)."""
        return cls(method="none", **_size(structure))

    @classmethod
    def every_stage(cls, structure: Structure | None = None) -> Plan:
        """Checkpoint each stage (node) on its own (``checkpoint`` around every block)."""
        if structure is None:
            return cls(rule="every-stage", method="every-stage")
        size = _size(structure)
        segments = tuple(Segment((v,)) for v in range(size["n"]))
        return cls(segments, method="every-stage", **size)

    @classmethod
    def from_checkpoints(
        cls, chain: Chain | int, indices: Iterable[int], store_last: bool = False
    ) -> Plan:
        """The flat plan of the papers on a chain: keep the activations ``a[k]`` for ``k`` in
        ``indices`` (``1..n-1``).

        Each run of stages between two kept activations (and between the input and the first,
        and the last and the output) becomes a checkpointed segment, recomputed once in the
        backward with every stage stored. With ``store_last=True`` the final segment is stored
        instead (it would be recomputed right after its forward otherwise). A graph's kept
        nodes: :meth:`from_kept`.
        """
        n = _size(chain)["n"]
        kept = sorted(set(indices))
        for k in kept:
            if not isinstance(k, int) or not 1 <= k <= n - 1:
                raise PlanError(
                    f"checkpoint index {k!r} out of range: kept activations are a[1]..a[{n - 1}] "
                    "(a[0] is the input and a[n] the output, both always kept)"
                )
        bounds = [0, *kept, n]
        segments = [
            ChainSegment(lo + 1, hi, checkpoint=not (store_last and hi == n))
            for lo, hi in zip(bounds, bounds[1:], strict=False)
        ]
        return cls.from_chain_segments(segments, method="checkpoints", params={"indices": kept})

    @classmethod
    def from_kept(cls, graph: Graph, kept: Iterable[int], **kwargs: Any) -> Plan:
        """The plan of Re-forwarding (Feng & Huang): keep the outputs of ``kept``, recompute the rest.

        Every node is recomputed except the multi-input kept nodes, which are stored (the
        "transitions" of Feng & Huang: an add or concat joining branches runs outside the
        segments, so each incoming branch is its own segment). The sinks (outputs) are always
        kept. The segments are the connected pieces left when the edges out of kept nodes (and
        into stored ones) are cut: a kept single-input node closes the segment of its input,
        like a kept activation in :meth:`from_checkpoints`.
        """
        kept_set = set(kept) | set(graph.sinks)
        for v in kept_set:
            if not isinstance(v, int) or not 0 <= v < graph.n:
                raise PlanError(f"checkpoint {v!r} is not a node index of this graph")
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
        kwargs.setdefault("n", graph.n)
        return cls(tuple(Segment(tuple(g)) for g in groups.values()), params=params, **kwargs)

    @classmethod
    def from_segments(cls, segments: Iterable[Iterable[int] | Segment], **kwargs: Any) -> Plan:
        """A plan of the given segments: each a :class:`Segment` or an iterable of node indices
        (a flat segment)."""
        segs = tuple(s if isinstance(s, Segment) else Segment(tuple(s)) for s in segments)
        return cls(segs, **kwargs)

    @classmethod
    def from_chain_segments(
        cls,
        segments: Sequence[ChainSegment],
        *,
        blocks: Sequence[Sequence[int]] | None = None,
        **kwargs: Any,
    ) -> Plan:
        """The plan of a chain's stage tree (``segments`` cover stages ``1..n`` in order):
        stage ``i`` is node ``i - 1``, nesting kept; :meth:`chain_segments` gives the tree back
        (stored segments side by side merged: ``[1-2] [3-4]`` comes back as ``[1-4]``, which
        runs the same).

        With ``blocks``, stage ``k`` is the nodes ``blocks[k - 1]`` of a graph (as
        :mod:`remat.planners.articulation` cuts it): the plan over those nodes. ``kwargs`` set
        the other fields.
        """
        segments = tuple(segments)
        if not segments:
            raise PlanError("a chain plan needs segments covering stages 1..n")
        n = segments[-1].stop
        _check_cover(segments, 1, n, "plan")
        if blocks is not None and len(blocks) != n:
            raise PlanError(f"the plan covers {n} stages but {len(blocks)} blocks are given")
        stages = blocks if blocks is not None else [[k] for k in range(n)]

        def convert(segs: Sequence[ChainSegment]) -> tuple[Segment, ...]:
            return tuple(
                Segment(
                    tuple(v for k in range(seg.start - 1, seg.stop) for v in stages[k]),
                    convert(seg.children),
                )
                for seg in segs
                if seg.checkpoint
            )

        if blocks is None:
            kwargs.setdefault("n", n)
            kwargs.setdefault("chain", True)
        return cls(convert(segments), **kwargs)

    def made_for(self, structure: Chain | Graph) -> Plan:
        """This plan recording ``structure``'s size and fingerprints (its costs, and its model's
        stages when it was captured from one): what every planner's plan carries (a rule plan
        expanded for it)."""
        return replace(
            self.for_graph(structure.n) if self.rule else self,
            fingerprint=structure.fingerprint,
            stages_fingerprint=getattr(structure, "stages_fingerprint", "") or None,
            **_size(structure),
        )

    # ------------------------------------------------------------------ use
    def for_graph(self, structure: Structure) -> Plan:
        """This plan fitted to ``structure`` (a graph, a chain, or a chain's number of stages):
        a rule plan expanded, the size recorded, and checked against it (raises
        :class:`PlanError` for a plan made for another size or other costs)."""
        size = _size(structure)
        n = size["n"]
        if self.rule == "every-stage":
            return replace(Plan.every_stage(structure), method=self.method, params=self.params)
        if self.n is not None and self.n != n:
            raise PlanError(
                f"the plan was made for {self.n} {_unit(self.chain)} but this {_what(structure)} "
                f"has {n} {_unit(size['chain'])}: re-plan for it"
            )
        if self.segments and max(s.last for s in self.segments) >= n:
            raise PlanError(
                f"segment {span(self.segments[-1].nodes)} names node {self.segments[-1].last} "
                f"but the {_what(structure)} has {n} nodes: re-plan for it"
            )
        if not isinstance(structure, int):
            check_made_for(self.fingerprint, structure.fingerprint, _what(structure))
        if self.n is None:
            return replace(self, n=n, chain=self.chain or size["chain"])
        return self

    for_chain = for_graph

    def chain_segments(self, n: Structure | None = None) -> tuple[ChainSegment, ...]:
        """The plan as a chain's stage tree over stages ``1..n`` (stored runs explicit), for the
        chain executor and the chain simulator; ``n`` (a chain, a graph, or a count) defaults to
        the size the plan was made for. Raises :class:`PlanError` when a segment is not a run of
        consecutive nodes (no chain plan has it)."""
        plan = self if n is None else self.for_graph(n)
        if plan.rule is not None or plan.n is None:
            raise PlanError(
                f"the plan {plan.describe()} was made for no chain: pass the chain (or its "
                "number of stages) to chain_segments"
            )

        def convert(segs: Sequence[Segment], start: int, stop: int) -> list[ChainSegment]:
            out: list[ChainSegment] = []
            pos = start
            for seg in sorted(segs, key=lambda s: s.first):
                if not seg.is_interval():
                    raise PlanError(
                        f"segment {span(seg.nodes)} is not a run of consecutive nodes: no chain "
                        "plan has it"
                    )
                if seg.first > pos:
                    out.append(ChainSegment(pos + 1, seg.first))
                children = tuple(convert(seg.children, seg.first, seg.last + 1))
                out.append(ChainSegment(seg.first + 1, seg.last + 1, True, children))
                pos = seg.last + 1
            if pos < stop:
                out.append(ChainSegment(pos + 1, stop))
            return out

        return tuple(convert(plan.segments, 0, plan.n))

    def walk(self) -> Iterator[Segment]:
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

    def kept_activations(self) -> list[int]:
        """On a chain: the indices ``k`` of the activations ``a[k]`` at top-level segment
        boundaries, each kept through the whole forward."""
        return [s.start - 1 for s in self.chain_segments()[1:]]

    def depth(self) -> int:
        """0 for a store-all plan, 1 for a flat plan, more with nesting."""
        if self.rule == "every-stage":
            return 1
        return max((s.depth() for s in self.segments), default=0)

    def is_contiguous(self) -> bool:
        """True when every segment is a run of consecutive node indices."""
        return all(s.is_interval() for s in self.walk())

    def describe(self, graph: Graph | None = None) -> str:
        """Compact text. A chain's plan by its stages, ``(1-3) (4-6) [7-8]`` (1-based;
        ``(..)`` checkpointed, ``[..]`` stored); any other by its nodes, ``{0-3} {5,7}``
        (0-based), or with ``graph`` by the node names at each segment's ends."""
        if self.rule:
            return f"<{self.rule}>"
        if graph is not None and self.segments:
            return " ".join(
                "{"
                + f"{graph.nodes[s.first].name}..{graph.nodes[s.last].name} ({len(s.nodes)})"
                + "}"
                for s in self.segments
            )
        if self.chain and self.n is not None and self.is_contiguous():
            return " ".join(s.describe() for s in self.chain_segments())
        if not self.segments:
            return "<store all>"
        return " ".join(s.describe() for s in self.segments)

    # ------------------------------------------------------------------ JSON
    def to_json(self, indent: int | None = None) -> str:
        data = {
            "schema": "remat.plan",
            "version": PLAN_SCHEMA_VERSION,
            "method": self.method,
            "params": dict(self.params),
            "rule": self.rule,
            "segments": [s.to_obj() for s in self.segments],
            "n": self.n,
            "chain": self.chain,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_time": self.predicted_time,
            "fingerprint": self.fingerprint,
            "stages_fingerprint": self.stages_fingerprint,
        }
        return json.dumps(data, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json` (checks the schema and its version; the
        version-1 files of chain plans and of graph plans are read too)."""
        try:
            head = json.loads(text)
        except ValueError:
            head = None
        if isinstance(head, dict) and head.get("schema") == "remat.graph_plan":
            data = read_schema(text, "remat.graph_plan", 1, "remat graph plan", PlanError)
            return cls(
                segments=tuple(Segment.from_obj(s) for s in data.get("segments", [])),
                **_fields(data, "graph_fingerprint"),
            )
        if isinstance(head, dict) and type(head.get("version")) is int and head["version"] == 1:
            data = read_schema(text, "remat.plan", 1, "remat plan", PlanError)
            fields = _fields(data, "chain_fingerprint")
            if data.get("segments"):
                tree = [ChainSegment.from_obj(s) for s in data["segments"]]
                return cls.from_chain_segments(tree, **fields)
            return cls(rule=data.get("rule"), **fields)
        data = read_schema(text, "remat.plan", PLAN_SCHEMA_VERSION, "remat plan", PlanError)
        return cls(
            segments=tuple(Segment.from_obj(s) for s in data.get("segments", [])),
            rule=data.get("rule"),
            n=data.get("n"),
            chain=bool(data.get("chain", False)),
            **_fields(data, "fingerprint"),
        )


def check_made_for(
    made_for: str | None, fingerprint: str | None, what: str, error: type[PlanError] = PlanError
) -> None:
    """Raise ``error`` when a plan made for the costs ``made_for`` (a chain's or a graph's
    fingerprint; a chain and its path graph share one) is used on costs ``fingerprint``
    (``what``: "chain" or "graph"). Either unknown (None or empty): nothing to check."""
    if made_for and fingerprint and fingerprint != made_for:
        raise error(
            f"this plan was made for other costs ({what} fingerprint {made_for}, this {what} "
            f"{fingerprint}): the batch shape or the model changed, so re-plan for it"
        )


def _fields(data: Mapping[str, Any], fingerprint_key: str) -> dict[str, Any]:
    return {
        "method": data.get("method", "manual"),
        "params": data.get("params") or {},
        "predicted_peak_bytes": data.get("predicted_peak_bytes"),
        "predicted_time": data.get("predicted_time"),
        "fingerprint": data.get(fingerprint_key),
        "stages_fingerprint": data.get("stages_fingerprint"),  # absent in older files
    }


def _size(structure: Structure | None) -> dict[str, Any]:
    """The ``n`` and ``chain`` fields of a plan made for ``structure`` (none: unknown)."""
    if structure is None:
        return {}
    if isinstance(structure, bool) or not isinstance(structure, (int, Chain, Graph)):
        raise PlanError(
            f"a plan is made for a Chain, a Graph or a number of stages, not {structure!r}"
        )
    n = structure if isinstance(structure, int) else structure.n
    if n < 1:
        raise PlanError(f"a chain has at least one stage, got n={n}")
    return {"n": n, "chain": not isinstance(structure, Graph)}


def _what(structure: Structure) -> str:
    return "graph" if isinstance(structure, Graph) else "chain"


def _unit(chain: bool) -> str:
    return "stages" if chain else "nodes"


def span(nodes: Sequence[int], sep: str = ",") -> str:
    """``0-3`` for a run, ``0,2,5`` otherwise (runs inside are compressed: ``0-3,7``), the
    parts joined by ``sep``."""
    parts: list[str] = []
    i = 0
    while i < len(nodes):
        j = i
        while j + 1 < len(nodes) and nodes[j + 1] == nodes[j] + 1:
            j += 1
        parts.append(str(nodes[i]) if i == j else f"{nodes[i]}-{nodes[j]}")
        i = j + 1
    return sep.join(parts)


def _check_cover(segments: Sequence[ChainSegment], start: int, stop: int, what: str) -> None:
    expected = start
    for seg in segments:
        if not isinstance(seg, ChainSegment):
            raise PlanError(f"{what}: expected ChainSegment objects, got {seg!r}")
        if seg.start != expected:
            raise PlanError(
                f"{what}: segments must cover stages {start}..{stop} in order without gaps or "
                f"overlaps; expected a segment starting at {expected}, got {seg.start}..{seg.stop}"
            )
        expected = seg.stop + 1
    if expected != stop + 1:
        raise PlanError(f"{what}: segments end at stage {expected - 1}, expected {stop}")
