"""The wire schema's building blocks: msgspec Structs whose fields carry their constraints, decoded and
checked in compiled code.

Owns the base classes of every record on the wire (`Record`: frozen, unknown fields refused; `WireEvent`:
the fields every event shares), the constrained value types
(`Int`, `NonNegInt`, `PosInt`, `Float`), one cached JSON decoder per type (`decoder`) and how a msgspec
validation error maps onto the codec's stable reasons (`reason_of`). Which events exist is
`streamgrp.core.events`'; bytes, sizes and the order of checks are `streamgrp.core.codec`'s.

msgspec checks types and constraints when it decodes, not when Python builds a Struct: an event built in
Python is checked when the codec encodes it (it decodes what it wrote), except the kinds streamgrp derives
from checked values (`streamgrp.core.codec.DERIVED`), and its cross-field rules run in ``__post_init__``,
on both paths. Pure: no I/O.
"""

from __future__ import annotations

import functools
import re
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Union, get_args, get_origin

import msgspec
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from streamgrp.core.policy import GroupPolicy

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
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


#: How deep a free-form dict may nest, the dict itself being level 1. The deepest free-form field
#: (``SlotResult.sample.meta``) sits at level 3 of a header, so headers stay within 3 + 24 - 1 = 26
#: levels, inside the codec's bound of 32.
FREE_FORM_DEPTH = 24


def check_free_form_depth(value: dict[str, Any]) -> dict[str, Any]:
    if not value:
        return value  # the common case (an empty meta) costs nothing
    # An explicit stack, not recursion: a hostile value must not reach Python's recursion limit.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > FREE_FORM_DEPTH:
            raise ValueError(f"nested deeper than {FREE_FORM_DEPTH} levels; flatten it")
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (dict, list, tuple)):
                stack.append((child, depth + 1))
    return value


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A frozen wire record that refuses fields it does not define."""

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes``; its rules between fields are checked again, its values' types and bounds
        when it is encoded."""
        return msgspec.structs.replace(self, **changes)

    def wire_fields(self) -> dict[str, Any]:
        """The fields by the names the header gives them (columns as columns), those left out of it not."""
        return {
            info.encode_name: value
            for info in msgspec.structs.fields(self)
            if (value := getattr(self, info.name)) is not msgspec.UNSET
        }

    def to_builtins(self) -> Any:
        """Plain JSON values (tensors' bytes as base64: the codec writes them beside the header instead)."""
        return msgspec.to_builtins(self, enc_hook=_enc_hook)


def as_tuples(record: Record, *names: str) -> None:
    """Fields ``names`` of ``record`` held as tuples when Python gave lists (decoding gives tuples already), so
    a record built in Python equals, and hashes like, the one read back."""
    for name in names:
        value = getattr(record, name)
        if value.__class__ is list:
            msgspec.structs.force_setattr(record, name, tuple(value))


def check_free_form(value: dict[str, Any], name: str) -> None:
    """A free-form object (prompt, meta, settings) nests at most `streamgrp.core.values.FREE_FORM_DEPTH` levels."""
    if value:
        try:
            check_free_form_depth(value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None


class WireEvent(Record, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Fields every event carries: schema version, and the producer's identity and sequence number. A
    subclass's first field is its ``kind``, a literal with that default (written right after these, as
    every schema wrote it)."""

    schema_version: Int = WIRE_SCHEMA
    producer: str = ""
    seq: NonNegInt = 0

    if TYPE_CHECKING:
        kind: str


def jsonable(event: Any) -> Any:
    """An event as plain JSON values."""
    return msgspec.to_builtins(event, enc_hook=_enc_hook)


def _policy(value: Any) -> GroupPolicy:
    """A recorded group policy (a settings model inside `RunStarted`), read as strictly as every event field:
    GroupPolicy's own fields are lax (``true`` would pass as n_samples=1)."""
    if not isinstance(value, dict):
        raise TypeError(f"Expected `object`, got `{type(value).__name__}`")
    try:
        check_strict_numbers(GroupPolicy, value, "")
        return GroupPolicy.model_validate(value)
    except PydanticCustomError as exc:
        raise ValueError(f"wrong_type: {exc}") from None
    except ValidationError as exc:
        error = exc.errors()[0]
        reason = (
            "missing_field"
            if error["type"] == "missing"
            else "wrong_type"
            if error["type"].endswith(("_type", "_parsing")) or error["type"] == "literal_error"
            else "invalid_value"
        )
        raise ValueError(f"{reason}: {'.'.join(map(str, error['loc']))}: {error['msg']}") from None


def dec_hook(kind: Any, value: Any) -> Any:
    """Values of types that are not Structs: the group policy, a settings model."""
    if kind is GroupPolicy:
        return _policy(value)
    raise NotImplementedError(f"no decoder for {kind!r}")


def _enc_hook(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    raise NotImplementedError(f"cannot encode a {type(value).__name__}")


@functools.cache
def decoder(kind: Any) -> msgspec.json.Decoder[Any]:
    """The JSON decoder of ``kind`` (a Struct class), built once."""
    return msgspec.json.Decoder(kind, dec_hook=dec_hook)


ENCODER = msgspec.json.Encoder(enc_hook=_enc_hook)


_HOOK_REASONS = frozenset({"missing_field", "wrong_type", "invalid_value"})


def reason_of(exc: msgspec.ValidationError, model: Any = None, data: Any = None) -> str:
    """The codec reason of a msgspec validation error, as pydantic's error types mapped before: a missing
    field, a wrong JSON type (literals included), else a value the schema refuses. Given the ``model`` and
    the ``data`` it refused, an object with an unknown field that also lacks a required one is a missing
    field (pydantic judged the fields it defines before the ones it does not)."""
    text = str(exc)
    if text.startswith("Object contains unknown field") and model is not None and _lacks_a_field(model, data, text):
        return "missing_field"
    reason = text.partition(":")[0]
    if reason in _HOOK_REASONS:  # a check that names its reason (a recorded policy)
        return reason
    if text.startswith("Object missing required field"):
        return "missing_field"
    if text.startswith("Invalid enum value") or (text.startswith("Expected `") and ", got `" in text):
        return "wrong_type"
    return "invalid_value"


_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")


def _lacks_a_field(model: Any, data: Any, text: str) -> bool:
    """Whether the object the error's path names (``- at `$.stats```) lacks a required field of its Struct."""
    where = text.rpartition(" - at `$")[2].rstrip("`") if " - at `$" in text else ""
    kind: Any = model
    for name, index in _STEP.findall(where):
        kind = _struct_in(kind)
        if kind is None:
            return False
        if name:
            info = {info.encode_name: info for info in msgspec.structs.fields(kind)}.get(name)
            if info is None or not isinstance(data, dict):
                return False
            kind, data = info.type, data.get(name)
        else:
            if not isinstance(data, (list, tuple)) or int(index) >= len(data):
                return False
            args = [arg for arg in get_args(kind) if arg is not Ellipsis]
            kind, data = (args[0] if args else Any), data[int(index)]
    kind = _struct_in(kind)
    return (
        kind is not None
        and isinstance(data, dict)
        and any(info.required and info.encode_name not in data for info in msgspec.structs.fields(kind))
    )


def _struct_in(kind: Any) -> Any:
    """The Struct class ``kind`` is, or holds as an option (``X | None``); else None."""
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return kind
    for arg in get_args(kind):
        if isinstance(arg, type) and issubclass(arg, msgspec.Struct):
            return arg
    return None


def check_strict_numbers(model: type[BaseModel], data: dict[Any, Any], where: str) -> None:
    """Reject what lax validation would coerce in ``model``'s scalar fields: bools as numbers,
    numbers as bools, floats and strings as ints. Nested models given as dicts are checked too."""
    for name, value in data.items():
        field = model.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            continue  # an unknown name: the model's own validation reports it
        args = _annotation_args(field.annotation)
        nested = [arg for arg in args if isinstance(arg, type) and issubclass(arg, BaseModel)]
        if nested and isinstance(value, dict):
            check_strict_numbers(nested[0], value, f"{where}{name}.")
            continue
        if not args <= {int, float, bool, type(None)} or not args & {int, float, bool}:
            continue  # not a numeric scalar field
        kind = type(value)
        if kind is bool:
            ok = bool in args
        elif kind is int:
            ok = int in args or float in args
        elif kind is float:
            ok = float in args
        else:
            ok = value is None and type(None) in args
        if not ok:
            expected = " or ".join(sorted(arg.__name__ for arg in args if arg is not type(None)))
            raise PydanticCustomError(
                "strict_type",
                "{where} must be {expected}, not {got}",
                {"where": f"{where}{name}", "expected": expected, "got": kind.__name__},
            )


def _annotation_args(annotation: Any) -> set[Any]:
    if get_origin(annotation) in (Union, UnionType):
        return {arg for part in get_args(annotation) for arg in _annotation_args(part)}
    return {annotation}
