"""The schema version every event shares (`streamgrp.core.wire.WireEvent` holds the shared fields,
`streamgrp.core.events` the events themselves)."""

from __future__ import annotations

from streamgrp.core.wire import WIRE_SCHEMA

SCHEMA_VERSION = WIRE_SCHEMA
#: Schema versions this build reads. 1: a slot result carried its whole sample in the slot log (read
#: through `streamgrp.core.legacy`); 2: the slot log carries a `SampleSummary` and the sample's
#: tensors are a `SamplePayload` in the payloads stream, at the same entry id.
READABLE_SCHEMAS = (1, 2)
