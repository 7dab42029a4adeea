"""The only code that turns events into stream-entry fields and back.

An entry has two fields: ``h``, a JSON header holding the event's fields with every tensor
replaced by a descriptor ``{"__raw__": [dtype, shape, offset, nbytes]}``, and ``b``, the tensors'
raw little-endian bytes back to back (absent when the event has no tensors). Other fields are
ignored (but counted in the size).

`decode` is total: whatever it is given, it returns a validated event or raises `DecodeError`
(never another exception) whose ``reason`` is one of `DECODE_REASONS`, a stable token used as the
dead-letter reason and a metric label. Checks run cheapest and least trusting first, so a size
is checked before anything is parsed and a header's depth before its fields are validated:

    bad_fields          the fields are not a mapping of bytes (or str) names to bytes (or str)
                        values, a str has no UTF-8 bytes (a lone surrogate), or the entry's
                        RESP field list was malformed (odd length, unhashable name)
    oversized           names plus values of every field exceed ``max_entry_bytes`` (checked
                        before anything is parsed)
    repeated_field      a field name occurs more than once in the entry (see `streamgrp.core.entry_fields`)
    missing_field       no ``h`` field; or the event lacks a required field
    bad_header          ``h`` is not UTF-8 JSON, not an object, nested deeper than
                        `MAX_HEADER_DEPTH`, or a tensor descriptor is malformed or sits where
                        the schema has no tensor
    unsupported_schema  ``schema_version`` is not the integer this build reads
    unknown_kind        ``kind`` is missing, not a string, or not an event kind
    unknown_dtype       a tensor descriptor names a dtype outside `streamgrp.core.values.DTYPES`
    length_mismatch     descriptors and the ``b`` bytes disagree (sizes, order, leftovers)
    wrong_type          a field has the wrong JSON type (``true`` or ``2.0`` for an integer)
    invalid_value       a field has the right type but a value the schema refuses (range,
                        extra field, inconsistent rows, a sample's values that cannot train:
                        `streamgrp.core.value_checks`); also the safety net for anything
                        unexpected raised while validating

Round trips are bit-exact. No pickle. The work per tensor is a constant number of checks.
"""

from __future__ import annotations

from typing import Any

import msgspec

from streamgrp.core.digests import (  # noqa: F401 - the digests' names, importable from here as before
    DIGEST_PREFIX,
    SHA256_PREFIX,
    UNTAGGED,
    blake2b_digest_of,
    combine_digests,
    digest_of,
    sha256_digest_of,
)
from streamgrp.core.entry_decode import (  # noqa: F401 - decode is the codec's, importable from here
    DEFAULT_MAX_ENTRY_BYTES,
    Fields,
    decode,
    decode_entry,
    decode_v1_slot_result,
    entry_digest,
)
from streamgrp.core.entry_fields import BLOB, HEADER
from streamgrp.core.events import (
    GroupDecided,
    GroupDiscarded,
    Sample,
    SamplePayload,
    SampleSummary,
    SlotResult,
    SlotSegment,
    StepManifest,
)
from streamgrp.core.payload_check import payload_problem, payload_view  # noqa: F401 - importable from here as before
from streamgrp.core.tensor_header import (  # noqa: F401 - the header's names, importable from here as before
    MAX_HEADER_DEPTH,
    MAX_NDIM,
    RAW_KEY,
    TENSOR_FIELDS,
    from_header,
    from_view,
    header_view,
    span,
    tensor_count,
    with_descriptors,
)
from streamgrp.core.wire import ENCODER, WireEvent, decoder
from streamgrp.errors import DecodeError

#: Every `DecodeError.reason` that `decode` can raise.
DECODE_REASONS = frozenset(
    {
        "bad_fields",
        "oversized",
        "repeated_field",
        "missing_field",
        "bad_header",
        "unsupported_schema",
        "unknown_kind",
        "unknown_dtype",
        "length_mismatch",
        "wrong_type",
        "invalid_value",
    }
)


#: Events encoded without decoding them again: their values are made by streamgrp's services from events they
#: decoded (and so checked: msgspec validates as it decodes) and from their own counters, never taken from outside.
#: A decision is the assembler's fold over the slot log; a step manifest and a discarded group are the batcher's,
#: from decisions; a segment's only outside values, the inference engine's tokens and logprobs, are checked when
#: it is built (`streamgrp.core.generation_events.check_token_arrays`). These are the hot writes (a decision per
#: group, a manifest per step, a segment every few dozen tokens); decoding each again cost as much as writing it
#: (a manifest of 8 groups: 27 µs) and could only find a bug of streamgrp's own, which the fold, golden and
#: round-trip tests look for. A reader still decodes and checks every entry. Every other kind (tasks, results,
#: rewards, payloads, session turns, run settings, training progress) can carry a user's values, and keeps the
#: check.
DERIVED: frozenset[type] = frozenset({GroupDecided, StepManifest, GroupDiscarded, SlotSegment})
#: How a result leaves out ``reward_pending`` when it is not set (its last field).
_NOT_PENDING = b',"reward_pending":false}'


def encode(event: Any) -> dict[bytes, bytes]:
    """Fields for XADD: the header and, if the event carries tensors, the raw bytes. An event that can carry
    values from outside streamgrp is checked as it is encoded, by decoding what was written as a reader will
    (a Struct built in Python checks only the rules between its fields): ``ValueError`` names what it breaks.
    The kinds of `DERIVED` are written as they are, not decoded again."""
    kind = type(event)
    if kind in DERIVED:
        return _tensor_entry(event) if TENSOR_FIELDS[kind] else {HEADER: ENCODER.encode(event)}
    if not TENSOR_FIELDS[kind]:
        return {HEADER: struct_header(event)}
    fields = _tensor_entry(event)
    try:
        decode_entry(fields, DEFAULT_MAX_ENTRY_BYTES, upcast=False)
    except DecodeError as exc:
        raise ValueError(f"this {event.kind} event cannot be written: {exc}") from None
    return fields


def _tensor_entry(event: Any) -> dict[bytes, bytes]:
    """The fields of an event with tensors: descriptors in the header, the bytes beside it (unchecked)."""
    blobs: list[bytes] = []
    fields = {HEADER: ENCODER.encode(with_descriptors(event, TENSOR_FIELDS[type(event)], blobs, [0]))}
    if blobs:
        fields[BLOB] = b"".join(blobs)
    return fields


def stamped(event: Any, *, producer: str, seq: int) -> Any:
    """``event`` as written by ``producer`` at sequence number ``seq`` (a copy)."""
    return event.replace(producer=producer, seq=seq)


def struct_header(event: WireEvent) -> bytes:
    """The header of an event without tensors, checked by decoding it as a reader will."""
    header = ENCODER.encode(event)
    if event.__class__ is SlotResult and header.endswith(_NOT_PENDING):
        header = header[: -len(_NOT_PENDING)] + b"}"
    try:
        decoder(type(event)).decode(header)
    except msgspec.ValidationError as exc:
        raise ValueError(f"this {event.kind} event cannot be written: {exc}") from None
    return header


def sample_result(
    task_id: str, slot: int, sample: Sample, *, producer: str = "", seq: int = 0, reward_pending: bool = False
) -> tuple[SlotResult, dict[bytes, bytes]]:
    """A sample's slot result and its payload entry's fields: the result's summary carries the payload's
    digest, computed here, once (what a publisher writes; `streamgrp.services.worker` is one).
    ``reward_pending``: the sample's rewards are placeholders that a `SlotRewarded` replaces."""
    event, payload, _ = _sample_entries(task_id, slot, sample, producer, seq, reward_pending)
    return event, payload


def encode_sample(
    task_id: str, slot: int, sample: Sample, *, producer: str = "", seq: int = 0, reward_pending: bool = False
) -> tuple[bytes, bytes, bytes]:
    """``sample_result`` already encoded: (slot result header, payload header, payload bytes), what the
    publisher writes."""
    _, payload, slot_header = _sample_entries(task_id, slot, sample, producer, seq, reward_pending)
    return slot_header, payload[HEADER], payload.get(BLOB, b"")


def _sample_entries(
    task_id: str, slot: int, sample: Sample, producer: str, seq: int, reward_pending: bool
) -> tuple[SlotResult, dict[bytes, bytes], bytes]:
    """The slot result, the payload's fields and the result's header. The publisher's hot path, so the payload
    is not decoded again to check it: the `Sample` checked its tensors and values when it was built, and what
    the payload shares with the result (task, slot, producer, sequence, version) is checked with the result's
    header; only the types of its rewards and row lengths are left, checked here."""
    if sample.__class__ is not Sample:
        raise ValueError(f"a sample is a streamgrp Sample, not a {type(sample).__name__}")
    for reward in sample.rewards:
        if reward.__class__ is not float and reward.__class__ is not int:
            raise ValueError(f"a sample's rewards are numbers, not {type(reward).__name__}")
    for length in sample.row_lengths:
        if length.__class__ is not int:
            raise ValueError(f"a sample's row lengths are integers, not {type(length).__name__}")
    payload = _tensor_entry(SamplePayload(task_id=task_id, slot=slot, sample=sample, producer=producer, seq=seq))
    summary = SampleSummary.of(sample, entry_digest(payload))
    event = SlotResult(
        task_id=task_id,
        slot=slot,
        outcome="sample",
        sample=summary,
        producer=producer,
        seq=seq,
        reward_pending=reward_pending,
    )
    return event, payload, struct_header(event)


def is_inline_sample(fields: Fields) -> bool:
    """Whether a slot entry is a schema-1 slot result, which carries its sample itself (no payload entry)."""
    try:
        return decode_v1_slot_result(fields).sample is not None
    except DecodeError:
        return False
