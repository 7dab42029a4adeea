"""Reading a run's control stream from a cursor: decoded events out, damaged entries dead-lettered.

The control stream carries the run's lifecycle facts (created, version advances, terminal, finished).
Every reader (the batcher, each trainer rank) keeps its own cursor so that it reads each entry once,
and an entry that does not decode is dead-lettered once for all readers and skipped: a forged or
damaged control entry must not stop a role.
"""

from __future__ import annotations

from streamgrp.core import codec, counters
from streamgrp.errors import DecodeError
from streamgrp.store.deadletter import DeadLetters
from streamgrp.store.streams import entry_id_str


class ControlCursor:
    """This reader's position in the control stream; `read` returns the events past it."""

    def __init__(self, dead_letters: DeadLetters, *, chunk: int = 100) -> None:
        self.client = dead_letters.client
        self.stream = dead_letters.keys.control
        self.dead_letters = dead_letters
        self.chunk = chunk
        self.last = "0-0"

    def read(self) -> list[object]:
        """Every decodable event written after the cursor, in order; the cursor moves past them all."""
        events: list[object] = []
        while True:
            entries = self.client.xrange(self.stream, f"({self.last}", "+", count=self.chunk)
            for raw_id, fields in entries:
                self.last = entry_id_str(raw_id)
                try:
                    events.append(codec.decode(fields))
                except DecodeError as exc:
                    self.dead_letters.send(self.stream, self.last, exc.reason, exc.detail, fields,
                                           counter=counters.INVALID_CONTROL)
            if len(entries) < self.chunk:
                return events
