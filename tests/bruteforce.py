"""Brute force over the flat plans, the reference the min-memory planners are held to.

The plan space is ``Plan.from_checkpoints(chain, S, store_last=b)`` for every ``S`` ⊆
{1..n-1} and ``b`` in {False, True}: ``2^n`` plans (16,384 at n = 14).

Two ways to cost them:

* ``simulate`` (the default): :func:`remat.simulate`, the single source of truth; about a
  millisecond per plan, so use it up to n ≈ 10.
* ``closed_form``: the O(n) closed form of Note [flat plan peak] (``remat.planners.hong``)
  through a table of every segment's cost, microseconds per plan; for n up to 14 and under
  hypothesis. ``tests/test_planners_minmem.py`` checks that it equals ``simulate`` on every
  plan of random chains, which is what makes it a valid stand-in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from remat import Chain, Plan, simulate
from remat.planners.hong import FlatCosts

__all__ = ["FlatPlan", "all_flat_plans", "brute_force_min_peak", "brute_force_best", "Best"]


@dataclass(frozen=True)
class FlatPlan:
    """One point of the plan space."""

    kept: tuple[int, ...]
    """Kept activations ``a[k]``, ``k`` in 1..n-1."""
    store_last: bool
    """Whether the last segment is stored instead of recomputed."""

    def plan(self, chain: Chain) -> Plan:
        return Plan.from_checkpoints(chain, self.kept, store_last=self.store_last)


@dataclass(frozen=True)
class Best:
    """What brute force found."""

    peak_bytes: int
    """The least peak over the space."""
    time: float
    """The least total time among the plans of that peak."""
    plans: tuple[FlatPlan, ...]
    """Every plan of that peak and that time."""


Cost = Callable[[Chain, FlatPlan], tuple[int, float]]


def all_flat_plans(chain: Chain) -> Iterator[FlatPlan]:
    """Every flat plan of ``chain``: each subset of {1..n-1}, with and without the last
    segment stored (``2^n`` plans)."""
    n = chain.n
    for mask in range(2 ** (n - 1)):
        kept = tuple(k for k in range(1, n) if mask >> (k - 1) & 1)
        for store_last in (False, True):
            yield FlatPlan(kept, store_last)


def simulated(chain: Chain, flat: FlatPlan) -> tuple[int, float]:
    """(peak, time) by :func:`remat.simulate`."""
    sim = simulate(chain, flat.plan(chain))
    return sim.peak_bytes, sim.total_time


def closed_form(chain: Chain) -> Cost:
    """(peak, time) from a table of segment costs (Note [flat plan peak]); built once per chain.

    Time: every checkpointed segment is recomputed once, so it is the plain forward and
    backward plus the forward time of every stage outside a stored last segment.
    """
    costs = FlatCosts.of(chain)
    n = chain.n
    table = {
        (lo, hi, recomputed): costs.segment_cost(lo, hi, recomputed)
        for lo in range(n)
        for hi in range(lo + 1, n + 1)
        for recomputed in (False, True)
    }
    out = [chain.input_bytes, *chain.out_bytes]
    base = chain.total_fwd_time() + chain.total_bwd_time()
    fwd_prefix = [0.0]
    for t in chain.fwd_time:
        fwd_prefix.append(fwd_prefix[-1] + t)

    def cost(_: Chain, flat: FlatPlan) -> tuple[int, float]:
        bounds = (0, *flat.kept, n)
        prefix = out[0]
        peak = 0
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            if lo:
                prefix += out[lo]
            recomputed = not (flat.store_last and hi == n)
            peak = max(peak, prefix + table[lo, hi, recomputed])
        last = bounds[-2] if flat.store_last else n
        return peak, base + fwd_prefix[last]

    return cost


def brute_force_best(chain: Chain, cost: Cost | None = None) -> Best:
    """The least peak over every flat plan, and the least time at that peak."""
    cost = cost or simulated
    scored = [(cost(chain, flat), flat) for flat in all_flat_plans(chain)]
    (peak, time), _ = min(scored, key=lambda item: item[0])
    plans = tuple(flat for key, flat in scored if key == (peak, time))
    return Best(peak, time, plans)


def brute_force_min_peak(chain: Chain, cost: Cost | None = None) -> int:
    """The least simulated peak over every flat plan of ``chain``."""
    return brute_force_best(chain, cost).peak_bytes


def fastest_under(chain: Chain, budget: int, cost: Cost | None = None) -> float | None:
    """The least time of a flat plan whose peak fits ``budget`` (None if none fits)."""
    cost = cost or simulated
    times = [t for p, t in (cost(chain, flat) for flat in all_flat_plans(chain)) if p <= budget]
    return min(times, default=None)
