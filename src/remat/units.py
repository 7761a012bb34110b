"""Byte and time units: the one place where "4GiB" is parsed and 4294967296 is printed.

Everything inside remat stores bytes as ``int`` and times as ``float`` seconds; only this
module converts to and from human units.

>>> parse_bytes("1.5KiB")
1536
>>> format_bytes(3 * 2**20)
'3.00 MiB'
"""

from __future__ import annotations

import re

__all__ = ["parse_bytes", "format_bytes", "format_time"]

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
    short K, M, G, T, which are binary).
    """
    if isinstance(value, bool):
        raise TypeError("a byte count cannot be a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte count must be >= 0, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value:
            raise ValueError(f"a byte count must be a non-negative number, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"expected bytes as int or str like '4GiB', got {type(value).__name__}")
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a size: write a number of bytes or a number with a unit, "
            "for example '512MiB', '4GiB' or '2GB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


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
