"""The fast paths of decoding: plain schema-2 group decision and step manifest headers
checked by hand, no pydantic validation.

The assembler decodes every slot header of the group log, the batcher every decision and each
trainer rank every step's manifest; pydantic spends several microseconds on each slot header, tens
on a decision with its member records and over a millisecond on a 32-group manifest's 256 members.
`fast_group_decided` and `fast_step_manifest` accept only headers that the full decoder would accept
and turn into the very same event (every key present and no other, the exact types and bounds of
the models), and return None for anything else, which then takes the full path with its reasons
and dead letters. So they change speed, never results: property tests hold them to the full decoder.
`fast_sample_payload` does the same for a sample's payload (the assembler checks every one before it
folds its slot), its values checked as `streamgrp.core.values.Sample` checks them.
"""

from __future__ import annotations

import math
from typing import Any

from streamgrp.core.events import (
    DecidedMember,
    GroupDecided,
    GroupStats,
    Member,
    RawArray,
    Sample,
    SamplePayload,
    Shard,
    ShardGroup,
    StepManifest,
)
from streamgrp.core.members import WIRE_COLUMNS
from streamgrp.core.values import DTYPES, INT64_MAX, INT64_MIN, built

#: Fields a plain header leaves out (written only when set): not in the built record's fields set.
_UNSET_REWARDS = frozenset({"rewards"})
#: A decision's member columns, in the order `GroupDecided.wire_fields` writes them (slots first).
_COLUMNS = tuple(WIRE_COLUMNS)
#: A decision's header keys: its fields with the members as columns.
_DECISION_KEYS = frozenset(GroupDecided.model_fields) | frozenset(_COLUMNS)
_STATS_KEYS = tuple(GroupStats.model_fields)
_STATS_KEY_SET = frozenset(_STATS_KEYS)
_MANIFEST_KEYS = frozenset(StepManifest.model_fields)
_SHARD_KEYS = frozenset(Shard.model_fields)
#: A shard group's header keys: its fields with the members as columns (a `Member` has every column
#: but digests and rewards); "partition" is written only when not 0.
_GROUP_KEYS = frozenset(ShardGroup.model_fields) - {"members", "partition"} \
    | {name for name, field in WIRE_COLUMNS.items() if field in Member.model_fields}
_GROUP_KEYS_PARTITIONED = _GROUP_KEYS | {"partition"}
_PAYLOAD_KEYS = frozenset(SamplePayload.model_fields)
_SAMPLE_KEYS = frozenset(Sample.model_fields)
#: `streamgrp.core.codec.RAW_KEY` (the codec imports this module, so it cannot be imported from there).
_RAW_KEY = "__raw__"
#: A sample's tensors in the order the encoder writes them, each with the dtypes `Sample` allows.
_SAMPLE_TENSORS = (("token_ids", ("int32", "int64")), ("loss_mask", ("bool", "uint8")),
                   ("logprobs", ("float32", "float16", "bfloat16", "float64")))

def fast_group_decided(header: dict[str, Any]) -> GroupDecided | None:
    """The `GroupDecided` of a parsed header when it is a plain, valid schema-2 one with every member
    column filled; else None."""
    if header.keys() != _DECISION_KEYS or header["kind"] != "group_decided" \
            or not _is_int(header["schema_version"], 2, 2):
        return None
    task_id, producer = header["task_id"], header["producer"]
    if not (task_id.__class__ is str and producer.__class__ is str and _is_int(header["seq"])
            and header["decision"] in ("complete", "partial", "dropped") and header["closed_by"] in ("all_slots", "deadline")
            and _is_optional_text(header["reason"]) and _is_optional_text(header["error"])
            and _is_optional_float(header["issued_at"]) and _is_optional_float(header["decided_at"])):
        return None
    outcomes = header["slot_outcomes"]
    if outcomes.__class__ is not dict or not all(value.__class__ is str for value in outcomes.values()):
        return None
    stats = _stats(header["stats"])
    members = _members([header[name] for name in _COLUMNS])
    if stats is None or members is None:
        return None
    return built(GroupDecided, {
        "schema_version": 2, "producer": producer, "seq": header["seq"], "kind": "group_decided", "task_id": task_id,
        "decision": header["decision"], "reason": header["reason"], "members": members, "slot_outcomes": outcomes,
        "stats": stats, "error": header["error"], "closed_by": header["closed_by"], "issued_at": header["issued_at"],
        "decided_at": header["decided_at"]})


def _stats(stats: Any) -> GroupStats | None:
    if stats.__class__ is not dict or stats.keys() != _STATS_KEY_SET:
        return None
    values = [stats[key] for key in _STATS_KEYS]
    if not (all(_is_int(count) for count in values[:3]) and values[3].__class__ is bool and values[4].__class__ is bool
            and all(_is_float(value) for value in values[5:])):
        return None
    return built(GroupStats, dict(zip(_STATS_KEYS, values)))


def _members(columns: list[Any]) -> tuple[DecidedMember, ...] | None:
    """The member records of full columns (one item per member in each); None for anything else."""
    if not all(column.__class__ is list for column in columns):
        return None
    slots, entries, digests, rows, tokens, versions, rewards = columns  # in WIRE_COLUMNS order
    count = len(slots)
    if any(len(column) != count for column in columns):
        return None  # an optional column left empty (schema 1 allows it): the full path
    if not (all(_is_int(slot) for slot in slots) and all(entry.__class__ is str for entry in entries)
            and all(digest.__class__ is str for digest in digests)
            and all(_is_int(value, INT64_MIN) for column in (rows, tokens, versions) for value in column)
            and all(_is_optional_float(reward) for reward in rewards)):
        return None
    return tuple(built(DecidedMember, {"slot": slot, "entry": entry, "rows": row, "tokens": token, "version": version,
                                       "rewards": None, "digest": digest, "reward": reward}, _UNSET_REWARDS)
                 for slot, entry, row, token, version, digest, reward
                 in zip(slots, entries, rows, tokens, versions, digests, rewards))


def fast_step_manifest(header: dict[str, Any]) -> StepManifest | None:
    """The `StepManifest` of a parsed header when it is a plain, valid schema-2 one; else None."""
    if header.keys() != _MANIFEST_KEYS or header["kind"] != "step" or not _is_int(header["schema_version"], 2, 2):
        return None
    producer, imbalance, created_at, shards = header["producer"], header["imbalance"], header["created_at"], \
        header["shards"]
    if not (producer.__class__ is str and _is_int(header["seq"]) and _is_int(header["step"])
            and _is_int(header["version"], INT64_MIN) and _is_float(imbalance) and _is_float(created_at)
            and shards.__class__ is list):
        return None
    built_shards = []
    for shard in shards:
        if shard.__class__ is not dict or shard.keys() != _SHARD_KEYS:
            return None
        groups, digest = shard["groups"], shard["digest"]
        if not (_is_int(shard["rank"], INT64_MIN) and _is_int(shard["tokens"], INT64_MIN) and digest.__class__ is str
                and groups.__class__ is list):
            return None
        built_groups = []
        for group in groups:
            placed = _shard_group(group)
            if placed is None:
                return None
            built_groups.append(placed)
        built_shards.append(built(Shard, {"rank": shard["rank"], "groups": tuple(built_groups),
                                          "tokens": shard["tokens"], "digest": digest}))
    return built(StepManifest, {
        "schema_version": 2, "producer": producer, "seq": header["seq"], "kind": "step", "step": header["step"],
        "version": header["version"], "shards": tuple(built_shards), "imbalance": imbalance,
        "created_at": created_at})


def _shard_group(group: Any) -> ShardGroup | None:
    if group.__class__ is not dict:
        return None
    keys = group.keys()
    if keys == _GROUP_KEYS:
        partition = None
    elif keys == _GROUP_KEYS_PARTITIONED and _is_int(group["partition"]):
        partition = group["partition"]
    else:
        return None
    task_id, entry, digest = group["task_id"], group["decision_entry"], group["digest"]
    slots, entries, rows, tokens, versions = (group["members"], group["member_entries"], group["member_rows"],
                                              group["member_tokens"], group["member_versions"])
    if not (task_id.__class__ is str and entry.__class__ is str and digest.__class__ is str
            and slots.__class__ is list and entries.__class__ is list and rows.__class__ is list
            and tokens.__class__ is list and versions.__class__ is list):
        return None
    count = len(slots)
    if not (len(entries) == count and len(rows) == count and len(tokens) == count and len(versions) == count):
        return None
    members = []
    for slot, member_entry, row, token, version in zip(slots, entries, rows, tokens, versions):
        if not (_is_int(slot) and member_entry.__class__ is str and _is_int(row, INT64_MIN)
                and _is_int(token, INT64_MIN) and _is_int(version, INT64_MIN)):
            return None
        members.append(built(Member, {"slot": slot, "entry": member_entry, "rows": row, "tokens": token,
                                      "version": version, "rewards": None}, _UNSET_REWARDS))
    placed = built(ShardGroup, {"task_id": task_id, "decision_entry": entry, "members": tuple(members),
                                "digest": digest, "partition": 0 if partition is None else partition})
    if partition is None:  # as validation leaves it: a default is not a field set
        object.__setattr__(placed, "__pydantic_fields_set__", {"task_id", "decision_entry", "members", "digest"})
    return placed


def fast_sample_payload(header: dict[str, Any], blob: bytes) -> SamplePayload | None:
    """The `SamplePayload` of a parsed header and its bytes when it is a plain, valid schema-2 one (no
    ``meta``, float rewards, values that can train); else None."""
    if header.keys() != _PAYLOAD_KEYS or header["kind"] != "sample_payload" \
            or not _is_int(header["schema_version"], 2, 2):
        return None
    task_id, producer, sample = header["task_id"], header["producer"], header["sample"]
    if not (task_id.__class__ is str and 1 <= len(task_id) <= 256 and producer.__class__ is str
            and _is_int(header["slot"]) and _is_int(header["seq"]) and sample.__class__ is dict
            and sample.keys() == _SAMPLE_KEYS):
        return None
    lengths, rewards, version, meta = sample["row_lengths"], sample["rewards"], sample["version"], sample["meta"]
    if not (lengths.__class__ is list and lengths and rewards.__class__ is list and len(rewards) == len(lengths)
            and _is_int(version) and meta.__class__ is dict and not meta):
        return None
    for length in lengths:
        if not _is_int(length, 1):
            return None
    for reward in rewards:
        if not _is_float(reward):
            return None
    total = sum(lengths)
    tensors = {}
    offset = 0
    for name, allowed in _SAMPLE_TENSORS:
        tensor = _tensor(sample[name], allowed, total, offset, blob)
        if tensor is None:
            return None
        tensors[name] = tensor
        offset += len(tensor.data)
    if offset != len(blob):
        return None
    built_sample = built(Sample, {**tensors, "row_lengths": tuple(lengths), "rewards": tuple(rewards),
                                  "version": version, "meta": meta})
    if built_sample.value_problem() is not None:
        return None  # the full path raises, naming the value
    return built(SamplePayload, {"schema_version": 2, "producer": producer, "seq": header["seq"],
                                 "kind": "sample_payload", "task_id": task_id, "slot": header["slot"],
                                 "sample": built_sample})


def _tensor(value: Any, allowed: tuple[str, ...], total: int, offset: int, blob: bytes) -> RawArray | None:
    """A 1-D tensor of ``total`` items of an ``allowed`` dtype starting at ``offset`` of ``blob``; else None."""
    if value.__class__ is not dict or len(value) != 1:
        return None
    descriptor = value.get(_RAW_KEY)
    if descriptor.__class__ is not list or len(descriptor) != 4:
        return None
    dtype, shape, start, nbytes = descriptor
    if not (dtype.__class__ is str and dtype in allowed and shape.__class__ is list and len(shape) == 1
            and shape[0].__class__ is int and shape[0] == total and start.__class__ is int and start == offset
            and nbytes.__class__ is int and nbytes == total * DTYPES[dtype][0] and start + nbytes <= len(blob)):
        return None
    return built(RawArray, {"dtype": dtype, "shape": (total,), "data": blob[start:start + nbytes]})


def _is_optional_text(value: Any) -> bool:
    return value is None or value.__class__ is str


def _is_float(value: Any) -> bool:
    return value.__class__ is float and math.isfinite(value)


def _is_optional_float(value: Any) -> bool:
    return value is None or _is_float(value)


def _is_int(value: Any, low: int = 0, high: int = INT64_MAX) -> bool:
    return value.__class__ is int and low <= value <= high
