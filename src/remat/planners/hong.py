"""Hong et al.: the checkpoint subset of least peak memory (``hong-dp``, ``hong-linear``).

Paper: Hong, Tsai, Wang, Liu, Wu, "GPU Memory Usage Optimization for Backward Propagation in
Deep Network Training", arXiv:2502.12499 / JPDC 2025 (notes §3). The paper finds "the optimal
checkpoint subset to achieve the least peak memory usage" with an O(n^3) dynamic program, then
revises the objective after tracing real runs and gives an "O(n)-time algorithm".

**Guarantee (both planners).** Over the flat plans
``Plan.from_checkpoints(chain, S, store_last=b)``, ``S`` ⊆ {1..n-1}, ``b`` ∈ {False, True},
the returned plan has the least peak that :func:`remat.simulate` predicts; among plans of that
peak it has the least simulated time. With a ``budget`` they return the fastest flat plan whose
peak fits the budget, or raise :class:`~remat.planners.BudgetTooSmallError` naming the least
peak. Both are checked against brute force over all ``2^n`` plans (``tests/bruteforce.py``).

Example:
    >>> from remat import Chain, simulate
    >>> chain = Chain.homogeneous(16, out_bytes=10)
    >>> plan = plan_hong_linear(chain, None)
    >>> plan.describe()
    '(1-4) (5-9) (10-13) [14-16]'
    >>> simulate(chain, plan).peak_bytes == plan_hong_dp(chain, None).params["peak_bytes"] == 90
    True

The exact peak of a flat plan
-----------------------------
Note [flat plan peak]. Write ``o[k]`` for ``out_bytes`` of stage ``k`` (``o[0]`` = input),
``s, f, b`` for ``saved_bytes``, ``fwd_overhead_bytes``, ``bwd_overhead_bytes``, and
``Q[i] = s[1] + ... + s[i]``. A flat plan keeps ``S = {k_1 < ... < k_m}``; its segments are
``(l, r]`` between consecutive elements of ``{0} ∪ S ∪ {n}``. Following simulate's rules:

* while segment ``(l, r]`` is back-propagated, the live kept activations are the inputs of the
  segments ``1..j``: ``P(l) = o[0] + Σ_{k ∈ S, k ≤ l} o[k]`` (the kept activations to the
  right were freed by their own segments' backward);
* recomputing stage ``i`` of the segment (``F_all``, the gradient ``δ[r]`` is live):
  ``P(l) + o[r] + Q[i] - Q[l] + f[i]``;
* back-propagating stage ``i`` (``δ[i]`` live, ``δ[i-1]`` allocated, none for ``i = 1``):
  ``P(l) + Q[i] - Q[l] + o[i] + o[i-1]·[i>1] + b[i]``;
* a stored last segment (``store_last``) is not recomputed: its forward terms lack ``o[r]``;
* the first forward pass never sets the peak: a stage run without grad holds at most
  ``o[i-1] + o[i] ≤ Q[i] - Q[l]`` besides ``P(l)``, below the recomputation terms (``s ≥ o``);
* the loss (``δ[n]`` allocated): ``P(l) + 2·o[n]`` after a recomputed last segment (below its
  recomputation term), ``P(l) + Q[n] - Q[l] + o[n]`` after a stored one. The latter is folded
  into ``E[n]``: it can exceed stage ``n``'s backward term, whose overhead ``b[n]`` may be
  negative (measured backwards free saved tensors before their peak).

So with ``F[i] = Q[i] + f[i]`` and ``E[i] = Q[i] + o[i] + o[i-1]·[i>1] + b[i]`` (and
``E[n]`` at least ``Q[n] + o[n]``, the loss)::

    cost(l, r) = max(max F[l+1..r] + o[r]·[recomputed], max E[l+1..r]) - Q[l]
    peak(S, b) = max over segments (l, r] of P(l) + cost(l, r)

(:func:`flat_plan_peak`; ``tests/test_planners_minmem.py`` checks it against simulate on
random chains with overheads.) Storing the last segment never raises a term and saves its
recomputation, so every optimum has ``store_last=True``; its time is
``forward + backward + Σ fwd_time[1..k_m]``: the fastest plan of a given peak is the one whose
last checkpoint ``k_m`` is smallest.

The peak is *prefix-dependent*: the segment ``(l, r]`` costs ``P(l) + cost(l, r)``, not
``Σ kept + max segment`` as in the paper (notes §3.2, §5). Both algorithms keep the paper's
structure and optimise this exact objective.

* ``hong-dp`` — Hong's first algorithm (H1 in notes §3.3): a search over a bound ``M`` on the
  peak; for each bound, the DP ``T(r) = o[r] + min {T(l) : l < r, T(l) + cost(l, r) <= M}``
  (``T(0) = o[0]``) gives the least kept prefix with a checkpoint at ``r``, and ``M`` is
  feasible iff some ``l`` has ``T(l) + cost_stored(l, n) <= M``. Keeping only the least prefix
  is exact because a smaller ``P(l)`` relaxes every later constraint. The paper enumerates
  O(n^2) candidate bounds because its objective ``F(S) + S`` is not monotone in ``S``; here the
  objective *is* the bound and feasibility is monotone in it, so the search of
  :func:`least_peak_plan` (Note [bound search]) is exact with a few rounds of 16 bounds.
  Cost: O(n·w) per bound (``w``: the longest segment that fits, n at worst) in n NumPy steps
  shared by the 16 bounds of a round; memory O(n·w) for the precomputed segment costs.
* ``hong-linear`` — Hong's revised objective (H2, "algo3" in notes §3.3): the min–max
  recurrence ``T(i) = d_i + min_j max(U(i, j), T(j))`` read right to left. With the exact cost
  it is ``V(l) = min_{r>l} max(cost(l, r), o[r] + V(r))`` (``r = n``: the stored last
  segment), least peak ``o[0] + V(0)``. It is exact because the prefix ``P(l)`` adds the same
  amount to every term of the suffix, so the best suffix does not depend on the prefix. No
  bound search: O(n^2) arithmetic in n NumPy steps, then one bound DP at the optimum (or at the
  budget) for the fastest plan.

The two share only the cost model and the final bound DP; the least peak itself comes from two
unrelated computations, and ``tests/test_planners_minmem.py`` checks that they agree.

Deviations from the paper
-------------------------
* The cost is remat's simulator, not sums of ``d_i``: saved bytes, the gradients ``δ`` and the
  overheads are counted, and the prefix to the left of a segment is live while it runs.
* **Not linear time.** The paper's O(n) (and H1's O(n) per bound, a sliding window with a
  monotone deque) rests on the feasible starts ``l`` of a segment ending at ``r`` forming a
  window that moves right as ``r`` grows. Under the exact cost they do not:
  ``T(l) + cost(l, r)`` is not monotone in ``l``, and the ``δ[r]`` live during a recomputation
  makes a start bounce between infeasible and feasible as ``r`` grows. Example: ``o[0..3] =
  1, 9, 1, 1``, ``s = o``, ``fwd_overhead_bytes = 20, 0, 0``: ``cost(0, 1) = 38 > cost(0, 2) =
  30``, so under a bound of 31 the first segment may end at ``a[2]`` but not at ``a[1]``; a
  window that drops ``l = 0`` at ``r = 1`` loses the optimum. Both planners are therefore
  O(n^2) (the authors' own code for H2 is O(n^2) as written), well under a second at n = 1000
  (docs/planners.md).
* The paper's plans always checkpoint the last layer; here the last segment is stored, which is
  never worse (argued above) and faster.
* With a budget the planners return the fastest flat plan that fits, not the least-peak one;
  without one, the least-peak plan of least time.

Known limitations: flat plans only (nested plans: ``chen-recursive``, ``optimal-time``); the
segment-cost band of ``hong-dp`` holds one int64 per segment that fits the largest bound tried
(at most n^2/2, 4 MB at n = 1000).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from math import gcd
from typing import Protocol

import numpy as np

from remat.core.chain import Chain
from remat.core.plan import Plan
from remat.planners import BudgetTooSmallError, register

__all__ = [
    "plan_hong_dp",
    "plan_hong_linear",
    "FlatCosts",
    "flat_plan_peak",
    "FlatSearch",
    "BoundChecker",
    "least_peak_plan",
    "fastest_flat_plan",
    "as_plan",
    "segment_starts",
    "band_jump",
    "UNREACHED",
]

UNREACHED = np.int64(2**62)
"""The kept prefix of a checkpoint no plan reaches: far above any peak, far from overflow."""
_PROBES = 16
"""Bounds checked together per round of the search: one NumPy call costs about the same for 1
or 16 of them, and 17-way splits need ~4x fewer rounds than bisection."""


# ---------------------------------------------------------------------------- planners
@register("hong-dp")
def plan_hong_dp(chain: Chain, budget: int | None = None) -> Plan:
    """Least-peak flat plan: a search over peak bounds, each checked by Hong's bound DP."""
    costs = FlatCosts.of(chain)
    found = least_peak_plan(costs, lambda cap: _ColumnBand(costs, cap), budget, "hong-dp")
    return as_plan(chain, "hong-dp", found, budget)


@register("hong-linear")
def plan_hong_linear(chain: Chain, budget: int | None = None) -> Plan:
    """Least-peak flat plan by the right-to-left min-max recurrence (no bound search)."""
    costs = FlatCosts.of(chain)
    least = _least_peak_by_recurrence(costs)
    if budget is not None and budget < least:
        raise BudgetTooSmallError(budget, least, "hong-linear")
    found = fastest_flat_plan(costs, least if budget is None else budget)
    assert found is not None and found.peak_bytes <= (least if budget is None else budget)
    return as_plan(chain, "hong-linear", found, budget)


# ---------------------------------------------------------------------------- cost model
@dataclass(frozen=True, eq=False)
class FlatCosts:
    """The per-stage terms of Note [flat plan peak], as int64 arrays indexed by stage."""

    n: int
    """Number of stages."""
    out_bytes: np.ndarray
    """``o[0..n]``: ``o[0]`` is the input, ``o[i]`` the output of stage ``i`` (bytes)."""
    saved_prefix: np.ndarray
    """``Q[0..n]``: bytes saved by stages ``1..i`` when stored (``Q[0] = 0``)."""
    recompute_term: np.ndarray
    """``F[1..n]`` at index ``i - 1``: ``Q[i] + fwd_overhead_bytes[i]`` (bytes)."""
    backward_term: np.ndarray
    """``E[1..n]`` at index ``i - 1``: ``Q[i] + o[i] + o[i-1]·[i>1] + bwd_overhead_bytes[i]``."""
    granularity: int
    """gcd of every byte count: every peak is a multiple of it (1 when all are 0)."""

    @classmethod
    def of(cls, chain: Chain) -> FlatCosts:
        n = chain.n
        out = np.array([chain.input_bytes, *chain.out_bytes], dtype=np.int64)
        saved = np.array(chain.saved_bytes, dtype=np.int64)
        prefix = np.concatenate(([0], np.cumsum(saved))).astype(np.int64)
        fwd = prefix[1:] + np.array(chain.fwd_overhead_bytes, dtype=np.int64)
        grad_in = out[:-1].copy()
        grad_in[0] = 0  # the input gets no gradient
        bwd = prefix[1:] + out[1:] + grad_in + np.array(chain.bwd_overhead_bytes, dtype=np.int64)
        # the loss event (δ[n] allocated while a stored last stage holds its saved bytes) can
        # exceed stage n's backward term when the backward overhead is negative
        bwd[-1] = max(bwd[-1], prefix[-1] + out[-1])
        g = 0
        for v in (
            chain.input_bytes,
            *chain.out_bytes,
            *chain.saved_bytes,
            *chain.fwd_overhead_bytes,
            *chain.bwd_overhead_bytes,
        ):
            g = gcd(g, v)
        return cls(n, out, prefix, fwd, bwd, max(g, 1))

    def segment_cost(self, lo: int, hi: int, recomputed: bool) -> int:
        """``cost(lo, hi)``: the segment's own peak above the kept prefix ``P(lo)``."""
        fwd = int(self.recompute_term[lo:hi].max()) + (int(self.out_bytes[hi]) if recomputed else 0)
        return max(fwd, int(self.backward_term[lo:hi].max())) - int(self.saved_prefix[lo])

    def lower_bound(self) -> int:
        """No flat plan peaks below this: the input plus the worst single stage on its own."""
        q = self.saved_prefix
        own = np.maximum(self.recompute_term, self.backward_term) - q[:-1]
        return int(self.out_bytes[0] + own.max())


def flat_plan_peak(chain: Chain | FlatCosts, kept: list[int], store_last: bool) -> int:
    """The peak :func:`remat.simulate` predicts for ``Plan.from_checkpoints(chain, kept,
    store_last)``, in O(n) from the closed form of Note [flat plan peak]."""
    costs = chain if isinstance(chain, FlatCosts) else FlatCosts.of(chain)
    bounds = [0, *sorted(set(kept)), costs.n]
    prefix = int(costs.out_bytes[0])
    peak = 0
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        if lo > 0:
            prefix += int(costs.out_bytes[lo])
        recomputed = not (store_last and hi == costs.n)
        peak = max(peak, prefix + costs.segment_cost(lo, hi, recomputed))
    return peak


@dataclass(frozen=True)
class FlatSearch:
    """A flat plan found under a bound: what it keeps and its exact peak."""

    kept: tuple[int, ...]
    """Kept activations ``a[k]`` (``store_last`` is always True)."""
    peak_bytes: int
    """Its simulated peak (closed form, Note [flat plan peak])."""


class BoundChecker(Protocol):
    """The bound DP over one band of candidate segments (columns for hong-dp, rows for
    reforward): least kept prefix ``T`` under several bounds at once."""

    def run(self, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(parent, tail, slack)`` per bound: ``parent[k, r]`` the predecessor of checkpoint
        ``r`` on a least-prefix path (ties to the smallest index; meaningless where no plan
        reaches ``r``), ``tail[k, l]`` whether the stored last segment ``(l, n]`` fits after
        ``T(l)``, and ``slack[k] = T - Q`` (``>= UNREACHED - Q`` where unreachable)."""
        ...

    def jump(self, slack: np.ndarray, bound: int) -> int:
        """After an infeasible ``bound``: a value ``> bound`` below which the DP is unchanged."""
        ...


def fastest_flat_plan(costs: FlatCosts, bound: int) -> FlatSearch | None:
    """The fastest flat plan whose peak is at most ``bound``, or None if there is none.

    Runs the bound DP of ``hong-dp`` once (O(n^2) arithmetic in n NumPy steps): least kept
    prefix ``T(r)`` for every checkpoint ``r``, then the smallest last checkpoint whose stored
    tail fits (the least recomputation). Ties between predecessors go to the smallest index, so
    the result is a deterministic function of the costs and the bound.
    """
    return _fastest(costs, _ColumnBand(costs, bound), bound)


def least_peak_plan(
    costs: FlatCosts, make: Callable[[int], BoundChecker], budget: int | None, method: str
) -> FlatSearch:
    """The search shared by ``hong-dp`` and ``reforward`` (``make(cap)`` builds their DP).

    With a budget: the fastest flat plan that fits, else :class:`BudgetTooSmallError` naming
    the least peak. Without: the least peak, and the fastest plan of that peak.

    Note [bound search]. Feasibility is monotone in the bound, and every peak is a multiple of
    ``g = costs.granularity``. Start from ``lo`` = :meth:`FlatCosts.lower_bound` and ``hi`` =
    the best of a few equal-segment plans. Each round checks ``_PROBES`` bounds in ``[lo, hi)``
    in one vectorised DP (spread geometrically while ``hi > 2 lo``, evenly after); the least
    feasible bound's plan sets ``hi`` to its actual peak, the greatest infeasible bound's
    jump sets ``lo`` (Note [bound jump]). Typically 2-5 rounds at n = 1000.
    """
    if budget is not None:
        found = _fastest(costs, make(budget), budget)
        if found is not None:
            return found
    g = costs.granularity
    lo = -(-costs.lower_bound() // g)
    hi = _equal_segments_peak(costs) // g
    checker = make(hi * g)  # its band serves every bound <= hi
    found = None
    while lo < hi:
        if hi > 2 * lo:
            grid = np.geomspace(max(lo, 1), hi, _PROBES + 2)[1:-1]
        else:
            grid = np.linspace(lo, hi, _PROBES + 2)[1:-1]
        mids = np.unique(np.clip(np.floor(grid).astype(np.int64), lo, hi - 1))
        parent, tail, slack = checker.run(mids * g)
        feasible = tail.any(axis=1)
        k = int(np.argmax(feasible)) if feasible.any() else len(mids)
        if k < len(mids):
            found = _trace(costs, parent[k], tail[k])
            hi = found.peak_bytes // g
        if k > 0:
            jump = checker.jump(slack[k - 1], int(mids[k - 1]) * g)
            lo = max(lo, int(mids[k - 1]) + 1, -(-jump // g))
    if found is None or found.peak_bytes != hi * g:
        found = _fastest(costs, checker, hi * g)
    assert found is not None and found.peak_bytes == hi * g
    if budget is not None:  # the budget was infeasible
        raise BudgetTooSmallError(budget, found.peak_bytes, method)
    return found


# ---------------------------------------------------------------------------- implementation
def as_plan(chain: Chain, method: str, found: FlatSearch, budget: int | None) -> Plan:
    """``found`` as a :class:`Plan` made by ``method`` (kept activations, peak in its params)."""
    plan = Plan.from_checkpoints(chain, list(found.kept), store_last=True)
    params = {"kept": list(found.kept), "store_last": True, "peak_bytes": found.peak_bytes}
    if budget is not None:
        params["budget_bytes"] = budget
    return replace(plan, method=method, params=params)


def _fastest(costs: FlatCosts, checker: BoundChecker, bound: int) -> FlatSearch | None:
    parent, tail, _ = checker.run(np.array([bound], dtype=np.int64))
    return _trace(costs, parent[0], tail[0]) if tail[0].any() else None


def _trace(costs: FlatCosts, parent: np.ndarray, tail: np.ndarray) -> FlatSearch:
    """The plan whose last checkpoint is the smallest feasible one, traced through ``parent``.

    Its time is the least among the plans under the bound: every segment but the stored tail
    is recomputed once, so the time depends on the last checkpoint alone.
    """
    k = int(np.argmax(tail))
    kept = []
    while k > 0:
        kept.append(k)
        k = int(parent[k])
    kept.reverse()
    return FlatSearch(tuple(kept), flat_plan_peak(costs, kept, store_last=True))


def segment_starts(costs: FlatCosts, cap: int) -> tuple[list[int], int]:
    """For each end ``r`` (list index ``r - 1``), the least segment start worth checking under
    any bound up to ``cap``, and the least check value among the starts left out (``> cap``).

    A segment ``(l, r]`` costs at least ``o[0] + Q[r] - Q[l]`` (the input and the saved bytes
    of the segment are live while its last stage is back-propagated), so the starts with
    ``o[0] + Q[r] - Q[l] > cap`` never fit; ``Q`` is non-decreasing, so they are a prefix
    ``l < lo(r)`` and ``lo`` is non-decreasing in ``r``. ``l = r - 1`` is always kept.
    """
    base = int(costs.out_bytes[0])
    q = costs.saved_prefix.tolist()
    starts = []
    floor = int(UNREACHED)
    lo = 0
    for r in range(1, costs.n + 1):
        while lo < r - 1 and base + q[r] - q[lo] > cap:
            lo += 1
        if lo > 0:
            floor = min(floor, base + q[r] - q[lo - 1])
        starts.append(lo)
    return starts, floor


def band_jump(
    values: np.ndarray, starts: np.ndarray, floor: int, slack: np.ndarray, bound: int
) -> int:
    """Note [bound jump]: the least check value above ``bound`` after a DP at ``bound``.

    ``values[p] + slack[starts[p]]`` is the check ``T(l) + cost(l, r)`` of the band's pair
    ``p``; ``floor`` bounds the checks left out of the band from below. Below the returned
    value every check of the DP has the outcome it had at ``bound`` (the DP's ``T`` are then
    the same, hence the checks too), so the verdict is the same: if ``bound`` is infeasible,
    the least peak is at least this value.
    """
    need = values + slack[starts]
    return min(int(np.where(need > bound, need, UNREACHED).min()), floor)


class _ColumnBand:
    """hong-dp's DP: for each checkpoint ``r``, pull the least prefix from the starts ``l``.

    ``cols[r - 1][l - lo(r)] = max(max F[l+1..r] + o[r]·[r<n], max E[l+1..r])``, the
    bound-independent part of the check ``T(l) + cost(l, r) = cols + T(l) - Q[l] <= bound``,
    for the starts of :func:`segment_starts` (``l >= lo(r)``). Built once per search in n NumPy
    steps (the running maxima are updated in place); memory: one int64 per (l, r) pair.
    """

    def __init__(self, costs: FlatCosts, cap: int) -> None:
        self.costs = costs
        n = costs.n
        out, fwd, bwd = costs.out_bytes, costs.recompute_term, costs.backward_term
        self.starts, self.floor = segment_starts(costs, cap)
        self.cols: list[np.ndarray] = []
        col_f = np.empty(n, dtype=np.int64)
        col_e = np.empty(n, dtype=np.int64)
        for r, lo in enumerate(self.starts, 1):
            col_f[r - 1] = fwd[r - 1]
            col_e[r - 1] = bwd[r - 1]
            if lo < r - 1:
                np.maximum(col_f[lo : r - 1], fwd[r - 1], out=col_f[lo : r - 1])
                np.maximum(col_e[lo : r - 1], bwd[r - 1], out=col_e[lo : r - 1])
            grad = int(out[r]) if r < n else 0  # the last segment is stored: no δ[n] then
            self.cols.append(np.maximum(col_f[lo:r] + grad, col_e[lo:r]))
        self.flat = np.concatenate(self.cols)
        self.flat_start = np.concatenate([np.arange(lo, r) for r, lo in enumerate(self.starts, 1)])

    def jump(self, slack: np.ndarray, bound: int) -> int:
        return band_jump(self.flat, self.flat_start, self.floor, slack, bound)

    def run(self, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``T(0) = o[0]``, ``T(r) = o[r] + min {T(l) : T(l) + cost(l, r) <= bound}`` for every
        bound at once (one NumPy call per ``r`` serves them all)."""
        costs = self.costs
        n = costs.n
        out, q = costs.out_bytes, costs.saved_prefix
        count = len(bounds)
        column = bounds[:, None]
        rows = np.arange(count)
        table = np.full((count, n), UNREACHED, dtype=np.int64)
        table[:, 0] = out[0]
        parent = np.zeros((count, n), dtype=np.int64)
        slack = np.full((count, n), UNREACHED, dtype=np.int64)
        slack[:, 0] = out[0]
        for r in range(1, n):
            lo = self.starts[r - 1]
            fits = self.cols[r - 1] + slack[:, lo:r] <= column
            ok = np.where(fits, table[:, lo:r], UNREACHED)
            best = np.argmin(ok, axis=1)
            value = ok[rows, best]  # UNREACHED when nothing fits
            table[:, r] = value + out[r]
            slack[:, r] = value + (out[r] - q[r])
            parent[:, r] = best + lo
        lo = self.starts[n - 1]
        tail = np.zeros((count, n), dtype=bool)
        tail[:, lo:] = self.cols[n - 1] + slack[:, lo:n] <= column
        return parent, tail, slack


def _equal_segments_peak(costs: FlatCosts) -> int:
    """The least peak of a few equal-segment plans (store all, ~sqrt(n)/2, sqrt(n), 2 sqrt(n))."""
    n = costs.n
    best = flat_plan_peak(costs, [], store_last=True)
    root = max(1.0, n**0.5)
    for segments in {min(n, max(1, round(root * f))) for f in (0.5, 1.0, 2.0)}:
        kept = sorted({round(j * n / segments) for j in range(1, segments)} - {0, n})
        best = min(best, flat_plan_peak(costs, kept, store_last=True))
    return best


def _least_peak_by_recurrence(costs: FlatCosts) -> int:
    """hong-linear: V(l) = min_{r>l} max(cost(l, r), o[r] + V(r)), right to left."""
    n = costs.n
    out, q = costs.out_bytes, costs.saved_prefix
    fwd, bwd = costs.recompute_term, costs.backward_term
    # row l holds, for r = l+1..n at index r-1: max F[l+1..r], max E[l+1..r]
    row_f = fwd.copy()
    row_e = bwd.copy()
    grad = out[1:].copy()
    grad[-1] = 0  # the last segment is stored: no δ[n] during a recomputation
    rest = np.empty(n, dtype=np.int64)  # o[r] + V(r) at index r-1; none after r = n
    rest[-1] = -UNREACHED
    value = 0
    for lo in range(n - 1, -1, -1):
        # row for this lo: r in lo+1..n  <->  indices lo..n-1
        np.maximum(row_f[lo:], fwd[lo], out=row_f[lo:])
        np.maximum(row_e[lo:], bwd[lo], out=row_e[lo:])
        seg = np.maximum(row_f[lo:] + grad[lo:], row_e[lo:]) - q[lo]
        value = int(np.maximum(seg, rest[lo:]).min())
        if lo > 0:
            rest[lo - 1] = out[lo] + value
    return int(out[0]) + value
