"""The cost model of a sequential network: a :class:`Chain` of stages.

This is the heterogeneous-chain model of Beaumont et al. 2019 ("rotor"). A network is cut into
stages ``1..n``; stage ``i`` maps the activation ``a[i-1]`` to ``a[i]``; ``a[0]`` is the input.
See ``docs/cost-model.md`` for the full semantics, which :func:`remat.simulate` implements.

Per stage ``i`` (all lists are indexed from 0 for stage 1):

* ``fwd_time[i]``, ``bwd_time[i]``: seconds (or any consistent unit, e.g. FLOPs) of the forward
  and of the backward of the stage.
* ``out_bytes[i]``: bytes of the stage's output ``a[i]``: what a checkpoint at that boundary keeps,
  and the size of the gradient ``δ[i]`` that flows back into it.
* ``saved_bytes[i]``: bytes that autograd keeps for the stage's backward when it runs with grad,
  *including its output* ``a[i]`` and *excluding its input* ``a[i-1]`` (which the stage's backward
  also needs, and which is accounted as ``out_bytes[i-1]``). Hence ``saved_bytes >= out_bytes``;
  the papers' one-size-per-layer models are the special case ``saved_bytes == out_bytes``.
* ``fwd_overhead_bytes[i]``: transient bytes during the stage's forward, beyond what it keeps.
* ``fwd_none_overhead_bytes[i]``: transient bytes during the stage's forward *without grad*
  (``F_none``: in a checkpointed segment), beyond its output. Not the storing forward's
  overhead: without grad the intermediates are freed as they go, yet several may be live at
  once (an MLP's ``h`` and ``gelu(h)``, saved with grad, so ``fwd_overhead_bytes`` is 0 there).
  Defaults to ``fwd_overhead_bytes`` (chains made by hand, files of schema version 1).
* ``bwd_overhead_bytes[i]``: the peak during the stage's backward relative to "everything the
  stage holds (``saved_bytes[i]``), its output gradient ``δ[i]`` and the input gradient
  ``δ[i-1]`` it produces, all live at once". Positive: workspace beyond that. **Negative** when
  the backward frees part of that before its peak (autograd frees each op's saved tensors and
  ``δ[i]`` as soon as they are used): the measured figure, never below
  ``-(saved_bytes[i] + out_bytes[i])``.

Plus ``input_bytes``: the bytes of ``a[0]``, live during the whole step. The model's input does
not get a gradient (``δ[0]`` is never allocated). And ``frozen_prefix``: the ``k`` leading stages
whose outputs need no gradient (a fine-tuned model's frozen stem on a batch without gradient)
have no backward; stored, they keep nothing, and ``δ[0..k]`` are never allocated. Without it, a
frozen ResNet's stem output was held through the whole backward: the unplanned step predicted
524,288 B above its measured peak, and the least whole-step peak remat named lay above it.

Example:
    >>> chain = Chain(fwd_time=[1.0, 1.0], bwd_time=[2.0, 2.0], out_bytes=[4, 4],
    ...               saved_bytes=[8, 4], input_bytes=4)
    >>> chain.n
    2
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field, fields
from typing import Any

from remat.core.schema import read_schema

__all__ = ["Chain", "CHAIN_SCHEMA_VERSION"]

CHAIN_SCHEMA_VERSION = 2
"""Version 2 added ``fwd_none_overhead_bytes``; a chain without it (equal to
``fwd_overhead_bytes``) is written as version 1, and both versions are read."""
_INT_FIELDS = ("out_bytes", "saved_bytes", "fwd_overhead_bytes", "bwd_overhead_bytes")
_FLOAT_FIELDS = ("fwd_time", "bwd_time")


@dataclass(frozen=True)
class Chain:
    """Costs of the stages ``1..n`` of a sequential network (see the module docstring)."""

    fwd_time: tuple[float, ...]
    """Forward time of each stage, seconds (or a consistent proxy such as FLOPs)."""
    bwd_time: tuple[float, ...]
    """Backward time of each stage, same unit as ``fwd_time``."""
    out_bytes: tuple[int, ...]
    """Bytes of each stage's output activation ``a[i]`` (also the size of its gradient)."""
    saved_bytes: tuple[int, ...]
    """Bytes autograd keeps for each stage's backward, output included, input excluded."""
    input_bytes: int = 0
    """Bytes of the chain's input ``a[0]``."""
    fwd_overhead_bytes: tuple[int, ...] = ()
    """Transient bytes during each stage's forward (default 0)."""
    bwd_overhead_bytes: tuple[int, ...] = ()
    """Peak during each stage's backward beyond saved + δ[i] + δ[i-1] (default 0; may be
    negative, see the module docstring)."""
    names: tuple[str, ...] = ()
    """Optional stage names (module FQNs) for reports; default ``stage1..stageN``."""
    time_unit: str = "s"
    """What ``fwd_time``/``bwd_time`` count: ``"s"`` (seconds) or ``"flop"``."""
    stages_fingerprint: str = ""
    """Structure of the model's stages the chain was captured from
    (:attr:`remat.capture.stages.Stages.fingerprint`; empty for a chain not captured from a model).
    Plans record it, so that :func:`remat.apply` refuses a plan made for another model. Not
    part of :attr:`fingerprint` (the costs)."""
    fwd_none_overhead_bytes: tuple[int, ...] = ()
    """Transient bytes during each stage's forward without grad beyond its output (default:
    ``fwd_overhead_bytes``; see the module docstring)."""
    frozen_prefix: int = 0
    """How many leading stages have no backward (default 0): their outputs ``a[1..k]`` need no
    gradient (frozen layers on a batch without gradient, a fine-tuned model's frozen stem).
    Stored, such a stage keeps nothing (its input and output are freed once read, as in a
    forward without grad), and no gradient is made for ``a[0..k]`` (see the module docstring)."""
    _fingerprint: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.fwd_time)
        if n == 0:
            raise ValueError("a Chain needs at least one stage")
        set_ = object.__setattr__
        for name in _FLOAT_FIELDS:
            set_(self, name, tuple(float(v) for v in getattr(self, name)))
        for name in _INT_FIELDS:
            values = getattr(self, name)
            if name.endswith("overhead_bytes") and len(values) == 0:
                values = (0,) * n
            set_(self, name, tuple(_as_int(name, v) for v in values))
        set_(self, "input_bytes", _as_int("input_bytes", self.input_bytes))
        k = _as_int("frozen_prefix", self.frozen_prefix)
        if not 0 <= k <= n:
            raise ValueError(f"Chain.frozen_prefix = {k}: need 0 <= frozen_prefix <= {n} (stages)")
        set_(self, "frozen_prefix", k)
        none = self.fwd_none_overhead_bytes
        none = tuple(_as_int("fwd_none_overhead_bytes", v) for v in none)
        set_(self, "fwd_none_overhead_bytes", none or self.fwd_overhead_bytes)
        names = tuple(self.names) if self.names else tuple(f"stage{i + 1}" for i in range(n))
        set_(self, "names", names)
        for name in (*_FLOAT_FIELDS, *_INT_FIELDS, "fwd_none_overhead_bytes", "names"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Chain.{name} has {len(getattr(self, name))} entries but fwd_time has {n}: "
                    "give one value per stage"
                )
        for name in (*_FLOAT_FIELDS, *_INT_FIELDS, "fwd_none_overhead_bytes"):
            if name == "bwd_overhead_bytes":
                continue
            for i, v in enumerate(getattr(self, name)):
                if not v >= 0 or v == float("inf"):
                    raise ValueError(f"Chain.{name}[{i}] = {v}: costs must be finite and >= 0")
        for i, v in enumerate(self.bwd_overhead_bytes):
            floor = -(self.saved_bytes[i] + self.out_bytes[i])
            if v < floor:
                raise ValueError(
                    f"Chain.bwd_overhead_bytes[{i}] = {v} is below -(saved_bytes + out_bytes) = "
                    f"{floor}: a backward cannot free more than the stage holds"
                )
        for i, (saved, out) in enumerate(zip(self.saved_bytes, self.out_bytes, strict=True)):
            if saved < out:
                raise ValueError(
                    f"stage {i + 1}: saved_bytes ({saved}) < out_bytes ({out}); saved_bytes "
                    "includes the stage's own output, so it is at least out_bytes"
                )
        if self.time_unit not in ("s", "flop"):
            raise ValueError(f"time_unit must be 's' or 'flop', got {self.time_unit!r}")
        set_(self, "_fingerprint", hashlib.sha256(self._canonical().encode()).hexdigest()[:16])

    # ------------------------------------------------------------------ constructors
    @classmethod
    def homogeneous(
        cls,
        n: int,
        fwd_time: float = 1.0,
        bwd_time: float = 2.0,
        out_bytes: int = 1,
        saved_bytes: int | None = None,
        input_bytes: int | None = None,
    ) -> Chain:
        """``n`` identical stages; ``saved_bytes`` and ``input_bytes`` default to ``out_bytes``."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        saved = out_bytes if saved_bytes is None else saved_bytes
        return cls(
            fwd_time=[fwd_time] * n,
            bwd_time=[bwd_time] * n,
            out_bytes=[out_bytes] * n,
            saved_bytes=[saved] * n,
            input_bytes=out_bytes if input_bytes is None else input_bytes,
        )

    @classmethod
    def random(
        cls,
        n: int,
        seed: int | None = None,
        max_bytes: int = 100,
        overheads: bool = True,
        max_time: float = 10.0,
        negative_bwd_overheads: bool = False,
    ) -> Chain:
        """A random heterogeneous chain for tests (integer-valued costs, reproducible by seed).

        ``negative_bwd_overheads=True`` draws backward overheads that may be negative (a
        backward that frees part of what it holds before its peak, as measured chains have).
        """
        rng = random.Random(seed)
        out = [rng.randint(1, max_bytes) for _ in range(n)]
        fwd = [float(rng.randint(1, int(max_time))) for _ in range(n)]
        bwd_time = [float(rng.randint(1, int(2 * max_time))) for _ in range(n)]
        saved = [o + rng.randint(0, 2 * max_bytes) for o in out]
        input_bytes = rng.randint(1, max_bytes)
        fwd_over = [rng.randint(0, max_bytes // 2) if overheads else 0 for _ in out]
        if negative_bwd_overheads:
            bwd_over = [
                rng.randint(-(s + o), max_bytes // 2) for s, o in zip(saved, out, strict=True)
            ]
        else:
            bwd_over = [rng.randint(0, max_bytes // 2) if overheads else 0 for _ in out]
        return cls(
            fwd_time=fwd,
            bwd_time=bwd_time,
            out_bytes=out,
            saved_bytes=saved,
            input_bytes=input_bytes,
            fwd_overhead_bytes=fwd_over,
            bwd_overhead_bytes=bwd_over,
        )

    # ------------------------------------------------------------------ properties
    @property
    def n(self) -> int:
        """Number of stages."""
        return len(self.fwd_time)

    @property
    def fingerprint(self) -> str:
        """A short hash of the costs: plans record it to detect use on another chain."""
        return self._fingerprint

    def activation_bytes(self, i: int) -> int:
        """Bytes of the activation ``a[i]`` for ``i`` in ``0..n`` (``a[0]`` is the input)."""
        return self.input_bytes if i == 0 else self.out_bytes[i - 1]

    def total_fwd_time(self) -> float:
        return sum(self.fwd_time)

    def total_bwd_time(self) -> float:
        return sum(self.bwd_time)

    def scaled(self, factor: float) -> Chain:
        """The same chain with every byte count multiplied by ``factor`` (e.g. another batch)."""
        data = self.to_dict()
        for name in _INT_FIELDS:
            data[name] = [int(round(v * factor)) for v in data[name]]
        data["input_bytes"] = int(round(self.input_bytes * factor))
        if "fwd_none_overhead_bytes" in data:
            data["fwd_none_overhead_bytes"] = [
                int(round(v * factor)) for v in data["fwd_none_overhead_bytes"]
            ]
        # rounded apart, a negative overhead may fall below -(saved + out) by a byte
        floors = [-(s + o) for s, o in zip(data["saved_bytes"], data["out_bytes"], strict=True)]
        data["bwd_overhead_bytes"] = [
            max(v, floor) for v, floor in zip(data["bwd_overhead_bytes"], floors, strict=True)
        ]
        return Chain._from_dict(data)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"schema": "remat.chain", "version": CHAIN_SCHEMA_VERSION}
        for f in fields(self):
            if f.name.startswith("_"):
                continue
            value = getattr(self, f.name)
            if f.name == "stages_fingerprint" and not value:
                continue  # a chain not captured from a model: the file format as before
            if f.name == "fwd_none_overhead_bytes" and value == self.fwd_overhead_bytes:
                continue  # the default: written (and hashed) as version 1, as before
            if f.name == "frozen_prefix" and not value:
                continue  # the default: the file format (and hash) as before
            data[f.name] = list(value) if isinstance(value, tuple) else value
        if "fwd_none_overhead_bytes" not in data:
            data["version"] = 1
        return data

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Chain:
        """Read a chain written by :meth:`to_json` (checks the schema and its version)."""

        try:
            found = json.loads(text).get("version")
        except (ValueError, AttributeError):
            found = None
        version = 1 if found == 1 and type(found) is int else CHAIN_SCHEMA_VERSION
        data = read_schema(text, "remat.chain", version, "remat chain", ValueError)
        return cls._from_dict(data)

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Chain:
        known = {f.name for f in fields(cls) if not f.name.startswith("_")}
        return cls(**{k: v for k, v in data.items() if k in known})

    def _canonical(self) -> str:
        data = self.to_dict()
        data.pop("names", None)
        data.pop("stages_fingerprint", None)
        return json.dumps(data, sort_keys=True)

    def __len__(self) -> int:
        return self.n


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"Chain.{name}: expected a number of bytes, got {value!r}")
    if isinstance(value, float):
        if value != int(value):
            raise ValueError(f"Chain.{name}: bytes must be whole numbers, got {value}")
        value = int(value)
    return value
