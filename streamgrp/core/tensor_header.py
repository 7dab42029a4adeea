"""The header's tensor descriptors: events' tensors replaced by ``{"__raw__": [dtype, shape, offset, nbytes]}``
on the way out (`with_descriptors`, then msgspec's encoder) and checked and cut back out of the entry's bytes
on the way in: in one compiled pass through the event's header view (`header_view`, derived from its Struct:
a `TensorRef` where a tensor goes; `span` checks each against the bytes, `from_view` builds the event), and
for a header that pass refuses, from the parsed JSON (`from_header`), which gives the reason.

Owns the descriptor's form and its checks (`MAX_NDIM`, `MAX_HEADER_DEPTH`, sizes and order against the bytes;
errors are `DecodeError` with the codec's reasons) and where each event model holds tensors (`TENSOR_FIELDS`).
The entry's fields, sizes and validation are the codec's (`streamgrp.core.codec`).
"""

from __future__ import annotations

import functools
import math
import types
from typing import Annotated, Any, Union, get_args, get_origin

import msgspec

from streamgrp.core.events import EVENT_TYPES, RawArray
from streamgrp.core.legacy import SlotResultV1
from streamgrp.core.shown import clip, show
from streamgrp.core.values import DTYPES
from streamgrp.core.wire import NonNegInt
from streamgrp.errors import DecodeError

RAW_KEY = "__raw__"
#: The deepest a header's JSON objects and arrays may nest (the header itself is level 1; a
#: tensor descriptor counts as one level). Encoded events reach about 6 (a step manifest).
MAX_HEADER_DEPTH = 32
#: The most dimensions a tensor descriptor may give (bounds the work of checking its size).
MAX_NDIM = 32


class Descriptor(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Where a tensor's bytes are: ``[dtype, shape, offset, nbytes]`` (what `span` checks against the bytes)."""

    dtype: str
    shape: Annotated[tuple[NonNegInt, ...], msgspec.Meta(max_length=MAX_NDIM)]
    offset: NonNegInt
    nbytes: NonNegInt


class TensorRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tensor as the header writes it: ``{"__raw__": [dtype, shape, offset, nbytes]}``."""

    raw: Descriptor = msgspec.field(name=RAW_KEY)


def with_descriptors(value: Any, where: tuple[tuple[str, Any], ...], blobs: list[bytes], offset: list[int]) -> Any:
    """A copy of the record ``value`` whose tensors (at ``where``: `TENSOR_FIELDS`) are descriptors, their bytes
    appended to ``blobs`` in header order: what msgspec's encoder writes as the header. The copy skips the
    record's checks (it holds descriptors where tensors go) and lives only until it is encoded."""
    out = value.__copy__()  # a Struct's own shallow copy, in C
    for name, nested in where:
        item = getattr(value, name)
        if item is None:
            continue
        if nested is None:
            start = offset[0]
            blobs.append(item.data)
            offset[0] += len(item.data)
            msgspec.structs.force_setattr(
                out, name, TensorRef(Descriptor(item.dtype, item.shape, start, len(item.data)))
            )
        else:
            msgspec.structs.force_setattr(out, name, with_descriptors(item, nested, blobs, offset))
    return out


def from_header(value: dict[str, Any] | list[Any], blob: bytes, state: list[int], depth: int) -> Any:
    # Only containers come here (scalars are copied by the caller), and never deeper than
    # MAX_HEADER_DEPTH: the bound is explicit, not Python's recursion limit.
    if depth > MAX_HEADER_DEPTH:
        raise DecodeError("bad_header", f"header nests deeper than {MAX_HEADER_DEPTH} levels")
    if value.__class__ is dict:
        if len(value) == 1:
            descriptor = value.get(RAW_KEY)
            if descriptor is not None:
                return raw_array(descriptor, blob, state)
        out = {}
        for key, item in value.items():
            kind = item.__class__
            out[key] = from_header(item, blob, state, depth + 1) if kind is dict or kind is list else item
        return out
    return [
        from_header(item, blob, state, depth + 1) if item.__class__ is dict or item.__class__ is list else item
        for item in value
    ]


def raw_array(descriptor: Any, blob: bytes, state: list[int]) -> dict[str, Any]:
    if descriptor.__class__ is not list or len(descriptor) != 4:
        raise DecodeError("bad_header", f"tensor descriptor {show(descriptor)} is not [dtype, shape, offset, nbytes]")
    dtype, shape, start, nbytes = descriptor
    if dtype.__class__ is not str or dtype not in DTYPES:
        raise DecodeError("unknown_dtype", f"dtype {show(dtype)} is not one of {sorted(DTYPES)}")
    if shape.__class__ is not list or len(shape) > MAX_NDIM:
        raise DecodeError("bad_header", f"shape {show(shape)} is not a list of at most {MAX_NDIM} dimensions")
    for dim in shape:  # a loop, not all(...): a third of the cost per tensor
        if dim.__class__ is not int or dim < 0:
            raise DecodeError(
                "bad_header", f"shape {show(shape)} has a dimension {show(dim)}; dimensions are non-negative integers"
            )
    if start.__class__ is not int or nbytes.__class__ is not int or start < 0 or nbytes < 0:
        raise DecodeError("bad_header", f"offset {show(start)} and nbytes {show(nbytes)} must be non-negative integers")
    expected = math.prod(shape) * DTYPES[dtype][0]
    if nbytes != expected:
        raise DecodeError(
            "length_mismatch", f"{dtype} {clip(str(shape), 80)} needs {show(expected)} bytes, header says {nbytes}"
        )
    used = state[0]
    if start != used or start + nbytes > len(blob):
        raise DecodeError(
            "length_mismatch",
            f"tensor at offset {start} of {nbytes} bytes does not follow the previous one "
            f"inside a {len(blob)}-byte blob",
        )
    state[0] = start + nbytes
    state[1] += 1
    # A plain dict: msgspec builds the RawArray once (its own size check included) as it converts the event.
    return {"dtype": dtype, "shape": shape, "data": blob[start : start + nbytes]}


def tensor_fields(model: type) -> tuple[tuple[str, Any], ...]:
    """Where ``model`` holds tensors: ``(field, None)`` for a RawArray, ``(field, nested)`` for a record."""
    found: list[tuple[str, Any]] = []
    for info in msgspec.structs.fields(model):
        annotation = info.type
        parts = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
        for part in parts:
            if part is RawArray:
                found.append((info.name, None))
            elif isinstance(part, type) and issubclass(part, msgspec.Struct):
                if nested := tensor_fields(part):
                    found.append((info.name, nested))
            elif _holds_tensors(part):  # e.g. tuple[RawArray, ...]: tensor_count would not see them
                raise TypeError(
                    f"{model.__name__}.{info.name}: the codec counts tensors only in fields and nested records"
                )
    return tuple(found)


def _holds_tensors(annotation: Any) -> bool:
    if annotation is RawArray:
        return True
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return bool(tensor_fields(annotation))
    return any(_holds_tensors(arg) for arg in get_args(annotation))


def tensor_count(value: Any, where: tuple[tuple[str, Any], ...]) -> int:
    count = 0
    for name, nested in where:
        item = getattr(value, name)
        if item is not None:
            count += 1 if nested is None else tensor_count(item, nested)
    return count


def span(descriptor: Descriptor, size: int, used: int) -> int:
    """Where the bytes of the tensor ``descriptor`` (of a header view) end in an entry's ``size`` bytes, the bytes
    before ``used`` taken by the tensors before it; `DecodeError` when it names no dtype of `DTYPES`, its size
    is not its shape's, or it does not follow the tensor before it inside the bytes (the checks `raw_array`
    makes of a parsed header)."""
    dtype, start, nbytes = descriptor.dtype, descriptor.offset, descriptor.nbytes
    item = DTYPES.get(dtype)
    if item is None:
        raise DecodeError("unknown_dtype", f"dtype {show(dtype)} is not one of {sorted(DTYPES)}")
    if nbytes != math.prod(descriptor.shape) * item[0]:
        raise DecodeError(
            "length_mismatch",
            f"{dtype} {clip(str(list(descriptor.shape)), 80)} needs "
            f"{math.prod(descriptor.shape) * item[0]} bytes, header says {nbytes}",
        )
    if start != used or start + nbytes > size:
        raise DecodeError(
            "length_mismatch",
            f"tensor at offset {start} of {nbytes} bytes does not follow the previous one inside a {size}-byte blob",
        )
    return start + nbytes


@functools.cache
def header_view(model: Any) -> Any:
    """The Struct that decodes the header of ``model`` (an event or record holding tensors) in one compiled pass:
    ``model``'s fields with their names, bounds and defaults, a `TensorRef` where a tensor goes and the view of
    a nested record that holds tensors. Derived from ``model``, never written out: the schema stays defined once.
    The rules between fields (``__post_init__``) are ``model``'s own: `from_view` builds the event, which
    runs them."""
    fields = []
    for info in msgspec.structs.fields(model):
        given: dict[str, Any] = {"default": info.default, "default_factory": info.default_factory}
        default = msgspec.field(name=info.encode_name, **given)
        fields.append((info.name, _view_type(info.type), default))
    config = model.__struct_config__
    return msgspec.defstruct(
        f"{model.__name__}Header",
        fields,
        kw_only=True,
        frozen=True,
        forbid_unknown_fields=config.forbid_unknown_fields,
        module=__name__,
    )


def _view_type(annotation: Any) -> Any:
    if annotation is RawArray:
        return TensorRef
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct) and tensor_fields(annotation):
        return header_view(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        args = tuple(_view_type(arg) for arg in get_args(annotation))
        return Union[args]  # noqa: UP007 - built from a tuple of types
    return annotation


def from_view(model: Any, view: Any, blob: bytes, used: list[int]) -> Any:
    """``model``'s event from its header view (`header_view`) and the entry's bytes: each tensor's bytes cut out
    in header order (``used``: the bytes taken so far, and how many tensors) and checked (`span`), then the
    event built, which runs its own rules (``ValueError`` when it breaks one)."""
    values = {name: getattr(view, name) for name in _FIELD_NAMES[model]}
    for name, nested in _NESTED[model]:
        item = values[name]
        if item is None:
            continue
        if nested is None:
            start = used[0]
            used[0] = span(item.raw, len(blob), start)
            used[1] += 1
            data = blob[start : used[0]]
            if data.__class__ is not bytes:  # a view of a reply (a payload key's): the tensor's bytes, copied once
                data = bytes(data)
            values[name] = RawArray(dtype=item.raw.dtype, shape=item.raw.shape, data=data)
        else:
            values[name] = from_view(nested, item, blob, used)
    return model(**values)


def _nested(model: Any) -> tuple[tuple[str, Any], ...]:
    """Where ``model`` holds tensors: ``(field, None)`` for a tensor, ``(field, record class)`` for a record."""
    found: list[tuple[str, Any]] = []
    for info in msgspec.structs.fields(model):
        parts = get_args(info.type) if get_origin(info.type) in (Union, types.UnionType) else (info.type,)
        for part in parts:
            if part is RawArray:
                found.append((info.name, None))
            elif isinstance(part, type) and issubclass(part, msgspec.Struct) and tensor_fields(part):
                found.append((info.name, part))
    return tuple(found)


_CODEC_TYPES: tuple[type, ...] = (*EVENT_TYPES.values(), SlotResultV1)
TENSOR_FIELDS = {model: tensor_fields(model) for model in _CODEC_TYPES}
_RECORDS = {*_CODEC_TYPES, *(nested for model in _CODEC_TYPES for _, nested in _nested(model) if nested is not None)}
_FIELD_NAMES = {model: tuple(info.name for info in msgspec.structs.fields(model)) for model in _RECORDS}
_NESTED = {model: _nested(model) for model in _RECORDS}
