"""The server-free parts of sizing and deleting runs: when a run counts as live, byte sizes as printed,
and archive directories on disk (their size, the archiver's lock, removing one). No server."""

from __future__ import annotations

import pytest

from streamgrp.errors import ConfigError
from streamgrp.store.archive_admin import archive_bytes, archive_in_use, archived_runs, remove_archive
from streamgrp.store.archive_writer import ArchiveWriter
from streamgrp.store.run_admin import DEFAULT_IDLE_S, Activity, human_bytes, live_reason

OLD = DEFAULT_IDLE_S + 1


def test_a_held_lease_makes_a_run_live_even_after_it_ended():
    for ended in (None, "finished", "failed"):
        reason = live_reason(Activity(leases={"batcher": 4.5}, ended=ended, newest_entry=("control", 3600)))
        assert reason == "a batcher process holds the run's batcher lease (for 4.5s more)"
    assert "with no expiry" in live_reason(Activity(leases={"assembler": None}))


def test_a_run_that_has_not_ended_is_live_while_something_happened_within_idle_s():
    entry = Activity(newest_entry=("slots", 12.0), recent_consumer=("tasks/workers/w1", OLD))
    assert live_reason(entry) == "it has not finished and its slots stream got an entry 12s ago (within --idle-s 60)"
    consumer = Activity(newest_entry=("slots", OLD), recent_consumer=("tasks/workers/w1", 0.5))
    assert live_reason(consumer) == (
        "it has not finished and the consumer tasks/workers/w1 read 0s ago (within --idle-s 60)"
    )
    assert live_reason(Activity(newest_entry=("slots", -2.0))).startswith("it has not finished")  # clock skew: recent
    assert live_reason(Activity(newest_entry=("slots", 12.0)), idle_s=10) is None
    assert live_reason(Activity(newest_entry=("slots", OLD), recent_consumer=("x/y/z", OLD))) is None
    assert live_reason(Activity()) is None  # nothing on the server: nothing to pull from under anyone


def test_an_ended_run_is_not_live_without_a_lease_whatever_its_workers_still_poll():
    busy = dict(newest_entry=("commits", 0.0), recent_consumer=("tasks/workers/w1", 0.0))
    assert live_reason(Activity(ended="finished", **busy)) is None
    assert live_reason(Activity(ended="failed", **busy)) is None


def test_sizes_read_like_du():
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 4_400_000, 3 * 1024**3, 5 * 1024**4)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "4.2 MiB",
        "3.0 GiB",
        "5120.0 GiB",
    ]


def _archive(directory, run: str) -> ArchiveWriter:
    writer = ArchiveWriter(directory, run=run)
    writer.append("slots", "1-0", {b"h": b"x" * 100})
    writer.sync()
    return writer


def test_an_archive_is_sized_listed_and_seen_locked_while_its_archiver_writes(tmp_path):
    data = tmp_path / "data"
    writer = _archive(data / "archive" / "r1", "r1")
    (data / "archive" / "not-an-archive").mkdir()
    assert archive_in_use(data / "archive" / "r1")
    assert not archive_in_use(data / "archive" / "not-an-archive")
    assert not (data / "archive" / "not-an-archive" / "LOCK").exists()  # probing leaves nothing behind
    writer.close()
    assert not archive_in_use(data / "archive" / "r1")
    files = [p for p in (data / "archive" / "r1").rglob("*") if p.is_file()]
    assert archive_bytes(data / "archive" / "r1") == sum(p.stat().st_size for p in files) > 100
    assert archive_bytes(tmp_path / "missing") == 0
    assert archived_runs(data) == {"r1": data / "archive" / "r1"}
    assert archived_runs(tmp_path / "nowhere") == {}


def test_removing_an_archive_checks_whose_it_is_and_that_no_archiver_writes_it(tmp_path):
    directory = tmp_path / "r1"
    writer = _archive(directory, "r1")
    with pytest.raises(ConfigError, match="an archiver is writing"):
        remove_archive(directory, "r1")
    writer.close()
    with pytest.raises(ConfigError, match="archive of run 'r1', not 'r2'"):
        remove_archive(directory, "r2")
    with pytest.raises(ConfigError, match="not a streamgrp archive"):
        remove_archive(tmp_path, "r1")
    size = archive_bytes(directory)
    assert remove_archive(directory, "r1") == size and not directory.exists()

    forced = _archive(tmp_path / "r3", "r3")
    assert remove_archive(tmp_path / "r3", "r3", force=True) > 0 and not (tmp_path / "r3").exists()
    forced.segment.abandon()  # the forced-out archiver's files are gone; it only lets go of them
    forced._lock.close()
