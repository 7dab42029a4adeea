"""Decision and step manifest headers, valid or one change away from valid: `codec.decode` gives the event
they say, which encodes back to the same header and decodes to itself, or refuses them with a documented
reason (never another exception)."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, StepManifest
from streamgrp.core.values import INT64_MAX
from streamgrp.errors import DecodeError

_INTS = st.one_of(st.integers(-3, 3), st.sampled_from([INT64_MAX, INT64_MAX + 1, -(2**63) - 1]), st.booleans())
_ODD = st.one_of(
    _INTS,
    st.none(),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.lists(st.integers(), max_size=2),
    st.sampled_from(["", "x" * 256, "x" * 257, "d" * 128, "d" * 129, "sample", "slot_result"]),
)
_COUNT = st.integers(0, INT64_MAX)
_ODD_ITEM = st.one_of(
    _ODD, st.just([]), st.lists(_ODD, max_size=3), st.dictionaries(st.text(max_size=2), _ODD, max_size=2)
)


def _edits(keys: list[str], values, part: str = ""):
    """One key of ``part`` of a header (the header itself when empty) set to one of ``values``, dropped, or
    another key added: ``(how, key, value)`` as `_edit` takes it, ``how`` naming the part."""
    hows = [f"{how} {part}".strip() for how in ("set", "drop", "add")]
    return st.tuples(st.sampled_from(hows), st.sampled_from(keys), values)


def _edit(target: dict, how: str, key: str, value) -> None:
    """A key of ``target`` set to ``value`` or dropped, or a key it does not know added; ``set item``:
    the first item of the list at ``key`` set (a column of members, when it has any)."""
    if how == "set item":
        if isinstance(target.get(key), list) and target[key]:
            target[key][0] = value
    elif how.startswith("set"):
        target[key] = value
    elif how.startswith("drop"):
        target.pop(key, None)
    else:
        target["more"] = value


def _check(header: dict, changed: bool, kind: type) -> None:
    try:
        wire = orjson.dumps(header)
    except orjson.JSONEncodeError:
        return  # an integer JSON cannot carry: never a header
    try:
        event = codec.decode({codec.HEADER: wire})
    except DecodeError as exc:
        assert exc.reason in codec.DECODE_REASONS
        assert changed, f"a valid header was refused: {exc}"
        return
    assert isinstance(event, kind)
    again = codec.encode(event)
    assert codec.decode(again) == event
    if not changed:
        assert orjson.loads(again[codec.HEADER]) == _without_partition_0(header)  # written back as it was


def _without_partition_0(header: dict) -> dict:
    """A header as the encoder writes it: a shard group's partition 0 left out."""
    for shard in header.get("shards", ()):
        for group in shard["groups"]:
            if group.get("partition") == 0:
                del group["partition"]
    return header


# -- group decisions -------------------------------------------------------------------------------------

_FLOATS = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def _valid_decision(draw) -> dict:
    count = draw(st.integers(0, 4))

    def column(values):
        return draw(st.lists(values, min_size=count, max_size=count))

    return {
        "schema_version": 2,
        "producer": draw(st.text(max_size=4)),
        "seq": draw(_COUNT),
        "kind": "group_decided",
        "task_id": draw(st.text(max_size=6)),
        "decision": draw(st.sampled_from(["complete", "partial", "dropped"])),
        "reason": draw(st.none() | st.text(max_size=3)),
        "members": column(_COUNT),
        "member_entries": column(st.text(max_size=4)),
        "member_digests": column(st.text(max_size=4)),
        "member_rows": column(st.integers(-(2**63), INT64_MAX)),
        "member_tokens": column(st.integers(-3, 9)),
        "member_versions": column(st.integers(-3, 9)),
        "member_rewards": column(st.none() | _FLOATS),
        "slot_outcomes": draw(st.dictionaries(st.text(max_size=2), st.text(max_size=7), max_size=3)),
        "stats": {
            "target_slot_count": draw(_COUNT),
            "usable_slot_count": draw(_COUNT),
            "trainable_slot_count": draw(_COUNT),
            "fully_masked_group": draw(st.booleans()),
            "singleton_slot_group": draw(st.booleans()),
            "pre_filter_usable_slot_yield": draw(_FLOATS),
            "pre_filter_trainable_slot_yield": draw(_FLOATS),
        },
        "error": draw(st.none() | st.text(max_size=3)),
        "closed_by": draw(st.sampled_from(["all_slots", "deadline"])),
        "issued_at": draw(st.none() | _FLOATS),
        "decided_at": draw(st.none() | _FLOATS),
    }


_DECISION_KEYS = [
    "schema_version",
    "producer",
    "seq",
    "kind",
    "task_id",
    "decision",
    "reason",
    "members",
    "member_entries",
    "member_digests",
    "member_rows",
    "member_tokens",
    "member_versions",
    "member_rewards",
    "slot_outcomes",
    "stats",
    "error",
    "closed_by",
    "issued_at",
    "decided_at",
]
_STATS_KEYS = [
    "target_slot_count",
    "usable_slot_count",
    "trainable_slot_count",
    "fully_masked_group",
    "singleton_slot_group",
    "pre_filter_usable_slot_yield",
    "pre_filter_trainable_slot_yield",
]

#: One change to a valid decision: a key set, dropped or added; a stats key; or one item of a member column.
_DECISION_CHANGE = st.one_of(
    st.none(),
    _edits(_DECISION_KEYS, _ODD_ITEM),
    _edits(_STATS_KEYS, _ODD, "stats"),
    st.tuples(st.just("set item"), st.sampled_from(_DECISION_KEYS[7:14]), _ODD),
)


def _changed_decision(header: dict, change) -> dict:
    if change is None:
        return header
    how, key, value = change
    _edit(header["stats"] if how.endswith("stats") else header, how, key, value)
    return header


@settings(max_examples=examples(800), deadline=None)
@given(header=_valid_decision(), change=_DECISION_CHANGE)
def test_a_decision_header_decodes_to_an_event_that_round_trips_or_is_refused_with_a_reason(header, change):
    _check(_changed_decision(header, change), change is not None, GroupDecided)


# -- step manifests --------------------------------------------------------------------------------

_INT64 = st.integers(-(2**63), INT64_MAX)


@st.composite
def _valid_group(draw) -> dict:
    count = draw(st.integers(0, 3))

    def column(values):
        return draw(st.lists(values, min_size=count, max_size=count))

    group = {
        "task_id": draw(st.text(max_size=4)),
        "decision_entry": draw(st.text(max_size=4)),
        "members": column(_COUNT),
        "member_entries": column(st.text(max_size=4)),
        "member_rows": column(_INT64),
        "member_tokens": column(st.integers(-3, 9)),
        "member_versions": column(st.integers(-3, 9)),
        "digest": draw(st.text(max_size=4)),
    }
    if draw(st.booleans()):
        group["partition"] = draw(st.integers(0, 5))
    return group


@st.composite
def _valid_manifest(draw) -> dict:
    shards = [
        {
            "rank": draw(_INT64),
            "groups": draw(st.lists(_valid_group(), max_size=3)),
            "tokens": draw(st.integers(-3, 99)),
            "digest": draw(st.text(max_size=4)),
        }
        for _ in range(draw(st.integers(0, 2)))
    ]
    return {
        "schema_version": 2,
        "producer": draw(st.text(max_size=4)),
        "seq": draw(_COUNT),
        "kind": "step",
        "step": draw(_COUNT),
        "version": draw(_INT64),
        "shards": shards,
        "imbalance": draw(_FLOATS),
        "created_at": draw(_FLOATS),
    }


_MANIFEST_KEYS = ["schema_version", "producer", "seq", "kind", "step", "version", "shards", "imbalance", "created_at"]
_SHARD_KEYS = ["rank", "groups", "tokens", "digest"]
_GROUP_KEYS = [
    "task_id",
    "decision_entry",
    "members",
    "member_entries",
    "member_rows",
    "member_tokens",
    "member_versions",
    "digest",
    "partition",
]
#: One change to a valid manifest: a key of it, of its first shard or of that shard's first group set,
#: dropped or added, or one item of a member column of that group.
_MANIFEST_CHANGE = st.one_of(
    st.none(),
    _edits(_MANIFEST_KEYS, _ODD_ITEM),
    _edits(_SHARD_KEYS, _ODD_ITEM, "shard"),
    _edits(_GROUP_KEYS, _ODD_ITEM, "group"),
    st.tuples(st.just("set item"), st.sampled_from(_GROUP_KEYS[2:7]), _ODD),
)


def _changed_manifest(header: dict, change) -> dict:
    if change is None:
        return header
    how, key, value = change
    shard = header["shards"][0] if header["shards"] else None
    group = shard["groups"][0] if shard and shard["groups"] else None
    target = {"shard": shard, "group": group, "item": group}.get(how.split()[-1], header)
    if target is None or (how.startswith("drop") and key not in target):
        return header
    _edit(target, how, key, value)
    return header


@settings(max_examples=examples(800), deadline=None)
@given(header=_valid_manifest(), change=_MANIFEST_CHANGE)
def test_a_manifest_header_decodes_to_an_event_that_round_trips_or_is_refused_with_a_reason(header, change):
    _check(_changed_manifest(header, change), change is not None, StepManifest)


def test_what_the_batcher_writes_decodes_to_the_same_manifest_partitioned_or_not():
    from streamgrp.core.events import DecidedMember
    from streamgrp.core.manifest import make_manifest
    from streamgrp.core.members import GroupStats

    def decision(task: str, tokens: int) -> GroupDecided:
        return GroupDecided.of(
            task_id=task,
            decision="complete",
            slot_outcomes={"0": "sample"},
            stats=GroupStats.of(1, 1, 1),
            closed_by="all_slots",
            members=[DecidedMember(slot=0, entry="1-0", rows=1, tokens=tokens, version=0, digest="ab", reward=0.5)],
        )

    for partition in (0, 2):
        ref = "5-0" if partition == 0 else f"5-0@{partition}"
        manifest = make_manifest(3, 1, [(ref, decision("t1", 4)), ("6-0", decision("t2", 9))], 2, 12.5)
        header = orjson.loads(codec.encode(manifest)[codec.HEADER])
        assert codec.decode(codec.encode(manifest)) == manifest
        groups = [group for shard in header["shards"] for group in shard["groups"]]
        assert [group.get("partition") for group in groups if group["task_id"] == "t1"] == [partition or None]
        assert (
            [group.task_id for shard in manifest.shards for group in shard.groups if group.partition == partition]
            == ["t1"]
            if partition
            else True
        )
    # A schema-1 manifest, as old logs hold, reads as such.
    old = orjson.loads(codec.encode(manifest)[codec.HEADER]) | {"schema_version": 1}
    assert codec.decode({codec.HEADER: orjson.dumps(old)}).schema_version == 1
