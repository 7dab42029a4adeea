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

import math
from typing import Any

import msgspec
from msgspec import UNSET

from streamgrp.core.digests import (  # noqa: F401 - the digests' names, importable from here as before
    DIGEST_PREFIX,
    UNTAGGED,
    blake2b_digest_of,
    combine_digests,
    digest_of,
)
from streamgrp.core.entry_decode import (
    DEFAULT_MAX_ENTRY_BYTES,
    KIND_KEY,
    RAW_NAME,
    Fields,
    decode,
    decode_entry,
    decode_v1_slot_result,
    entry_digest,
)
from streamgrp.core.entry_fields import BLOB, HEADER
from streamgrp.core.events import (
    READABLE_SCHEMAS,
    GroupDecided,
    GroupDiscarded,
    Sample,
    SamplePayload,
    SampleSummary,
    SlotResult,
    SlotSegment,
    StepManifest,
    token_version_fields,
)
from streamgrp.core.shown import clip
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
from streamgrp.core.value_checks import token_id_problem
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
_PAYLOAD_VIEW = decoder(header_view(SamplePayload))
_PAYLOAD_TENSORS = ("token_ids", "loss_mask", "logprobs")
_PAYLOAD_KIND = KIND_KEY + b'sample_payload"'
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


def payload_problem(
    fields: Fields | None,
    result: SlotResult,
    *,
    vocab_size: int | None = None,
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
) -> str | None:
    """What keeps the sample of ``result`` (a schema-2 slot result with a summary) from training, judged by
    its payload entry's ``fields`` (None: no entry at the result's id); None when nothing does.

    A sample trains only if its payload decodes (its values can train: `streamgrp.core.value_checks`),
    is the payload of that task and slot, hashes to the digest the summary recorded and agrees with the
    summary's rows, tokens, version and reward; its token ids are below ``vocab_size`` when given. A
    publisher that is not streamgrp's worker can write any of these wrong; the assembler asks this of
    every sample before folding it, so the batcher never places one a trainer would fail on."""
    summary = result.sample
    if summary is None:
        raise ValueError(f"slot {result.slot} of task {result.task_id} is {result.outcome}: it has no payload")
    if not fields:
        return "its payload entry is not in the payloads stream (deleted, or never written)"
    try:
        payload = decode(fields, max_entry_bytes=max_entry_bytes)
    except DecodeError as exc:
        return f"its payload does not decode ({exc.reason}): {exc.detail}"
    if not isinstance(payload, SamplePayload):
        return f"the payloads entry at its id is a {payload.kind} event, not a sample_payload"
    if payload.task_id != result.task_id or payload.slot != result.slot:
        return f"the payloads entry at its id is slot {payload.slot} of task {clip(payload.task_id, 80)!r}"
    if entry_digest(fields, like=summary.digest) != summary.digest:
        return "its payload does not hash to the digest its slot result recorded"
    sample = payload.sample
    claimed = (summary.rows, summary.tokens, summary.version)
    held = (sample.rows, sample.valid_tokens, sample.version)
    if claimed != held:
        return (
            f"its slot result says rows, tokens, version {list(claimed)} but its payload holds {list(held)}; "
            "publish with streamgrp's worker (or codec.encode_sample), which writes both from one sample"
        )
    reward = sum(sample.rewards) / sample.rows
    if not math.isclose(summary.reward, reward, rel_tol=1e-9, abs_tol=1e-12):
        return f"its slot result says reward {summary.reward!r} but its payload's rewards average {reward!r}"
    versions = token_version_fields(sample)
    told = {name: getattr(summary, name) for name in versions}
    if told != versions:  # what the batch fold reads of its token versions under --staleness mask
        return f"its slot result says token versions {_shown(told)} but its payload's give {_shown(versions)}"
    # Every other value was checked as the payload decoded; the vocabulary is the run's, not the sample's.
    return None if vocab_size is None else token_id_problem(sample.token_ids.dtype, sample.token_ids.data, vocab_size)


def _shown(fields: dict[str, Any]) -> dict[str, Any]:
    """Fields with the left-out ones (UNSET) shown as None."""
    return {name: None if value is UNSET else value for name, value in fields.items()}


def is_inline_sample(fields: Fields) -> bool:
    """Whether a slot entry is a schema-1 slot result, which carries its sample itself (no payload entry)."""
    try:
        return decode_v1_slot_result(fields).sample is not None
    except DecodeError:
        return False


def payload_view(header: Any, blob: Any) -> Any:
    """The header of a sample payload entry as its compiled view (`header_view` of `SamplePayload`: tensors as
    descriptors), each descriptor checked against ``blob`` (any buffer: its bytes are not cut, copied or
    looked at) as `decode` checks them. What a trainer rank reads a payload with: the manifest's checks
    were made where the sample entered, so it neither rebuilds the `Sample` nor checks its values again.
    Raises `DecodeError` with the reason `decode` gives the entry, and ``unknown_kind`` for another event; reads
    every payload `decode` reads."""
    header = _as_read(header)
    view = None
    if header.__class__ is bytes:
        try:
            view = _PAYLOAD_VIEW.decode(header)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass
    if view is not None and view.schema_version in READABLE_SCHEMAS:
        size = len(blob)
        used = 0
        sample = view.sample
        try:
            for name in _PAYLOAD_TENSORS:
                used = span(getattr(sample, name).raw, size, used)
        except DecodeError:
            used = -1
        if used == size and header.count(RAW_NAME) == len(_PAYLOAD_TENSORS):
            return view
    try:
        # The refused entry, as a stream read gives it: what is wrong with it.
        event = decode({HEADER: _as_read(header), BLOB: _as_read(blob)})
    except DecodeError as exc:
        if header.__class__ is not bytes or _PAYLOAD_KIND not in header:
            raise DecodeError("unknown_kind", f"not a sample_payload event ({exc.reason}: {exc.detail})") from None
        raise
    if event.__class__ is not SamplePayload:
        raise DecodeError("unknown_kind", f"a {event.kind} event, not a sample_payload")
    # A payload the compiled pass refuses but `decode` reads (a key given twice: JSON's last one counts): the
    # trainer reads what the assembler's check read, as descriptors in the same places.
    return with_descriptors(event, TENSOR_FIELDS[SamplePayload], [], [0])


def _as_read(value: Any) -> Any:
    """A field's value as bytes, as a stream read gives it: a str (a decode_responses client) as its UTF-8
    bytes, another buffer as its bytes; anything else as it is (`decode` refuses it: bad_fields)."""
    if value.__class__ is bytes:
        return value
    try:
        return value.encode("utf-8", "surrogateescape") if isinstance(value, str) else memoryview(value).tobytes()
    except (TypeError, ValueError):
        return value
