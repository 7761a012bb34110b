"""Chen et al. 2016: sqrt(n) segments, greedy segments under a budget, and recursion.

Paper: Chen, Xu, Zhang, Guestrin, "Training Deep Nets with Sublinear Memory Cost",
arXiv:1604.06174 (notes §1). Three planners, each a pure function ``(chain, budget) -> Plan``:

* ``chen-sqrt`` (§4.3, Alg. 1 with equal segments): ``k = round(sqrt(n))`` segments of nearly
  equal length (they differ by at most one stage). Guarantee on a homogeneous chain: peak
  O(sqrt n) activations, at most one extra forward pass.
* ``chen-budget`` (§4.3 Alg. 3 and Appendix A): greedy segments with a per-segment budget
  ``B``, and the paper's search over ``B``. Guarantee: none beyond "the best of the plans
  tried"; every plan tried costs at most one extra forward.
* ``chen-recursive`` (§4.4): one kept activation per level of a binary recursion,
  ``g(n) = 1 + g(n/2) = log2 n``; a nested plan. Peak O(log n) activations, every stage
  recomputed at most ``ceil(log2 n)`` times, O(n log n) forward work.

With a ``budget`` each raises :class:`~remat.planners.BudgetTooSmallError` naming the least
peak it reaches when its plan does not fit; ``chen-budget`` returns the fastest of its
candidate plans that fits.

Example:
    >>> from remat import Chain, simulate
    >>> chain = Chain.homogeneous(16)
    >>> plan_chen_sqrt(chain, None).describe()
    '(1-4) (5-8) (9-12) [13-16]'
    >>> simulate(chain, plan_chen_sqrt(chain, None)).recompute_time == 12.0
    True

Note [store the last segment]. Alg. 1 re-forwards every segment in the backward, the last one
included, although the last segment's backward starts right after its forward. remat stores it
(``store_last=True``), which is never worse in memory and saves its recomputation. By
simulate's rules (Note [flat plan peak] in :mod:`remat.planners.hong`), while the last segment
``(l, n]`` is handled the live memory is the kept prefix ``P(l)`` plus:

* checkpointed: forward without grad (``<= o[i-1] + o[i]``), the loss (``2 o[n]``), then the
  recomputation with ``δ[n]`` live, ``o[n] + Q[i] - Q[l] + f[i]``, then the backward terms;
* stored: the forward with grad, ``Q[i] - Q[l] + f[i]`` (the recomputation term minus
  ``o[n]``), the loss (``Q[n] - Q[l] + o[n]``, below the backward of stage ``n``), then the
  *same* backward terms.

Every term of the stored version is at most a term of the checkpointed one, and the other
segments are untouched, so the peak cannot grow; the time drops by the segment's forward time.
``tests/test_planners_chen.py`` checks both claims on random chains.

Note [greedy sizes]. Alg. 3 adds up "size-of-output(v)" along a segment and cuts once the sum
exceeds ``B``. The quantity that grows with a segment in remat's model is what its stored
stages keep while it is recomputed and back-propagated, ``saved_bytes`` (output plus autograd's
saved tensors; Note [flat plan peak]: the segment term is ``Q[r] - Q[l]`` plus a few
activations). So ``temp`` sums ``saved_bytes``, and a cut keeps ``out_bytes`` (what a
checkpoint holds): ``x`` is the kept bytes, ``y`` the largest stored segment, as in the paper.
On the papers' one-size models (``saved_bytes == out_bytes``) this is Alg. 3 verbatim.

Note [chen-budget search]. We follow the paper (Appendix A), not the released code:
``B = 0`` gives ``(x, y)``; then ``B = sqrt(x·y)``; then 6 evenly spaced values on
``[B/2, 2B]``; every plan is costed exactly by :func:`remat.simulate` (the paper's static
allocator). The authors' ``memonger.search_plan`` differs (notes §1.6): the threshold is in MB
of ``numel·4`` excluding parameters; the guess is ``sqrt(x·y/2)`` (an extra ``/2``), applied
in three start rounds (``0 -> guess -> guess`` from the previous plan's ``x, y``); the grid
is 6 values ``min + k·step``, ``k = 1..6``, from the least ``y`` seen to
``last_guess·sqrt(2)``; candidates are the nodes tagged ``mirror_stage`` (residual-block inputs;
an LSTM step's ``c`` and ``h`` kept together), the cost is MXNet's total allocation. Here
every stage boundary is a candidate, since a captured chain's stages are already blocks.

Known limitations: flat plans for ``chen-sqrt``/``chen-budget`` (optimal flat plans:
``hong-dp``, ``reforward``); ``chen-recursive`` splits by stage count, not by bytes, so on
very heterogeneous chains its peak can be far from the least nested one (``optimal-time``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from remat.core.chain import Chain
from remat.core.chain_simulate import simulate
from remat.core.plan import ChainSegment, Plan
from remat.planners.registry import BudgetTooSmallError, register

__all__ = ["plan_chen_sqrt", "plan_chen_budget", "plan_chen_recursive", "greedy_checkpoints"]

_GRID = 6
"""Appendix A: the number of budgets tried on ``[B/2, 2B]``."""


@register("chen-sqrt")
def plan_chen_sqrt(chain: Chain, budget: int | None = None) -> Plan:
    """``round(sqrt(n))`` equal segments, the last one stored (Note [store the last segment])."""
    n = chain.n
    segments = max(1, round(math.sqrt(n)))
    kept = [j * n // segments for j in range(1, segments)]
    plan = Plan.from_checkpoints(chain, kept, store_last=True)
    plan = replace(plan, method="chen-sqrt", params={"segments": segments, "kept": kept})
    return _check_budget(chain, plan, budget)


@register("chen-budget")
def plan_chen_budget(chain: Chain, budget: int | None = None) -> Plan:
    """Alg. 3 greedy segments, searched over the per-segment budget ``B`` (Appendix A).

    Without a budget: the candidate of least simulated peak (ties: least time). With one: the
    fastest candidate that fits (ties: least peak).
    """
    _, x, y = greedy_checkpoints(chain, 0)
    guess = math.isqrt(x * y)
    tried = [0, guess, *(round(guess / 2 + k * (1.5 * guess) / (_GRID - 1)) for k in range(_GRID))]
    candidates = []  # (peak, time, B, plan), one per distinct plan
    seen: set[tuple[int, ...]] = set()
    for segment_budget in tried:
        kept, _, _ = greedy_checkpoints(chain, segment_budget)
        if tuple(kept) in seen:
            continue
        seen.add(tuple(kept))
        plan = Plan.from_checkpoints(chain, kept, store_last=True)
        sim = simulate(chain, plan)
        candidates.append((sim.peak_bytes, sim.total_time, segment_budget, kept, plan))
    if budget is None:
        peak, _, chosen, kept, plan = min(candidates, key=lambda c: (c[0], c[1]))
    else:
        fitting = [c for c in candidates if c[0] <= budget]
        if not fitting:
            least = min(c[0] for c in candidates)
            raise BudgetTooSmallError(
                budget, least, "chen-budget", f"least peak of its {len(candidates)} plans"
            )
        peak, _, chosen, kept, plan = min(fitting, key=lambda c: (c[1], c[0]))
    params = {
        "segment_budget_bytes": chosen,
        "segment_budgets_tried": tried,
        "kept": kept,
        "peak_bytes": peak,
    }
    return replace(plan, method="chen-budget", params=params)


@register("chen-recursive")
def plan_chen_recursive(chain: Chain, budget: int | None = None) -> Plan:
    """Binary recursion (Chen §4.4, k = 1): keep the middle activation, recurse into halves.

    The plan of stages ``lo..hi`` checkpoints the left half ``lo..mid`` (recomputed under the
    same plan of ``lo..mid``) and runs the right half in place under the plan of ``mid+1..hi``.
    Running the right half in place rather than as a second checkpointed segment is the
    recursive form of Note [store the last segment]: its backward follows its forward at
    once, so recomputing it would only cost time. The kept activations of one level (at most
    ``log2 n`` of them along the right spine) plus those of the nested levels give the
    ``log2 n + O(1)`` activations of ``g(n) = 1 + g(n/2)``.
    """
    plan = Plan.from_chain_segments(
        _halves(1, chain.n), method="chen-recursive", params={"split": "halves"}
    )
    return _check_budget(chain, plan, budget)


def greedy_checkpoints(chain: Chain, segment_budget: int) -> tuple[list[int], int, int]:
    """Alg. 3: ``(kept, x, y)`` for a per-segment budget ``B`` (Note [greedy sizes]).

    Walks the stages, summing ``saved_bytes`` into ``temp``; at each stage boundary
    ``a[1..n-1]`` (every one is a candidate) with ``temp > B`` it keeps the boundary, adds its
    ``out_bytes`` to ``x``, folds ``temp`` into ``y = max(y, temp)`` and restarts. As in the
    paper the tail after the last cut is not counted in ``y``; ``B = 0`` keeps every boundary.

    >>> greedy_checkpoints(Chain.homogeneous(6, out_bytes=2, saved_bytes=5), 9)
    ([2, 4], 4, 10)
    """
    temp = x = y = 0
    kept = []
    for i in range(1, chain.n + 1):
        temp += chain.saved_bytes[i - 1]
        if i < chain.n and temp > segment_budget:
            kept.append(i)
            x += chain.out_bytes[i - 1]
            y = max(y, temp)
            temp = 0
    return kept, x, y


def _halves(lo: int, hi: int) -> tuple[ChainSegment, ...]:
    if lo == hi:
        return (ChainSegment(lo, lo),)
    mid = (lo + hi - 1) // 2
    return (ChainSegment(lo, mid, True, _halves(lo, mid)), *_halves(mid + 1, hi))


def _check_budget(chain: Chain, plan: Plan, budget: int | None) -> Plan:
    if budget is None:
        return plan
    peak = simulate(chain, plan).peak_bytes
    if peak > budget:
        raise BudgetTooSmallError(budget, peak, plan.method)
    return plan
