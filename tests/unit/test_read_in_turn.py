"""`read_in_turn`: how a worker and a batcher read several partitions' streams as one blocking read."""

from __future__ import annotations

from streamgrp.store.streams import read_in_turn


def _reader(ready: dict[str, list[int]], calls: list):
    def read(source, block):
        calls.append((source, block))
        return ready.get(source, [])

    return read


def test_one_source_is_one_read_with_the_whole_wait():
    calls = []
    assert read_in_turn(["a"], _reader({}, calls), 900, first=True) == []
    assert calls == [("a", 900)]


def test_every_ready_source_without_waiting_or_the_first_one():
    calls = []
    assert read_in_turn(["a", "b", "c"], _reader({"b": [1], "c": [2]}, calls), 900, first=False) == [
        ("b", [1]),
        ("c", [2]),
    ]
    assert calls == [("a", None), ("b", None), ("c", None)]
    calls.clear()
    assert read_in_turn(["a", "b", "c"], _reader({"b": [1], "c": [2]}, calls), 900, first=True) == [("b", [1])]
    assert calls == [("a", None), ("b", None)]


def test_nothing_ready_waits_on_each_for_its_share_unless_told_not_to_wait():
    calls = []
    assert read_in_turn(["a", "b", "c"], _reader({}, calls), 900, first=True) == []
    assert calls == [("a", None), ("b", None), ("c", None), ("a", 300), ("b", 300), ("c", 300)]
    calls.clear()
    assert read_in_turn(["a", "b"], _reader({}, calls), None, first=False) == []
    assert calls == [("a", None), ("b", None)]
