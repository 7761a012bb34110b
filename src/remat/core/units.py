"""Byte and time units: the one place where "4GiB" is parsed and 4294967296 is printed.

Everything inside remat stores bytes as ``int`` and times as ``float`` seconds; only this
module converts to and from human units.

>>> parse_bytes("1.5KiB")
1536
>>> format_bytes(3 * 2**20)
'3.00 MiB'
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

__all__ = ["parse_bytes", "resolve_budget", "format_bytes", "format_time"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts an int (bytes), a float (rounded down), or a string such as ``"512MiB"``, ``"4GiB"``,
    ``"1.5e9"`` or ``"2GB"`` (decimal units: KB, MB, GB, TB; binary: KiB, MiB, GiB, TiB, and the
    short K, M, G, T, which are binary). Negative numbers, NaN, infinity, bools and a float
    between 0 and 1 (a fraction, not a byte count) raise a clear error.
    """
    if isinstance(value, bool):
        raise TypeError(f"a byte count cannot be a bool (got {value}); pass bytes like '4GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte count must be >= 0, got {value}")
        return value
    if isinstance(value, float):
        if math.isnan(value) or value < 0:
            raise ValueError(f"a byte count must be a non-negative number, got {value}")
        if math.isinf(value):
            raise ValueError("a byte count must be finite, got inf")
        if 0 < value <= 1:
            raise ValueError(_FRACTION.format(value=value, percent=_percent(value)))
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"expected bytes as int or str like '4GiB', got {type(value).__name__}")
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        if value.strip().startswith("-"):
            raise ValueError(f"a byte count must be >= 0, got {value!r}")
        if value.strip().endswith("%"):
            raise ValueError(
                f"{value!r} is a percentage, not a byte count: a budget percentage is read "
                "against the unplanned peak (remat.auto, remat.fit, remat.plan take it)"
            )
        raise ValueError(
            f"cannot read {value!r} as a size: write a number of bytes or a number with a unit, "
            "for example '512MiB', '4GiB' or '2GB'"
        )
    number = float(match.group(1))
    if not unit and 0 < number <= 1 and "." in match.group(1):
        raise ValueError(_FRACTION.format(value=value, percent=_percent(number)))
    return int(number * _UNITS[unit])


_FRACTION = (
    "{value!r} is a fraction, and fractions are not bytes; pass '{percent}' for that "
    "fraction of the unplanned step's peak, or bytes like '4GiB'"
)
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*%\s*$")


def _percent(fraction: float) -> str:
    return f"{100 * fraction:g}%"


def resolve_budget(
    budget: int | float | str,
    unplanned_peak: int | Callable[[], int],
    what: str = "the unplanned step's predicted peak",
) -> int:
    """A memory budget as bytes: the one place where remat reads a budget argument.

    ``budget`` is bytes (an int, or a string like ``"4GiB"``: :func:`parse_bytes`), a
    percentage string such as ``"50%"`` (that share of ``unplanned_peak``), or
    ``float("inf")`` (no limit: the unplanned peak itself, so the unplanned plan fits).
    ``unplanned_peak`` is the peak of storing everything (``what`` names it in messages), or a
    function computing it (called only for a percentage or infinity). A float between 0 and 1
    is refused (a fraction is not bytes: write ``"50%"``), as are negative numbers, NaN, bools
    and text that is neither a size nor a percentage.

    >>> resolve_budget("50%", 1000)
    500
    >>> resolve_budget("1KiB", 1000)
    1024
    """
    if isinstance(budget, float) and math.isinf(budget) and budget > 0:
        return _peak(unplanned_peak)
    if isinstance(budget, str):
        match = _PERCENT.match(budget)
        if match is not None:
            share = float(match.group(1))
            if not share > 0:
                raise ValueError(f"a budget percentage must be > 0%, got {budget!r}")
            return int(_peak(unplanned_peak) * share / 100)
        if budget.strip().endswith("%"):
            raise ValueError(
                f"cannot read {budget!r} as a budget percentage: write e.g. '50%' ({what})"
            )
    try:
        return parse_bytes(budget)
    except ValueError as err:
        if isinstance(budget, str) and "cannot read" in str(err):
            raise ValueError(f"{err}, or a percentage of {what} such as '50%'") from None
        raise


def _peak(unplanned_peak: int | Callable[[], int]) -> int:
    return int(unplanned_peak() if callable(unplanned_peak) else unplanned_peak)


def format_bytes(num_bytes: int | float) -> str:
    """Format a byte count with a binary unit, e.g. ``'3.00 MiB'``."""
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{int(value)} B" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_time(seconds: float) -> str:
    """Format seconds as s / ms / µs."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"
