"""Plan a graph with any chain planner: cut it at articulation points into a chain of blocks.
Registered as ``articulation``.

A node ``v`` is a **cut point** when no edge jumps over it in the node order (no ``u < v < w``
with ``w`` reading ``u``, nor an output held by the program until ``w``: ``Node.held_until``):
every later node depends on earlier ones only through ``v``'s output
(Checkmate's ``solve_chen_*`` uses the articulation points of the graph the same way; Chen et
al.'s Alg. 3 takes them as its candidates). The cut points split the nodes into blocks, and the
blocks form a :class:`~remat.core.chain.Chain` (:func:`block_chain`):

* ``out_bytes``: the block's last node's output (the cut tensor);
* ``saved_bytes``: the sum over the block; ``fwd_time`` / ``bwd_time``: the sums;
* ``fwd_overhead_bytes``: the largest excess over ``saved_bytes`` (with grad) or over
  ``out_bytes`` (without grad) of the memory the block's nodes hold while it runs forward;
* ``bwd_overhead_bytes``: the largest excess, during the block's backward, of its internal
  gradients and overheads over what it has already freed (negative when the nodes' backwards
  free before their peaks, as measured chains do: the block chain of a chain's path graph is
  that chain).

These aggregates make the chain an **upper bound**: the graph plan that a chain plan maps to
(each chain segment becomes the union of its blocks' nodes, nesting kept) never peaks above
the chain plan's simulated peak, and takes exactly its time (``tests/test_graph_planners.py``
checks both on random block graphs and plans). So any chain planner's budget guarantee carries
over. Because the bound is loose inside blocks, :func:`plan_articulation` then relaxes the
chain budget while the graph plan still fits (a few more chain planner calls) to buy time back.

Known limitations:
    * Needs a single sink (the last node) and at least ``min_blocks`` blocks; a graph with long
      skip connections (a U-Net, a DenseNet block) has few cut points: use ``reforward`` or
      ``checkmate-milp``.
    * Segments only start and end at cut points, so the plan is coarser than the MILP's.
    * Cut points are found in the given node order; another topological order may have more.

Example:
    >>> from remat.core.synthetic import residual_chain
    >>> chain, blocks = block_chain(residual_chain(3))
    >>> chain.n, [len(b) for b in blocks]
    (7, [1, 6, 1, 6, 1, 6, 1])
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from remat.core.chain import Chain
from remat.core.errors import RematError
from remat.core.graph import Graph
from remat.core.plan import Plan
from remat.core.simulate import simulate_graph
from remat.planners.registry import BudgetTooSmallError, available, plan_chain, register

__all__ = [
    "plan_articulation",
    "ArticulationConfig",
    "ArticulationError",
    "cut_points",
    "block_chain",
    "chain_plan_to_graph",
]


class ArticulationError(RematError, ValueError):
    """The graph cannot be cut into enough blocks (or has several outputs)."""


@dataclass(frozen=True)
class ArticulationConfig:
    """Settings of the ``articulation`` planner."""

    chain_method: str | None = None
    """The chain planner; default ``optimal-time``, else ``chen-sqrt`` when it is missing."""
    min_blocks: int = 2
    """Fewest blocks accepted (fewer raise :class:`ArticulationError`)."""
    relax_steps: int = 4
    """How many times the chain budget is relaxed towards the graph's slack (0: never)."""

    def __post_init__(self) -> None:
        if self.min_blocks < 2:
            raise ValueError("min_blocks must be >= 2")
        if self.relax_steps < 0:
            raise ValueError("relax_steps must be >= 0")


def cut_points(graph: Graph) -> list[int]:
    """Nodes (except the last) that no edge jumps over, in increasing order."""
    cuts = []
    reach = -1  # the farthest node read by any node before v
    for v, node in enumerate(graph.nodes):
        if v < graph.n - 1 and reach <= v:
            cuts.append(v)
        consumers = graph.consumers(v)
        if consumers:
            reach = max(reach, consumers[-1])
        if node.held_until is not None:
            reach = max(reach, node.held_until)
    return cuts


def block_chain(graph: Graph, min_blocks: int = 2) -> tuple[Chain, list[list[int]]]:
    """The chain of blocks between cut points, and each block's nodes (module docstring)."""
    sinks = graph.sinks
    if sinks != (graph.n - 1,):
        raise ArticulationError(
            f"the articulation planner needs one output, the last node; this graph has sinks "
            f"{list(sinks)[:5]}: use 'reforward' or 'checkmate-milp'"
        )
    cuts = cut_points(graph)
    ends = [*cuts, graph.n - 1]
    if len(ends) < min_blocks:
        raise ArticulationError(
            f"found {len(cuts)} cut point(s), i.e. {len(ends)} block(s), fewer than "
            f"min_blocks={min_blocks}: long skip connections leave no place to cut the graph "
            "into a chain; use 'reforward' or 'checkmate-milp'"
        )
    blocks = [list(range(lo + 1, hi + 1)) for lo, hi in zip([-1, *ends], ends, strict=False)]
    nodes = graph.nodes
    fwd_oh, bwd_oh = [], []
    for block in blocks:
        last = block[-1]
        saved = sum(nodes[j].saved_bytes for j in block)
        inside = set(block)
        # forward with grad: everything saved so far plus the node's overhead
        prefix, worst_all = 0, 0
        for j in block:
            prefix += nodes[j].saved_bytes
            worst_all = max(worst_all, prefix + nodes[j].fwd_overhead_bytes)
        # forward without grad: outputs still needed (or held by the program) inside the block
        last_read = {
            j: max(
                (w for w in (*graph.consumers(j), nodes[j].held_until) if w in inside), default=j
            )
            for j in block
        }
        held_at: dict[int, list[int]] = {}
        for j in block:
            if last_read[j] == nodes[j].held_until:
                held_at.setdefault(last_read[j], []).append(j)
        live, worst_none = 0, 0
        alive: dict[int, int] = {}
        for j in block:
            alive[j] = nodes[j].out_bytes
            live += nodes[j].out_bytes
            worst_none = max(worst_none, live + nodes[j].none_overhead_bytes)
            for u in [*nodes[j].inputs, j, *held_at.get(j, ())]:
                if u in alive and u != last and last_read[u] <= j:
                    live -= alive.pop(u)
        fwd_oh.append(max(0, worst_all - saved, worst_none - nodes[last].out_bytes))
        # backward: internal gradients alive minus what the block has freed already
        grads: set[int] = set()
        freed, internal, worst = 0, 0, None
        for j in reversed(block):
            for u in nodes[j].inputs:
                if u in inside and u not in grads:
                    grads.add(u)
                    internal += nodes[u].out_bytes
            here = internal - freed + nodes[j].bwd_overhead_bytes
            worst = here if worst is None else max(worst, here)
            if j != last and j in grads:
                internal -= nodes[j].out_bytes
            freed += nodes[j].saved_bytes
        assert worst is not None
        # negative when the backwards free before their peaks (measured overheads), never
        # below what the block's backward holds: its saved bytes and its output gradient
        bwd_oh.append(max(worst, -(saved + nodes[last].out_bytes)))
    chain = Chain(
        fwd_time=tuple(float(sum(nodes[j].fwd_time for j in b)) for b in blocks),
        bwd_time=tuple(float(sum(nodes[j].bwd_time for j in b)) for b in blocks),
        out_bytes=tuple(nodes[b[-1]].out_bytes for b in blocks),
        saved_bytes=tuple(sum(nodes[j].saved_bytes for j in b) for b in blocks),
        input_bytes=graph.saved_constants_as_input().input_bytes,
        fwd_overhead_bytes=tuple(fwd_oh),
        bwd_overhead_bytes=tuple(bwd_oh),
        names=tuple(f"{nodes[b[0]].name}..{nodes[b[-1]].name}" for b in blocks),
        time_unit=graph.time_unit,
    )
    return chain, blocks


def chain_plan_to_graph(plan: Plan, blocks: list[list[int]]) -> Plan:
    """The graph plan of a chain plan over blocks (stage ``k`` = ``blocks[k - 1]``)."""
    return Plan.from_chain_segments(
        plan.chain_segments(len(blocks)), blocks=blocks, method=plan.method, params=plan.params
    )


@register("articulation", plans="graph")
def plan_articulation(graph: Graph, budget: int | None = None, **options: Any) -> Plan:
    """Cut points -> chain of blocks -> a chain planner -> graph plan (module docstring)."""
    config = ArticulationConfig(**options)
    chain, blocks = block_chain(graph, config.min_blocks)
    method = config.chain_method
    if method is None:
        names = available()
        method = next((m for m in ("optimal-time", "chen-sqrt") if m in names), None)
        if method is None:
            raise ValueError(
                "neither 'optimal-time' nor 'chen-sqrt' is registered; pass chain_method=<one of "
                f"{', '.join(names)}>"
            )

    def attempt(chain_budget: int | None) -> tuple[Plan, int, float, str] | None:
        try:
            cplan = plan_chain(chain, method, chain_budget)
        except BudgetTooSmallError:
            return None
        gplan = chain_plan_to_graph(cplan, blocks)
        sim = simulate_graph(graph, gplan)
        return gplan, sim.peak_bytes, sim.total_time, cplan.describe()

    best = attempt(budget)
    if budget is not None:
        if best is None or best[1] > budget:
            # the chain over-estimates the graph: its least peak may still fit the graph
            try:
                plan_chain(chain, method, budget)
            except BudgetTooSmallError as err:
                found = attempt(err.minimum_bytes)
                if found is None or found[1] > budget:
                    minimum = found[1] if found is not None else err.minimum_bytes
                    raise BudgetTooSmallError(
                        budget, minimum, "articulation", f"chain planner {method!r} over blocks"
                    ) from None
                best = found
        assert best is not None
        chain_budget = budget
        for _ in range(config.relax_steps):
            slack = budget - best[1]
            if slack <= 0:
                break
            chain_budget += slack
            found = attempt(chain_budget)
            if found is None or found[1] > budget:
                break
            if found[2] < best[2]:
                best = found
    assert best is not None
    plan = best[0]
    params = {
        "chain_method": method,
        "chain_plan": best[3],
        "blocks": len(blocks),
        "cut_points": [b[-1] for b in blocks[:-1]],
    }
    return replace(plan, method="articulation", params=params)
