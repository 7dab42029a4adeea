"""A task's agent sessions as lines of its timeline (`streamgrp.replay.steps.inspect_task`).

Reads the task's partition's sessions stream (`streamgrp.store.keys.PartitionKeys.sessions`: every
`SessionOpened`, `TurnRecorded` and `SessionEnded` the gateway recorded) and says, per session, when it
opened, each turn's tokens, version and text, and how it ended. A run without sessions has none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import orjson

from streamgrp.core import codec
from streamgrp.core.events import SessionEnded, SessionOpened, TurnRecorded
from streamgrp.errors import DecodeError
from streamgrp.store.streams import entry_time

#: Characters of a turn's text shown on its line (the whole text is in the line's data).
TEXT_SHOWN = 160


def session_lines(
    entries: Iterable[tuple[str, dict[bytes, bytes]]], task_id: str, line: Callable[..., Any]
) -> list[Any]:
    """The timeline lines (``line(at, what, text, entry, data)``) of ``task_id``'s sessions among ``entries``
    (a sessions stream's, in order); entries of other tasks, and ones that do not decode, are skipped."""
    needle = b'"task_id":' + orjson.dumps(task_id)
    out = []
    for entry_id, fields in entries:
        if needle not in (fields.get(codec.HEADER) or b""):
            continue
        try:
            event = codec.decode(fields)
        except DecodeError:
            continue
        if getattr(event, "task_id", None) != task_id:
            continue
        at = entry_time(entry_id)
        if isinstance(event, SessionOpened):
            out.append(
                line(
                    at,
                    "session",
                    f"slot {event.slot} session {event.session} opened at version "
                    f"{event.version} by {event.producer or '?'}",
                    entry_id,
                    {"slot": event.slot, "session": event.session},
                )
            )
        elif isinstance(event, TurnRecorded):
            text = event.meta.get("text")
            shown = "" if not isinstance(text, str) else f", text {_short(text)}"
            out.append(
                line(
                    at,
                    "turn",
                    f"slot {event.slot} turn {event.turn}: {event.prompt_ids.numel} prompt + "
                    f"{event.completion_ids.numel} generated tokens, version {event.version}, "
                    f"{event.finish}{shown}",
                    entry_id,
                    {
                        "slot": event.slot,
                        "session": event.session,
                        "turn": event.turn,
                        "prompt_tokens": event.prompt_ids.numel,
                        "completion_tokens": event.completion_ids.numel,
                        "version": event.version,
                        "finish": event.finish,
                        **({"text": text} if isinstance(text, str) else {}),
                    },
                )
            )
        elif isinstance(event, SessionEnded):
            said = (
                f"{event.rows} row(s) from {event.turns} turn(s), reward "
                + ("pending" if event.reward is None else f"{event.reward:.4g}")
                if event.outcome == "sample"
                else f"{event.turns} turn(s)" + (f": {_short(event.error)}" if event.error else "")
            )
            out.append(
                line(
                    at,
                    "session end",
                    f"slot {event.slot} session {event.session} {event.outcome}: {said}",
                    entry_id,
                    {"slot": event.slot, "session": event.session, "outcome": event.outcome},
                )
            )
    return out


def _short(text: str) -> str:
    return text if len(text) <= TEXT_SHOWN else text[: TEXT_SHOWN - 3] + "..."
