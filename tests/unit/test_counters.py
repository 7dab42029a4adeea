"""The counter names: one module owns them, and every name the commit scripts write is one of them."""

from __future__ import annotations

import re
from importlib import resources

from streamgrp.core import counters
from streamgrp.core.events import DecidedMember, GroupDecided, GroupStats

# incr(KEYS[n], 'name', ...) or incr(KEYS[n], 'family:' .. reason, ...)
_INCR = re.compile(r"incr\(KEYS\[\d+\],\s*'([^']*)'(\s*\.\.)?")


def _lua_counter_names() -> list[tuple[str, bool]]:
    lua = resources.files("streamgrp.store").joinpath("lua")
    found = []
    for script in lua.iterdir():
        if script.name.endswith(".lua"):
            found += [(m.group(1), bool(m.group(2))) for m in _INCR.finditer(script.read_text())]
    return found


def test_every_counter_the_lua_writes_is_a_known_name():
    names = _lua_counter_names()
    assert len(names) >= 7  # the scanner sees the scripts' literal names (a broken pattern would find none)
    for name, is_prefix in names:
        if is_prefix:
            assert name.endswith(":") and name[:-1] in counters.FAMILIES, name
        else:
            assert counters.is_known(name), f"{name!r} is written by a commit script but not defined in core/counters"


def test_unknown_names_are_not_known():
    assert not counters.is_known("slots")  # a family needs a label
    assert not counters.is_known("slot:sample")
    assert not counters.is_known("decisions:")
    assert counters.is_known("dropped:stale") and counters.is_known(counters.GROUPS_BATCHED)


def test_a_decision_adds_its_slot_outcomes_kind_reason_and_slot_counts():
    decision = GroupDecided.of(
        task_id="t",
        decision="dropped",
        reason="below_minimum",
        members=(DecidedMember(slot=1, entry="1-1", rows=1, tokens=4, version=0),),
        slot_outcomes={"0": "failed", "1": "sample", "2": "timeout", "3": "failed"},
        stats=GroupStats.of(4, 1, 0),
        closed_by="deadline",
    )
    assert counters.decision_increments(decision) == {
        "slots:failed": 2,
        "slots:sample": 1,
        "slots:timeout": 1,
        "decisions:dropped": 1,
        "dropped:below_minimum": 1,
        "target_slots": 4,
        "usable_slots": 1,
        "trainable_slots": 0,
    }


def test_families_and_yields_read_the_hash():
    counts = {
        "dropped:stale": 3,
        "dropped:filtered": 0,
        "slots:sample": 5,
        "target_slots": 8,
        "usable_slots": 6,
        "trainable_slots": 4,
    }
    assert counters.family(counts, counters.DROPPED) == {"stale": 3}
    assert counters.slot_yields(counts) == (0.75, 0.5)
    assert counters.slot_yields({}) is None
