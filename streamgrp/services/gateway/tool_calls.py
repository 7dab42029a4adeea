"""Tool calls in a completion's text, as OpenAI's ``tool_calls``: the gateway's tool parsers.

The gateway generates token-in/token-out, so the model's tool calls arrive as text in its own format;
an agent framework wants OpenAI's shape. A parser turns the raw text into (content, tool_calls), only
when the request offered ``tools``. ``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
blocks (Hermes, Qwen 2.5/3, SmolLM3 and the many templates that copied them); ``none``: text stays text.

A call's id is made from the session, the turn and its position, so answering a turn again (a client's
retry after a lost answer) gives the same ids. The raw text is what was generated and what the turn
recorded; when the agent sends the parsed message back, the gateway renders the raw text in its place
(`streamgrp.services.gateway.live`), so the next prompt continues the generated tokens exactly.
Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

PARSERS = ("hermes", "none")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, parser: str, *, call_prefix: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of ``text``: content None when the text held only tool calls."""
    if parser == "none" or "<tool_call>" not in text:
        return text, []
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _HERMES.finditer(text):
        call = _call(match.group(1), f"{call_prefix}_{len(calls)}")
        if call is None:
            continue  # not a call the format allows: it stays in the content
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[position:])
    content = "".join(kept).strip()
    return (content or None), calls


def _call(body: str, call_id: str) -> dict[str, Any] | None:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()
    return {"id": call_id, "type": "function", "function": {"name": value["name"], "arguments": text}}
