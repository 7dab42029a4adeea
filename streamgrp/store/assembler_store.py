"""The assembler's store adapter: the records one read round commits, and the one function call that does it.

Owns the assembler's server-side function (`commit.lua`): registering it, encoding a round's records into
its arguments (`encode_round`), calling it fenced by the assembler lease, waiting for replicas, and
decoding its reply (`Committed`). The function's operation names are private to this module and
`commit.lua`, one name per meaning. The assembler (`streamgrp.services.assembler`) decides what a round
commits and in what order, and never sees an argument list; this module decides nothing.

A round is a sequence of records, applied in order in one atomic call:

- `streamgrp.core.group_fold.Closed` (a decision, stamped by the assembler): written once per task (the
  ``decided`` marker), its entries acknowledged, its counters added (`counters.decision_increments`);
- `Acknowledge`: entries acknowledged, those really acknowledged counted under ``counter``;
- `LateOrUnknown`: a slot entry of a task not open when folded: late if the task is decided by the
  time of the call, else dead-lettered ``unknown_task``;
- `DeadLetter`: an entry dead-lettered (and acknowledged) with its own fields (or a stub of them,
  `streamgrp.store.deadletter`).

Errors: a lost lease raises `streamgrp.errors.LeaseLost` (`streamgrp.store.scripts.FencedScript`); an input
the function refuses (``BAD_INPUT``, a bug here) stays a `redis.ResponseError`, and the function has
written nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from streamgrp.core import codec, counters
from streamgrp.core.group_fold import Closed
from streamgrp.store import scripts
from streamgrp.store.connection import wait_for_replicas
from streamgrp.store.deadletter import MAX_DETAIL_CHARS, op_fields
from streamgrp.store.keys import ASSEMBLER_GROUP, PartitionKeys

# commit.lua's operations (private: only this module and the Lua name them).
_DECIDE = "decide"
_ACK_COUNT = "ack_count"
_LATE_OR_UNKNOWN = "late_or_unknown"
_DEAD_LETTER = "dead_letter"


@dataclass(frozen=True, slots=True)
class Acknowledge:
    """Entries to acknowledge; how many really were is added to the counter ``counter`` ("": none)."""

    counter: str
    entry_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LateOrUnknown:
    """A slot entry whose task was not open: late if ``task_id`` is decided when the round commits, else
    dead-lettered ``unknown_task`` with ``detail`` and the entry's ``fields``."""

    task_id: str
    entry_id: str
    detail: str
    fields: Mapping[Any, Any]


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An entry dead-lettered for ``reason`` (``detail`` says what is wrong) with its ``fields``, and acknowledged."""

    reason: str
    entry_id: str
    detail: str
    fields: Mapping[Any, Any]


Record = Closed | Acknowledge | LateOrUnknown | DeadLetter


@dataclass(frozen=True, slots=True)
class Committed:
    """What a round's call did: decisions written, decisions another assembler had written already
    (not written again), and every counter change it applied."""

    written: int
    redundant: int
    counts: dict[str, int]


def encode_round(records: Sequence[Record]) -> list[Any]:
    """The function's arguments after the lease token and consumer group, for ``records`` in order."""
    args: list[Any] = []
    for record in records:
        if isinstance(record, Closed):
            decision = record.decision
            increments = counters.decision_increments(decision)
            args += [
                _DECIDE,
                decision.task_id,
                codec.encode(decision)[codec.HEADER],
                len(record.entries),
                *record.entries,
                len(increments),
            ]
            for field, amount in increments.items():
                args += [field, amount]
        elif isinstance(record, Acknowledge):
            args += [_ACK_COUNT, record.counter, len(record.entry_ids), *record.entry_ids]
        elif isinstance(record, DeadLetter):
            args += [
                _DEAD_LETTER,
                record.reason,
                record.entry_id,
                record.detail[:MAX_DETAIL_CHARS],
                *op_fields(record.fields),
            ]
        elif isinstance(record, LateOrUnknown):
            args += [
                _LATE_OR_UNKNOWN,
                record.task_id,
                record.entry_id,
                record.detail[:MAX_DETAIL_CHARS],
                *op_fields(record.fields),
            ]
        else:
            raise TypeError(
                f"an assembler round commits Closed, Acknowledge, LateOrUnknown or DeadLetter records, "
                f"not {type(record).__name__}"
            )
    return args


def decode_reply(reply: Sequence[Any]) -> Committed:
    """The function's reply ``{written, redundant, counter, amount, ...}`` as a `Committed`."""
    written, redundant, *applied = reply
    return Committed(int(written), int(redundant), counters.pairs_to_counts(applied))


class AssemblerStore:
    """One partition's assembler commits: ``commit(lease_token, records)``."""

    def __init__(self, client: redis.Redis, keys: PartitionKeys) -> None:
        self.client = client
        self._keys = [keys.slots, keys.decisions, keys.deadletter, keys.decided, keys.counts, keys.assembler_lease]
        self._commit = scripts.register_fenced(client, "commit.lua")

    def commit(self, lease_token: str, records: Sequence[Record]) -> Committed:
        """Apply ``records`` in one atomic call fenced by the lease, then wait for replicas (when configured)."""
        reply = self._commit(keys=self._keys, args=[lease_token, ASSEMBLER_GROUP, *encode_round(records)])
        wait_for_replicas(self.client)
        return decode_reply(reply)
