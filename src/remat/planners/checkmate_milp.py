"""Minimal time under a memory budget, exactly: Checkmate (Jain et al., MLSys 2020,
"Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization"), registered as
``checkmate-milp`` (exact MILP) and ``checkmate-lp`` (its LP relaxation + rounding).

**Checkmate's formulation.** The training graph is run in *stages*; stage ``t`` computes its
frontier node ``t`` (frontier-advancing schedule), and may first recompute other nodes.
``R[t,i] = 1`` when node ``i`` is (re)computed in stage ``t``; ``S[t,i] = 1`` when its value is
kept from stage ``t-1`` into stage ``t``; ``U[t,k]`` is the memory after the ``k``-th operation of
stage ``t``; ``FREE[t,i,k]`` frees value ``i`` after operation ``k``. They minimise the compute
time ``sum C_i R[t,i]`` subject to (1b) dependencies being computed or kept, (1c) only computed
or kept values being kept, the frontier being computed, and ``U <= budget``.

**Specialised here to what an executor can run** (non-reentrant checkpoint regions, and what
:func:`~remat.graphs.simulate_graph` costs): stages ``0..n-1`` are the forward nodes (no
recomputation in the forward), stage ``n`` is the loss, stage ``T(v) = 2n - v`` is the backward
of node ``v``. Recomputation happens only in backward stages; ``R[v,i]`` (for ``i <= v``)
recomputes node ``i`` in stage ``T(v)``, and the nodes recomputed in one stage form a run of
consecutive nodes ending at ``v``: a segment of the plan, recomputed just before the backward of
its last node. Each node is recomputed at most once. Because every recomputed node is run with
grad and keeps its saved tensors until its own backward, nothing is freed inside a stage
before its frontier backward: Checkmate's within-stage ``FREE[t,i,k]`` reduces to
``FREE[t,u] = S[t,u] - S[t+1,u] >= 0`` (value freed after stage ``t``), and ``U`` follows
Checkmate's recurrence ``U[t,k] = U[t,k-1] + M_k R[t,k]`` inside a stage. ``S[t,u]`` is the
kept **forward copy** of ``u``'s output; the saved tensors of stored nodes and of recomputed
ones are linear expressions of ``R``, and gradients are fixed by the backward order.

The MILP is exact for flat plans whose segments are runs of consecutive nodes (every chain
plan of depth <= 1 is one): its optimum equals brute force over that space under
:func:`~remat.graphs.simulate_graph`, and the plan it returns simulates to exactly the
objective's time and to a peak no larger than its ``U`` (``tests/test_graph_planners.py``).
Two encodings of it: ``"stages"`` is Checkmate's matrix ``R[T(v),i]`` (n^2/2 binaries,
:class:`StageModel`, kept as the reference); ``"runs"`` (default, :class:`RunModel`) uses that
a stage recomputes a *run* ending at its frontier, so ``R`` is fixed by ``r[i] = sum_t R[t,i]``
and ``e[v] = R[T(v),v]``: 2n binaries, O(n + edge spans) rows. Both are tested to give the
same optimum. ``S`` is continuous (the minimal kept set is integral whenever ``R`` is).

**Outputs freed by their consumers** (``Node.keeps_output`` False, ``runs`` encoding): such a
node's forward copy is held only by the backwards that saved it, the checkpoints and the loss
(no "(1b) stored output" row); a recomputed copy adds only its residual to the run sum, joins
it at its first saving consumer (``z``) and, during the recomputation pass, lives while a later
node of the run reads it (``y``). Exact against brute force like the rest.

**Outputs the program holds** past their last reader (``Node.held_until``): the forward copy
counts in every forward stage up to that node's, as in the simulator (both encodings).

**LP relaxation + rounding** (``checkmate-lp``, Checkmate §5): solve the relaxation at 0.9 x
the budget, round the recomputation decisions at thresholds 0.1..0.9 (and a few random ones),
cut the recomputed runs where the LP ends segments, cost every candidate with the simulator
and keep the fastest that fits; if none fits, solve the LP again at a tighter budget. The LP
at the full budget bounds the time from below: ``plan.params["lp_gap"]`` is the rounding's
gap to that bound. No guarantee that a rounding fits when the MILP does.

Known limitations:
    * Plans are flat (no nested recomputation) and segments are runs of the node order; the
      chain planner ``optimal-time`` (nested) can be faster on chains.
    * The default ``strengthen=True`` adds valid inequalities (checkpoint links), integral
      kept copies and budget-derived bounds (:class:`MilpConfig`); ResNet-50 at module level
      (106 nodes, paper size) then solves to proven optimality within 60 s at 0.7 and 0.5 of
      its regular peak and at the ``reforward`` plan's memory
      (``docs/results/reforward/milp_speed.md``). Near the least feasible peak of larger
      graphs HiGHS can still run out of time (then the best plan found
      and its proven gap are reported, or :class:`PlannerTimeoutError` when none was found):
      raise ``time_limit_s``, or use ``checkmate-lp`` or ``articulation``. The ``"stages"``
      encoding is only practical below ~60 nodes.
    * Memory is scaled to at most 1e4 units per coefficient and solved in floating point; a
      plan the solver accepts within its tolerance but whose simulated peak exceeds the budget
      is re-solved with the budget tightened by the excess (so a plan exactly at the budget
      edge can be missed by a few bytes).

Example:
    >>> from remat.core.synthetic import residual_chain
    >>> from remat.planners.graph import plan_graph
    >>> g = residual_chain(2)
    >>> p = plan_graph(g, "checkmate-milp", budget=110)
    >>> p.predicted_peak_bytes <= 110, p.params["status"]
    (True, 'optimal')
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from remat.core.errors import RematError
from remat.core.graph import Graph
from remat.core.plan import Plan, Segment
from remat.core.simulate import simulate_graph
from remat.planners.registry import BudgetTooSmallError, register

__all__ = [
    "plan_checkmate",
    "plan_checkmate_lp",
    "MilpConfig",
    "RunModel",
    "StageModel",
    "PlannerTimeoutError",
    "backward_floor",
]


@contextlib.contextmanager
def _highs_prints_dropped() -> Iterator[None]:
    """The solve with HiGHS's own prints dropped from the process's standard output.

    HiGHS as SciPy bundles it prints some debug lines with C's ``printf`` whatever ``disp``
    says ("HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();", on a timm
    ResNet-18-D's graph): file descriptor 1 points at a temporary file during the solve, and
    what else was written there meanwhile (another thread's output) is written back after it,
    the lines that start with ``Highs`` left out. Where descriptor 1 cannot be moved, the solve
    runs as it is."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):
        yield
        return
    with tempfile.TemporaryFile() as out:
        os.dup2(out.fileno(), 1)
        try:
            yield
        finally:
            _flush_c_stdio()
            os.dup2(saved, 1)
            os.close(saved)
            out.seek(0)
            kept = [line for line in out.read().splitlines(True) if not line.startswith(b"Highs")]
            if kept:
                os.write(1, b"".join(kept))


def _flush_c_stdio() -> None:
    """C's buffered ``stdout`` written out (``fflush(NULL)``), where the C library is found."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):
        pass


class PlannerTimeoutError(RematError, RuntimeError):
    """The solver found no feasible plan within its time limit (feasibility unknown)."""


@dataclass(frozen=True)
class MilpConfig:
    """Settings of ``checkmate-milp`` / ``checkmate-lp``."""

    time_limit_s: float = 60.0
    """Wall-clock limit of each HiGHS solve; the best plan found is returned with its gap."""
    mip_rel_gap: float = 0.0
    """Stop when HiGHS proves the plan within this relative gap (0: optimal)."""
    relaxation: bool = False
    """Solve the LP relaxation and round (Checkmate's approximation) instead of the MILP."""
    lp_budget_fraction: float = 0.9
    """Rounding mode: the LP is solved at this fraction of the budget (Checkmate uses 0.9)."""
    random_roundings: int = 8
    """Rounding mode: extra random thresholds tried (Checkmate's randomized rounding)."""
    seed: int = 0
    """Seed of the random roundings."""
    encoding: str = "runs"
    """``"runs"`` (2n binaries, default) or ``"stages"`` (Checkmate's n^2/2 stage matrix);
    both encode the same problem and give the same optimum."""
    strengthen: bool = True
    """``runs`` encoding: add the checkpoint-link inequalities
    (:meth:`RunModel._checkpoint_links`), declare the kept copies ``S`` integer (0/1 in every
    plan) and derive big-M constants and variable bounds from the budget. Same optimum, much
    faster near the least feasible peak (``docs/results/reforward/milp_speed.md``); False
    builds the plain budget-independent model (for comparisons)."""

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise ValueError("time_limit_s must be > 0")
        if not 0 <= self.mip_rel_gap < 1:
            raise ValueError("mip_rel_gap must be in [0, 1)")
        if not 0 < self.lp_budget_fraction <= 1:
            raise ValueError("lp_budget_fraction must be in (0, 1]")
        if self.encoding not in ("runs", "stages"):
            raise ValueError(f"encoding must be 'runs' or 'stages', got {self.encoding!r}")


@register("checkmate-milp", plans="graph")
def plan_checkmate(graph: Graph, budget: int | None = None, **options: Any) -> Plan:
    """Checkmate's exact MILP: minimal simulated time with a peak within ``budget``."""
    config = MilpConfig(**options)
    if budget is None:
        return Plan.none()
    if config.relaxation:
        return _round_lp(graph, budget, config)
    return _solve_exact(graph, budget, config)


@register("checkmate-lp", plans="graph")
def plan_checkmate_lp(graph: Graph, budget: int | None = None, **options: Any) -> Plan:
    """Checkmate's LP relaxation + rounding (fast, approximate; see the module docstring)."""
    options.setdefault("relaxation", True)
    return plan_checkmate(graph, budget, **options)


class _Model:
    """Shared parts of the two encodings: scaled costs, rows, the HiGHS call.

    Memory is counted in units of ``scale`` bytes so that coefficients stay below ~1e4 (HiGHS
    struggles with rows mixing 1 and 1e9); the simulator re-checks every plan in bytes. The
    last column is the budget: fixed when minimising time, minimised when asked for the
    least feasible peak.
    """

    n_binary: int
    col_budget: int
    integer_cols: list[int]

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.n = n = graph.n
        nodes = graph.nodes
        values = [graph.input_bytes]
        for node in nodes:
            values += [
                node.out_bytes,
                node.residual_bytes,
                node.fwd_overhead_bytes,
                node.bwd_overhead_bytes,
            ]
        self.scale = max(1.0, max(values) / 1e4)
        q = self.scale
        self.out = [node.out_bytes / q for node in nodes]
        self.res = [node.residual_bytes / q for node in nodes]
        self.saved = [o + r for o, r in zip(self.out, self.res, strict=True)]
        self.foh = [node.fwd_overhead_bytes / q for node in nodes]
        self.boh = [node.bwd_overhead_bytes / q for node in nodes]
        self.inp = graph.input_bytes / q
        self.sinks = set(graph.sinks)
        self.maxcons = [max(graph.consumers(u), default=-1) for u in range(n)]
        # the last forward stage that reads u's first-forward copy or runs while the program
        # holds it (Node.held_until)
        self.fwd_last = [
            max(self.maxcons[u], -1 if node.held_until is None else node.held_until)
            for u, node in enumerate(nodes)
        ]
        # gradients are fixed by the backward order: live when stage T(v) starts / new in b_v
        self.grad_start = [
            sum(self.out[u] for u in range(v + 1) if u in self.sinks or self.maxcons[u] > v)
            for v in range(n)
        ]
        self.grad_new = [
            sum(self.out[u] for u in nodes[v].inputs if self.maxcons[u] == v) for v in range(n)
        ]
        self.loss_grads = sum(self.out[o] for o in self.sinks)
        self.ncols = 0
        self.integer_cols = []
        self.lb: dict[int, float] = {}
        self.ub: dict[int, float] = {}
        self.objective: dict[int, float] = {}
        self._rows: list[tuple[dict[int, float], float, float, str]] = []

    def _new(self, lb: float = 0.0, ub: float = 1.0) -> int:
        col = self.ncols
        self.ncols += 1
        if lb:
            self.lb[col] = lb
        if ub != 1.0:
            self.ub[col] = ub
        return col

    def _row(self, coef: dict[int, float], lo: float, hi: float, group: str) -> None:
        self._rows.append((coef, lo, hi, group))

    def constraint_groups(self) -> dict[str, int]:
        """How many rows each constraint group has (for reports)."""
        groups: dict[str, int] = {}
        for *_, group in self._rows:
            groups[group] = groups.get(group, 0) + 1
        return groups

    def segments(self, x: Any) -> tuple[Segment, ...]:
        """The plan's segments from an integral solution vector."""
        raise NotImplementedError

    def fractions(self, x: Any) -> tuple[list[float], list[float]]:
        """Per node: how much it is recomputed, and how much it ends a segment (LP values)."""
        raise NotImplementedError

    def solve(
        self, budget: int | None, *, integral: bool, time_limit_s: float, mip_rel_gap: float = 0.0
    ) -> dict[str, Any]:
        """Solve at ``budget`` (bytes; ``None``: minimise the peak instead of the time)."""
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp  # type: ignore[import-untyped]
        from scipy.sparse import coo_array  # type: ignore[import-untyped]

        rows, cols, vals, lo, hi = [], [], [], [], []
        for r, (coef, l_, h_, _) in enumerate(self._rows):
            for col, val in coef.items():
                if val:
                    rows.append(r)
                    cols.append(col)
                    vals.append(val)
            lo.append(l_)
            hi.append(h_)
        A = coo_array((vals, (rows, cols)), shape=(len(self._rows), self.ncols)).tocsr()
        c = np.zeros(self.ncols)
        for col, value in self.objective.items():
            c[col] = value
        # time in units of the largest recomputation cost, so HiGHS's absolute gap
        # tolerance (1e-6) is negligible
        time_scale = float(c.max()) if c.size and c.max() > 0 else 1.0
        c = c / time_scale
        lb = np.zeros(self.ncols)
        ub = np.ones(self.ncols)
        for col, value in self.lb.items():
            lb[col] = value
        for col, value in self.ub.items():
            ub[col] = value
        integrality = np.zeros(self.ncols)
        if integral:
            integrality[: self.n_binary] = 1
            for col in self.integer_cols:
                integrality[col] = 1
        if budget is None:
            c = c / max(1.0, float(c.sum())) * 1e-6  # tie-break on time, minimise the peak
            c[self.col_budget] = 1.0
            lb[self.col_budget], ub[self.col_budget] = 0.0, np.inf
        else:
            lb[self.col_budget] = ub[self.col_budget] = budget / self.scale
        options: dict[str, Any] = {"time_limit": time_limit_s, "disp": False, "presolve": True}
        if integral:
            options["mip_rel_gap"] = mip_rel_gap
        start = time.perf_counter()
        with _highs_prints_dropped():
            res = milp(
                c,
                integrality=integrality,
                bounds=Bounds(lb, ub),
                constraints=[LinearConstraint(A, np.array(lo), np.array(hi))],
                options=options,
            )
        status = {0: "optimal", 1: "time_limit", 2: "infeasible", 3: "unbounded"}.get(
            res.status, "error"
        )
        out: dict[str, Any] = {
            "status": status,
            "message": res.message,
            "seconds": time.perf_counter() - start,
            "x": None if res.x is None else np.asarray(res.x),
            "rows": len(self._rows),
            "columns": self.ncols,
            "binaries": self.n_binary if integral else 0,
        }
        if res.x is not None:
            base = self.graph.total_fwd_time() + self.graph.total_bwd_time()
            out["objective"] = base + float(
                sum(v * res.x[col] for col, v in self.objective.items())
            )
        if integral:
            for name in ("mip_gap", "mip_dual_bound", "mip_node_count"):
                reported = getattr(res, name, None)
                if reported is not None:
                    out[name] = float(reported)
            if "mip_dual_bound" in out and budget is not None:
                out["mip_dual_bound"] = out["mip_dual_bound"] * time_scale + (
                    self.graph.total_fwd_time() + self.graph.total_bwd_time()
                )
        return out

    def milp_peak_bytes(self, x: Any) -> int:
        """The largest ``U`` of a solution, in bytes (what the MILP thinks the peak is)."""
        peak = 0.0
        for coef, _, hi, group in self._rows:
            if group.startswith("U <= budget"):
                used = sum(v * x[c] for c, v in coef.items() if c != self.col_budget) - hi
                peak = max(peak, used)
        return int(round(peak * self.scale))


class StageModel(_Model):
    """Checkmate's stage matrix (``encoding="stages"``): the reference encoding.

    Columns: ``R[v,i]`` (binary), ``CR[c,i] = sum_{v >= c} R[v,i]`` (recomputed in stage
    ``T(c)`` or earlier), ``S[t,u]`` (forward copy of ``u`` kept into stage ``t``), ``U[v,k]``
    (memory after the ``k``-th recomputation of stage ``T(v)``), and optionally a budget column
    (when minimising the peak).
    """

    def __init__(self, graph: Graph) -> None:
        if not all(node.keeps_output for node in graph.nodes):
            raise ValueError(
                "the 'stages' encoding assumes every node keeps its own output until its "
                "backward (Node.keeps_output); this graph has nodes that do not: use "
                "encoding='runs'"
            )
        super().__init__(graph)
        n, sinks, maxcons = self.n, self.sinks, self.maxcons
        self.L = n
        # --- columns
        self.ncols = 0
        self.col_R: dict[tuple[int, int], int] = {}
        for v in range(n):
            for i in range(v + 1):
                self.col_R[(v, i)] = self._new()
        self.n_binary = self.ncols
        self.col_CR: dict[tuple[int, int], int] = {}
        for c in range(n):
            for i in range(c + 1):
                self.col_CR[(c, i)] = self._new()
        self.col_S: dict[tuple[int, int], int] = {}
        for u in range(n):
            need_fwd = self.L if u in sinks else self.fwd_last[u]
            for t in range(u + 1, self.T(u) + 1):
                # (1b) a forward consumer or the loss reads it: kept until then
                self.col_S[(t, u)] = self._new(lb=1.0 if t <= need_fwd else 0.0)
        self.col_U: dict[tuple[int, int], int] = {}
        for v in range(n):
            for k in range(v + 1):
                self.col_U[(v, k)] = self._new(ub=math.inf)
        self.col_budget = self._new()
        fwd = [node.fwd_time for node in graph.nodes]
        for (_, i), col in self.col_R.items():
            self.objective[col] = fwd[i]
        self._build(maxcons)

    def T(self, v: int) -> int:
        """The stage of the backward of node ``v``."""
        return 2 * self.n - v

    def _build(self, maxcons: list[int]) -> None:
        n, nodes = self.n, self.graph.nodes
        R, CR, S, U, B = self.col_R, self.col_CR, self.col_S, self.col_U, self.col_budget
        # [Segment shape] R[v,i] <= R[v,i+1]: a stage recomputes a run ending at its frontier v
        for v in range(n):
            for i in range(v):
                self._row({R[(v, i)]: 1, R[(v, i + 1)]: -1}, -math.inf, 0, "segment-run")
        # [Cumulative recomputation] CR[c,i] = R[c,i] + CR[c+1,i]; CR <= 1: at most once
        for c in range(n):
            for i in range(c + 1):
                coef = {CR[(c, i)]: 1.0, R[(c, i)]: -1.0}
                if c + 1 < n:
                    coef[CR[(c + 1, i)]] = -1.0
                self._row(coef, 0, 0, "recompute-once")
        # [(1c) + FREE] S[t+1,u] <= S[t,u]: a freed forward copy never comes back
        for u in range(n):
            for t in range(u + 1, self.T(u)):
                self._row({S[(t + 1, u)]: 1, S[(t, u)]: -1}, -math.inf, 0, "(1c) FREE")
        # [(1b) stored node] b_u reads f_u's saved tensors: kept until T(u) unless recomputed
        for u in range(n):
            self._row({S[(self.T(u), u)]: 1, CR[(u, u)]: 1}, 1, math.inf, "(1b) stored output")
        # [(1b) stored consumer] b_w reads the inputs it saved: kept until T(w) if w is stored
        for w, node in enumerate(nodes):
            for u in node.backward_inputs:
                self._row({S[(self.T(w), u)]: 1, CR[(w, w)]: 1}, 1, math.inf, "(1b) saved input")
        # [(1b) segment frame] a segment [a, v] reads external input u: kept until T(a)
        # (sum over v >= c of y[v,a] = CR[c,a] - CR[c,a-1], y = "a starts the segment at v")
        for u in range(n):
            cons = self.graph.consumers(u)
            for a in range(u + 1, (max(cons) if cons else u) + 1):
                first = min((w for w in cons if w >= a), default=None)
                if first is None:
                    continue
                self._row(
                    {S[(self.T(a), u)]: 1, CR[(first, a)]: -1, CR[(first, a - 1)]: 1},
                    0,
                    math.inf,
                    "(1b) segment input",
                )
        # [U, forward stages] memory while node t runs its first forward
        for t in range(n):
            coef = {B: -1.0}
            const = self.inp + self.out[t] + self.res[t] + self.foh[t]
            coef[CR[(t, t)]] = -self.res[t]
            for u in range(t):
                coef[S[(t, u)]] = self.out[u]
                const += self.res[u]
                coef[CR[(u, u)]] = coef.get(CR[(u, u)], 0) - self.res[u]
            self._row(coef, -math.inf, -const, "U <= budget (forward)")
        # [U, loss stage]
        coef = {B: -1}
        const = self.inp + self.loss_grads
        for u in range(n):
            coef[S[(self.L, u)]] = self.out[u]
            const += self.res[u]
            coef[CR[(u, u)]] = coef.get(CR[(u, u)], 0) - self.res[u]
        self._row(coef, -math.inf, -const, "U <= budget (loss)")
        # [U, backward stages] U[v,-1] = memory when stage T(v) starts; Checkmate's recurrence
        # U[v,k] = U[v,k-1] + M_k R[v,k] (nothing is freed before the frontier backward)
        for v in range(n):
            t = self.T(v)
            coef = {U[(v, 0)]: 1.0, R[(v, 0)]: -self.saved[0]}
            const = self.inp + self.grad_start[v]
            for u in range(v + 1):
                coef[S[(t, u)]] = coef.get(S[(t, u)], 0) - self.out[u]
                const += self.res[u]
                coef[CR[(u, u)]] = coef.get(CR[(u, u)], 0) + self.res[u]
                if v + 1 < n:
                    coef[CR[(v + 1, u)]] = coef.get(CR[(v + 1, u)], 0) - self.saved[u]
            self._row(coef, const, const, "U recurrence")
            for k in range(1, v + 1):
                self._row(
                    {U[(v, k)]: 1, U[(v, k - 1)]: -1, R[(v, k)]: -self.saved[k]},
                    0,
                    0,
                    "U recurrence",
                )
            for k in range(v):
                if self.foh[k]:
                    self._row(
                        {U[(v, k)]: 1, R[(v, k)]: self.foh[k], B: -1}, -math.inf, 0, "U <= budget"
                    )
            self._row({U[(v, v)]: 1, R[(v, v)]: self.foh[v], B: -1}, -math.inf, 0, "U <= budget")
            self._row(
                {U[(v, v)]: 1, B: -1},
                -math.inf,
                -(self.grad_new[v] + self.boh[v]),
                "U <= budget",
            )

    def fractions(self, x: Any) -> tuple[list[float], list[float]]:
        n = self.n
        mass = [float(x[self.col_CR[(i, i)]]) for i in range(n)]
        return mass, [float(x[self.col_R[(i, i)]]) for i in range(n)]

    def segments(self, x: Any) -> tuple[Segment, ...]:
        """The plan's segments from a solution vector (``R > 0.5``)."""
        segs = []
        for v in range(self.n):
            nodes = tuple(i for i in range(v + 1) if x[self.col_R[(v, i)]] > 0.5)
            if nodes:
                segs.append(Segment(nodes))
        return tuple(segs)


class RunModel(_Model):
    """The compact encoding (``encoding="runs"``, the default) of the same MILP.

    A stage's recomputation is a run of nodes ending at its frontier, so the stage matrix is
    fixed by two binaries per node: ``r[i] = sum_t R[t,i]`` (node ``i`` is recomputed) and
    ``e[v] = R[T(v),v]`` (node ``v`` ends a segment; then ``R[T(v),i] = 1`` for the run
    ``i..v`` of recomputed nodes with no end before ``v``). ``q[i] = r[i] - e[i]`` says the
    segment goes on after ``i``. The memory of recomputed copies is the run sum ``RS[k]`` of
    ``saved`` from the segment's first node to ``k`` (a linear recurrence with a big-M), and
    ``S[u,v]`` (the forward copy of ``u`` kept into stage ``T(v)``) exists only for
    ``v <= max(u, last reader of u)``: later it cannot change. 2n binaries and O(n + sum of
    edge spans) rows, against n^2/2 binaries for :class:`StageModel`; same optimum (tested).
    """

    def __init__(self, graph: Graph, cap_bytes: int | None = None) -> None:
        super().__init__(graph)
        self.cap = None if cap_bytes is None else cap_bytes / self.scale
        n, nodes, maxcons = self.n, graph.nodes, self.maxcons
        self.col_r = [self._new() for _ in range(n)]
        self.col_e = [self._new() for _ in range(n)]
        self.n_binary = self.ncols
        for i, node in enumerate(nodes):
            self.objective[self.col_r[i]] = node.fwd_time
        self.col_RS = [self._new(ub=math.inf) for _ in range(n)]
        # outputs that only consumers' backwards keep (Node.keeps_output False): a recomputed
        # copy lives from its first saving consumer's recomputation on (z), and during the
        # recomputation pass only while a later node of the run still reads it (y)
        self.keeps = [node.keeps_output for node in nodes]
        self.first_saver: list[int | None] = []
        for j in range(n):
            savers = [w for w in graph.consumers(j) if j in nodes[w].backward_inputs]
            self.first_saver.append(min(savers) if savers else None)
        self.col_z = {
            j: self._new()
            for j in range(n)
            if not self.keeps[j] and self.first_saver[j] is not None
        }
        self.col_y: dict[tuple[int, int], tuple[int, int]] = {}  # (j, m) -> (column, d)
        for j in range(n):
            if self.keeps[j]:
                continue
            cons = graph.consumers(j)
            stop = self.first_saver[j] if self.first_saver[j] is not None else n
            for m in range(j + 1, min(stop, self.maxcons[j] + 1)):
                d = min(w for w in cons if w >= m)
                self.col_y[(j, m)] = (self._new(), d)
        overheads = any(self.foh) or not all(self.keeps)
        self.col_MX = [self._new(ub=math.inf) for _ in range(n)] if overheads else []
        self.hold = [max(u, maxcons[u]) for u in range(n)]  # last stage index that can hold u
        self.col_S: dict[tuple[int, int], int] = {}
        for u in range(n):
            for v in range(u, self.hold[u] + 1):
                self.col_S[(u, v)] = self._new()
        self.col_budget = self._new()
        # constants (Graph.constants): live through the forwards of first..last; one that a
        # recomputed node reads is kept to its recomputation (K >= r[reader]), counted from
        # the forward after ``last`` to the backward of its first reader (an upper bound)
        self.constants = [
            (c.nbytes / self.scale, c.first, c.last, min(c.readers) if c.readers else None)
            for c in graph.constants
        ]
        self.col_K = [self._new() if c.readers else None for c in graph.constants]
        self._build(overheads)

    def _S(self, u: int, v: int) -> int:
        """Column of the forward copy of ``u`` kept into stage ``T(v)`` (``v >= u``)."""
        return self.col_S[(u, min(v, self.hold[u]))]

    def _build(self, overheads: bool) -> None:
        n, nodes, graph = self.n, self.graph.nodes, self.graph
        r, e, RS, MX, B = self.col_r, self.col_e, self.col_RS, self.col_MX, self.col_budget
        big = sum(self.saved) + max(self.foh)  # bounds every run sum and running max
        keeps, z, y = self.keeps, self.col_z, self.col_y
        # what a recomputed node k adds to the run sum: its saved tensors, less its output when
        # its own backward does not keep it, plus the outputs whose first saving consumer is k
        run_saved = [self.saved[k] if keeps[k] else self.res[k] for k in range(n)]
        joins: list[dict[int, float]] = [{} for _ in range(n)]
        joined = [0.0] * n
        for j, col in z.items():
            joins[self.first_saver[j]][col] = -self.out[j]  # type: ignore[index]
            joined[self.first_saver[j]] += self.out[j]  # type: ignore[index]
        # bounds on the run sums (big-M of the recurrence): the longest run ending at k, and,
        # under a budget cap, what stage T(k) leaves of it (any plan that fits obeys both)
        ub_rs, total = [], 0.0
        for k in range(n):
            total += run_saved[k] + joined[k]
            ub = total
            if self.cap is not None:
                stage = self.inp + self.grad_start[k] + self.grad_new[k] + self.boh[k]
                ub = max(0.0, min(ub, self.cap - stage))
            ub_rs.append(ub)
            if self.cap is None:
                continue  # the plain model (checkmate-lp's relaxation, strengthen=False)
            self.ub[RS[k]] = ub
            if ub < run_saved[k] - 1e-9:  # k cannot be recomputed at all under the cap
                self.ub[r[k]] = self.ub[e[k]] = 0.0
        ub_mx = [big] * n
        if overheads and self.cap is not None:
            least_start = math.inf
            for k in reversed(range(n)):  # MX[k] is paid at the end of its run, some v >= k
                least_start = min(least_start, self.inp + self.grad_start[k])
                ub_mx[k] = max(0.0, self.cap - least_start)
                self.ub[MX[k]] = ub_mx[k]

        def same_run(col: int, j: int, d: int, group: str) -> None:
            # col >= 1 when j..d are recomputed in one segment: r[d] + sum q[j..d-1] - (d - j)
            coef: dict[int, float] = {col: 1.0, r[d]: -1.0}
            for i in range(j, d):
                coef[r[i]] = coef.get(r[i], 0.0) - 1.0
                coef[e[i]] = coef.get(e[i], 0.0) + 1.0
            self._row(coef, -(d - j), math.inf, group)

        for j, col in z.items():
            same_run(col, j, self.first_saver[j], "U recurrence")  # type: ignore[arg-type]
        read_later: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for (j, m), (col, d) in y.items():
            same_run(col, j, d, "U recurrence")
            read_later[m].append((j, col))
        # [R shape] e[v] <= r[v]; a segment going on after i needs i+1: q[i] <= r[i+1];
        # the last node ends its segment
        for i in range(n):
            self._row({e[i]: 1, r[i]: -1}, -math.inf, 0, "R runs")
            nxt = {r[i + 1]: -1.0} if i + 1 < n else {}
            self._row({r[i]: 1, e[i]: -1, **nxt}, -math.inf, 0, "R runs")
        # [U recurrence] RS[k] = saved_k r[k] + q[k-1] RS[k-1] (recomputed copies of the run)
        for k in range(n):
            self._row({RS[k]: 1, r[k]: -run_saved[k], **joins[k]}, 0, math.inf, "U recurrence")
            if k:
                m_k = big if self.cap is None else ub_rs[k - 1] + run_saved[k] + joined[k]
                self._row(
                    {RS[k]: 1, RS[k - 1]: -1, r[k - 1]: -m_k, e[k - 1]: m_k, **joins[k]},
                    run_saved[k] - m_k,
                    math.inf,
                    "U recurrence",
                )
            if overheads:  # MX[k] = max over the run so far of what the recomputation holds
                # at node k: RS, k's output, the outputs a later node of the run still reads
                alloc = self.foh[k] + (0.0 if keeps[k] else self.out[k])
                coef = {MX[k]: 1.0, RS[k]: -1.0, r[k]: -alloc}
                for j, col in read_later[k]:
                    coef[col] = -self.out[j]
                self._row(coef, 0, math.inf, "U recurrence")
                if k:
                    m_k = ub_mx[k - 1]
                    self._row(
                        {MX[k]: 1, MX[k - 1]: -1, r[k - 1]: -m_k, e[k - 1]: m_k},
                        -m_k,
                        math.inf,
                        "U recurrence",
                    )
        if self.cap is not None:  # the kept copies are 0/1 in every plan: let HiGHS branch
            self.integer_cols = list(self.col_S.values())
            self._checkpoint_links()
        # [(1c) + FREE] S[u,v-1] <= S[u,v]: kept into a later stage => kept into earlier ones
        for u in range(n):
            for v in range(u + 1, self.hold[u] + 1):
                self._row(
                    {self.col_S[(u, v)]: 1, self.col_S[(u, v - 1)]: -1}, 0, math.inf, "(1c) FREE"
                )
        # [(1b) stored output] b_u reads f_u's saved tensors unless u is recomputed
        for u in range(n):
            if keeps[u]:
                self._row({self._S(u, u): 1, r[u]: 1}, 1, math.inf, "(1b) stored output")
        # [(1b) saved input] a stored consumer w keeps the inputs its backward reads
        for w, node in enumerate(nodes):
            for u in node.backward_inputs:
                self._row({self._S(u, w): 1, r[w]: 1}, 1, math.inf, "(1b) saved input")
        # [(1b) segment input] a segment starting at a (b[a] = r[a] - q[a-1]) that reaches the
        # first reader c >= a of u keeps u's forward copy until T(a)
        for u in range(n):
            cons = graph.consumers(u)
            for a in range(u + 1, self.maxcons[u] + 1):
                c = min(w for w in cons if w >= a)
                coef = {self._S(u, a): 1.0, r[a]: -1.0, r[a - 1]: 1.0, e[a - 1]: -1.0}
                for k in range(a, c):
                    coef[r[k]] = coef.get(r[k], 0.0) - 1.0
                    coef[e[k]] = coef.get(e[k], 0.0) + 1.0
                self._row(coef, -(c - a), math.inf, "(1b) segment input")
        # [K] a constant read by a recomputed node is kept until its recomputation
        for K, c in zip(self.col_K, graph.constants, strict=True):
            if K is not None:
                for i in c.readers:
                    self._row({K: 1.0, r[i]: -1.0}, 0, math.inf, "K kept constant")

        def constants(coef: dict[int, float], stage: int | None) -> float:
            """Add the constants live at forward ``stage`` (None: the loss, or the backward
            stage of node ``-stage - 1``): their bytes, returned, or their K terms."""
            const = 0.0
            for (m, first, last, low), K in zip(self.constants, self.col_K, strict=True):
                if stage is not None and stage >= 0 and first <= stage <= last:
                    const += m
                elif K is not None and (
                    stage is None
                    or (stage >= 0 and stage > last)
                    or (stage < 0 and -stage - 1 >= low)  # type: ignore[operator]
                ):
                    coef[K] = coef.get(K, 0.0) + m
            return const

        # [U <= budget] forward stages: kept copies, stored residuals, the node itself
        for t in range(n):
            coef = {B: -1.0, r[t]: -self.res[t]}
            const = self.inp + self.saved[t] + self.foh[t] + constants(coef, t)
            for u in range(t):
                const += self.res[u]
                coef[r[u]] = coef.get(r[u], 0.0) - self.res[u]
                if u in self.sinks or t <= self.fwd_last[u]:
                    const += self.out[u]
                else:
                    coef[self._S(u, self.hold[u])] = self.out[u]
            self._row(coef, -math.inf, -const, "U <= budget (forward)")
        coef = {B: -1}
        const = self.inp + self.loss_grads + constants(coef, None)
        for u in range(n):
            const += self.res[u]
            coef[r[u]] = coef.get(r[u], 0.0) - self.res[u]
            if u in self.sinks:
                const += self.out[u]
            else:
                coef[self._S(u, self.hold[u])] = self.out[u]
        self._row(coef, -math.inf, -const, "U <= budget (loss)")
        # [U <= budget] backward stage T(v): start memory + recomputed run (+ b_v's new grads)
        for v in range(n):
            coef = {B: -1, RS[v]: 1}
            const = self.inp + self.grad_start[v] + constants(coef, -v - 1)
            for u in range(v + 1):
                const += self.res[u]
                coef[r[u]] = coef.get(r[u], 0.0) - self.res[u]
                coef[self._S(u, v)] = coef.get(self._S(u, v), 0.0) + self.out[u]
            start = dict(coef)
            self._row(coef, -math.inf, -(const + self.grad_new[v] + self.boh[v]), "U <= budget")
            if overheads:  # the recomputation phase, when v ends a segment
                start.pop(RS[v])
                start[MX[v]] = 1
                # relaxed when e[v] = 0 by the most the row's left side can reach
                m_v = big
                if self.cap is not None:
                    m_v = const + sum(self.out[u] for u in range(v + 1)) + ub_mx[v]
                    m_v += sum(m for m, *_ in self.constants)
                start[e[v]] = start.get(e[v], 0.0) + m_v
                self._row(start, -math.inf, -const + m_v, "U <= budget (recompute)")

    def _checkpoint_links(self) -> None:
        """Valid inequalities that the relaxation otherwise misses: a node's value must be at
        hand when a consumer ``c`` needs it, unless both are recomputed in one segment.

        For an edge ``u -> c``, "same segment" is at most ``r[u]``, ``r[c]`` and every
        ``q[i] = r[i] - e[i]`` for ``i`` in ``u..c-1``. Otherwise ``u``'s forward copy is kept
        into stage ``T(c)``: by ``c``'s backward if ``c`` saves ``u`` (stored ``c``), or as an
        input of ``c``'s segment (recomputed ``c``; kept until the backward of the segment's
        first node, which is at or after ``T(c)``). Hence, if ``c`` saves ``u``:
        ``S[u,c] >= 1 - r[u]``, ``>= 1 - r[c]``, ``>= 1 - q[i]``; if not:
        ``S[u,c] >= r[c] - r[u]``, ``>= r[c] - q[i]``. The integer solutions are unchanged; on
        ResNet-50 at the ``reforward`` memory the LP bound rises from an overhead of 0.066 to
        0.109 (optimum 0.124)."""
        r, e = self.col_r, self.col_e
        for c, node in enumerate(self.graph.nodes):
            saves = set(node.backward_inputs)
            for u in node.inputs:
                S = self._S(u, c)
                if u in saves:
                    self._row({S: 1.0, r[u]: 1.0}, 1, math.inf, "checkpoint link")
                    for i in range(u, c):
                        self._row({S: 1.0, r[i]: 1.0, e[i]: -1.0}, 1, math.inf, "checkpoint link")
                else:
                    self._row({S: 1.0, r[c]: -1.0, r[u]: 1.0}, 0, math.inf, "checkpoint link")
                    for i in range(u, c):
                        self._row(
                            {S: 1.0, r[c]: -1.0, r[i]: 1.0, e[i]: -1.0},
                            0,
                            math.inf,
                            "checkpoint link",
                        )

    def fractions(self, x: Any) -> tuple[list[float], list[float]]:
        return [float(x[c]) for c in self.col_r], [float(x[c]) for c in self.col_e]

    def segments(self, x: Any) -> tuple[Segment, ...]:
        """The plan's segments from a solution vector: runs of ``r``, cut after each ``e``."""
        segs: list[Segment] = []
        run: list[int] = []
        for i in range(self.n):
            if x[self.col_r[i]] > 0.5:
                run.append(i)
                if x[self.col_e[i]] > 0.5:
                    segs.append(Segment(tuple(run)))
                    run = []
            elif run:
                segs.append(Segment(tuple(run)))
                run = []
        if run:
            segs.append(Segment(tuple(run)))
        return tuple(segs)


def _model(graph: Graph, encoding: str, cap_bytes: int | None = None) -> _Model:
    """The MILP of ``graph``; ``cap_bytes`` (an upper bound of every budget it will be solved
    at) tightens the ``runs`` encoding's big-M constants and variable bounds. Constants that
    backwards save are counted all step (:meth:`Graph.saved_constants_as_input`)."""
    graph = graph.saved_constants_as_input()
    return RunModel(graph, cap_bytes) if encoding == "runs" else StageModel(graph)


def backward_floor(graph: Graph) -> tuple[int, int | None]:
    """``(bytes, node)``: a peak no plan of this graph goes below (any segments, nested or not,
    any recomputation order: the graph's nodes are the granularity), and the node whose
    backward sets it (``None``: the loss). Each backward ``v`` needs, at once, the graph input,
    the gradients already made for outputs still read by later nodes, the input gradients it
    makes, its own saved tensors, the forward values of the inputs it saved, and its backward
    transients. For AlexNet and VGG this is the first convolution + in-place ReLU at full
    resolution (ReLU's output, the gradient in and the gradient out, VGG-13/16 also the
    convolution's input), which is why no plan reaches the Re-forwarding paper's ratios there
    (docs/results/reforward). Used by ``checkmate-milp`` to reject a budget below it at once."""
    n, nodes = graph.n, graph.nodes
    sinks = set(graph.sinks)
    maxcons = [max(graph.consumers(u), default=-1) for u in range(n)]
    best: tuple[int, int | None] = (
        graph.input_bytes + sum(2 * nodes[o].out_bytes for o in sinks),
        None,
    )
    for v in range(n):
        grads = sum(nodes[u].out_bytes for u in range(v + 1) if u in sinks or maxcons[u] > v)
        new = sum(nodes[u].out_bytes for u in nodes[v].inputs if maxcons[u] == v)
        own = nodes[v].saved_bytes if nodes[v].keeps_output else nodes[v].residual_bytes
        read = sum(nodes[u].out_bytes for u in nodes[v].backward_inputs)
        total = graph.input_bytes + grads + new + own + read + nodes[v].bwd_overhead_bytes
        best = max(best, (total, v), key=lambda bn: bn[0])
    return best


@functools.lru_cache(maxsize=8)
def _least_plan(graph: Graph, config: MilpConfig) -> tuple[Plan | None, str]:
    """The MILP's plan of least peak (or the best found in the time), and the solver status.
    Its peak is the simulator's: the MILP counts a constant read by recomputed nodes as an
    upper bound, so it may price this plan a little above what the simulator names.

    Kept for the latest graphs (equal costs, equal configuration): a budget search asks for it
    from each refusal and from its floor, on the same graph (unit times: the least does not
    move with timing noise), and one solve took 6 s of a 116-node detection model's minute."""
    model = _model(graph, config.encoding)
    sol = model.solve(None, integral=True, time_limit_s=config.time_limit_s)
    if sol["x"] is None:
        return None, sol["status"]
    return Plan(model.segments(sol["x"])), sol["status"]


def _too_small(graph: Graph, budget: int, config: MilpConfig, why: str, fallback: int) -> Plan:
    """The MILP's least plan when it meets ``budget`` in simulation (the budget the error
    names is then accepted, even where the MILP's own model prices that plan above it);
    otherwise :class:`BudgetTooSmallError` naming its simulated peak."""
    least, status = _least_plan(graph, config)
    peak = simulate_graph(graph, least).peak_bytes if least is not None else None
    if least is not None and peak is not None and peak <= budget:
        params = {"status": status, "least_peak": True, "time_limit_s": config.time_limit_s}
        return Plan(least.segments, method="checkmate-milp", params=params)
    raise BudgetTooSmallError(
        budget,
        peak if peak is not None else fallback,
        "checkmate-milp",
        why + ("" if status == "optimal" else f"; minimum search stopped: {status}"),
    )


def _solve_exact(graph: Graph, budget: int, config: MilpConfig) -> Plan:
    floor = backward_floor(graph)[0]
    if budget < floor:
        return _too_small(
            graph, budget, config, "below what the loss or some backward needs", floor
        )
    model = _model(graph, config.encoding, budget if config.strengthen else None)
    target = budget
    for _ in range(3):
        sol = model.solve(
            target, integral=True, time_limit_s=config.time_limit_s, mip_rel_gap=config.mip_rel_gap
        )
        if sol["status"] == "infeasible":
            return _too_small(graph, budget, config, "no flat run-segment plan fits", budget + 1)
        if sol["x"] is None:
            raise PlannerTimeoutError(
                f"checkmate-milp found no plan within time_limit_s={config.time_limit_s} "
                f"({sol['message']}); raise the limit, or use 'checkmate-lp' or 'articulation'"
            )
        plan = Plan(model.segments(sol["x"]))
        peak = simulate_graph(graph, plan).peak_bytes
        if peak <= budget:
            break
        target -= peak - budget  # numerical slack of the solver: tighten and solve again
    params = {
        "status": sol["status"],
        "objective": sol["objective"],
        "mip_gap": sol.get("mip_gap", 0.0),
        "mip_dual_bound": sol.get("mip_dual_bound"),
        "mip_node_count": sol.get("mip_node_count"),
        "solve_seconds": round(sol["seconds"], 3),
        "time_limit_s": config.time_limit_s,
        "binaries": sol["binaries"],
        "rows": sol["rows"],
        "columns": sol["columns"],
        "milp_peak_bytes": model.milp_peak_bytes(sol["x"]),
    }
    return Plan(plan.segments, method="checkmate-milp", params=params)


def _round_lp(graph: Graph, budget: int, config: MilpConfig) -> Plan:
    """Checkmate's approximation: LP at a fraction of the budget, threshold rounding.

    When no rounding fits, the LP is solved again at a tighter budget (x 0.85 each time, down
    to 0.3 of the budget), as Checkmate tightens the LP budget to absorb rounding overshoot.
    """
    model = _model(graph, config.encoding)
    rng = random.Random(config.seed)
    fraction = config.lp_budget_fraction
    tried = 0
    lowest: int | None = None
    while fraction >= 0.3:
        sol = model.solve(int(budget * fraction), integral=False, time_limit_s=config.time_limit_s)
        if sol["x"] is None:
            break
        tried += 1
        best = None
        candidates = _roundings(model, sol["x"], rng, config.random_roundings)
        for plan in candidates:
            sim = simulate_graph(graph, plan)
            lowest = sim.peak_bytes if lowest is None else min(lowest, sim.peak_bytes)
            if sim.peak_bytes <= budget and (best is None or sim.total_time < best[0]):
                best = (sim.total_time, plan)
        if best is not None:
            bound = model.solve(budget, integral=False, time_limit_s=config.time_limit_s)
            lp_time = bound.get("objective")
            params = {
                "status": sol["status"],
                "lp_bound": lp_time,
                "lp_gap": (best[0] - lp_time) / lp_time if lp_time else None,
                "lp_budget_bytes": int(budget * fraction),
                "lp_solves": tried,
                "roundings": len(candidates),
                "solve_seconds": round(sol["seconds"], 3),
            }
            return Plan(best[1].segments, method="checkmate-lp", params=params)
        fraction *= 0.85
    if lowest is None:
        lowest = simulate_graph(graph, Plan.from_segments([range(graph.n)])).peak_bytes
    raise BudgetTooSmallError(
        budget,
        max(lowest, budget + 1),
        "checkmate-lp",
        "no rounding of the LP fits (the least peak a rounding reached is given); "
        "try checkmate-milp",
    )


def _roundings(model: _Model, x: Any, rng: random.Random, random_roundings: int) -> list[Plan]:
    """Threshold roundings of an LP solution: recompute the nodes whose LP recomputation is at
    least the threshold; segments are their runs, cut where the LP ends a segment by at least
    a second threshold (1.01: never cut; 0: every node alone)."""
    n = model.n
    mass, ends = model.fractions(x)
    thresholds = [k / 10 for k in range(1, 10)]
    thresholds += [min(1.0, max(0.0, rng.gauss(0.5, 0.5))) for _ in range(random_roundings)]
    candidates: dict[tuple[tuple[int, ...], ...], Plan] = {}
    for theta in thresholds:
        chosen = [i for i in range(n) if mass[i] >= theta and mass[i] > 1e-9]
        for cut in (1.01, 0.5, 0.25, 0.1, 0.01, 0.0):
            runs: list[list[int]] = []
            for i in chosen:
                if runs and runs[-1][-1] == i - 1 and not ends[i - 1] >= cut:
                    runs[-1].append(i)
                else:
                    runs.append([i])
            key = tuple(tuple(r) for r in runs)
            candidates.setdefault(key, Plan.from_segments(runs))
    return list(candidates.values())
