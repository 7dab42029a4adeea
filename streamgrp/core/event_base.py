"""The fields and schema version every event shares (`streamgrp.core.events` holds the events themselves)."""

from __future__ import annotations

from streamgrp.core.values import Frozen, Int, NonNegInt

SCHEMA_VERSION = 2
#: Schema versions this build reads. 1: a slot result carried its whole sample in the slot log (read
#: through `streamgrp.core.legacy`); 2: the slot log carries a `SampleSummary` and the sample's
#: tensors are a `SamplePayload` in the payloads stream, at the same entry id.
READABLE_SCHEMAS = (1, 2)


class _Event(Frozen):
    """Fields every event carries: schema version, and the producer's identity and sequence number."""

    schema_version: Int = SCHEMA_VERSION
    producer: str = ""
    seq: NonNegInt = 0
