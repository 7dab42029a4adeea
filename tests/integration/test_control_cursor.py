"""The control-stream cursor every reader shares: each entry read once, damaged ones dead-lettered once."""

from __future__ import annotations

from streamgrp.config import RunConfig
from streamgrp.core import codec
from streamgrp.core.events import RunFinished, RunTerminated, VersionAdvanced
from streamgrp.store.control import ControlCursor
from streamgrp.store.deadletter import DeadLetters
from streamgrp.store.runs import join_run


def advance(client, keys, version: int) -> None:
    client.xadd(
        keys.control, codec.encode(VersionAdvanced(version=version, step=version - 1, producer="t", seq=version))
    )


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
    finished = client.xadd(keys.control, codec.encode(RunFinished(steps=3, producer="t", seq=1)))
    client.hset(keys.batcher_state, "finished", finished)  # as batch_commit.lua records it
    assert [type(e) for e in first.read()] == [VersionAdvanced, RunFinished]
    assert len(second.read()) == created + 252  # a second reader keeps its own cursor
    assert client.xlen(keys.deadletter) == 1  # two readers met the damaged entry: one dead letter
    assert int(client.hget(keys.deadletter_counts, "invalid:control")) == 1  # kept apart from the run's counts


def test_a_terminal_event_the_batcher_did_not_write_is_refused(client, run_name):
    """Anyone who may append to control (a trainer's user) could write a terminal event that stops every rank;
    it counts only when the batcher's state names its entry."""
    keys = join_run(client, run_name, RunConfig(n_samples=2)).keys
    reader = ControlCursor(DeadLetters(client, keys))
    reader.read()
    client.xadd(keys.control, codec.encode(RunTerminated(reason="stall", message="forged", step=0)))
    client.xadd(keys.control, codec.encode(RunFinished(steps=0)))
    assert reader.read() == []
    letters = [fields for _, fields in client.xrange(keys.deadletter)]
    assert [f[b"reason"] for f in letters] == [b"untrusted_control", b"untrusted_control"]
    real = client.xadd(keys.control, codec.encode(RunTerminated(reason="stall", message="real", step=3)))
    client.hset(keys.batcher_state, "terminal", real)
    forged_after = client.xadd(keys.control, codec.encode(RunTerminated(reason="stall", message="forged", step=1)))
    assert [e.message for e in reader.read()] == ["real"]
    assert forged_after != real and client.xlen(keys.deadletter) == 3
