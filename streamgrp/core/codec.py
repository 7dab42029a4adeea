"""The only code that turns events into stream-entry fields and back.

An entry has two fields: ``h``, an orjson header holding the event's fields with every tensor
replaced by a descriptor ``{"__raw__": [dtype, shape, offset, nbytes]}``, and ``b``, the tensors'
raw little-endian bytes back to back (absent when the event has no tensors). Other fields are
ignored (but counted in the size).

`decode` is total: whatever it is given, it returns a validated event or raises `DecodeError`
(never another exception) whose ``reason`` is one of `DECODE_REASONS`, a stable token used as the
dead-letter reason and a metric label. Checks run cheapest and least trusting first, so a size
is checked before anything is parsed and a header's depth before pydantic sees it:

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
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from streamgrp.core.digests import (  # noqa: F401 - the digests' names, importable from here as before
    DIGEST_PREFIX,
    UNTAGGED,
    blake2b_digest_of,
    combine_digests,
    digest_of,
)
from streamgrp.core.events import (
    EVENT_TYPES,
    READABLE_SCHEMAS,
    SCHEMA_VERSION,
    Sample,
    SamplePayload,
    SampleSummary,
    SlotResult,
)
from streamgrp.core.fast_decode import (
    fast_group_decided,
    fast_sample_payload,
    fast_slot_result,
    fast_step_manifest,
)
from streamgrp.core.legacy import LEGACY_SCHEMA, SlotResultV1
from streamgrp.core.shown import (
    clip,
    field_names,
    json_name,
    safe_text,
    show,
    show_names,
)
from streamgrp.core.tensor_header import (  # noqa: F401 - the header's names, importable from here as before
    MAX_HEADER_DEPTH,
    MAX_NDIM,
    RAW_KEY,
    TENSOR_FIELDS,
    from_header,
    tensor_count,
    to_header,
)
from streamgrp.core.value_checks import token_id_problem
from streamgrp.core.values import INT64_MAX
from streamgrp.errors import DecodeError

HEADER = b"h"
BLOB = b"b"
#: Entry fields as a stream read returns them: bytes names and values, or str from a client that decodes
#: replies. Any of these mappings is accepted (the codec checks every name and value itself: ``bad_fields``);
#: `decode` takes None too (an entry deleted before it was read) and refuses it the same way.
Fields = Mapping[bytes, bytes | str] | Mapping[str, bytes | str] | Mapping[bytes | str, bytes | str]
#: Default ceiling for one entry (header plus bytes); larger entries are dead-lettered as oversized.
DEFAULT_MAX_ENTRY_BYTES = 64 * 1024 * 1024
#: Every `DecodeError.reason` that `decode` can raise.
DECODE_REASONS = frozenset({
    "bad_fields", "oversized", "repeated_field", "missing_field", "bad_header", "unsupported_schema",
    "unknown_kind", "unknown_dtype", "length_mismatch", "wrong_type", "invalid_value",
})

_WRONG_TYPE_SUFFIXES = ("_type", "_parsing")


def encode(event: BaseModel) -> dict[bytes, bytes]:
    """Fields for XADD: the orjson header and, if the event carries tensors, the raw bytes."""
    blobs: list[bytes] = []
    header = to_header(event, blobs, [0])
    fields = {HEADER: orjson.dumps(header)}
    if blobs:
        fields[BLOB] = b"".join(blobs)
    return fields


def sample_result(task_id: str, slot: int, sample: Sample, *, producer: str = "", seq: int = 0,
                  reward_pending: bool = False) -> tuple[SlotResult, dict[bytes, bytes]]:
    """A sample's slot result and its payload entry's fields: the result's summary carries the payload's
    digest, computed here, once (what a publisher writes; `streamgrp.services.worker` is one).
    ``reward_pending``: the sample's rewards are placeholders that a `SlotRewarded` replaces."""
    payload = encode(SamplePayload(task_id=task_id, slot=slot, sample=sample, producer=producer, seq=seq))
    summary = SampleSummary.of(sample, entry_digest(payload))
    return SlotResult(task_id=task_id, slot=slot, outcome="sample", sample=summary, producer=producer,
                      seq=seq, reward_pending=reward_pending), payload


def encode_sample(task_id: str, slot: int, sample: Sample, *, producer: str = "", seq: int = 0,
                  reward_pending: bool = False) -> tuple[bytes, bytes, bytes]:
    """``sample_result`` already encoded: (slot result header, payload header, payload bytes), the very
    bytes `encode` would write for both. The publisher's hot path: a 1024-token sample's three models
    and their walk cost about 30 µs, so the headers of a plain sample (the `Sample` validated when it
    was built; the few other values checked here by hand) are written directly. Anything unusual takes
    the models, with their errors; a property test holds the two paths to the same bytes."""
    plain = None if reward_pending else _plain_sample_headers(task_id, slot, sample, producer, seq)
    if plain is not None:
        return plain
    event, payload = sample_result(task_id, slot, sample, producer=producer, seq=seq, reward_pending=reward_pending)
    return encode(event)[HEADER], payload[HEADER], payload.get(BLOB, b"")


def _plain_sample_headers(task_id: Any, slot: Any, sample: Any, producer: Any,
                          seq: Any) -> tuple[bytes, bytes, bytes] | None:
    if not (sample.__class__ is Sample and task_id.__class__ is str and 1 <= len(task_id) <= 256
            and producer.__class__ is str and slot.__class__ is int and 0 <= slot <= INT64_MAX
            and seq.__class__ is int and 0 <= seq <= INT64_MAX):
        return None
    rows = len(sample.row_lengths)
    reward = sum(sample.rewards) / rows
    if not math.isfinite(reward):  # finite rewards can still sum past the largest float
        return None
    descriptors = {}
    offset = 0
    for name in ("token_ids", "loss_mask", "logprobs"):
        tensor = getattr(sample, name)
        descriptors[name] = {RAW_KEY: [tensor.dtype, list(tensor.shape), offset, len(tensor.data)]}
        offset += len(tensor.data)
    # Key order is the models' field order, as `encode` writes it.
    payload_header = orjson.dumps({
        "schema_version": SCHEMA_VERSION, "producer": producer, "seq": seq, "kind": "sample_payload",
        "task_id": task_id, "slot": slot,
        "sample": {**descriptors, "row_lengths": sample.row_lengths, "rewards": sample.rewards,
                   "version": sample.version, "meta": sample.meta}})
    blob = b"".join((sample.token_ids.data, sample.loss_mask.data, sample.logprobs.data))
    summary = {"rows": rows, "tokens": sample.valid_tokens, "version": sample.version, "reward": reward,
               "digest": digest_of(payload_header, blob)}
    slot_header = orjson.dumps({
        "schema_version": SCHEMA_VERSION, "producer": producer, "seq": seq, "kind": "slot_result",
        "task_id": task_id, "slot": slot, "outcome": "sample", "sample": summary, "error": None})
    return slot_header, payload_header, blob


def payload_problem(fields: Fields | None, result: SlotResult, *,
                    vocab_size: int | None = None, max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES) -> str | None:
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
        return (f"its slot result says rows, tokens, version {list(claimed)} but its payload holds {list(held)}; "
                "publish with streamgrp's worker (or codec.encode_sample), which writes both from one sample")
    reward = sum(sample.rewards) / sample.rows
    if not math.isclose(summary.reward, reward, rel_tol=1e-9, abs_tol=1e-12):
        return f"its slot result says reward {summary.reward!r} but its payload's rewards average {reward!r}"
    # Every other value was checked as the payload decoded; the vocabulary is the run's, not the sample's.
    return None if vocab_size is None else token_id_problem(sample.token_ids.dtype, sample.token_ids.data, vocab_size)


def is_inline_sample(fields: Fields) -> bool:
    """Whether a slot entry is a schema-1 slot result, which carries its sample itself (no payload entry)."""
    try:
        return decode_v1_slot_result(fields).sample is not None
    except DecodeError:
        return False


def decode(fields: Fields | None, *, max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES) -> Any:
    """Rebuild and validate an event from XREAD fields; raises `DecodeError` with a reason, nothing else."""
    return _totally(_decode, fields, max_entry_bytes)


def decode_v1_slot_result(fields: Fields | None, *,
                          max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES) -> SlotResultV1:
    """A schema-1 slot entry as recorded, its sample inline; raises `DecodeError` for anything else, a
    schema-2 slot result included (its tensors are a payload)."""
    event = _totally(_decode, fields, max_entry_bytes, upcast=False)
    if not isinstance(event, SlotResultV1):
        raise DecodeError("unknown_kind", f"a {getattr(event, 'kind', type(event).__name__)} event (schema "
                          f"{getattr(event, 'schema_version', '?')}) carries no inline sample")
    return event


def _totally(decoder: Any, *args: Any, **options: Any) -> Any:
    """Run ``decoder``; anything it raises besides `DecodeError` becomes one (the safety net behind the
    explicit checks: decoding is total)."""
    try:
        return decoder(*args, **options)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError("invalid_value", f"unexpected {type(exc).__name__} while decoding: {clip(safe_text(exc))}") \
            from None


def _decode(fields: Any, max_entry_bytes: int, *, upcast: bool = True) -> Any:
    items = _field_items(fields)
    text = _check_size(items, max_entry_bytes)
    raw_header, blob = _header_and_blob(fields, text)
    header = _parse_header(raw_header)
    kind = header["kind"]
    # None: not the plain case, so the full path below judges it
    event: BaseModel | None
    if not blob:
        event = fast_slot_result(header) if kind == "slot_result" else \
            fast_group_decided(header) if kind == "group_decided" else \
            fast_step_manifest(header) if kind == "step" else None
    else:
        event = fast_sample_payload(header, blob) if kind == "sample_payload" else None
    if event is not None:
        return event
    legacy = header.get("schema_version") == LEGACY_SCHEMA and header["kind"] == "slot_result"
    model = SlotResultV1 if legacy else EVENT_TYPES[header["kind"]]
    state = [0, 0]  # bytes of ``blob`` used so far, descriptors seen
    data = from_header(header, blob, state, 1)
    if state[0] != len(blob):
        raise DecodeError("length_mismatch", f"descriptors cover {state[0]} bytes but the entry carries {len(blob)}")
    try:
        event = model.model_validate(data)
    except ValidationError as exc:
        raise DecodeError(_reason(exc), _first_error(exc)) from None
    if state[1] and state[1] != tensor_count(event, TENSOR_FIELDS[model]):
        raise DecodeError("bad_header", f"the header has {state[1]} tensor descriptors but the {header['kind']} event "
                          f"has {tensor_count(event, TENSOR_FIELDS[model])} tensors: a descriptor sits in a field "
                          "that takes no tensor")
    if legacy and upcast and isinstance(event, SlotResultV1):  # legacy: the model is SlotResultV1
        # Schema 1's assemblers digested a slot entry with untagged BLAKE2b when they folded it, and the
        # decisions they wrote recorded that: upcast to the same digest.
        return event.upcast(entry_digest(fields, like=UNTAGGED))
    return event


def _field_items(fields: Any) -> Iterable[tuple[Any, Any]]:
    """Every (name, value) pair of the entry, repeats included; refuses what is not a field mapping."""
    if fields.__class__ is dict:  # the fast path: what redis-py and `entry_fields` return
        return fields.items()
    if not isinstance(fields, Mapping):
        raise DecodeError("bad_fields", f"entry fields are a {type(fields).__name__}, not a mapping of names "
                          "to values" + (" (the entry was deleted?)" if fields is None else ""))
    malformed = getattr(fields, "malformed", None)
    if malformed:
        raise DecodeError("bad_fields", clip(str(malformed)))
    pairs = getattr(fields, "pairs", None)
    return pairs if isinstance(pairs, list) else fields.items()


def _check_size(items: Iterable[tuple[Any, Any]], max_entry_bytes: int) -> bool:
    """Refuse an entry over ``max_entry_bytes`` before anything is parsed (every name and value counts).
    Returns whether any name or value is a str (a decode_responses client)."""
    size = 0
    text = False
    for key, value in items:
        if key.__class__ is not bytes or value.__class__ is not bytes:
            _check_field_types(key, value)
            text = True
        size += len(key) + len(value)
    if size <= max_entry_bytes and text:
        # A str counted its characters, a lower bound; count the UTF-8 bytes the server holds.
        size = sum(len(_as_bytes(key)) + len(_as_bytes(value)) for key, value in items)
    if size > max_entry_bytes:
        raise DecodeError("oversized", f"entry is {'at least ' if text else ''}{size} bytes, over the "
                          f"{max_entry_bytes}-byte limit (max_entry_bytes); write smaller events or raise the limit")
    return text


def _header_and_blob(fields: Any, text: bool) -> tuple[bytes, bytes]:
    """The ``h`` and ``b`` values as bytes (``b`` empty when absent); refuses repeated or missing ones."""
    if fields.__class__ is not dict:
        repeated = getattr(fields, "repeated", ())
        if repeated:
            raise DecodeError("repeated_field", f"field names repeated in one entry: {show_names(repeated)}; "
                              "each field must appear once (was the entry written by streamgrp.core.codec?)")
    raw_header = fields.get(HEADER)
    blob = fields.get(BLOB)
    if text:
        raw_header, blob = _text_fields(fields, raw_header, blob)
    if raw_header is None:
        raise DecodeError("missing_field", f"entry has no {HEADER.decode()!r} header field (fields: {field_names(fields)})")
    return raw_header, b"" if blob is None else blob


def _parse_header(raw_header: bytes) -> dict[str, Any]:
    """The header as a JSON object of this schema version and a known kind."""
    try:
        header = orjson.loads(raw_header)
    except orjson.JSONDecodeError as exc:
        raise DecodeError("bad_header", f"header is not UTF-8 JSON: {clip(str(exc))}") from None
    if header.__class__ is not dict:
        raise DecodeError("bad_header", f"header is a JSON {json_name(header)}, expected an object")
    version = header.get("schema_version", SCHEMA_VERSION)
    if version.__class__ is not int or version not in READABLE_SCHEMAS:
        raise DecodeError("unsupported_schema", f"schema_version {show(version)}; this build reads the integers "
                          f"{', '.join(map(str, READABLE_SCHEMAS))} (a newer streamgrp wrote it? upgrade this one)")
    kind = header.get("kind")
    if kind.__class__ is not str or kind not in EVENT_TYPES:
        raise DecodeError("unknown_kind", f"kind {show(kind)} is not one of {sorted(EVENT_TYPES)}")
    return header


def entry_digest(fields: Fields, like: str | None = None) -> str:
    """A digest of an entry's header and bytes: what replay checks the rebuilt tensors against. Made
    the way ``like`` (a digest the log recorded for this entry) was made; by default, today's way."""
    header, blob = (_field(fields, key) or b"" for key in (HEADER, BLOB))
    header = header.encode() if isinstance(header, str) else header
    blob = blob.encode() if isinstance(blob, str) else blob
    if like is not None and not like.startswith(DIGEST_PREFIX):
        return blake2b_digest_of(header, blob)
    return digest_of(header, blob)


def _check_field_types(key: Any, value: Any) -> None:
    for what, item in (("name", key), ("value", value)):
        if item.__class__ is not bytes and item.__class__ is not str:
            raise DecodeError("bad_fields", f"a field {what} is of type {type(item).__name__} ({show(item)}), "
                              "expected bytes (or str from a decode_responses client)")


def _as_bytes(value: bytes | str) -> bytes:
    if value.__class__ is bytes:
        return value
    try:
        # surrogateescape gives back the server's bytes when the client decoded them that way
        return value.encode("utf-8", "surrogateescape")  # type: ignore[union-attr]
    except UnicodeEncodeError as exc:
        raise DecodeError("bad_fields", f"a str field holds text that has no UTF-8 bytes: {exc.reason}") from None


def _text_fields(fields: Mapping[Any, Any], raw_header: Any, blob: Any) -> tuple[bytes | None, bytes | None]:
    """The header and blob from a mapping with str names or values (a decode_responses client)."""
    for key, value in ((HEADER, raw_header), (BLOB, blob)):
        if value is not None and key.decode() in fields:
            raise DecodeError("repeated_field", f"field {key.decode()!r} is given both as bytes and as str")
    if raw_header is None:
        raw_header = fields.get(HEADER.decode())
    if blob is None:
        blob = fields.get(BLOB.decode())
    return (None if raw_header is None else _as_bytes(raw_header),
            None if blob is None else _as_bytes(blob))


def _field(fields: Mapping[Any, bytes | str], key: bytes) -> bytes | str | None:
    value = fields.get(key)
    if value is None:
        value = fields.get(key.decode())
    return value


def _reason(exc: ValidationError) -> str:
    kind = exc.errors()[0]["type"]
    if kind == "missing":
        return "missing_field"
    if kind.endswith(_WRONG_TYPE_SUFFIXES) or kind in ("literal_error", "union_tag_invalid", "model_attributes_type"):
        return "wrong_type"
    return "invalid_value"


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "event"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return clip(f"{clip(where, 100)}: {error['msg']}", 280) + more
