"""Planners: pure functions ``(chain or graph, budget) -> plan``, selected by name.

One registry (:mod:`remat.planners.registry`, re-exported here): one table of planners, each
entry a name and its planner of each kind (chain, graph), one :func:`register`, one
:func:`available`, one :func:`get`, one :class:`Planner` protocol (``planner(structure,
budget)`` and optional ``sweep`` / ``least_peak`` / ``candidates``). A chain planner also plans
a path graph. :func:`plan_chain` and :func:`plan_graph` run one by name: they parse the budget,
call the planner, check the plan against the budget and stamp it with its simulated cost;
:func:`remat.plan` (the public entry point) calls one or the other. Planners never import torch.
The old graph names (:func:`register_graph_planner`, :func:`available_graph_planners`,
:func:`get_graph_planner`, :func:`sweep_graph`, :func:`least_graph_peak`) are aliases.

Registered chain planners (name -> module):

==================  ===========================  =============================================
``none``            ``baselines``                store everything
``every-stage``     ``baselines``                checkpoint each stage
``chen-sqrt``       ``chen``                     Chen et al. 2016, sqrt(n) equal segments
``chen-budget``     ``chen``                     Chen et al. 2016, Alg. 3 greedy + search over B
``chen-recursive``  ``chen``                     Chen et al. 2016, recursive O(log n) memory
``hong-dp``         ``hong``                     Hong et al., optimal subset, O(n^3) DP
``hong-linear``     ``hong``                     Hong et al., the linear-time algorithm
``reforward``       ``reforward``                Feng & Huang, optimal for linear graphs
``optimal-time``    ``optimal_time``             Beaumont et al. 2019 (rotor), min time
==================  ===========================  =============================================

Registered graph planners (name -> module):

==================  ===================  ==================================================
``none``            ``baselines``        store everything
``reforward``       ``reforward_graph``  Feng & Huang, division tree; minimal peak (their model)
``checkmate-milp``  ``checkmate_milp``   Jain et al. 2020 (Checkmate), exact MILP, minimal time
``checkmate-lp``    ``checkmate_milp``   Checkmate's LP relaxation + rounding (fast, approximate)
``articulation``    ``articulation``     cut points -> a Chain of blocks -> any chain planner
==================  ===================  ==================================================
"""

from __future__ import annotations

from remat.planners import registry
from remat.planners.registry import *  # noqa: F403 - registry's __all__
from remat.planners.registry import _REGISTRY

__all__ = [*registry.__all__, "_REGISTRY"]
