"""Reading schema-1 slot results, which carried their whole sample inside the slot log.

Schema 2 keeps the slot log small (a `SampleSummary`) and the tensors in the payloads stream. Logs
and archives written before keep replaying: a schema-1 slot result is validated as it was
recorded (`SlotResultV1`) and upcast to a schema-2 `SlotResult` whose summary digest is the digest
of the slot entry itself, which is what schema-1 decisions recorded. `inline_sample` gives a
trainer or replay the tensors of such an entry. Pure: no I/O.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from streamgrp.core import wire
from streamgrp.core.events import SampleSummary, SlotResult, check_outcome
from streamgrp.core.values import Outcome, Sample
from streamgrp.core.wire import Record

LEGACY_SCHEMA = 1


class SlotResultV1(Record, frozen=True, kw_only=True):
    """A slot result as schema 1 recorded it: the sample inline."""

    schema_version: wire.Int = LEGACY_SCHEMA
    producer: str = ""
    seq: wire.NonNegInt = 0
    kind: Literal["slot_result"] = "slot_result"
    task_id: Annotated[str, Meta(min_length=1, max_length=256)]
    slot: wire.NonNegInt
    outcome: Outcome
    sample: Sample | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        check_outcome(self.outcome, self.sample, self.error)

    def upcast(self, entry_digest: str) -> SlotResult:
        """The schema-2 event this entry stands for; ``entry_digest`` is the digest of its own entry."""
        summary = SampleSummary.of(self.sample, entry_digest) if self.sample is not None else None
        return SlotResult(
            producer=self.producer,
            seq=self.seq,
            task_id=self.task_id,
            slot=self.slot,
            outcome=self.outcome,
            sample=summary,
            error=self.error,
        )
