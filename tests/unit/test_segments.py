"""The archive's on-disk format: records, segments, their index, rotation, torn tails, duplicates. No server."""

from __future__ import annotations

import os
import random

import orjson
import pytest

from streamgrp.errors import ConfigError
from streamgrp.segments import (
    SEGMENT_MAGIC,
    ArchiveError,
    ArchiveReader,
    ArchiveWriter,
    decode_record,
    encode_record,
    last_ids,
    scan_segment,
)


def _entries(stream: str, count: int, *, start_ms: int = 1000, seed: int = 0, size: int = 64):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        fields = {b"h": orjson.dumps({"stream": stream, "i": i}), b"b": rng.randbytes(rng.randrange(0, size))}
        out.append((f"{start_ms + i // 3}-{i % 3}", fields))
    return out


def _segment_files(directory):
    return sorted((directory / "segments").glob("*.seg"))


def test_a_record_round_trips_any_bytes_and_rejects_every_truncation():
    fields = {b"h": b'{"kind":"x"}', b"b": bytes(range(256)), b"f:\xff\x00weird": b"", b"": b"empty name"}
    raw = encode_record("deadletter", "1700000000000-5", fields)
    record, end = decode_record(raw)
    assert (record.stream, record.entry_id, record.fields, end) == ("deadletter", "1700000000000-5", fields, len(raw))
    assert list(record.fields) == list(fields)  # field order is kept
    for cut in range(len(raw)):
        assert decode_record(raw[:cut]) is None, cut
    flipped = bytearray(raw)
    flipped[-1] ^= 0x01
    assert decode_record(bytes(flipped)) is None  # the checksum catches a changed byte


def test_entries_written_are_read_back_by_id_and_by_range(tmp_path):
    writer = ArchiveWriter(tmp_path, run="r1")
    slots, steps = _entries("slots", 50), [(f"{n}-1", {b"h": b"step %d" % n}) for n in range(5)]
    for i, (slot_id, slot_fields) in enumerate(slots):
        writer.append("slots", slot_id, slot_fields)
        if i < len(steps):
            writer.append("steps", *steps[i])
    writer.sync()
    reader = ArchiveReader(tmp_path)  # reads the unsealed segment while the writer holds it
    assert reader.run == "r1"
    assert list(reader.scan("slots")) == slots
    assert list(reader.scan("steps")) == steps
    ids = [slots[7][0], "1-1", slots[0][0], "999999-0"]
    assert reader.get("slots", ids) == [slots[7][1], None, slots[0][1], None]
    assert list(reader.scan("slots", after=slots[9][0], before=slots[13][0])) == slots[10:13]
    assert list(reader.scan("steps", after="2-1")) == steps[3:]
    assert list(reader.scan("tasks")) == []
    writer.close()
    assert (tmp_path / "segments" / "00000001.idx").exists()
    sealed = ArchiveReader(tmp_path)
    assert list(sealed.scan("slots")) == slots and sealed.get("steps", ["4-1"]) == [steps[4][1]]
    assert sealed.streams() == {"slots": 50, "steps": 5}


def test_segments_rotate_by_size_and_the_index_finds_entries_across_them(tmp_path):
    writer = ArchiveWriter(tmp_path, run="r1", segment_bytes=4096)
    entries = _entries("slots", 300, size=200)
    for start in range(0, 300, 10):  # the archiver syncs after each pass; rotation happens at a sync
        for entry_id, fields in entries[start:start + 10]:
            writer.append("slots", entry_id, fields)
        writer.sync()
    writer.close()
    files = _segment_files(tmp_path)
    assert len(files) > 5
    for path in files[:-1]:
        assert path.stat().st_size >= 4096  # sealed once full, not before
        index = orjson.loads(path.with_suffix(".idx").read_bytes())
        assert index["length"] == path.stat().st_size
        first, last = index["streams"]["slots"]["first"], index["streams"]["slots"]["last"]
        assert [r[0] for r in index["records"]["slots"]][0] == first
        assert [r[0] for r in index["records"]["slots"]][-1] == last
    reader = ArchiveReader(tmp_path)
    assert len(reader.segments()) == len(files)
    assert list(reader.scan("slots")) == entries
    picks = random.Random(1).sample(entries, 40)
    assert reader.get("slots", [entry_id for entry_id, _ in picks]) == [fields for _, fields in picks]
    assert last_ids(reader.segments()) == {"slots": entries[-1][0]}


def test_a_torn_last_record_is_ignored_and_a_restart_copies_again_without_duplicating(tmp_path):
    entries = _entries("slots", 40)
    writer = ArchiveWriter(tmp_path, run="r1")
    for entry_id, fields in entries[:30]:
        writer.append("slots", entry_id, fields)
    writer.sync()
    # A crash mid-append: half of the next record reaches the file, no index is written.
    torn = encode_record("slots", entries[30][0], entries[30][1])
    with open(_segment_files(tmp_path)[0], "ab") as handle:
        handle.write(torn[: len(torn) // 2])
    writer.segment.abandon()
    writer._lock.close()

    reader = ArchiveReader(tmp_path)
    assert list(reader.scan("slots")) == entries[:30]
    assert reader.segments()[0].torn

    # The restarted archiver resumes from its last recorded progress (say entry 20) and copies again.
    restarted = ArchiveWriter(tmp_path, run="r1")
    assert restarted.sealed_on_start == 1
    for entry_id, fields in entries[20:]:
        restarted.append("slots", entry_id, fields)
    restarted.close()
    assert len(_segment_files(tmp_path)) == 2  # a new segment: the torn one is never appended to
    reader = ArchiveReader(tmp_path)
    assert list(reader.scan("slots")) == entries  # each id once, in order
    copies = list(reader.copies("slots"))
    assert len(copies) == 30 + 20
    by_id: dict[str, set[bytes]] = {}
    for entry_id, _, fields in copies:
        by_id.setdefault(entry_id, set()).add(orjson.dumps({k.hex(): v.hex() for k, v in fields.items()}))
    assert all(len(versions) == 1 for versions in by_id.values())  # duplicates are byte-identical
    first = scan_segment(_segment_files(tmp_path)[0], 1)
    assert first.torn and len(first.streams["slots"]) == 30


def test_the_later_copy_of_an_id_wins(tmp_path):
    writer = ArchiveWriter(tmp_path, run="r1")
    writer.append("slots", "5-0", {b"h": b"old"})
    writer.close()
    writer = ArchiveWriter(tmp_path, run="r1")
    writer.append("slots", "5-0", {b"h": b"new"})
    writer.append("slots", "6-0", {b"h": b"six"})
    writer.close()
    reader = ArchiveReader(tmp_path)
    assert reader.get("slots", ["5-0"]) == [{b"h": b"new"}]
    assert list(reader.scan("slots")) == [("5-0", {b"h": b"new"}), ("6-0", {b"h": b"six"})]


def test_one_writer_per_archive_one_run_per_archive_and_ids_only_go_forward(tmp_path):
    writer = ArchiveWriter(tmp_path, run="r1")
    with pytest.raises(ConfigError, match="another archiver is writing"):
        ArchiveWriter(tmp_path, run="r1")
    writer.append("slots", "2-0", {b"h": b"x"})
    with pytest.raises(ValueError, match="is not after"):
        writer.append("slots", "1-0", {b"h": b"y"})
    writer.close()
    with pytest.raises(ArchiveError, match="archives run 'r1', not 'r2'"):
        ArchiveWriter(tmp_path, run="r2")
    with pytest.raises(ConfigError, match="not a streamgrp archive"):
        ArchiveReader(tmp_path / "elsewhere")


def test_a_damaged_sealed_segment_is_reported_not_misread(tmp_path):
    writer = ArchiveWriter(tmp_path, run="r1")
    for entry_id, fields in _entries("slots", 5):
        writer.append("slots", entry_id, fields)
    writer.close()
    path = _segment_files(tmp_path)[0]
    data = bytearray(path.read_bytes())
    data[len(SEGMENT_MAGIC) + 20] ^= 0xFF  # inside the first record's header
    path.write_bytes(bytes(data))
    with pytest.raises(ArchiveError, match="damaged"):
        list(ArchiveReader(tmp_path).scan("slots"))


def test_a_snapshot_is_replaced_whole(tmp_path):
    writer = ArchiveWriter(tmp_path, run="r1")
    assert ArchiveReader(tmp_path).snapshot() is None
    writer.write_snapshot({"hashes": {"committed": {"0": "3"}}})
    writer.write_snapshot({"hashes": {"committed": {"0": "4"}}})
    writer.close()
    assert ArchiveReader(tmp_path).snapshot() == {"hashes": {"committed": {"0": "4"}}}
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".partial")]


def test_a_reader_follows_a_segment_while_it_is_written(tmp_path):
    ArchiveWriter(tmp_path, run="r1").close()
    entries = _entries("slots", 3)
    records = [encode_record("slots", entry_id, fields) for entry_id, fields in entries]
    path = tmp_path / "segments" / "00000001.seg"
    path.write_bytes(SEGMENT_MAGIC + records[0] + records[1][:10])  # the second record half written
    reader = ArchiveReader(tmp_path)
    assert list(reader.scan("slots")) == entries[:1]
    with open(path, "ab") as handle:
        handle.write(records[1][10:] + records[2])
    assert list(reader.scan("slots")) == entries  # read on from where the last look stopped
    assert reader.get("slots", [entries[2][0]]) == [entries[2][1]]
