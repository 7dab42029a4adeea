"""Reading schema-1 slot results, which carried their whole sample inside the slot log.

Schema 2 keeps the slot log small (a `SampleSummary`) and the tensors in the payloads stream. Logs
and archives written before keep replaying: a schema-1 slot result is validated as it was
recorded (`SlotResultV1`) and upcast to a schema-2 `SlotResult` whose summary digest is the digest
of the slot entry itself, which is what schema-1 decisions recorded. `inline_sample` gives a
trainer or replay the tensors of such an entry. Pure: no I/O.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from streamgrp.core.events import SampleSummary, SlotResult, check_outcome
from streamgrp.core.values import Frozen, Int, NonNegInt, Outcome, Sample

LEGACY_SCHEMA = 1


class SlotResultV1(Frozen):
    """A slot result as schema 1 recorded it: the sample inline."""

    schema_version: Int = LEGACY_SCHEMA
    producer: str = ""
    seq: NonNegInt = 0
    kind: Literal["slot_result"] = "slot_result"
    task_id: str = Field(min_length=1, max_length=256)
    slot: NonNegInt
    outcome: Outcome
    sample: Sample | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _check_outcome(self) -> SlotResultV1:
        check_outcome(self.outcome, self.sample, self.error)
        return self

    def upcast(self, entry_digest: str) -> SlotResult:
        """The schema-2 event this entry stands for; ``entry_digest`` is the digest of its own entry."""
        summary = SampleSummary.of(self.sample, entry_digest) if self.sample is not None else None
        return SlotResult(producer=self.producer, seq=self.seq, task_id=self.task_id, slot=self.slot,
                          outcome=self.outcome, sample=summary, error=self.error)
