"""Brute force over nested plans: every segment tree of a small chain, costed by simulate.

A plan over stages ``s..t`` is a sequence of segments covering them in order. Two stored
segments are never adjacent (``[1-2] [3]`` is ``[1-3]``: the same execution), and a
checkpointed segment never has a single checkpointed child over its own range (``ChainSegment``
rejects it). Every other tree is enumerated, so minima over this list are the true minima over
the plan space of :mod:`remat.core.plan`. Counts: n = 1: 2 plans, 2: 8, 3: 40, 4: 224, 5: 1,344,
6: 8,448 (keep brute force to n <= 6).
"""

from __future__ import annotations

from functools import cache

from remat import Chain, ChainSegment, Plan, simulate

__all__ = ["nested_plans", "brute_force"]


def nested_plans(n: int) -> list[Plan]:
    """Every nested plan of a chain with ``n`` stages (canonical forms, no duplicates)."""
    return [Plan.from_chain_segments(segments) for segments in _sequences(1, n)]


def brute_force(chain: Chain) -> list[tuple[int, float, Plan]]:
    """``(peak_bytes, total_time, plan)`` of every nested plan of ``chain``, by simulate."""
    rows = []
    for plan in nested_plans(chain.n):
        sim = simulate(chain, plan)
        rows.append((sim.peak_bytes, sim.total_time, plan))
    return rows


def min_time_within(rows: list[tuple[int, float, Plan]], budget: int) -> float | None:
    """Least time among ``rows`` whose peak is at most ``budget`` (None if none fits)."""
    times = [time for peak, time, _ in rows if peak <= budget]
    return min(times) if times else None


@cache
def _sequences(s: int, t: int) -> tuple[tuple[ChainSegment, ...], ...]:
    """All segment sequences covering ``s..t``."""
    plain = _not_single_checkpoint(s, t)
    whole = tuple((ChainSegment(s, t, True, children),) for children in plain)
    return plain + whole


@cache
def _not_single_checkpoint(s: int, t: int) -> tuple[tuple[ChainSegment, ...], ...]:
    """Sequences covering ``s..t`` other than one checkpointed segment over all of it."""
    out: list[tuple[ChainSegment, ...]] = [(ChainSegment(s, t),)]
    for stop in range(s, t):  # first segment s..stop, then at least one more segment
        rests = _sequences(stop + 1, t)
        for rest in rests:
            if rest[0].checkpoint:  # a stored first segment must be followed by a checkpoint
                out.append((ChainSegment(s, stop), *rest))
        for children in _not_single_checkpoint(s, stop):  # never checkpointed twice
            first = ChainSegment(s, stop, True, children)
            out.extend((first, *rest) for rest in rests)
    return tuple(out)
