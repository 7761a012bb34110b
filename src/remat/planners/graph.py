"""The graph planners' old names: aliases over the one registry (:mod:`remat.planners.registry`).

``plan_graph``, ``sweep_graph`` (:func:`~remat.planners.registry.sweep`), ``least_graph_peak``
(:func:`~remat.planners.registry.least_peak`), ``register_graph_planner`` (``register(...,
plans="graph")``), ``get_graph_planner`` (``get(name, "graph")``), ``available_graph_planners``
(``available("graph")``) and ``GraphPlanner`` (:class:`~remat.planners.registry.Planner`).
"""

from __future__ import annotations

from remat.planners.registry import (
    GraphPlanner,
    available_graph_planners,
    get_graph_planner,
    least_graph_peak,
    plan_graph,
    register_graph_planner,
    sweep_graph,
)

__all__ = [
    "plan_graph",
    "register_graph_planner",
    "get_graph_planner",
    "available_graph_planners",
    "sweep_graph",
    "least_graph_peak",
    "GraphPlanner",
]
