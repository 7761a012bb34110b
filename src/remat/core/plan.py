"""What to keep and what to recompute: a :class:`Plan` for a :class:`~remat.core.chain.Chain`.

A plan is a nested segment tree over the stages ``1..n``. Each :class:`Segment` covers the
stages ``start..stop`` (1-based, inclusive) and is either

* **stored**: its stages run with autograd as usual and keep what their backward needs; or
* **checkpointed**: in the forward its stages run without keeping anything but the segment's
  input; in the backward the segment is recomputed under its own sub-plan (``children``, which
  cover ``start..stop``) and then back-propagated. A checkpointed segment with stored children
  is the classic one-level checkpoint; deeper nesting gives the recursive and rotor plans.

This is exactly what nested non-reentrant ``torch.utils.checkpoint`` executes (see
``remat.execute.chain``), and what :func:`remat.simulate` costs.

Example:
    >>> from remat import Chain
    >>> chain = Chain.homogeneous(6)
    >>> plan = Plan.from_checkpoints(chain, [2, 4])   # keep a[2] and a[4]
    >>> [(s.start, s.stop, s.checkpoint) for s in plan.segments]
    [(1, 2, True), (3, 4, True), (5, 6, True)]
    >>> Plan.from_json(plan.to_json()) == plan
    True
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from remat.core.schema import read_schema

if TYPE_CHECKING:
    from remat.core.chain import Chain

__all__ = ["Segment", "Plan", "PlanError", "PLAN_SCHEMA_VERSION"]

PLAN_SCHEMA_VERSION = 1


class PlanError(ValueError):
    """A plan that does not fit its chain or is malformed."""


@dataclass(frozen=True)
class Segment:
    """Stages ``start..stop`` (1-based, inclusive), stored or checkpointed with a sub-plan."""

    start: int
    """First stage of the segment (1-based)."""
    stop: int
    """Last stage of the segment (inclusive)."""
    checkpoint: bool = False
    """True: keep only the segment's input in the forward and recompute it in the backward."""
    children: tuple[Segment, ...] = ()
    """Sub-plan used when a checkpointed segment is recomputed; default: store every stage."""

    def __post_init__(self) -> None:
        if not (isinstance(self.start, int) and isinstance(self.stop, int)):
            raise PlanError(f"segment bounds must be ints, got {self.start!r}..{self.stop!r}")
        if self.start < 1 or self.stop < self.start:
            raise PlanError(f"segment {self.start}..{self.stop} is empty or starts before stage 1")
        children = tuple(self.children)
        if not self.checkpoint and children:
            raise PlanError(
                f"stored segment {self.start}..{self.stop} has children: only checkpointed "
                "segments have a sub-plan"
            )
        if self.checkpoint and not children:
            children = (Segment(self.start, self.stop),)
        if children:
            _check_cover(children, self.start, self.stop, f"segment {self.start}..{self.stop}")
            if (
                len(children) == 1
                and children[0].checkpoint
                and (
                    children[0].start,
                    children[0].stop,
                )
                == (self.start, self.stop)
            ):
                raise PlanError(
                    f"segment {self.start}..{self.stop} is checkpointed twice over the same "
                    "stages; that recomputes everything again for nothing"
                )
        object.__setattr__(self, "children", children)

    @property
    def length(self) -> int:
        return self.stop - self.start + 1

    def stages(self) -> range:
        return range(self.start, self.stop + 1)

    def depth(self) -> int:
        """Nesting depth: 0 for a stored segment, 1 for a one-level checkpoint, ..."""
        if not self.checkpoint:
            return 0
        return 1 + max(c.depth() for c in self.children)

    def to_obj(self) -> list[Any]:
        if not self.checkpoint:
            return [self.start, self.stop, "store"]
        return [self.start, self.stop, "checkpoint", [c.to_obj() for c in self.children]]

    @classmethod
    def from_obj(cls, obj: Any) -> Segment:
        if (
            not isinstance(obj, list)
            or len(obj) not in (3, 4)
            or obj[2]
            not in (
                "store",
                "checkpoint",
            )
        ):
            raise PlanError(
                f"cannot read segment {obj!r}: expected [start, stop, 'store'] or "
                "[start, stop, 'checkpoint', [children]]"
            )
        if obj[2] == "store":
            return cls(obj[0], obj[1])
        children = tuple(cls.from_obj(c) for c in (obj[3] if len(obj) == 4 else []))
        return cls(obj[0], obj[1], True, children)

    def describe(self) -> str:
        """Compact text: ``[1-3]`` stored, ``(4-6)`` checkpointed, nesting shown inside."""
        span = f"{self.start}" if self.start == self.stop else f"{self.start}-{self.stop}"
        if not self.checkpoint:
            return f"[{span}]"
        inner = self.children
        if len(inner) == 1 and not inner[0].checkpoint:
            return f"({span})"
        return f"({span}: {' '.join(c.describe() for c in inner)})"


@dataclass(frozen=True)
class Plan:
    """A segment tree over a chain's stages plus what the planner predicted for it.

    Build one with :meth:`none`, :meth:`every_stage`, :meth:`from_checkpoints`, or a planner
    (:func:`remat.plan`). ``Plan.none()`` and ``Plan.every_stage()`` may be made without a chain;
    they are expanded for the chain they are used with (:meth:`for_chain`).
    """

    segments: tuple[Segment, ...] = ()
    """Top-level segments covering stages ``1..n`` in order (empty for a rule plan)."""
    rule: str | None = None
    """For chain-independent plans: ``"none"`` (store all) or ``"every-stage"``."""
    method: str = "manual"
    """The planner that made the plan."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """The planner's parameters (budget, segment count, ...), JSON-compatible."""
    predicted_peak_bytes: int | None = None
    """Peak activation bytes that :func:`remat.simulate` predicts for the plan."""
    predicted_time: float | None = None
    """Total time (forward + recomputation + backward) predicted by :func:`remat.simulate`."""
    chain_fingerprint: str | None = None
    """Fingerprint of the chain the plan was made for (:attr:`Chain.fingerprint`)."""
    stages_fingerprint: str | None = None
    """Structure of the model's stages the plan was made for (:attr:`Chain.stages_fingerprint`,
    from :attr:`remat.capture.stages.Stages.fingerprint`), when its chain was captured from a model:
    :func:`remat.apply` refuses the plan for a model with other stages. None for plans made
    without a captured chain (``Plan.from_checkpoints(n, ...)``, rule plans)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        object.__setattr__(self, "params", dict(self.params))
        if self.rule is not None:
            if self.rule not in ("none", "every-stage"):
                raise PlanError(f"unknown plan rule {self.rule!r}: use 'none' or 'every-stage'")
            if self.segments:
                raise PlanError("a rule plan has no explicit segments")
        elif not self.segments:
            raise PlanError("a plan needs segments covering stages 1..n, or a rule")
        else:
            _check_cover(self.segments, 1, self.segments[-1].stop, "plan")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def none(cls, chain: Chain | int | None = None) -> Plan:
        """Store every activation: no recomputation (the unplanned model)."""
        if chain is None:
            return cls(rule="none", method="none")
        return cls((Segment(1, _n(chain)),), method="none")

    @classmethod
    def every_stage(cls, chain: Chain | int | None = None) -> Plan:
        """Checkpoint each stage on its own (what ``checkpoint`` around every block does)."""
        if chain is None:
            return cls(rule="every-stage", method="every-stage")
        n = _n(chain)
        return cls(tuple(Segment(i, i, True) for i in range(1, n + 1)), method="every-stage")

    @classmethod
    def from_checkpoints(
        cls, chain: Chain | int, indices: Iterable[int], store_last: bool = False
    ) -> Plan:
        """The flat plan of the papers: keep the activations ``a[k]`` for ``k`` in ``indices``.

        Each run of stages between two kept activations (and between the input and the first,
        and the last and the output) becomes a checkpointed segment, recomputed once in the
        backward with every stage stored. ``indices`` are in ``1..n-1``. With
        ``store_last=True`` the final segment is stored instead (it would be recomputed right
        after its forward otherwise).
        """
        n = _n(chain)
        kept = sorted(set(indices))
        for k in kept:
            if not isinstance(k, int) or not 1 <= k <= n - 1:
                raise PlanError(
                    f"checkpoint index {k!r} out of range: kept activations are a[1]..a[{n - 1}] "
                    "(a[0] is the input and a[n] the output, both always kept)"
                )
        bounds = [0, *kept, n]
        segments = [
            Segment(lo + 1, hi, checkpoint=not (store_last and hi == n))
            for lo, hi in zip(bounds, bounds[1:], strict=False)
        ]
        return cls(tuple(segments), method="checkpoints", params={"indices": kept})

    @classmethod
    def from_segments(cls, segments: Sequence[Segment], **kwargs: Any) -> Plan:
        return cls(tuple(segments), **kwargs)

    def made_for(self, chain: Chain) -> Plan:
        """This plan recording ``chain``'s fingerprints (its costs, and its model's stages when
        it was captured from one): what every planner's plan carries."""
        return replace(
            self,
            chain_fingerprint=chain.fingerprint,
            stages_fingerprint=getattr(chain, "stages_fingerprint", "") or None,
        )

    # ------------------------------------------------------------------ use
    def for_chain(self, chain: Chain | int) -> Plan:
        """This plan expanded and validated for ``chain`` (raises :class:`PlanError`)."""
        n = _n(chain)
        if self.rule == "none":
            return replace(Plan.none(n), method=self.method, params=self.params)
        if self.rule == "every-stage":
            return replace(Plan.every_stage(n), method=self.method, params=self.params)
        if self.segments[-1].stop != n:
            raise PlanError(
                f"plan covers stages 1..{self.segments[-1].stop} but the chain has {n} stages; "
                "make a new plan for this chain"
            )
        fingerprint = getattr(chain, "fingerprint", None)
        if self.chain_fingerprint and fingerprint and fingerprint != self.chain_fingerprint:
            raise PlanError(
                "this plan was made for other costs (chain fingerprint "
                f"{self.chain_fingerprint}, this chain {fingerprint}): the batch shape or the "
                "model changed, so re-plan for it"
            )
        return self

    @property
    def n(self) -> int | None:
        """Number of stages the plan covers (None for rule plans)."""
        return self.segments[-1].stop if self.segments else None

    def walk(self) -> Iterator[Segment]:
        """Every segment of the tree, parents before children."""
        stack = list(reversed(self.segments))
        while stack:
            seg = stack.pop()
            yield seg
            if seg.checkpoint:
                stack.extend(reversed(seg.children))

    def kept_activations(self) -> list[int]:
        """Indices ``k`` of the activations ``a[k]`` at top-level segment boundaries: each is
        kept through the whole forward (by the checkpointed segment it starts, or by the stored
        stage that reads it)."""
        return [s.start - 1 for s in self.segments[1:]]

    def depth(self) -> int:
        return max(s.depth() for s in self.segments) if self.segments else 0

    def describe(self) -> str:
        """Compact text, e.g. ``(1-3) (4-6) [7-8]``."""
        if self.rule:
            return f"<{self.rule}>"
        return " ".join(s.describe() for s in self.segments)

    # ------------------------------------------------------------------ JSON
    def to_json(self, indent: int | None = None) -> str:
        data = {
            "schema": "remat.plan",
            "version": PLAN_SCHEMA_VERSION,
            "method": self.method,
            "params": dict(self.params),
            "rule": self.rule,
            "segments": [s.to_obj() for s in self.segments],
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_time": self.predicted_time,
            "chain_fingerprint": self.chain_fingerprint,
            "stages_fingerprint": self.stages_fingerprint,
        }
        return json.dumps(data, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json` (checks the schema and its version)."""
        data = read_schema(text, "remat.plan", PLAN_SCHEMA_VERSION, "remat plan", PlanError)
        return cls(
            segments=tuple(Segment.from_obj(s) for s in data.get("segments", [])),
            rule=data.get("rule"),
            method=data.get("method", "manual"),
            params=data.get("params") or {},
            predicted_peak_bytes=data.get("predicted_peak_bytes"),
            predicted_time=data.get("predicted_time"),
            chain_fingerprint=data.get("chain_fingerprint"),
            stages_fingerprint=data.get("stages_fingerprint"),  # absent in older files
        )


def _n(chain: Chain | int) -> int:
    n = chain if isinstance(chain, int) else chain.n
    if n < 1:
        raise PlanError(f"a chain has at least one stage, got n={n}")
    return n


def _check_cover(segments: Sequence[Segment], start: int, stop: int, what: str) -> None:
    expected = start
    for seg in segments:
        if not isinstance(seg, Segment):
            raise PlanError(f"{what}: expected Segment objects, got {seg!r}")
        if seg.start != expected:
            raise PlanError(
                f"{what}: segments must cover stages {start}..{stop} in order without gaps or "
                f"overlaps; expected a segment starting at {expected}, got {seg.start}..{seg.stop}"
            )
        expected = seg.stop + 1
    if expected != stop + 1:
        raise PlanError(f"{what}: segments end at stage {expected - 1}, expected {stop}")
