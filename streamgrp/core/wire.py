"""The wire schema's building blocks: msgspec Structs whose fields carry their constraints, decoded and
checked in compiled code.

Owns the base classes of every record on the wire (`Record`: frozen, unknown fields refused; `WireEvent`:
the fields every event shares, ``kind`` as the tag of its class), the constrained value types
(`Int`, `NonNegInt`, `PosInt`, `Float`), one cached JSON decoder per type (`decoder`) and how a msgspec
validation error maps onto the codec's stable reasons (`reason_of`). Which events exist is
`streamgrp.core.events`'; bytes, sizes and the order of checks are `streamgrp.core.codec`'s.

msgspec checks types and constraints when it decodes, not when Python builds a Struct: an event built in
Python is checked when the codec encodes it (it decodes what it wrote), and its cross-field rules run in
``__post_init__``, on both paths. Pure: no I/O.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

import msgspec

from streamgrp.core.values import INT64_MAX, INT64_MIN

#: Schema version written today (also `streamgrp.core.event_base.SCHEMA_VERSION`).
WIRE_SCHEMA = 2
_FLOAT_MAX = 1.7976931348623157e308

#: An integer field: a JSON integer (not a bool, not a float, not a string) within the signed 64-bit range.
Int = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
#: A count, index, step or version: a non-negative `Int`.
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
#: A count of at least one.
PosInt = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
#: A float field: a finite number (ints become floats; bools and strings are refused; the bounds refuse
#: infinities and NaN, which fails every comparison).
Float = Annotated[float, msgspec.Meta(ge=-_FLOAT_MAX, le=_FLOAT_MAX)]


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A frozen wire record that refuses fields it does not define."""

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` (``model_copy(update=...)`` of the pydantic models before; unchecked
        until encoded, as that was)."""
        return msgspec.structs.replace(self, **changes)

    def to_builtins(self) -> Any:
        """Plain JSON values (``model_dump(mode="json")`` of the pydantic models before)."""
        return msgspec.to_builtins(self)


class WireEvent(Record, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="kind"):
    """Fields every event carries: schema version, and the producer's identity and sequence number. A
    subclass names its ``kind`` (the tag) in its class keywords: ``tag="slot_result"``."""

    schema_version: Int = WIRE_SCHEMA
    producer: str = ""
    seq: NonNegInt = 0

    @property
    def kind(self) -> str:
        return self.__struct_config__.tag  # type: ignore[return-value]


def jsonable(event: Any) -> Any:
    """An event as plain JSON values, whichever schema library defines it."""
    if isinstance(event, msgspec.Struct):
        return msgspec.to_builtins(event)
    return event.model_dump(mode="json")


@functools.cache
def decoder(kind: Any) -> msgspec.json.Decoder[Any]:
    """The JSON decoder of ``kind`` (a Struct class or a union of tagged ones), built once."""
    return msgspec.json.Decoder(kind)


ENCODER = msgspec.json.Encoder()


def reason_of(exc: msgspec.ValidationError) -> str:
    """The codec reason of a msgspec validation error, as pydantic's error types mapped before: a missing
    field, a wrong JSON type (literals included), else a value the schema refuses."""
    text = str(exc)
    if text.startswith("Object missing required field"):
        return "missing_field"
    if text.startswith("Invalid enum value") or (text.startswith("Expected `") and ", got `" in text):
        return "wrong_type"
    return "invalid_value"
