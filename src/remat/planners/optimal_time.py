"""optimal-time: the fastest plan under a peak-memory budget (Beaumont et al. 2019, "rotor").

Paper: O. Beaumont, L. Eyraud-Dubois, J. Herrmann, A. Joly, A. Shilova, "Optimal checkpointing
for heterogeneous chains: how to train deep neural networks with limited memory" (2019), the
dynamic program behind ``rotor`` (github.com/topal-team/rotor, ``algorithms/persistent.py``).

**Guarantee.** Among *all* nested segment trees (:class:`~remat.core.plan.Plan`) whose peak, as
:func:`remat.simulate` computes it, is at most the budget, the returned plan has the least total
time (forward + recomputation + backward). The recurrence is derived from simulate's rules, not
from the paper's memory model, so the peak it predicts for a plan is the simulated peak exactly
(:func:`predicted_cost`; the tests check it on every plan of small chains). Below
:func:`min_feasible_peak` (the least peak of any nested plan, exact) it raises
:class:`~remat.planners.BudgetTooSmallError` naming that minimum. With ``budget=None`` it
returns the plan with the least peak among those of the least possible time (no recomputation
time): with positive forward times that is ``Plan.none``.

The recurrence (docs/optimal-time.md derives it) is ``opt(s, t, m)``: the least time to run the
sub-chain ``s..t`` forward and backward when the caller holds ``a[s-1]``, ``δ[t]`` is live, and
``m`` bytes are free above that. Stage ``n + 1`` is a virtual, free, stored "loss" stage, so a
training step is ``opt(1, n + 1, budget - input_bytes)``. Either stage ``s`` is stored
(``F_all``, ``opt(s + 1, t, m - saved[s])``, ``B_s``), or the prefix ``s..j-1`` is checkpointed
(run without grad keeping ``a[j-1]``, ``opt(j, t, m - a[j-1])``, then recomputed and
back-propagated as ``opt(s, j - 1, m)``), each under its own transient-peak conditions.

**Memory units.** Exact bytes whenever that table costs no more than the grid table of a
200-stage chain (so small chains, and every test against brute force, are exact). Otherwise a
table of ``GRID_CELLS`` cells of ``q`` bytes with every size rounded *down*: a relaxation, so
each entry is a lower bound on the exact least time. The plan itself is then found by a search
in exact bytes (every size, every peak condition exact, so every returned plan truly fits):
first a greedy descent that follows the best lower bound (after ``GREEDY_NODES`` nodes it takes
the plans it already knows instead of trying to beat them, so it always ends), then branch and
bound that proves optimality. If the proof needs more than ``SEARCH_NODES`` nodes, the planner
returns the fastest of the best plan found, the exact optimum of the chain with sizes rounded
*up* to whole cells (it truly fits), and reference plans (every stage, the least-peak plan, flat
plans of equal segments), with ``plan.params["proven_optimal"] = False`` and a lower bound on the time
in ``plan.params["time_lower_bound"]``.

Example:
    >>> from remat import Chain, simulate
    >>> chain = Chain.homogeneous(8, out_bytes=10, saved_bytes=30)
    >>> p = solve(chain, 150)
    >>> p.describe()
    '[1] (2) (3-4) (5-6) [7-8]'
    >>> sim = simulate(chain, p)
    >>> sim.peak_bytes, p.predicted_peak_bytes, sim.recompute_time
    (150, 150, 5.0)
    >>> min_feasible_peak(chain)
    70

Known limitations:
    * Cost ``O(n^3 * cells)`` time and ``O(n^2 * cells)`` memory: about 40 MB and 2-3.5 CPU
      seconds at n = 200 (docs/optimal-time.md has measurements).
    * On long chains with large byte counts the search may stop before its proof (see above);
      the gap to the lower bound was below 3 % in our measurements at n = 200.
    * Only plans that nested non-reentrant checkpoints execute (segment trees). Schedules
      outside that space (e.g. freeing a stored stage's activations before its backward) are
      not considered.
    * Times closer than ``1e-12`` of the total are treated as equal.
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from remat.core.chain import Chain
from remat.core.plan import ChainSegment, Plan
from remat.planners.registry import BudgetTooSmallError, grid_candidates, plan_chain, register

__all__ = [
    "plan_optimal_time",
    "candidates",
    "solve",
    "sweep",
    "min_feasible_peak",
    "predicted_cost",
    "GRID_CELLS",
    "SEARCH_NODES",
]

METHOD = "optimal-time"
GRID_CELLS = 500
"""Memory cells of the table when exact bytes would cost too much (rotor's default)."""
SEARCH_NODES = 20_000
"""Nodes the branch and bound may visit per budget before it returns its best plan unproven."""
GREEDY_NODES = SEARCH_NODES // 4
"""Nodes after which the first (greedy) descent stops trying to beat plans it already knows
and takes them, so that it always ends quickly."""
_TABLE_WORK = 200**3 // 6 * GRID_CELLS
"""Exact byte units are used when ``n^3 / 6 * (budget + 1)`` stays below this (the cost of
the grid table at n = 200) and the table has at most ``_TABLE_ENTRIES`` entries."""
_TABLE_ENTRIES = 201 * 202 // 2 * GRID_CELLS
_REL_TOL = 1e-12
_FLOAT32_MARGIN = 1e-4


# ====================================================================== public API
def plan_optimal_time(chain: Chain, budget: int | None = None) -> Plan:
    """The fastest nested plan whose simulated peak is at most ``budget`` bytes (see module)."""
    return solve(chain, budget)


def solve(chain: Chain, budget: int | None) -> Plan:
    """The least-time plan within ``budget`` bytes (``None``: least memory at least time).

    Raises :class:`~remat.planners.BudgetTooSmallError` with the least feasible peak when no
    nested plan fits. The plan carries the peak and time the recurrence predicts, which are
    what :func:`remat.simulate` reports.
    """
    plan = sweep(chain, [budget])[0]
    if plan is None:
        assert budget is not None
        raise BudgetTooSmallError(
            budget, min_feasible_peak(chain), METHOD, "no nested checkpointing plan fits"
        )
    return plan


def sweep(chain: Chain, budgets: Iterable[int | None]) -> list[Plan | None]:
    """:func:`solve` for many budgets with one table and one search memory (Pareto curves).

    Returns one plan per budget, ``None`` where the budget is below :func:`min_feasible_peak`.
    """
    budgets = list(budgets)
    model = _Model(chain)
    floor = model.input + int(model.min_peak()[1, model.N])
    store_all = Plan.none(chain).chain_segments()
    store_all_peak = model.input + model.plan_peak(store_all)
    # One table serves budgets down to half its own (its cells are budget / GRID_CELLS bytes);
    # what the search proves is kept across tables.
    known: dict[tuple[int, int], _Known] = {}
    searches: dict[int, _Search] = {}
    search: _Search | None = None
    for budget in sorted({b for b in budgets if b is not None}, reverse=True):
        if floor <= budget < store_all_peak:
            top = budget - model.input
            if search is None or 2 * top < search.table.top:
                search = _Search(model, _TimeTable(model, top), known)
                search.largest_budget = budget
            searches[budget] = search
    plans: list[Plan | None] = []
    for budget in budgets:
        if budget is None:
            segments = model.least_memory_at_least_time()
            plans.append(model.finish(segments, None, {"proven_optimal": True}))
        elif budget < floor:
            plans.append(None)
        elif budget >= store_all_peak:  # no recomputation at all: nothing is faster
            plans.append(model.finish(store_all, budget, {"proven_optimal": True}))
        else:
            search = searches[budget]
            segments, lower = search.plan(budget - model.input)
            proven = lower >= model.plan_time(segments) - model.tol
            params: dict[str, object] = {
                "memory_unit_bytes": search.table.q,
                "proven_optimal": proven,
            }
            if not proven:
                params["time_lower_bound"] = lower
                rounded_up = search.rounded_up_plan(budget)
                candidates = [segments, *([rounded_up] if rounded_up else []), *model.references()]
                segments = model.fastest_fitting(candidates, budget)
            plans.append(model.finish(segments, budget, params))
    return plans


def min_feasible_peak(chain: Chain) -> int:
    """The least simulated peak of any nested plan of ``chain`` (exact bytes, O(n^3))."""
    model = _Model(chain)
    return model.input + int(model.min_peak()[1, model.N])


def predicted_cost(chain: Chain, plan: Plan) -> tuple[int, float]:
    """``(peak_bytes, total_time)`` of ``plan`` by the planner's recurrence, not by simulate.

    It equals ``simulate(chain, plan)``'s ``peak_bytes`` and ``total_time`` for every plan.
    """
    model = _Model(chain)
    segments = plan.chain_segments(chain)
    return model.input + model.plan_peak(segments), model.plan_time(segments)


# ====================================================================== implementation
class _Model:
    """The chain as 1-based arrays over stages ``1..N``, ``N = n + 1`` the virtual loss stage.

    ``a[i]`` activation bytes (``a[0]`` the input, ``a[N] = 0``); ``d[i]`` gradient bytes
    ``δ[i]`` (``d[0] = 0``: the input gets none; ``d[N] = 0``); ``sv`` saved bytes; ``ovf`` and
    ``ovb`` transients; ``f``, ``b`` times and ``cumf`` the prefix sums of ``f``.
    """

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.n = n = chain.n
        self.N = N = n + 1
        self.input = chain.input_bytes

        def ints(values: Sequence[int], head: int) -> np.ndarray:
            return np.array([head, *values, 0], dtype=np.int64)

        self.a = ints(chain.out_bytes, chain.input_bytes)
        self.d = ints(chain.out_bytes, 0)
        self.sv = ints(chain.saved_bytes, 0)
        ovf = ints(chain.fwd_overhead_bytes, 0)
        ovn = ints(chain.fwd_none_overhead_bytes, 0)  # F_none's transients
        ovb = ints(chain.bwd_overhead_bytes, 0)
        self.f = np.array([0.0, *chain.fwd_time, 0.0])
        self.b = np.array([0.0, *chain.bwd_time, 0.0])
        self.cumf = np.cumsum(self.f)
        # Storing stage s needs d[t] + store_fwd[s] (F_all, δ[t] live) and store_bwd[s] (B_s).
        self.store_fwd = self.sv + ovf
        self.store_bwd = self.sv + self.d + np.r_[0, self.d[:-1]] + ovb
        self.store_need_table = np.maximum(
            self.d[None, :] + self.store_fwd[:, None], self.store_bwd[:, None]
        )  # [s, t]
        self._store_need = self.store_need_table.tolist()
        # nograd_peak[s, e]: the most that F_none of s..e needs above the caller (who holds
        # a[s-1]): max(a[s] + ovn[s], a[i-1] + a[i] + ovn[i] for s < i <= e).
        step = np.r_[0, self.a[:-1] + self.a[1:] + ovn[1:]]
        self.nograd_peak = np.zeros((N + 1, N + 1), dtype=np.int64)
        for s in range(1, N + 1):
            run = step[s : N + 1].copy()
            run[0] = self.a[s] + ovn[s]
            self.nograd_peak[s, s:] = np.maximum.accumulate(run)
        self.tol = _REL_TOL * max(1.0, float(self.cumf[-1] + self.b.sum()))
        self._least_peak: tuple[np.ndarray, np.ndarray] | None = None

    def store_need(self, s: int, t: int) -> int:
        """What storing stage ``s`` needs above the caller, besides what follows it."""
        return self._store_need[s][t]

    # ------------------------------------------------------------ the recurrence on a plan
    def plan_peak(self, segments: Sequence[ChainSegment]) -> int:
        """Peak above the input of a whole plan (the virtual loss stage appended)."""
        return self._sequence_peak([*_items(segments), (self.N, self.N, None)], self.N)

    def _sequence_peak(self, items: list[_Item], t: int) -> int:
        """Peak above the caller of the items covering ``..t``, evaluated back to front."""
        rest: int | None = None
        for start, stop, children in reversed(items):
            if children is None:  # stored stage `start`: F_all, the rest, B_start
                here = self.store_need(start, t)
                if rest is not None:
                    here = max(here, int(self.sv[start]) + rest)
            else:  # checkpoint start..stop: F_none pass, the rest, recompute under `children`
                here = max(
                    int(self.d[t] + self.nograd_peak[start, stop]),
                    self._sequence_peak(_items(children), stop),
                )
                if rest is not None:
                    here = max(here, int(self.a[stop]) + rest)
            rest = here
        assert rest is not None
        return rest

    def plan_time(self, segments: Sequence[ChainSegment]) -> float:
        total = 0.0
        for seg in segments:
            if seg.checkpoint:
                total += float(self.cumf[seg.stop] - self.cumf[seg.start - 1])
                total += self.plan_time(seg.children)
            else:
                stages = slice(seg.start, seg.stop + 1)
                total += float(self.f[stages].sum() + self.b[stages].sum())
        return total

    # ------------------------------------------------------------ least peaks (exact)
    def min_peak(self) -> np.ndarray:
        """``P[s, t]``: the least peak above the caller of any plan of ``s..t``."""
        if self._least_peak is None:
            self._least_peak = self._peak_dp(zero_recompute=False)
        return self._least_peak[0]

    def min_peak_plan(self) -> list[ChainSegment]:
        self.min_peak()
        assert self._least_peak is not None
        choice = self._least_peak[1]
        return _choice_segments(self, lambda s, t: int(choice[s, t]))

    def least_memory_at_least_time(self) -> list[ChainSegment]:
        """The least-peak plan among those without recomputation time (it may checkpoint only
        stages whose forward time is 0)."""
        choice = self._peak_dp(zero_recompute=True)[1]
        return _choice_segments(self, lambda s, t: int(choice[s, t]))

    def store_all_peak(self) -> np.ndarray:
        """``Q[s, t]``: peak above the caller of storing every stage of ``s..t``."""
        Q = np.zeros((self.N + 2, self.N + 2), dtype=np.int64)
        before = np.r_[0, np.cumsum(self.sv)]  # before[i] = sv[0] + ... + sv[i-1]
        for t in range(1, self.N + 1):
            s = np.arange(1, t + 1)
            # the peak is at the stage i of s..t maximising sv[s..i-1] + what storing i needs
            need = np.maximum(self.d[t] + self.store_fwd[s], self.store_bwd[s]) + before[s]
            Q[s, t] = np.maximum.accumulate(need[::-1])[::-1] - before[s]
        return Q

    def _peak_dp(self, zero_recompute: bool) -> tuple[np.ndarray, np.ndarray]:
        """Least peaks and their choices (0: store ``s``; ``j``: checkpoint ``s..j-1``), one
        diagonal ``t - s`` at a time. ``zero_recompute``: only checkpoints of free stages."""
        N = self.N
        peak = np.zeros((N + 2, N + 2), dtype=np.int64)
        choice = np.zeros((N + 2, N + 2), dtype=np.int64)
        for length in range(N):
            s = np.arange(1, N - length + 1)
            t = s + length
            store = np.maximum(self.d[t] + self.store_fwd[s], self.store_bwd[s])
            if length == 0:
                peak[s, t] = store
                continue
            store = np.maximum(store, self.sv[s] + peak[s + 1, t])
            j = s[:, None] + np.arange(1, length + 1)[None, :]
            ckpt = np.maximum.reduce(
                [
                    self.d[t][:, None] + self.nograd_peak[s[:, None], j - 1],
                    self.a[j - 1] + peak[j, t[:, None]],
                    peak[s[:, None], j - 1],
                ]
            )
            if zero_recompute:
                recompute = self.cumf[j - 1] - self.cumf[s - 1][:, None]
                ckpt = np.where(recompute > 0, np.iinfo(np.int64).max, ckpt)
            k = np.argmin(ckpt, axis=1)
            best = ckpt[np.arange(len(s)), k]
            use = best < store
            peak[s, t] = np.where(use, best, store)
            choice[s, t] = np.where(use, s + 1 + k, 0)
        return peak, choice

    # ------------------------------------------------------------ reference plans, result
    def references(self) -> Iterator[Sequence[ChainSegment]]:
        """Plans other planners make: every stage, the least-peak plan, and the flat plans of
        1..3*sqrt(n) equal segments (Chen et al.'s sqrt(n) plan among them)."""
        yield Plan.every_stage(self.n).chain_segments()
        yield self.min_peak_plan()
        for count in range(1, min(self.n, 3 * math.isqrt(self.n) + 3) + 1):
            kept = sorted({round(k * self.n / count) for k in range(1, count)} - {0, self.n})
            for store_last in (False, True):
                yield Plan.from_checkpoints(self.n, kept, store_last).chain_segments()

    def fastest_fitting(
        self, candidates: Iterable[Sequence[ChainSegment]], budget: int
    ) -> Sequence[ChainSegment]:
        best: tuple[float, Sequence[ChainSegment]] | None = None
        for segments in candidates:
            if self.input + self.plan_peak(segments) <= budget:
                time = self.plan_time(segments)
                if best is None or time < best[0] - self.tol:
                    best = (time, segments)
        assert best is not None
        return best[1]

    def finish(
        self, segments: Sequence[ChainSegment], budget: int | None, params: dict[str, object]
    ) -> Plan:
        peak = self.input + self.plan_peak(segments)
        if budget is not None:
            assert peak <= budget, (peak, budget)
            params = {"budget_bytes": int(budget), **params}
        return Plan.from_chain_segments(
            tuple(segments),
            method=METHOD,
            params=params,
            predicted_peak_bytes=peak,
            predicted_time=self.plan_time(segments),
        ).made_for(self.chain)


_Item = tuple[int, int, "tuple[ChainSegment, ...] | None"]
"""A stored stage ``(i, i, None)`` or a checkpointed segment ``(start, stop, children)``."""


def _items(segments: Sequence[ChainSegment]) -> list[_Item]:
    items: list[_Item] = []
    for seg in segments:
        if seg.checkpoint:
            items.append((seg.start, seg.stop, seg.children))
        else:
            items.extend((i, i, None) for i in seg.stages())
    return items


def _choice_segments(model: _Model, choose: Callable[[int, int], int]) -> list[ChainSegment]:
    """The whole plan described by ``choose(s, t)`` (0: store ``s``; j: checkpoint s..j-1)."""

    def build(s: int, t: int) -> list[ChainSegment]:
        out: list[ChainSegment] = []
        while s <= t:
            j = choose(s, t)
            if j == 0:
                _append_stored(out, s, model.n)
                s += 1
            else:
                out.append(ChainSegment(s, j - 1, True, tuple(build(s, j - 1))))
                s = j
        return out

    return build(1, model.N)


def _append_stored(out: list[ChainSegment], stage: int, n: int) -> None:
    """Store ``stage`` (merged with a stored segment just before it); stage n+1 is virtual."""
    if stage > n:
        return
    if out and not out[-1].checkpoint:
        out[-1] = ChainSegment(out[-1].start, stage)
    else:
        out.append(ChainSegment(stage, stage))


class _TimeTable:
    """``opt[s, t, k]``: least time of ``s..t`` within ``k`` cells of ``q`` bytes, each size
    rounded down to whole cells: a lower bound on the exact least time with ``k*q .. k*q+q-1``
    bytes (``q = 1``: exact).

    Built column by column (``t`` ascending, ``s`` descending); the rows ``(s, s..t)`` are
    contiguous, so the checkpoint case of each ``(s, t)`` is one add and one min over a block.
    """

    def __init__(self, model: _Model, top_bytes: int, exact: bool = False) -> None:
        self.model = model
        self.top = top_bytes
        N = model.N
        pairs = N * (N + 1) // 2
        exact = (
            exact
            or top_bytes + 1 <= GRID_CELLS
            or (
                (top_bytes + 1) * N**3 // 6 <= _TABLE_WORK
                and (top_bytes + 1) * pairs <= _TABLE_ENTRIES
            )
        )
        self.q = q = 1 if exact else -(-top_bytes // (GRID_CELLS - 1))
        self.cells = top_bytes // q + 1
        self.offset = np.zeros(N + 2, dtype=np.int64)
        self.offset[2:] = np.cumsum(N - np.arange(1, N + 1) + 1)
        # float32 halves the memory traffic of the big tables; its rounding is covered by
        # lowering every bound read from it by _FLOAT32_MARGIN (relative).
        self.dtype = np.float64 if exact else np.float32
        self.margin = 1.0 if exact else 1.0 - _FLOAT32_MARGIN
        self.opt = np.full((pairs, self.cells), np.inf, dtype=self.dtype)
        self.flat = self.opt.reshape(-1)
        self._fill()

    def lower(self, s: int, t: int, m: int) -> float:
        """A lower bound on the least time of ``s..t`` within ``m`` exact bytes."""
        if m < 0:
            return np.inf
        cell = min(m // self.q, self.cells - 1)
        return float(self.flat[(self.offset[s] + t - s) * self.cells + cell]) * self.margin

    def _fill(self) -> None:
        md, q, cells, opt = self.model, self.q, self.cells, self.opt
        # Python lists: this loop runs n^2 / 2 times and reads many scalars.
        a_cells = (md.a // q).tolist()
        sv_cells = (md.sv // q).tolist()
        offset = self.offset.tolist()
        d = md.d.tolist()
        nograd = md.nograd_peak.tolist()
        cumf = md.cumf.tolist()
        stage_time = (md.f + md.b).tolist()
        store_time = np.cumsum(md.f + md.b).tolist()
        store_need = (md.store_need_table // q).tolist()
        # Only the cells lo..hi-1 of a row need the recurrence: below floor(least peak / q)
        # nothing fits (inf stays a valid bound); from ceil(store-all peak / q) on, storing
        # everything fits and nothing is faster.
        lows = np.minimum(md.min_peak() // q, cells).tolist()
        highs = np.minimum(-(-md.store_all_peak() // q), cells).tolist()
        block_buffer = np.empty((md.N, cells), dtype=self.dtype)
        for t in range(1, md.N + 1):
            # shifted[j, k] = cumf[j-1] + opt[j, t, k - a[j-1]]: the part of "checkpoint
            # s..j-1" that does not depend on s, made once per (j, t).
            shifted = np.full((t + 1, cells), np.inf, dtype=self.dtype)
            for s in range(t, 0, -1):
                lo, hi = lows[s][t], highs[s][t]
                row = opt[offset[s] + t - s]  # a view, all inf so far
                row[hi:] = store_time[t] - store_time[s - 1]
                need = store_need[s][t]
                if s == t:
                    row[max(need, lo) : hi] = stage_time[s]
                elif lo < hi:
                    # store s: F_all, then s+1..t with saved[s] fewer bytes, then B_s
                    shift = sv_cells[s]
                    k0 = max(need, shift, lo)
                    if k0 < hi:
                        rest = opt[offset[s + 1] + t - s - 1]
                        row[k0:hi] = rest[k0 - shift : hi - shift] + stage_time[s]
                    # checkpoint s..j-1 for every j in s+1..t, at once
                    block = block_buffer[: t - s, : hi - lo]
                    base = offset[s]
                    np.add(
                        opt[base : base + t - s, lo:hi], shifted[s + 1 : t + 1, lo:hi], out=block
                    )
                    # its F_none pass needs d[t] + nograd_peak[s, j-1], which grows with j:
                    # at each cell the usable j form a prefix
                    first = (d[t] + nograd[s][s]) // q - lo
                    last = (d[t] + nograd[s][t - 1]) // q - lo
                    if last <= 0:
                        best = block.min(axis=0)
                    elif first == last:
                        best = block.min(axis=0)
                        best[:first] = np.inf
                    else:
                        needs = (md.d[t] + md.nograd_peak[s, s:t]) // q - lo
                        np.minimum.accumulate(block, axis=0, out=block)
                        columns = np.arange(hi - lo)
                        usable = np.searchsorted(needs, columns, side="right")
                        best = block[np.maximum(usable - 1, 0), columns]
                        best[usable == 0] = np.inf
                    best -= cumf[s - 1]
                    window = row[lo:hi]
                    np.minimum(window, best, out=window)
                if s >= 2:
                    shift = a_cells[s - 1]
                    if shift < cells:
                        np.add(row[: cells - shift], cumf[s - 1], out=shifted[s, shift:])


_Node = tuple[int, float, int, "_Node | None", "_Node | None"]
"""A solved sub-problem ``(s, t)``: ``(peak, time, j, rest, inner)``. ``j = 0``: stage ``s``
is stored and ``rest`` solves ``s+1..t`` (None when ``s = t``); ``j > 0``: ``s..j-1`` is
checkpointed, ``rest`` solves ``j..t`` and ``inner`` its recomputation ``s..j-1``. ``peak`` is
the peak above the caller by the recurrence, ``time`` the total time."""


@dataclass
class _Known:
    """What the search has learnt about one sub-problem ``(s, t)``, for any memory ``m``.

    Both are Pareto fronts sorted by memory, so a query is one bisection.
    """

    plan_peaks: list[int] = field(default_factory=list)
    """Peaks of the plans found, ascending (their times descend)."""
    plan_nodes: list[_Node] = field(default_factory=list)
    """The plans; each fits every ``m >= peak``, so its time bounds the least time there."""
    bound_memory: list[int] = field(default_factory=list)
    """``m_max`` of the proven bounds, ascending (their times descend)."""
    bound_time: list[float] = field(default_factory=list)
    """No plan within ``m <= m_max`` bytes is faster than this."""

    def best_plan(self, m: int) -> _Node | None:
        k = bisect_right(self.plan_peaks, m)
        return self.plan_nodes[k - 1] if k else None

    def lower(self, m: int) -> float:
        k = bisect_left(self.bound_memory, m)
        return self.bound_time[k] if k < len(self.bound_time) else -np.inf

    def add_plan(self, node: _Node) -> None:
        peak, time = node[0], node[1]
        k = bisect_right(self.plan_peaks, peak)
        if k and self.plan_nodes[k - 1][1] <= time:
            return  # a known plan is as fast with no more memory
        start = k - 1 if k and self.plan_peaks[k - 1] == peak else k
        end = k
        while end < len(self.plan_peaks) and self.plan_nodes[end][1] >= time:
            end += 1
        self.plan_peaks[start:end] = [peak]
        self.plan_nodes[start:end] = [node]

    def add_bound(self, m_max: int, time: float) -> None:
        k = bisect_left(self.bound_memory, m_max)
        if k < len(self.bound_time) and self.bound_time[k] >= time:
            return  # a known bound is as strong over more memory
        end = k + 1 if k < len(self.bound_memory) and self.bound_memory[k] == m_max else k
        start = k
        while start > 0 and self.bound_time[start - 1] <= time:
            start -= 1
        self.bound_memory[start:end] = [m_max]
        self.bound_time[start:end] = [time]


class _GiveUp(Exception):
    pass


class _Search:
    """The least time in exact bytes: branch and bound over the recurrence.

    Lower bounds come from the table and from what earlier calls proved; a plan found with
    peak ``p`` serves every memory from ``p`` up, and a bound proved at ``m`` holds below ``m``
    (the least time never increases with memory). Both are kept across the budgets of a sweep.
    """

    def __init__(
        self, model: _Model, table: _TimeTable, known: dict[tuple[int, int], _Known]
    ) -> None:
        self.model = model
        self.table = table
        self.known = known
        self.least_peak = model.min_peak()
        self.nodes = 0
        self.largest_budget = 0
        """The largest budget this search serves (sizes the rounded-up table)."""
        self._rounded_up: _Search | None = None
        self._checkpoint_cache: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}

    def plan(self, top: int) -> tuple[list[ChainSegment], float]:
        """The plan for the whole chain within ``top`` bytes above the input, and a proven
        lower bound on the least time (the plan's own time when the proof completed).

        A greedy descent gives a first plan, then branch and bound improves it and proves it
        optimal, unless it needs more than ``SEARCH_NODES`` nodes.
        """
        md = self.model
        self.nodes = 0
        with _recursion_limit(8 * md.N + 200):
            self.solve(1, md.N, top, np.inf, greedy=True)
            try:
                time, _ = self.solve(1, md.N, top, np.inf)
                lower = time
            except _GiveUp:
                lower = self.lower(1, md.N, top)
        node = self.known[(1, md.N)].best_plan(top)
        assert node is not None
        return _node_segments(md, node), min(lower, node[1])

    def rounded_up_plan(self, budget: int) -> list[ChainSegment] | None:
        """The optimal plan of the chain with every size rounded *up* to whole cells of
        ``q`` bytes, within ``budget // q`` cells: it truly fits ``budget`` (each sum of sizes
        is at most ``q`` times its rounded sum). A second opinion when the proof stopped short:
        the optimum with a little less memory, where the greedy descent can go astray."""
        q = self.table.q
        if self._rounded_up is None:
            chain = self.model.chain

            def up(values: Sequence[int]) -> list[int]:
                return [-(-v // q) for v in values]

            rounded = _Model(
                Chain(
                    fwd_time=chain.fwd_time,
                    bwd_time=chain.bwd_time,
                    out_bytes=up(chain.out_bytes),
                    saved_bytes=up(chain.saved_bytes),
                    input_bytes=-(-chain.input_bytes // q),
                    fwd_overhead_bytes=up(chain.fwd_overhead_bytes),
                    bwd_overhead_bytes=up(chain.bwd_overhead_bytes),
                    fwd_none_overhead_bytes=up(chain.fwd_none_overhead_bytes),
                )
            )
            top = self.largest_budget // q - rounded.input
            if top < rounded.min_peak()[1, rounded.N]:
                return None
            self._rounded_up = _Search(rounded, _TimeTable(rounded, top, exact=True), {})
        top = budget // q - self._rounded_up.model.input
        if top < self._rounded_up.least_peak[1, self._rounded_up.model.N]:
            return None
        return self._rounded_up.plan(top)[0]

    def lower(self, s: int, t: int, m: int) -> float:
        if m < self.least_peak[s, t]:
            return np.inf
        known = self.known.get((s, t))
        low = self.table.lower(s, t, m)
        return low if known is None else max(low, known.lower(m))

    def solve(
        self, s: int, t: int, m: int, bound: float, greedy: bool = False
    ) -> tuple[float, _Node | None]:
        """``(time, plan)``: the least time of ``s..t`` within ``m`` bytes and a plan with it,
        if that time is below ``bound``; otherwise ``(a value >= bound, None)``.

        ``greedy``: no proof, follow the best lower bound at each step (keeping a known plan
        if that is faster). Every choice it tries passes the exact least-peak checks, so it
        always ends with a plan that fits.
        """
        if m < self.least_peak[s, t]:
            return np.inf, None
        md, tol = self.model, self.model.tol
        known = self.known.setdefault((s, t), _Known())
        best_node = known.best_plan(m)
        best = np.inf if best_node is None else best_node[1]
        if greedy and best_node is not None and self.nodes >= GREEDY_NODES:
            # past its share of nodes the descent only has to reach *a* plan: trying to beat
            # known ones everywhere made it backtrack without limit (1.1 M nodes, 33 s, for one
            # budget of a 63-stage DenseNet chain)
            return best, best_node
        low = max(self.table.lower(s, t, m), known.lower(m))
        if best_node is not None and low >= best - tol:  # proven optimal at m
            return (best, best_node) if best < bound else (best, None)
        if low >= bound:
            return low, None
        self.nodes += 1
        if self.nodes > SEARCH_NODES and not greedy:
            raise _GiveUp
        if best >= bound:
            best, best_node = bound, None
        for choice_low, j in self._choices(s, t, m, best - tol):
            if choice_low >= best - tol:
                break
            node: _Node
            if j == 0:  # store s
                here = md.f[s] + md.b[s]
                if s == t:
                    node = (md.store_need(s, t), float(here), 0, None, None)
                else:
                    rest_bound = np.inf if greedy else best - here
                    rest, rest_node = self.solve(s + 1, t, m - int(md.sv[s]), rest_bound, greedy)
                    if rest_node is None:
                        continue
                    here += rest
                    peak = max(md.store_need(s, t), int(md.sv[s]) + rest_node[0])
                    node = (peak, float(here), 0, rest_node, None)
            else:  # checkpoint s..j-1
                recompute = md.cumf[j - 1] - md.cumf[s - 1]
                inner_low = self.lower(s, j - 1, m)
                rest_m = m - int(md.a[j - 1])
                rest_bound = np.inf if greedy else best - recompute - inner_low
                rest, rest_node = self.solve(j, t, rest_m, rest_bound, greedy)
                if rest_node is None or recompute + rest + inner_low >= best - tol:
                    continue
                inner_bound = np.inf if greedy else best - recompute - rest
                inner, inner_node = self.solve(s, j - 1, m, inner_bound, greedy)
                if inner_node is None:
                    continue
                here = recompute + rest + inner
                peak = max(
                    int(md.d[t] + md.nograd_peak[s, j - 1]),
                    int(md.a[j - 1]) + rest_node[0],
                    inner_node[0],
                )
                node = (peak, float(here), j, rest_node, inner_node)
            if here < best - tol or (best_node is None and here < best):
                best, best_node = float(here), node
                known.add_plan(node)  # valid whatever happens next
            if greedy:
                break
        if best_node is None:
            if not greedy:
                known.add_bound(m, bound)
            return bound, None
        if not greedy:
            known.add_bound(m, best)
        return best, best_node

    def _choices(self, s: int, t: int, m: int, below: float) -> list[tuple[float, int]]:
        """The choices at ``(s, t, m)`` whose lower bound is below ``below``, best first
        (``0``: store ``s``; ``j``: checkpoint ``s..j-1``)."""
        md, table = self.model, self.table
        out: list[tuple[float, int]] = []
        if md.store_need(s, t) <= m:
            low = md.f[s] + md.b[s]
            if s < t:
                low += self.lower(s + 1, t, m - int(md.sv[s]))
            if low < below:
                out.append((float(low), 0))
        if s < t:
            j, recompute, need, size, rest_rows, inner_rows = self._checkpoint_data(s, t)
            ok = need <= m
            rest_cells = np.minimum((m - size) // table.q, table.cells - 1)
            flat = table.flat
            low = flat[rest_rows + np.maximum(rest_cells, 0)].astype(np.float64)
            low += flat[inner_rows + min(m // table.q, table.cells - 1)]
            low *= table.margin
            low += recompute
            keep = np.flatnonzero(ok & (low < below))
            out.extend(zip(low[keep].tolist(), j[keep].tolist(), strict=True))
        out.sort()
        return out

    def _checkpoint_data(self, s: int, t: int) -> tuple[np.ndarray, ...]:
        """For ``j = s+1..t`` (checkpoint ``s..j-1``): ``j``, its recomputation time, the
        least memory it can run in (its F_none pass, and the least peaks of ``j..t`` above
        ``a[j-1]`` and of ``s..j-1``), ``a[j-1]``, and the flat table offsets of the rows of
        ``j..t`` and ``s..j-1``. Cached per ``(s, t)``."""
        data = self._checkpoint_cache.get((s, t))
        if data is None:
            md, table = self.model, self.table
            j = np.arange(s + 1, t + 1)
            size = md.a[j - 1]
            need = np.maximum.reduce(
                [
                    md.d[t] + md.nograd_peak[s, s:t],
                    size + self.least_peak[j, t],
                    self.least_peak[s, j - 1],
                ]
            )
            data = (
                j,
                md.cumf[j - 1] - md.cumf[s - 1],
                need,
                size,
                (table.offset[j] + t - j) * table.cells,
                (table.offset[s] + (j - 1 - s)) * table.cells,
            )
            self._checkpoint_cache[(s, t)] = data
        return data


def _node_segments(model: _Model, node: _Node) -> list[ChainSegment]:
    """The segments of a solved whole-chain problem ``1..N``."""

    def build(node: _Node | None, s: int, t: int) -> list[ChainSegment]:
        out: list[ChainSegment] = []
        while s <= t:
            assert node is not None
            _, _, j, rest, inner = node
            if j == 0:
                _append_stored(out, s, model.n)
                s += 1
            else:
                out.append(ChainSegment(s, j - 1, True, tuple(build(inner, s, j - 1))))
                s = j
            node = rest
        return out

    return build(node, 1, model.N)


@contextmanager
def _recursion_limit(limit: int) -> Iterator[None]:
    """The search recurses about once per stage: allow it on long chains."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, limit))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


_REFERENCE_PLANNERS = ("none", "every-stage", "chen-sqrt", "chen-budget", "hong-dp")
"""The planners whose default plans :func:`candidates` adds to the grid."""


def candidates(chain: Chain) -> list[Plan]:
    """The plans to weigh under a whole-step budget: the grid of activation budgets
    (:func:`remat.planners.grid_candidates`, one DP table) and the default plans of
    :data:`_REFERENCE_PLANNERS`. optimal-time promises the least time; under a budget on the
    whole step (whose peak is not a monotone function of the activation peak) a baseline's plan
    can fit where the grid's plans of similar time do not, and is then the faster answer."""
    return grid_candidates(chain, METHOD) + [plan_chain(chain, m) for m in _REFERENCE_PLANNERS]


register(METHOD, sweep=sweep, least_peak=min_feasible_peak, candidates=candidates)(
    plan_optimal_time
)
