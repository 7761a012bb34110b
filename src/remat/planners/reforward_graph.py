"""Re-forwarding on arbitrary graphs: Feng & Huang, "Optimal Gradient Checkpoint Search for
Arbitrary Computation Graphs" (CVPR 2021; arXiv:1808.00079), registered as ``reforward``.

**Their model.** Vertices are tensors (here: the graph input ``s``, one vertex per node output,
and the output ``t``; several sinks get a virtual ``t``). A set ``C`` of gradient checkpoints
(GCs) is kept; every other vertex is recomputed, segment by segment, in the backward. They
minimise ::

    cost(C) = sum_{v in C} c(v) + max over segments of sum_{u inside} c(u)

where the segments are the connected pieces left when ``C``, ``s`` and ``t`` are removed. Here
a GC costs its ``out_bytes`` and a recomputed vertex its ``saved_bytes`` (the paper's model is
the case ``saved_bytes == out_bytes``); the sinks are outputs, always kept and never charged.

**Their algorithm** (pinned down from the official code, ``shared/papers/notes.md`` §4.3-4.4):

1. *Division tree.* A piece (between a source ``a`` and a target ``b``) is **linear** when it
   has splitting vertices (every edge lies before or after them): it is cut at all of them into
   a chain of sub-pieces. Otherwise it is a **branch** when the direct edge ``a -> b`` or the
   connected components of the piece minus ``{a, b}`` split it. Otherwise it is
   **complicate**: for every pair of candidate endpoints (``a``, ``b`` and vertices of degree
   > 2) the largest *independent segment* (IS) is found, and the ISs are taken greedily,
   largest first, edge-disjoint, until they cover the piece. Each piece is divided again.
2. *For a bound* ``m`` *on the segment cost*, ``solve_with_max`` walks the tree: a piece whose
   cost exceeds ``m`` must be split. Branch and complicate pieces checkpoint all their division
   vertices and recurse into their over-budget pieces; linear pieces recurse into over-budget
   sub-pieces (checkpointing both ends) and solve the runs in between exactly with the linear
   algorithm (LCG: shortest path in the accessibility graph of jumps of cost <= ``m``).
3. *The bound* ``m`` ranges over every piece cost and every linear sub-run cost; the answer is
   the minimum of ``gc(m) + m``.

**Guarantee.** Exact for their cost model (the paper's theorem; checked here against brute
force over all checkpoint subsets in ``tests/test_graph_planners.py``). The plan executed is
:meth:`Plan.from_kept`: kept single-input vertices close the segment of their
input, kept multi-input vertices (their "transitions") are stored.

**What remat adds.** ``gc(m)`` is monotone in ``m``, so the minimum is found by bisection over
the sorted candidates (each break point of ``gc`` costs O(log) evaluations) instead of one
evaluation per candidate, and the linear shortest path is a sliding-window minimum (O(r) per
run instead of Dijkstra on O(r^2) edges). The plans of the break points (each optimal for its
bound) are then costed by :func:`~remat.graphs.simulate_graph`, which also counts gradients,
residuals, inputs held for backward and overheads that their model leaves out; by default the
one with the least simulated peak is returned (``objective="feng"`` returns their argmin
instead). With a budget, the fastest break-point plan that fits is returned.

Known limitations:
    * Their cost model ignores gradients, overheads and the tensors a backward keeps; the
      simulated peak of their optimum is therefore not always the least simulated peak over
      all checkpoint sets (the tests measure the gap).
    * When the greedy IS selection does not cover a complicate piece (the official code raises
      ``ValueError`` there), the piece is treated as opaque: all its inner vertices become
      checkpoints when it must be split. ``plan.params["division"]`` counts such pieces.
    * Every non-checkpoint node is recomputed (about one extra forward): the plan space is
      Feng & Huang's, which has no stored segments.

Example:
    >>> from remat.core.synthetic import residual_chain
    >>> from remat.planners.graph import plan_graph
    >>> p = plan_graph(residual_chain(4), "reforward")
    >>> p.method, len(p.params["checkpoints"]) > 0
    ('reforward', True)
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from remat.core.graph import Graph
from remat.core.plan import Plan
from remat.core.simulate import simulate_graph
from remat.planners.registry import BudgetTooSmallError, register

__all__ = ["plan_reforward", "ReforwardConfig", "FengGraph", "feng_cost", "DivisionTree"]


@dataclass(frozen=True)
class ReforwardConfig:
    """Settings of the ``reforward`` planner."""

    objective: str = "simulated"
    """``"simulated"``: of the break-point plans, the least simulated peak; ``"feng"``: the
    minimum of their cost model (ties broken by simulated peak)."""
    max_candidates: int = 16
    """How many break-point plans (best first by their model) are simulated."""

    def __post_init__(self) -> None:
        if self.objective not in ("simulated", "feng"):
            raise ValueError(f"objective must be 'simulated' or 'feng', got {self.objective!r}")
        if self.max_candidates < 1:
            raise ValueError("max_candidates must be >= 1")


@register("reforward", plans="graph")
def plan_reforward(graph: Graph, budget: int | None = None, **options: object) -> Plan:
    """Feng & Huang's optimal checkpoint set (see the module docstring)."""
    config = ReforwardConfig(**options)  # type: ignore[arg-type]
    feng = FengGraph(graph)
    tree = DivisionTree(feng)
    candidates = tree.breakpoint_plans(limit=config.max_candidates)
    best_feng = candidates[0][0] + candidates[0][1]
    rows = []
    for gc, m, kept in candidates[: config.max_candidates]:
        plan = Plan.from_kept(graph, kept)
        sim = simulate_graph(graph, plan)
        rows.append((sim.peak_bytes, sim.total_time, gc + m, m, kept, plan))
    if budget is not None:
        fitting = [r for r in rows if r[0] <= budget]
        if not fitting:
            raise BudgetTooSmallError(
                budget,
                min(r[0] for r in rows),
                "reforward",
                "no checkpoint set of Feng & Huang fits",
            )
        chosen = min(fitting, key=lambda r: (r[1], r[0], r[2]))
    elif config.objective == "feng":
        chosen = min(rows, key=lambda r: (r[2], r[0], r[1]))
    else:
        chosen = min(rows, key=lambda r: (r[0], r[2], r[1]))
    peak, _, cost, m, kept, plan = chosen
    params = {
        "checkpoints": sorted(kept),
        "feng_cost_bytes": feng_cost(graph, kept),
        "feng_optimum_bytes": best_feng,
        "max_term_bytes": m,
        "objective": config.objective,
        "candidates": len(candidates),
        "candidates_simulated": len(rows),
        "division": tree.summary(),
    }
    return Plan(plan.segments, method="reforward", params=params)


def feng_cost(graph: Graph, kept: Iterable[int]) -> int:
    """Feng & Huang's cost of keeping ``kept``: their sum plus the largest segment.

    ``sum(out_bytes of kept) + max over connected pieces of the other nodes of the sum of
    their saved_bytes``; sinks are outputs and are neither charged nor part of a piece.
    """
    return FengGraph(graph).cost([v + 1 for v in kept])


class FengGraph:
    """The tensor-vertex graph of Feng & Huang built from a :class:`Graph`.

    Vertex 0 is the graph input ``s``; vertex ``v + 1`` is node ``v``; with several sinks a
    virtual vertex ``n + 1`` is the target ``t`` (with one sink, ``t`` is that node). Edges and
    vertex sets are Python-int bitsets.
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        n = graph.n
        sinks = graph.sinks
        self.virtual_t = len(sinks) > 1
        self.size = n + 2 if self.virtual_t else n + 1
        self.s = 0
        self.t = n + 1 if self.virtual_t else sinks[0] + 1
        succ: list[list[int]] = [[] for _ in range(self.size)]
        for v, node in enumerate(graph.nodes):
            for u in node.inputs:
                succ[u + 1].append(v + 1)
            if not node.inputs:
                succ[0].append(v + 1)
        if self.virtual_t:
            for o in sinks:
                succ[o + 1].append(self.t)
        self.succ = [sorted(s) for s in succ]
        self.pred: list[list[int]] = [[] for _ in range(self.size)]
        for x, ys in enumerate(self.succ):
            for y in ys:
                self.pred[y].append(x)
        self.c_out = [0] * self.size  # cost of keeping the vertex (a GC)
        self.c_in = [0] * self.size  # cost of recomputing it inside a segment
        sink_set = set(sinks)
        for v, node in enumerate(graph.nodes):
            if v not in sink_set:
                self.c_out[v + 1] = node.out_bytes
                self.c_in[v + 1] = node.saved_bytes
        self.succ_mask = [_mask(s) for s in self.succ]
        self.pred_mask = [_mask(p) for p in self.pred]
        self.adj_mask = [self.succ_mask[x] | self.pred_mask[x] for x in range(self.size)]
        self.all = (1 << self.size) - 1

    def cost(self, kept_vertices: Iterable[int]) -> int:
        """Their cost of keeping ``kept_vertices`` (``s``, ``t`` and sinks excluded)."""
        kept = set(kept_vertices) - {self.s, self.t}
        inner = {x for x in range(self.size) if x not in kept and x not in (self.s, self.t)}
        seen: set[int] = set()
        largest = 0
        for x in inner:
            if x in seen:
                continue
            total, stack = 0, [x]
            seen.add(x)
            while stack:
                y = stack.pop()
                total += self.c_in[y]
                for z in self.succ[y] + self.pred[y]:
                    if z in inner and z not in seen:
                        seen.add(z)
                        stack.append(z)
            largest = max(largest, total)
        return sum(self.c_out[x] for x in kept) + largest


@dataclass
class _Piece:
    """A node of the division tree: the vertices between ``a`` and ``b`` (both included)."""

    a: int
    b: int
    mask: int
    """Vertex set (bitset); edges are those of the induced subgraph."""
    skip_direct: bool
    """True when the direct edge ``a -> b`` belongs to a sibling piece."""
    kind: str = "leave"
    """``leave`` (one edge), ``linear``, ``branch``, ``complicate`` or ``opaque``."""
    cost: int = 0
    """Sum of ``c_in`` strictly inside."""
    children: list[_Piece] = field(default_factory=list)
    chain: list[int] = field(default_factory=list)
    """Linear pieces: the vertices ``a = u_0, ..., u_r = b``; children[i] spans u_i..u_i+1."""
    division: list[int] = field(default_factory=list)
    """Branch/complicate pieces: the inner endpoints of the children (all become GCs)."""


class DivisionTree:
    """Feng & Huang's division tree of a :class:`FengGraph` and the search over max terms."""

    def __init__(self, feng: FengGraph) -> None:
        self.g = feng
        self.counts = {"linear": 0, "branch": 0, "complicate": 0, "opaque": 0, "leave": 0}
        full = feng.all
        self.root = self._build(feng.s, feng.t, full, False, False)

    # ------------------------------------------------------------------ building
    def _inner_cost(self, piece_mask: int, a: int, b: int) -> int:
        inner = piece_mask & ~(1 << a) & ~(1 << b)
        return sum(self.g.c_in[x] for x in _bits(inner))

    def _succ_in(self, x: int, mask: int, a: int, b: int, skip_direct: bool) -> int:
        s = self.g.succ_mask[x] & mask
        if skip_direct and x == a:
            s &= ~(1 << b)
        return s

    def _build(self, a: int, b: int, mask: int, skip_direct: bool, known_linear: bool) -> _Piece:
        piece = _Piece(a, b, mask, skip_direct, cost=self._inner_cost(mask, a, b))
        if mask.bit_count() == 2:
            self.counts["leave"] += 1
            return piece
        order = list(_bits(mask))  # vertex indices are topological
        if not known_linear:
            splits = self._splitting_vertices(order, mask, a, b, skip_direct)
            if splits:
                piece.kind = "linear"
                chain = [a, *splits, b]
                piece.chain = chain
                anc, desc = self._reach(order, mask, a, b, skip_direct)
                for u, w in zip(chain, chain[1:], strict=False):
                    sub = (desc[u] & anc[w]) | (1 << u) | (1 << w)
                    piece.children.append(self._build(u, w, sub, False, True))
                self.counts["linear"] += 1
                return piece
        direct = (not skip_direct) and bool(self.g.succ_mask[a] >> b & 1)
        comps = self._components(order, mask, a, b)
        if direct or len(comps) > 1:
            piece.kind = "branch"
            if direct:
                piece.children.append(self._build(a, b, (1 << a) | (1 << b), False, False))
            for comp in comps:
                sub = comp | (1 << a) | (1 << b)
                piece.children.append(self._build(a, b, sub, direct or skip_direct, False))
            self.counts["branch"] += 1
            return piece
        self._complicate(piece, order)
        return piece

    def _splitting_vertices(
        self, order: list[int], mask: int, a: int, b: int, skip_direct: bool
    ) -> list[int]:
        """Vertices no edge jumps over (every vertex of a piece lies on an a -> b path)."""
        splits = []
        reach = -1
        for x in order:
            if x != a and x != b and reach <= x:
                splits.append(x)
            s = self._succ_in(x, mask, a, b, skip_direct)
            if s:
                reach = max(reach, s.bit_length() - 1)
        return splits

    def _reach(
        self, order: list[int], mask: int, a: int, b: int, skip_direct: bool
    ) -> tuple[dict[int, int], dict[int, int]]:
        """Ancestors and descendants of each vertex inside the piece (bitsets, strict)."""
        anc: dict[int, int] = {x: 0 for x in order}
        desc: dict[int, int] = {x: 0 for x in order}
        for x in order:
            for y in _bits(self._succ_in(x, mask, a, b, skip_direct)):
                anc[y] |= anc[x] | (1 << x)
        for x in reversed(order):
            for y in _bits(self._succ_in(x, mask, a, b, skip_direct)):
                desc[x] |= desc[y] | (1 << y)
        return anc, desc

    def _components(self, order: list[int], mask: int, a: int, b: int) -> list[int]:
        """Connected components (bitsets) of the piece minus ``a`` and ``b``."""
        inner = mask & ~(1 << a) & ~(1 << b)
        comps = []
        left = inner
        while left:
            low = left & -left
            comp = low
            frontier = low
            while frontier:
                grow = 0
                for x in _bits(frontier):
                    grow |= self.g.adj_mask[x]
                grow &= inner & ~comp
                comp |= grow
                frontier = grow
            comps.append(comp)
            left &= ~comp
        return comps

    def _complicate(self, piece: _Piece, order: list[int]) -> None:
        """Feng & Huang's complicate division: largest ISs, greedy, largest first.

        Their largest IS between ``x`` and ``y`` starts from the vertices between them and
        removes, to a fixed point, inner vertices adjacent to the outside and every inner
        vertex on a path with a removed one. Two inner vertices on a common path, or adjacent,
        are connected in the subgraph induced on the inner vertices; so the survivors are the
        connected components of that subgraph with no vertex adjacent to the outside, i.e.
        the components of the piece minus ``{x, y}`` that touch nothing but ``x`` and ``y``.
        Each contains a successor of ``x``: a search from those successors, abandoned as soon
        as it steps outside, gives the same IS without the fixed point.
        """
        g = self.g
        a, b, mask = piece.a, piece.b, piece.mask
        anc, desc = self._reach(order, mask, a, b, piece.skip_direct)
        adj = {x: g.adj_mask[x] & mask for x in order}
        succ = {x: self._succ_in(x, mask, a, b, piece.skip_direct) for x in order}
        candidates = [x for x in order if x in (a, b) or adj[x].bit_count() > 2]
        edge_base: dict[int, int] = {}
        total_edges = 0
        for z in order:
            edge_base[z] = total_edges
            total_edges += succ[z].bit_count()
        found: list[tuple[int, int, int, int, int, int]] = []  # -edges, rank, emask, keep, x, y
        rank = 0
        for i, x in enumerate(candidates[:-1]):
            for y in reversed(candidates[i + 1 :]):
                if (x == a and y == b) or not desc[x] >> y & 1:
                    continue
                rank += 1
                ends = (1 << x) | (1 << y)
                inside = desc[x] & anc[y]
                keep = ends
                explored = 0
                for start in _bits(succ[x] & inside & ~explored):
                    if explored >> start & 1:
                        continue
                    comp = frontier = 1 << start
                    ok = True
                    while frontier:
                        grow = 0
                        for z in _bits(frontier):
                            grow |= adj[z]
                        grow &= ~comp & ~ends
                        if grow & ~inside:
                            ok = False
                            break
                        comp |= grow
                        frontier = grow
                    explored |= comp
                    if ok:
                        keep |= comp
                direct = bool(succ[x] >> y & 1)
                if keep == ends and not direct:
                    continue
                emask = 0
                for z in _bits(keep):
                    out = succ[z]
                    for k, w in enumerate(_bits(out)):
                        if keep >> w & 1:
                            emask |= 1 << (edge_base[z] + k)
                found.append((-emask.bit_count(), rank, emask, keep, x, y))
        found.sort(key=lambda f: (f[0], f[1]))
        covered = 0
        chosen = []
        for _, _, emask, keep, x, y in found:
            if emask & covered == 0:
                covered |= emask
                chosen.append((keep, x, y))
        if covered != (1 << total_edges) - 1:
            piece.kind = "opaque"
            self.counts["opaque"] += 1
            return
        piece.kind = "complicate"
        self.counts["complicate"] += 1
        division: set[int] = set()
        for keep, x, y in chosen:
            division |= {x, y}
            piece.children.append(self._build(x, y, keep, False, False))
        piece.division = sorted(division - {a, b})

    def summary(self) -> dict[str, int]:
        """How many pieces of each kind the tree has."""
        return dict(self.counts)

    # ------------------------------------------------------------------ solving
    def max_terms(self) -> list[int]:
        """Every candidate segment bound: all piece costs and all linear sub-run costs."""
        terms: set[int] = {0}
        stack = [self.root]
        while stack:
            piece = stack.pop()
            for child in piece.children:
                terms.add(child.cost)
                stack.append(child)
            if piece.kind == "linear":
                prefix = self._prefix(piece)
                c_in = self.g.c_in
                for j in range(len(piece.chain)):
                    for k in range(j + 1, len(piece.chain)):
                        terms.add(prefix[k] - prefix[j] - c_in[piece.chain[k]])
        return sorted(terms)

    def _prefix(self, piece: _Piece) -> list[int]:
        c_in = self.g.c_in
        prefix = [c_in[piece.chain[0]]]
        for i in range(1, len(piece.chain)):
            prefix.append(prefix[-1] + c_in[piece.chain[i]] + piece.children[i - 1].cost)
        return prefix

    def solve_with_max(self, m: int) -> tuple[int, set[int]]:
        """``(gc cost, checkpoint vertices)`` when every segment must cost at most ``m``."""
        gcs: set[int] = set()
        cost = self._solve(self.root, m, gcs)
        return cost, gcs

    def _solve(self, piece: _Piece, m: int, gcs: set[int]) -> int:
        g = self.g
        if piece.kind == "opaque":
            inner = piece.mask & ~(1 << piece.a) & ~(1 << piece.b)
            verts = list(_bits(inner))
            gcs.update(verts)
            return sum(g.c_out[x] for x in verts)
        if piece.kind in ("branch", "complicate"):
            total = sum(g.c_out[x] for x in piece.division)
            gcs.update(piece.division)
            for child in piece.children:
                if child.cost > m:
                    total += self._solve(child, m, gcs)
            return total
        if piece.kind != "linear":
            return 0
        chain = piece.chain
        local: set[int] = set()
        total = 0
        run = [0]  # indices into chain
        for i in range(1, len(chain)):
            child = piece.children[i - 1]
            if child.cost > m:
                total += self._solve(child, m, gcs)
                local |= {chain[i - 1], chain[i]}
                if len(run) > 1:
                    local |= self._lcg(piece, run, m)
                run = [i]
            else:
                run.append(i)
        if len(run) > 1:
            local |= self._lcg(piece, run, m)
        local -= {piece.a, piece.b}
        gcs.update(local)
        return total + sum(g.c_out[x] for x in local)

    def _lcg(self, piece: _Piece, run: Sequence[int], m: int) -> set[int]:
        """Feng & Huang's linear solver on a run of the chain: the cheapest GC path.

        Jump ``j -> k`` is allowed when the segment strictly between costs at most ``m``; the
        path cost is the sum of ``c_out`` of its vertices. The allowed ``j`` for each ``k`` form
        a window that slides forward, so a monotone deque gives the shortest path in O(len).
        """
        g = self.g
        verts = [piece.chain[i] for i in run]
        q = len(verts)
        prefix = [0] * q  # prefix[k] = cost strictly inside (0, k) + edges, via chain costs
        acc = 0
        for k in range(1, q):
            acc += piece.children[run[k] - 1].cost
            prefix[k] = acc
            acc += g.c_in[verts[k]]
        # cost strictly between j and k: prefix[k] - prefix[j] - c_in[verts[j]] (for j >= 1)
        dist = [0] * q
        back = [0] * q
        window: deque[int] = deque([0])
        lo = 0
        for k in range(1, q):
            while lo < k - 1 and self._between(prefix, verts, lo, k) > m:
                lo += 1
            while window and window[0] < lo:
                window.popleft()
            j = window[0]
            dist[k] = dist[j] + g.c_out[verts[k]]
            back[k] = j
            while window and dist[window[-1]] > dist[k]:
                window.pop()
            window.append(k)
        path = set()
        k = q - 1
        while True:
            path.add(verts[k])
            if k == 0:
                break
            k = back[k]
        return path

    def _between(self, prefix: list[int], verts: list[int], j: int, k: int) -> int:
        return prefix[k] - prefix[j] - (self.g.c_in[verts[j]] if j else 0)

    def breakpoint_plans(self, limit: int | None = None) -> list[tuple[int, int, list[int]]]:
        """``(gc cost, m, checkpoint nodes)`` at the break points of the monotone ``gc(m)``.

        ``gc(m)`` never increases with ``m``, so for each of its values only the smallest ``m``
        matters. A best-first bisection over the sorted candidates finds them, skipping
        intervals that cannot hold one of the ``limit`` best totals ``gc + m`` (all break
        points when ``limit`` is None). The best total is always exact.
        """
        terms = self.max_terms()
        cache: dict[int, tuple[int, set[int]]] = {}

        def gc_at(i: int) -> int:
            if i not in cache:
                cache[i] = self.solve_with_max(terms[i])
            return cache[i][0]

        first: dict[int, int] = {}  # gc value -> smallest index seen reaching it

        def record(i: int) -> None:
            gc = gc_at(i)
            first[gc] = min(first.get(gc, i), i)

        def kth_best() -> float:
            if limit is None or len(first) < limit:
                return float("inf")
            totals = sorted(gc + terms[i] for gc, i in first.items())
            return totals[limit - 1]

        record(0)
        record(len(terms) - 1)
        heap = [(gc_at(len(terms) - 1) + terms[0], 0, len(terms) - 1)]
        while heap:
            bound, lo, hi = heapq.heappop(heap)
            if bound >= kth_best():
                break
            if hi - lo <= 1 or gc_at(lo) == gc_at(hi):
                continue
            mid = (lo + hi) // 2
            record(mid)
            heapq.heappush(heap, (gc_at(mid) + terms[lo], lo, mid))
            heapq.heappush(heap, (gc_at(hi) + terms[mid], mid, hi))
        out = []
        for gc, i in first.items():
            kept = sorted(x - 1 for x in cache[i][1] if x not in (self.g.s, self.g.t))
            out.append((gc, terms[i], kept))
        out.sort(key=lambda r: (r[0] + r[1], r[0]))
        return out if limit is None else out[:limit]


def _mask(items: Iterable[int]) -> int:
    m = 0
    for x in items:
        m |= 1 << x
    return m


def _bits(mask: int) -> Iterable[int]:
    """Indices of the set bits of ``mask``, increasing."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
