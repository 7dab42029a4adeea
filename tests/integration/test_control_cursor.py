"""The control-stream cursor every reader shares: each entry read once, damaged ones dead-lettered once."""

from __future__ import annotations

from streamgrp.config import RunConfig
from streamgrp.core import codec
from streamgrp.core.events import RunFinished, VersionAdvanced
from streamgrp.store.control import ControlCursor
from streamgrp.store.deadletter import DeadLetters
from streamgrp.store.runs import join_run


def advance(client, keys, version: int) -> None:
    client.xadd(keys.control, codec.encode(VersionAdvanced(version=version, step=version - 1, producer="t", seq=version)))


def test_each_entry_is_read_once_across_chunks_and_damage_is_dead_lettered_once(client, run_name):
    keys = join_run(client, run_name, RunConfig(n_samples=2)).keys
    created = len(client.xrange(keys.control))  # the run's own creation entry
    for version in range(1, 251):
        advance(client, keys, version)
    client.xadd(keys.control, {"v": "1", "type": "run_finished", "body": "not json"})
    first, second = ControlCursor(DeadLetters(client, keys), chunk=32), ControlCursor(DeadLetters(client, keys))
    events = first.read()
    assert len(events) == created + 250
    assert [e.version for e in events if isinstance(e, VersionAdvanced)] == list(range(1, 251))
    assert first.read() == []  # nothing new: nothing returned, nothing re-read
    advance(client, keys, 251)
    client.xadd(keys.control, codec.encode(RunFinished(steps=3, producer="t", seq=1)))
    assert [type(e) for e in first.read()] == [VersionAdvanced, RunFinished]
    assert len(second.read()) == created + 252  # a second reader keeps its own cursor
    assert client.xlen(keys.deadletter) == 1  # two readers met the damaged entry: one dead letter
    assert int(client.hget(keys.counts, "invalid:control")) == 1
