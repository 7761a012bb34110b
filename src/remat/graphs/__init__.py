"""Arbitrary computation graphs: the pure (no torch) cost model, plans, simulator and planners.

* :class:`Graph` / :class:`Node` (``graph.py``): a DAG of costed nodes in topological order,
  the same per-node convention as :class:`remat.Chain`; JSON with a schema version.
* :class:`Plan` / :class:`Segment` (``core/plan.py``): stored nodes, recomputation
  segments (nestable), and the kept tensors they imply: the one plan type of chains and graphs
  (``GraphPlan``, ``GraphSegment`` and ``GraphPlanError`` are its old names here).
* :func:`simulate_graph` (``simulate.py``): the single source of truth for a plan's peak and
  time (:func:`simulate_step_peak`: the whole step's, parameter gradients included);
  :func:`lower_plan` gives the explicit schedule an executor must reproduce and
  :func:`run_schedule` checks any schedule (:class:`InfeasibleScheduleError`).
* :func:`plan_graph` (``planners.py``) with the planners ``none``, ``reforward`` (Feng & Huang),
  ``checkmate-milp`` / ``checkmate-lp`` (Checkmate) and ``articulation`` (any chain planner
  over the blocks between cut points).

``docs/graphs.md`` has the semantics, the algorithms, their guarantees and limitations.

Example:
    >>> from remat.graphs import plan_graph, simulate_graph
    >>> from remat.core.synthetic import residual_chain
    >>> g = residual_chain(3)
    >>> p = plan_graph(g, "reforward")
    >>> simulate_graph(g, p).peak_bytes == p.predicted_peak_bytes
    True
"""

from __future__ import annotations

from remat.core.graph import GRAPH_SCHEMA_VERSION, Graph, Node
from remat.core.plan import PLAN_SCHEMA_VERSION, Plan, PlanError, Segment
from remat.core.simulate import (
    GraphEvent,
    GraphSimulation,
    InfeasibleScheduleError,
    ScheduleOp,
    graph_step_peak,
    lower_plan,
    run_schedule,
    simulate_graph,
    simulate_step_peak,
)
from remat.planners import graph as _planners
from remat.planners.graph import *  # noqa: F403 - the graph planners' names

GraphPlan = Plan
GraphSegment = Segment
GraphPlanError = PlanError
GRAPH_PLAN_SCHEMA_VERSION = PLAN_SCHEMA_VERSION

__all__ = [
    "Graph",
    "Node",
    "Plan",
    "Segment",
    "PlanError",
    "GraphPlan",
    "GraphSegment",
    "GraphPlanError",
    "GraphSimulation",
    "GraphEvent",
    "ScheduleOp",
    "InfeasibleScheduleError",
    "simulate_graph",
    "simulate_step_peak",
    "graph_step_peak",
    "lower_plan",
    "run_schedule",
    "GRAPH_SCHEMA_VERSION",
    "GRAPH_PLAN_SCHEMA_VERSION",
    *_planners.__all__,
]
