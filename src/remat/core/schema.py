"""Reading remat's JSON files (plans, chains, graphs, memory reports): one check of their
schema name and integer version, with an error that says what the file holds."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["read_schema"]


def read_schema(
    text: str, schema: str, version: int, what: str, error: type[Exception] = ValueError
) -> dict[str, Any]:
    """The JSON object of a remat file (plan, graph plan, chain, graph, memory report) whose
    ``schema`` is ``schema`` and whose ``version`` is the integer ``version``; anything else
    raises ``error`` saying what the file holds (``what``: e.g. ``"remat plan"``)."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise error(f"not a {what}: the text is not valid JSON ({err})") from None
    if not isinstance(data, dict) or data.get("schema") != schema:
        raise error(f"not a {what}: the JSON has no 'schema': '{schema}'")
    found = data.get("version")
    if type(found) is not int or found != version:
        kind = "" if type(found) is int else f" (a {type(found).__name__}, not an integer)"
        raise error(
            f"{what} schema version {found!r}{kind} is not supported: this remat reads "
            f"version {version} (the integer {version}); write the file again with this "
            "remat's to_json, or read it with the remat version that wrote it"
        )
    return data
