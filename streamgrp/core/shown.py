"""Short, safe renderings of untrusted values for error details (never a deep or unbounded repr), and text
safe to print.

Decoding and dead letters quote what an entry held; a hostile entry must not make that quote
large, slow, or raise. Task ids, producer names, prompts and error texts come from whoever could
write the streams: `printable` makes them safe to put on a terminal or in a log line (no escape
sequence that moves the cursor or rewrites the screen, no newline that forges another line). Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

JSON_NAMES = {
    dict: "object",
    list: "array",
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def show(value: Any, limit: int = 60) -> str:
    """A short, safe rendering of a decoded value for an error detail (never a deep repr)."""
    kind = value.__class__
    if kind is dict or kind is list or kind is tuple:
        return f"(a {kind.__name__} of length {len(value)})"
    if kind is int and value.bit_length() > 64:
        return f"(an integer of {value.bit_length()} bits)"
    if (kind is str or kind is bytes) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value)} long)"
    if kind in JSON_NAMES or kind is bytes:
        return repr(value)
    return f"(a {kind.__name__})"


def printable(text: Any) -> str:
    """``text`` on one safe line: every character that is not printable (ESC and the other control characters,
    CR and newline, bidirectional overrides, ...) written as its escape (``\\x1b``, ``\\n``, ``\\u202e``)."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def printable_lines(text: Any) -> str:
    """`printable` for each line of a text whose line breaks are its own (a message streamgrp composed)."""
    return "\n".join(printable(line) for line in str(text).split("\n"))


def json_name(value: Any) -> str:
    return JSON_NAMES.get(value.__class__, "array" if isinstance(value, tuple) else type(value).__name__)


def show_names(names: Iterable[Any]) -> str:
    return ", ".join(show(name) for name in list(names)[:10])


def clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def safe_text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a hostile __str__ must not escape decode either
        return type(exc).__name__


def field_names(fields: Mapping[Any, Any]) -> str:
    names = sorted(show(k.decode(errors="replace") if isinstance(k, bytes) else k, 20) for k in list(fields)[:10])
    return f"[{', '.join(names)}{', ...' if len(fields) > 10 else ''}]"
