"""A sample's payload read without rebuilding it: the trainer's reader and the assembler's check.

Owns `payload_view`, a payload entry's header as its compiled view (`header_view` of `SamplePayload`: the
event's own types and bounds, tensors as descriptors checked against the bytes), and `payload_problem`, what
keeps a published sample from training, judged on that view.

Neither builds the `Sample`. Building it would run two rule sets: msgspec's types and bounds, which the view
has too (it is derived from the event, never written out), and the rules between its fields and its values,
which `payload_problem` runs on the view through the very functions `Sample` runs
(`streamgrp.core.values.layout_problem` and `values_problem`, and the free-form bound of its meta). So the
check refuses exactly what decoding refuses (a property test over mutated payloads holds the two equal), at
about a third of the cost: the assembler asks it of every sample. A header the compiled pass refuses takes
`decode`, which says why (or reads it: JSON's repeated key), as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import UNSET

from streamgrp.core.entry_decode import DEFAULT_MAX_ENTRY_BYTES, KIND_KEY, RAW_NAME, Fields, decode, entry_digest
from streamgrp.core.entry_fields import BLOB, HEADER, check_size, field_items, header_and_blob
from streamgrp.core.events import READABLE_SCHEMAS, SamplePayload, SlotResult
from streamgrp.core.fresh_tokens import version_fields
from streamgrp.core.shown import clip
from streamgrp.core.tensor_header import TENSOR_FIELDS, header_view, span, with_descriptors
from streamgrp.core.value_checks import token_id_problem
from streamgrp.core.values import SAMPLE_TENSORS, layout_problem, values_problem
from streamgrp.core.wire import check_free_form, decoder
from streamgrp.errors import DecodeError

__all__ = ["payload_problem", "payload_view"]

_PAYLOAD_VIEW = decoder(header_view(SamplePayload))
_PAYLOAD_TENSORS = tuple(name for name, _ in SAMPLE_TENSORS)
_PAYLOAD_KIND = KIND_KEY + b'sample_payload"'


def payload_view(header: Any, blob: Any) -> Any:
    """The header of a sample payload entry as its compiled view (`header_view` of `SamplePayload`: tensors as
    descriptors), each descriptor checked against ``blob`` (any buffer: its bytes are not cut, copied or
    looked at) as `decode` checks them. What a trainer rank reads a payload with: the manifest's checks
    were made where the sample entered, so it neither rebuilds the `Sample` nor checks its values again.
    Raises `DecodeError` with the reason `decode` gives the entry, and ``unknown_kind`` for another event; reads
    every payload `decode` reads."""
    header = _as_read(header)
    view = _compiled(header, blob)
    if view is not None:
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


def _compiled(header: Any, blob: Any) -> Any:
    """The view of a payload header the compiled pass reads, every descriptor in order inside ``blob``; else
    None (`decode` then gives the reason, or reads what this pass does not)."""
    if header.__class__ is not bytes:
        return None
    try:
        view = _PAYLOAD_VIEW.decode(header)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if view.schema_version not in READABLE_SCHEMAS:
        return None
    size = len(blob)
    used = 0
    sample = view.sample
    try:
        for name in _PAYLOAD_TENSORS:
            used = span(getattr(sample, name).raw, size, used)
    except DecodeError:
        return None
    # Every descriptor in the header is one of its tensors (one in a free-form dict is refused by `decode`).
    return view if used == size and header.count(RAW_NAME) == len(_PAYLOAD_TENSORS) else None


@dataclass(frozen=True, slots=True)
class _Held:
    """What a payload holds that its slot result's summary must agree with."""

    task_id: str
    slot: int
    row_lengths: tuple[int, ...]
    rewards: tuple[float, ...]
    version: int
    meta: dict[str, Any]
    loss_mask: bytes
    token_ids: tuple[str, bytes]


class _Refused(Exception):
    """A payload that cannot train; its one argument says why, as `payload_problem` reports it."""


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
        held = _held(fields, max_entry_bytes)
    except _Refused as refused:
        return str(refused)
    if held.task_id != result.task_id or held.slot != result.slot:
        return f"the payloads entry at its id is slot {held.slot} of task {clip(held.task_id, 80)!r}"
    if entry_digest(fields, like=summary.digest) != summary.digest:
        return "its payload does not hash to the digest its slot result recorded"
    mask = held.loss_mask
    claimed = (summary.rows, summary.tokens, summary.version)
    rows = len(held.row_lengths)
    kept = (rows, len(mask) - mask.count(0), held.version)
    if claimed != kept:
        return (
            f"its slot result says rows, tokens, version {list(claimed)} but its payload holds {list(kept)}; "
            "publish with streamgrp's worker (or codec.encode_sample), which writes both from one sample"
        )
    reward = sum(held.rewards) / rows
    if not math.isclose(summary.reward, reward, rel_tol=1e-9, abs_tol=1e-12):
        return f"its slot result says reward {summary.reward!r} but its payload's rewards average {reward!r}"
    versions = version_fields(held.meta, held.row_lengths, held.version, mask)
    told = {name: getattr(summary, name) for name in versions}
    if told != versions:  # what the batch fold reads of its token versions under --staleness mask
        return f"its slot result says token versions {_shown(told)} but its payload's give {_shown(versions)}"
    # Every other value was checked as the payload was read; the vocabulary is the run's, not the sample's.
    return None if vocab_size is None else token_id_problem(*held.token_ids, vocab_size)


def _held(fields: Fields, max_entry_bytes: int) -> _Held:
    """What the payload entry ``fields`` holds, every rule of a `Sample` checked (`_Refused` when one fails)."""
    try:
        header, blob = header_and_blob(fields, check_size(field_items(fields), max_entry_bytes))
    except Exception:  # noqa: BLE001 - `decode` (total: its safety net included) says what is wrong
        return _decoded(fields, max_entry_bytes)
    view = _compiled(header, blob)
    if view is None:
        return _decoded(fields, max_entry_bytes)
    sample = view.sample
    refs = [getattr(sample, name).raw for name in _PAYLOAD_TENSORS]
    problem = _free_form_problem(sample.meta) or layout_problem(sample.row_lengths, sample.rewards, *refs)
    if problem is not None:
        raise _Refused(f"its payload does not decode (invalid_value): {problem}")
    token_ids, loss_mask, logprobs = [(ref.dtype, bytes(blob[ref.offset : ref.offset + ref.nbytes])) for ref in refs]
    problem = values_problem(token_ids, loss_mask, logprobs, sample.rewards)
    if problem is not None:
        raise _Refused(f"its payload does not decode (invalid_value): {problem}")
    return _Held(
        view.task_id,
        view.slot,
        sample.row_lengths,
        sample.rewards,
        sample.version,
        sample.meta,
        loss_mask[1],
        token_ids,
    )


def _free_form_problem(meta: dict[str, Any]) -> str | None:
    try:
        check_free_form(meta, "meta")
    except ValueError as exc:
        return str(exc)
    return None


def _decoded(fields: Fields, max_entry_bytes: int) -> _Held:
    """`_held` of a payload the compiled pass refuses: decoded, which says what is wrong with it."""
    try:
        payload = decode(fields, max_entry_bytes=max_entry_bytes)
    except DecodeError as exc:
        raise _Refused(f"its payload does not decode ({exc.reason}): {exc.detail}") from None
    if not isinstance(payload, SamplePayload):
        raise _Refused(f"the payloads entry at its id is a {payload.kind} event, not a sample_payload")
    sample = payload.sample
    return _Held(
        payload.task_id,
        payload.slot,
        sample.row_lengths,
        sample.rewards,
        sample.version,
        sample.meta,
        sample.loss_mask.data,
        (sample.token_ids.dtype, sample.token_ids.data),
    )


def _shown(fields: dict[str, Any]) -> dict[str, Any]:
    """Fields with the left-out ones (UNSET) shown as None."""
    return {name: None if value is UNSET else value for name, value in fields.items()}


def _as_read(value: Any) -> Any:
    """A field's value as bytes, as a stream read gives it: a str (a decode_responses client) as its UTF-8
    bytes, another buffer as its bytes; anything else as it is (`decode` refuses it: bad_fields)."""
    if value.__class__ is bytes:
        return value
    try:
        return value.encode("utf-8", "surrogateescape") if isinstance(value, str) else memoryview(value).tobytes()
    except (TypeError, ValueError):
        return value
