"""Feng & Huang's optimal gradient checkpoints on a linear computation graph (``reforward``).

Paper: Feng & Huang, "Cutting Down Training Memory by Re-forwarding" (arXiv:1808.00079 v1-v4)
/ "Optimal Gradient Checkpoint Search for Arbitrary Computation Graphs" (CVPR 2021); the
linear-graph algorithm as the authors' code implements it (notes §4.3): for every candidate
value ``m`` of the max term, build the *accessibility graph* (the chain edges plus an edge
``v_i -> v_j`` for every segment whose cost is at most ``m``), take the shortest path from the
input to the output with the vertex costs on the incoming edges, and keep the best
``Σ path + m`` over all ``m``.

**Guarantee.** Over the flat plans ``Plan.from_checkpoints(chain, S, store_last=b)``, the plan
returned has the least peak that :func:`remat.simulate` predicts, and the least time among
those (the same answer as ``hong-dp`` / ``hong-linear``; ``tests/test_planners_minmem.py``
checks both against brute force). With a ``budget``: the fastest flat plan that fits, or
:class:`~remat.planners.BudgetTooSmallError` naming the least peak.

Example:
    >>> from remat import Chain, simulate
    >>> chain = Chain.random(12, seed=0)
    >>> plan = plan_reforward(chain, None)
    >>> simulate(chain, plan).peak_bytes == plan.params["peak_bytes"]
    True

How it maps to remat's cost model
---------------------------------
Feng's cost is ``Σ c(kept) + max_σ Σ c(inside σ)``: kept tensors plus the largest segment,
independent of where the segment sits. remat's simulator charges a segment ``(l, r]``
``P(l) + cost(l, r)`` (Note [flat plan peak] in :mod:`remat.planners.hong`): the kept
activations *to its left* are live while it runs, so the max term is prefix-dependent and
``Σ + m`` is only an approximation. The adaptation keeps the paper's two parts:

* **Accessibility graph for a bound** ``M`` on the peak: vertices are the activations
  ``a[0..n-1]``, an edge ``a[l] -> a[r]`` means "checkpoint ``a[l]`` and ``a[r]``, recompute
  the stages between". With the path's kept bytes ``T(l)`` as the label of ``a[l]``, the edge
  is usable iff ``T(l) + cost(l, r) <= M`` and costs ``o[r]``; the output is reached from
  ``a[l]`` iff the stored last segment fits, ``T(l) + cost_stored(l, n) <= M``. The edge set
  depends on the label, but monotonically: a smaller label opens more edges and leads to
  smaller labels, so the least label of every vertex is also the one that opens the most
  edges, and a label-setting shortest path (Dijkstra) is exact. The graph is a DAG whose
  edges go from lower to higher index, so its settling order can be the topological one:
  each vertex, once settled, relaxes its row of edges (one NumPy call for the whole row).
* **Candidate max terms**: the least peak is the least bound ``M`` whose graph connects input
  and output. Feng enumerates all O(n^2) candidate values; here they are pruned without
  losing exactness (Note [bound search] and Note [bound jump] in
  :mod:`remat.planners.hong`): only multiples of the gcd of the byte counts can be peaks,
  feasibility is monotone in ``M`` (so 16 bounds per round, sharing each NumPy call, cut the
  range 17-fold), a feasible bound is lowered to the peak its path actually reaches, and an
  infeasible bound is raised to the least edge check it failed (no bound in between changes
  any edge, hence any label). Edges whose segment holds more saved bytes than the bound are
  never built (``cost(l, r) >= o[0] + Q[r] - Q[l]``).

Complexity: O(n·w) per bound, ``w`` the longest usable segment (``n`` at worst), in n NumPy
steps; a few rounds of 16 bounds. Measured well under a second at n = 1000
(docs/planners.md).

Deviations: the exact objective above instead of ``Σ + m``; vertex costs are ``out_bytes``
(what a checkpoint keeps), not ``numel``; the last segment is stored, not recomputed (never
worse, see :mod:`remat.planners.hong`); only the linear-graph algorithm (the division tree for
arbitrary graphs, notes §4.4, needs a Graph planner).

Known limitations: flat plans only; memory O(n·w) int64 for the edge rows.
"""

from __future__ import annotations

import numpy as np

from remat.core.chain import Chain
from remat.core.plan import Plan
from remat.planners import register
from remat.planners.hong import (
    UNREACHED,
    FlatCosts,
    as_plan,
    band_jump,
    least_peak_plan,
    segment_starts,
)

__all__ = ["plan_reforward"]


@register("reforward")
def plan_reforward(chain: Chain, budget: int | None = None) -> Plan:
    """Least-peak flat plan: shortest paths in accessibility graphs over candidate bounds."""
    costs = FlatCosts.of(chain)
    found = least_peak_plan(costs, lambda cap: _AccessibilityGraph(costs, cap), budget, "reforward")
    return as_plan(chain, "reforward", found, budget)


class _AccessibilityGraph:
    """The candidate edges ``a[l] -> a[r]`` of every accessibility graph with bound ``<= cap``.

    ``rows[l][r - l - 1] = max(max F[l+1..r] + o[r]·[r<n], max E[l+1..r])`` for
    ``r = l+1..ends[l]``, the bound-independent part of the edge test
    ``T(l) + cost(l, r) = rows + T(l) - Q[l] <= M``. The edges kept are those of
    :func:`~remat.planners.hong.segment_starts`: ``(l, r)`` with ``l >= lo(r)``.
    """

    def __init__(self, costs: FlatCosts, cap: int) -> None:
        self.costs = costs
        n = costs.n
        grad = costs.out_bytes[1:].copy()
        grad[-1] = 0  # the last segment is stored: no δ[n] while it runs
        starts, self.floor = segment_starts(costs, cap)
        self.ends = []
        r = 0
        for lo in range(n):  # ends[l] = the last r with starts[r - 1] <= l
            while r < n and starts[r] <= lo:
                r += 1
            self.ends.append(r)
        fwd, bwd = costs.recompute_term, costs.backward_term
        self.rows = [
            np.maximum(
                np.maximum.accumulate(fwd[lo:end]) + grad[lo:end],
                np.maximum.accumulate(bwd[lo:end]),
            )
            for lo, end in enumerate(self.ends)
        ]
        self.flat = np.concatenate(self.rows)
        self.flat_start = np.repeat(np.arange(n), [end - lo for lo, end in enumerate(self.ends)])

    def jump(self, slack: np.ndarray, bound: int) -> int:
        return band_jump(self.flat, self.flat_start, self.floor, slack, bound)

    def run(self, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Shortest paths (least kept bytes) from ``a[0]`` in the graph of every bound at once.

        Vertices are settled in index order; a settled ``a[l]`` relaxes its edges that pass the
        test under its final label. A label only improves strictly, so among equal paths the
        one through the smallest predecessor is kept (the same ties as ``hong-dp``).
        """
        costs = self.costs
        n = costs.n
        out, q = costs.out_bytes, costs.saved_prefix
        count = len(bounds)
        column = bounds[:, None]
        table = np.full((count, n), UNREACHED, dtype=np.int64)
        table[:, 0] = out[0]
        parent = np.zeros((count, n), dtype=np.int64)
        slack = np.full((count, n), UNREACHED, dtype=np.int64)
        tail = np.zeros((count, n), dtype=bool)
        for lo in range(n):
            slack[:, lo] = table[:, lo] - q[lo]
            end = self.ends[lo]
            usable = self.rows[lo] + slack[:, lo : lo + 1] <= column
            if end == n:
                tail[:, lo] = usable[:, -1]
                usable = usable[:, :-1]
                end = n - 1
            if end <= lo:
                continue
            label = table[:, lo : lo + 1] + out[lo + 1 : end + 1]
            better = usable & (label < table[:, lo + 1 : end + 1])
            table[:, lo + 1 : end + 1] = np.where(better, label, table[:, lo + 1 : end + 1])
            parent[:, lo + 1 : end + 1] = np.where(better, lo, parent[:, lo + 1 : end + 1])
        return parent, tail, slack
