"""The only code that turns events into stream-entry fields and back.

An entry has two fields: ``h``, an orjson header holding the event's fields with every tensor
replaced by a descriptor ``{"__raw__": [dtype, shape, offset, nbytes]}``, and ``b``, the tensors'
raw little-endian bytes back to back (absent when the event has no tensors). Decoding checks the
header against the bytes before pydantic validates the fields, and every failure raises one
`DecodeError` whose ``reason`` is a stable token used as the dead-letter reason:

    missing_field, bad_header, unsupported_schema, unknown_kind, unknown_dtype,
    length_mismatch, oversized, wrong_type, invalid_value

Round trips are bit-exact. No pickle.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from streamgrp.errors import DecodeError
from streamgrp.events import DTYPES, EVENT_TYPES, SCHEMA_VERSION, RawArray

HEADER = b"h"
BLOB = b"b"
RAW_KEY = "__raw__"
#: Default ceiling for one entry (header plus bytes); larger entries are dead-lettered as oversized.
DEFAULT_MAX_ENTRY_BYTES = 64 * 1024 * 1024

_WRONG_TYPE_SUFFIXES = ("_type", "_parsing")


def encode(event: BaseModel) -> dict[bytes, bytes]:
    """Fields for XADD: the orjson header and, if the event carries tensors, the raw bytes."""
    blobs: list[bytes] = []
    header = _to_header(event, blobs, [0])
    fields = {HEADER: orjson.dumps(header)}
    if blobs:
        fields[BLOB] = b"".join(blobs)
    return fields


def decode(fields: Mapping[bytes | str, bytes | str], *, max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES) -> Any:
    """Rebuild and validate an event from XREAD fields; raises `DecodeError` with a reason."""
    raw_header = _field(fields, HEADER)
    if raw_header is None:
        raise DecodeError("missing_field", f"entry has no {HEADER.decode()!r} header field (fields: {_names(fields)})")
    blob = _field(fields, BLOB) or b""
    if isinstance(raw_header, str):
        raw_header = raw_header.encode()
    if isinstance(blob, str):
        blob = blob.encode()
    size = sum(len(key) + len(value) for key, value in fields.items())
    if size > max_entry_bytes:
        raise DecodeError("oversized", f"entry is {size} bytes, over the {max_entry_bytes}-byte limit")
    try:
        header = orjson.loads(raw_header)
    except orjson.JSONDecodeError as exc:
        raise DecodeError("bad_header", f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise DecodeError("bad_header", f"header is a JSON {type(header).__name__}, expected an object")
    version = header.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise DecodeError("unsupported_schema", f"schema_version {version!r}; this build reads {SCHEMA_VERSION}")
    model = EVENT_TYPES.get(header.get("kind"))  # type: ignore[arg-type]
    if model is None:
        raise DecodeError("unknown_kind", f"kind {header.get('kind')!r} is not one of {sorted(EVENT_TYPES)}")
    used = [0]
    data = _from_header(header, blob, used)
    if used[0] != len(blob):
        raise DecodeError("length_mismatch", f"descriptors cover {used[0]} bytes but the entry carries {len(blob)}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise DecodeError(_reason(exc), _first_error(exc)) from None


def entry_digest(fields: Mapping[bytes | str, bytes | str]) -> str:
    """A digest of an entry's header and bytes: what replay checks the rebuilt tensors against."""
    digest = hashlib.blake2b(digest_size=16)
    for key in (HEADER, BLOB):
        value = _field(fields, key) or b""
        digest.update(value.encode() if isinstance(value, str) else value)
        digest.update(b"\0")
    return digest.hexdigest()


def combine_digests(digests: Iterable[str]) -> str:
    """One digest for an ordered list of entry digests (a group's members, a shard's groups)."""
    digest = hashlib.blake2b(digest_size=16)
    for item in digests:
        digest.update(item.encode())
    return digest.hexdigest()


def _to_header(value: Any, blobs: list[bytes], offset: list[int]) -> Any:
    if isinstance(value, RawArray):
        start = offset[0]
        blobs.append(value.data)
        offset[0] += len(value.data)
        return {RAW_KEY: [value.dtype, list(value.shape), start, len(value.data)]}
    if isinstance(value, BaseModel):
        return {name: _to_header(item, blobs, offset) for name, item in value.__dict__.items()}
    if isinstance(value, (list, tuple)):
        return [_to_header(item, blobs, offset) for item in value]
    if isinstance(value, dict):
        return {key: _to_header(item, blobs, offset) for key, item in value.items()}
    return value


def _from_header(value: Any, blob: bytes, used: list[int]) -> Any:
    if isinstance(value, dict):
        descriptor = value.get(RAW_KEY)
        if descriptor is not None and len(value) == 1:
            return _raw_array(descriptor, blob, used)
        return {key: _from_header(item, blob, used) for key, item in value.items()}
    if isinstance(value, list):
        return [_from_header(item, blob, used) for item in value]
    return value


def _raw_array(descriptor: Any, blob: bytes, used: list[int]) -> dict[str, Any]:
    if not (isinstance(descriptor, list) and len(descriptor) == 4):
        raise DecodeError("bad_header", f"tensor descriptor {descriptor!r} is not [dtype, shape, offset, nbytes]")
    dtype, shape, start, nbytes = descriptor
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise DecodeError("unknown_dtype", f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise DecodeError("bad_header", f"shape {shape!r} is not a list of non-negative integers")
    if type(start) is not int or type(nbytes) is not int or start < 0 or nbytes < 0:
        raise DecodeError("bad_header", f"offset {start!r} and nbytes {nbytes!r} must be non-negative integers")
    expected = math.prod(shape) * DTYPES[dtype][0]
    if nbytes != expected:
        raise DecodeError("length_mismatch", f"{dtype} {shape} needs {expected} bytes, header says {nbytes}")
    if start != used[0] or start + nbytes > len(blob):
        raise DecodeError(
            "length_mismatch",
            f"tensor at offset {start} of {nbytes} bytes does not follow the previous one inside a {len(blob)}-byte blob",
        )
    used[0] = start + nbytes
    # A plain dict: pydantic builds the RawArray once (its own size check included) in the model's
    # validation pass; constructing it here first doubled the work on the assembler's hot path.
    return {"dtype": dtype, "shape": shape, "data": blob[start : start + nbytes]}


def _field(fields: Mapping[bytes | str, bytes | str], key: bytes) -> bytes | str | None:
    value = fields.get(key)
    if value is None:
        value = fields.get(key.decode())  # type: ignore[call-overload]
    return value


def _names(fields: Mapping[Any, Any]) -> list[str]:
    return sorted(k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in fields)


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
    return f"{where}: {error['msg']}{more}"
