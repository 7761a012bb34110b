"""Baselines: store everything (``none``, a chain and a graph planner) and checkpoint every stage
(``every-stage``)."""

from __future__ import annotations

from remat.core.chain import Chain
from remat.core.graph import Graph
from remat.core.plan import Plan
from remat.planners.registry import register

__all__ = ["plan_none", "plan_none_graph", "plan_every_stage"]


@register("none")
def plan_none(chain: Chain, budget: int | None = None) -> Plan:
    """Keep every activation: the fastest plan and the largest peak."""
    return Plan.none(chain)


@register("every-stage")
def plan_every_stage(chain: Chain, budget: int | None = None) -> Plan:
    """Checkpoint every stage separately (``torch.utils.checkpoint`` around each block)."""
    return Plan.every_stage(chain)


@register("none", plans="graph")
def plan_none_graph(graph: Graph, budget: int | None = None) -> Plan:
    """Store every node: the fastest plan and the largest peak."""
    return Plan.none()
