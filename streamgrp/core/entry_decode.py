"""Reading an entry back into an event: `decode` and the checks behind it, cheapest and least trusting first, each
failure a `DecodeError` with one of the reasons `streamgrp.core.codec` lists (`DECODE_REASONS`); and
`entry_digest`, what a payload's bytes hash to, which reading a schema-1 slot result needs.

Owns the compiled decoder of each kind's header, the slow path that finds the reason a header is refused, and
upcasting schema-1 slot results. Writing entries, and a sample's payload as a trainer or the assembler reads it,
are `streamgrp.core.codec`'s, which re-exports these names (import them from there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import orjson

from streamgrp.core.digests import (
    DIGEST_PREFIX,
    SHA256_PREFIX,
    UNTAGGED,
    blake2b_digest_of,
    digest_of,
    sha256_digest_of,
)
from streamgrp.core.entry_fields import BLOB, HEADER, check_size, field, field_items, header_and_blob
from streamgrp.core.events import EVENT_TYPES, READABLE_SCHEMAS, SCHEMA_VERSION, SlotResult
from streamgrp.core.legacy import LEGACY_SCHEMA, SlotResultV1
from streamgrp.core.shown import clip, json_name, safe_text, show
from streamgrp.core.tensor_header import (
    RAW_KEY,
    TENSOR_FIELDS,
    from_header,
    from_view,
    header_view,
    tensor_count,
)
from streamgrp.core.wire import WireEvent, dec_hook, decoder, reason_of
from streamgrp.errors import DecodeError

#: Entry fields as a stream read returns them: bytes names and values, or str from a client that decodes
#: replies. Any of these mappings is accepted (the codec checks every name and value itself: ``bad_fields``);
#: `decode` takes None too (an entry deleted before it was read) and refuses it the same way.
Fields = Mapping[bytes, bytes | str] | Mapping[str, bytes | str] | Mapping[bytes | str, bytes | str]
#: Default ceiling for one entry (header plus bytes); larger entries are dead-lettered as oversized.
DEFAULT_MAX_ENTRY_BYTES = 64 * 1024 * 1024
#: How the encoder writes an event's kind: where `decode` finds which compiled decoder to try.
KIND_KEY = b'"kind":"'
#: A descriptor's key as the header holds it (inside a JSON string it is escaped: ``\"__raw__\"``, never this).
RAW_NAME = f'"{RAW_KEY}"'.encode()
#: The compiled decoder of each event's header, by its kind: the event's own Struct, or for an event with tensors
#: its header view (`streamgrp.core.tensor_header.header_view`: a `TensorRef` where a tensor goes).
_TENSOR_EVENTS: list[Any] = [model for model in EVENT_TYPES.values() if TENSOR_FIELDS[model]]
_STRUCT_DECODERS = {
    kind: decoder(header_view(model) if model in _TENSOR_EVENTS else model)
    for kind, model in EVENT_TYPES.items()
    if issubclass(model, WireEvent)
}
_MODEL_OF_VIEW: dict[Any, Any] = {header_view(model): model for model in _TENSOR_EVENTS}


def decode(fields: Fields | None, *, max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES) -> Any:
    """Rebuild and validate an event from XREAD fields; raises `DecodeError` with a reason, nothing else."""
    return _totally(decode_entry, fields, max_entry_bytes)


def decode_v1_slot_result(fields: Fields | None, *, max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES) -> SlotResultV1:
    """A schema-1 slot entry as recorded, its sample inline; raises `DecodeError` for anything else, a
    schema-2 slot result included (its tensors are a payload)."""
    event = _totally(decode_entry, fields, max_entry_bytes, upcast=False)
    if not isinstance(event, SlotResultV1):
        raise DecodeError(
            "unknown_kind",
            f"a {getattr(event, 'kind', type(event).__name__)} event (schema "
            f"{getattr(event, 'schema_version', '?')}) carries no inline sample",
        )
    return event


def _totally(decoder: Any, *args: Any, **options: Any) -> Any:
    """Run ``decoder``; anything it raises besides `DecodeError` becomes one (the safety net behind the
    explicit checks: decoding is total)."""
    try:
        return decoder(*args, **options)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(
            "invalid_value", f"unexpected {type(exc).__name__} while decoding: {clip(safe_text(exc))}"
        ) from None


def decode_entry(fields: Any, max_entry_bytes: int, *, upcast: bool = True) -> Any:
    """`decode` without its safety net: the checks, which raise `DecodeError`, but anything unexpected raised as it
    is (`decode` wraps it). ``upcast``: a schema-1 slot result as schema 2 (False: as recorded)."""
    items = field_items(fields)
    text = check_size(items, max_entry_bytes)
    raw_header, blob = header_and_blob(fields, text)
    # One compiled pass for a valid header (an event with tensors: its header view, the bytes cut out after);
    # anything else (an error, an older schema's slot result) takes the checks below, which give the reason.
    decoded = _compiled(raw_header)
    if decoded is not None and (
        decoded.schema_version == SCHEMA_VERSION
        or (decoded.schema_version in READABLE_SCHEMAS and decoded.__class__ is not SlotResult)
    ):
        if decoded.__class__ in _MODEL_OF_VIEW:
            used = [0, 0]  # bytes, tensors
            try:
                event = from_view(_MODEL_OF_VIEW[decoded.__class__], decoded, blob, used)
            except (DecodeError, ValueError, TypeError):
                event = None
            # Every descriptor in the header is one of its tensors (one in a free-form dict is refused below).
            if event is not None and used[0] == len(blob) and raw_header.count(RAW_NAME) == used[1]:
                return event
        elif not blob:
            return decoded
    header = _parse_header(raw_header)
    legacy = header.get("schema_version") == LEGACY_SCHEMA and header["kind"] == "slot_result"
    model = SlotResultV1 if legacy else EVENT_TYPES[header["kind"]]
    state = [0, 0]  # bytes of ``blob`` used so far, descriptors seen
    data = from_header(header, blob, state, 1)
    if state[0] != len(blob):
        raise DecodeError("length_mismatch", f"descriptors cover {state[0]} bytes but the entry carries {len(blob)}")
    event = _struct_event(model, data, state[1])
    if legacy and upcast and isinstance(event, SlotResultV1):  # legacy: the model is SlotResultV1
        # Schema 1's assemblers digested a slot entry with untagged BLAKE2b when they folded it, and the
        # decisions they wrote recorded that: upcast to the same digest.
        return event.upcast(entry_digest(fields, like=UNTAGGED))
    return event


def _compiled(raw_header: bytes) -> Any:
    """The header decoded by its kind's compiled decoder, or None when that refuses it (or names no kind)."""
    # Which decoder: the kind as the encoder writes it (a header that only looks so fails the decoder's own
    # check of its kind, and takes the checks that give the reason).
    start = raw_header.find(KIND_KEY) + len(KIND_KEY)
    if start < len(KIND_KEY):
        return None
    struct_decoder = _STRUCT_DECODERS.get(raw_header[start : raw_header.find(b'"', start)].decode(errors="replace"))
    if struct_decoder is None:
        return None
    try:
        return struct_decoder.decode(raw_header)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def _struct_event(model: Any, data: dict[str, Any], descriptors: int) -> Any:
    """An event from its parsed header (tensors cut out of the entry's bytes), with the reason of the first
    thing it breaks; a descriptor must sit where the event holds a tensor."""
    try:
        # bytes only as bytes: a tensor never comes from header text (no base64)
        event = msgspec.convert(data, model, dec_hook=dec_hook, builtin_types=(bytes,))
    except msgspec.ValidationError as exc:
        raise DecodeError(reason_of(exc, model, data), clip(safe_text(exc), 280)) from None
    if descriptors and descriptors != tensor_count(event, TENSOR_FIELDS[model]):
        raise DecodeError(
            "bad_header",
            f"the header has {descriptors} tensor descriptors but the {event.kind} event "
            f"has {tensor_count(event, TENSOR_FIELDS[model])} tensors: a descriptor sits in a field "
            "that takes no tensor",
        )
    return event


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
        raise DecodeError(
            "unsupported_schema",
            f"schema_version {show(version)}; this build reads the integers "
            f"{', '.join(map(str, READABLE_SCHEMAS))} (a newer streamgrp wrote it? upgrade this one)",
        )
    kind = header.get("kind")
    if kind.__class__ is not str or kind not in EVENT_TYPES:
        raise DecodeError("unknown_kind", f"kind {show(kind)} is not one of {sorted(EVENT_TYPES)}")
    return header


def entry_digest(fields: Fields, like: str | None = None) -> str:
    """A digest of an entry's header and bytes: what replay checks the rebuilt tensors against. Made
    the way ``like`` (a digest the log recorded for this entry) was made; by default, today's way."""
    header, blob = (field(fields, key) or b"" for key in (HEADER, BLOB))
    header = header.encode() if isinstance(header, str) else header
    blob = blob.encode() if isinstance(blob, str) else blob
    if like is None or like.startswith(DIGEST_PREFIX):
        return digest_of(header, blob)
    if like.startswith(SHA256_PREFIX):
        return sha256_digest_of(header, blob)
    return blake2b_digest_of(header, blob)
