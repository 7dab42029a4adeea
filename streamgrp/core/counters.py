"""The run's durable counters: the field names of the ``counts`` hash, and reading the increments
the commit scripts report.

Each commit script returns the (field, amount) pairs it applied (`store/lua/counters.lua`), so a
process mirrors exactly what reached the server, never what it meant to write.
"""

from __future__ import annotations


def pairs_to_counts(flat: list) -> dict[str, int]:
    """``[field, amount, field, amount, ...]`` from a commit script into a dict."""
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in zip(flat[::2], flat[1::2])}
