"""Reading a run's control stream from a cursor: decoded events out, damaged or forged entries dead-lettered.

The control stream carries the run's lifecycle facts (created, version advances, terminal, finished).
Every reader (each trainer rank) keeps its own cursor so that it reads each entry once, and an
entry that does not decode is dead-lettered once for all readers and skipped: a forged or damaged
control entry must not stop a role.

A terminal or finished event stops every trainer rank, and more roles than the batcher may append
to the stream (trainers write their version advances there). So such an event counts only when the
batcher's state hash, which only the batcher's user may write, records that very entry id
(``batch_commit.lua`` writes both atomically); any other is dead-lettered as ``untrusted_control``.
Runs recorded before the markers named their entry hold ``1`` there: their events are taken as
they are.
"""

from __future__ import annotations

from streamgrp.core import codec, counters
from streamgrp.core.events import RunFinished, RunTerminated
from streamgrp.errors import DecodeError
from streamgrp.store.deadletter import DeadLetters
from streamgrp.store.keys import RunKeys
from streamgrp.store.streams import entry_id_str, range_reply

#: The batcher-state field that names each trusted event's control entry.
MARKERS: dict[type, str] = {RunTerminated: "terminal", RunFinished: "finished"}
_LEGACY_MARKER = b"1"


class ControlCursor:
    """This reader's position in the control stream; `read` returns the events past it."""

    def __init__(self, dead_letters: DeadLetters, *, chunk: int = 100) -> None:
        keys = dead_letters.keys
        if not isinstance(keys, RunKeys):
            raise TypeError("the control stream is the run's: give the run's DeadLetters, not a partition's")
        self.client = dead_letters.client
        self.stream = keys.control
        self.state = keys.batcher_state
        self.dead_letters = dead_letters
        self.chunk = chunk
        self.last = "0-0"

    def read(self) -> list[object]:
        """Every decodable, trusted event written after the cursor, in order; the cursor moves past them all."""
        events: list[object] = []
        while True:
            entries = range_reply(self.client.xrange(self.stream, f"({self.last}", "+", count=self.chunk))
            for raw_id, fields in entries:
                self.last = entry_id_str(raw_id)
                try:
                    event = codec.decode(fields)
                except DecodeError as exc:
                    self._refuse(exc.reason, exc.detail, fields)
                    continue
                if self._trusted(event):
                    events.append(event)
                else:
                    self._refuse(
                        "untrusted_control",
                        f"a {event.kind} entry the batcher did not write (its state "
                        f"names another entry, or none); ignored",
                        fields,
                    )
            if len(entries) < self.chunk:
                return events

    def _trusted(self, event: object) -> bool:
        marker = MARKERS.get(type(event))
        if marker is None:
            return True
        recorded = self.client.hget(self.state, marker)
        return recorded is not None and recorded in (self.last.encode(), _LEGACY_MARKER)

    def _refuse(self, reason: str, detail: str, fields) -> None:
        self.dead_letters.send(self.stream, self.last, reason, detail, fields, counter=counters.INVALID_CONTROL)
