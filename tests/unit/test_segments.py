"""The archive's on-disk format: records, segments, their index, rotation, torn tails, duplicates, and
damage: in the middle of a segment (refused, never sealed over) and in an index (refused before use). No server."""

from __future__ import annotations

import os
import random
import struct

import orjson
import pytest

from streamgrp.errors import ArchiveError, ConfigError
from streamgrp.store.archive_reader import ArchiveReader, last_ids
from streamgrp.store.archive_writer import ArchiveWriter
from streamgrp.store.segment_file import scan_segment
from streamgrp.store.segment_format import SEGMENT_MAGIC, decode_record, encode_record


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
        for entry_id, fields in entries[start : start + 10]:
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


# -- damage: in the middle of a segment, and in its index ---------------------------------------------


def _unsealed(directory, entries):
    """A segment left by an archiver killed after a sync: whole records, no index. Returns it and record offsets."""
    writer = ArchiveWriter(directory, run="r1")
    for entry_id, fields in entries:
        writer.append("slots", entry_id, fields)
    writer.sync()
    offsets = [offset for _, _, offset, _ in writer.segment.index.streams["slots"]]
    writer.segment.abandon()
    writer._lock.close()
    return _segment_files(directory)[0], offsets


def _flip(data: bytearray, at: int) -> None:
    data[at] ^= 0x5A


def _zero_run(data: bytearray, at: int) -> None:
    data[at + 4 : at + 36] = bytes(32)


def _bad_magic(data: bytearray, at: int) -> None:
    data[at : at + 4] = b"XXXX"


def _huge_body_length(data: bytearray, at: int) -> None:
    struct.pack_into("<I", data, at + 8, 2**31)  # the record now seems to run past the end, like a torn one


@pytest.mark.parametrize(
    "damage, where",
    [
        (_flip, 40),
        (_zero_run, 0),
        (_bad_magic, 0),
        (_huge_body_length, 0),
    ],
)
def test_damage_in_the_middle_of_an_unsealed_segment_is_refused_and_never_sealed(tmp_path, damage, where):
    entries = _entries("slots", 120)
    path, offsets = _unsealed(tmp_path, entries)
    data = bytearray(path.read_bytes())
    damage(data, offsets[10] + where)
    path.write_bytes(bytes(data))

    with pytest.raises(ArchiveError) as info:
        scan_segment(path, 1)
    message = str(info.value)
    assert str(path) in message and f"damaged at offset {offsets[10]}" in message, message
    assert f"a whole record follows at offset {offsets[11]}" in message and "Restore" in message, message
    with pytest.raises(ArchiveError, match="not the torn tail"):
        list(ArchiveReader(tmp_path).scan("slots"))
    with pytest.raises(ArchiveError, match="not the torn tail"):
        ArchiveWriter(tmp_path, run="r1")  # the restarted archiver must not seal the loss in
    assert not path.with_suffix(".idx").exists() and path.read_bytes() == bytes(data)
    path.rename(tmp_path / "moved-aside.seg")  # what the message offers besides restoring a copy
    ArchiveWriter(tmp_path, run="r1").close()  # starts: the refusal released the directory's lock


def test_a_damaged_segment_magic_with_records_after_it_is_refused(tmp_path):
    path, _ = _unsealed(tmp_path, _entries("slots", 5))
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArchiveError, match=r"damaged at offset 0 \(its magic bytes are wrong\)"):
        scan_segment(path, 1)


def test_damage_is_found_when_reading_resumes_in_a_segment_being_written(tmp_path):
    entries = _entries("slots", 120)
    writer = ArchiveWriter(tmp_path, run="r1")
    for entry_id, fields in entries[:20]:
        writer.append("slots", entry_id, fields)
    writer.sync()
    reader = ArchiveReader(tmp_path)
    assert list(reader.scan("slots")) == entries[:20]
    path = _segment_files(tmp_path)[0]
    seen = scan_segment(path, 1)
    for entry_id, fields in entries[20:]:
        writer.append("slots", entry_id, fields)
    writer.sync()
    damaged_at = writer.segment.index.streams["slots"][30][2]
    with open(path, "r+b") as handle:  # damage after what the reader has seen, before the end
        handle.seek(damaged_at + 20)
        handle.write(b"\x00\x01")

    with pytest.raises(ArchiveError, match=f"damaged at offset {damaged_at}"):
        scan_segment(path, 1, resume=seen)
    with pytest.raises(ArchiveError, match=f"damaged at offset {damaged_at}"):
        list(reader.scan("slots"))
    writer.segment.abandon()
    writer._lock.close()
    with pytest.raises(ArchiveError, match="not the torn tail"):
        ArchiveWriter(tmp_path, run="r1")
    assert not path.with_suffix(".idx").exists()


@pytest.mark.parametrize(
    "tail",
    [
        lambda record: record[: len(record) // 2],  # the write stopped half way
        lambda record: record[:10],  # inside the prefix
        lambda record: record[:-1],  # one byte short
        lambda record: record[:16] + bytes(len(record) - 16),  # the length reached the disk, the data did not
        lambda record: bytes(4096),  # a block allocated but never written
    ],
    ids=["half", "in-prefix", "one-short", "zeroed-body", "zero-block"],
)
def test_a_torn_tail_of_any_shape_still_resumes(tmp_path, tail):
    entries = _entries("slots", 40)
    path, _ = _unsealed(tmp_path, entries[:30])
    with open(path, "ab") as handle:
        handle.write(tail(encode_record("slots", *entries[30])))
    reader = ArchiveReader(tmp_path)
    assert list(reader.scan("slots")) == entries[:30] and reader.segments()[0].torn
    restarted = ArchiveWriter(tmp_path, run="r1")
    assert restarted.sealed_on_start == 1
    for entry_id, fields in entries[20:]:
        restarted.append("slots", entry_id, fields)
    restarted.close()
    assert list(ArchiveReader(tmp_path).scan("slots")) == entries


@pytest.mark.parametrize("content", [b"", b"SGSEG", bytes(4096)], ids=["empty", "half-magic", "zeros"])
def test_a_segment_killed_before_its_magic_reached_the_disk_is_sealed_empty(tmp_path, content):
    ArchiveWriter(tmp_path, run="r1").close()
    (tmp_path / "segments" / "00000001.seg").write_bytes(content)
    restarted = ArchiveWriter(tmp_path, run="r1")
    restarted.close()
    assert restarted.sealed_on_start == 1
    assert ArchiveReader(tmp_path).streams() == {}


def _sealed(directory):
    """A closed archive of one segment holding two streams; returns the segment, its index, and the entries."""
    writer = ArchiveWriter(directory, run="r1")
    slots, steps = _entries("slots", 12), [(f"{n}-1", {b"h": b"step %d" % n}) for n in range(3)]
    for i, (entry_id, fields) in enumerate(slots):
        writer.append("slots", entry_id, fields)
        if i < len(steps):
            writer.append("steps", *steps[i])
    writer.close()
    path = _segment_files(directory)[0]
    return path, path.with_suffix(".idx"), {"slots": slots, "steps": steps}


def _read_all(directory) -> dict:
    """Everything a reader serves, through every path: listing, scan, get by id, every copy."""
    with ArchiveReader(directory) as reader:
        out = {}
        for name in reader.streams():
            scanned = list(reader.scan(name))
            assert reader.get(name, [entry_id for entry_id, _ in scanned]) == [fields for _, fields in scanned]
            assert [(entry_id, fields) for entry_id, _, fields in reader.copies(name)] == scanned
            out[name] = scanned
        return out


def _edit(change):
    """An index mutation from a function that edits the index's JSON in place."""

    def mutate(raw: bytes) -> bytes:
        index = orjson.loads(raw)
        change(index)
        return orjson.dumps(index)

    return mutate


def _set_record(field, value):
    def change(index):
        index["records"]["slots"][0][field] = value

    return _edit(change)


def _swap_first_two(index):
    recs = index["records"]["slots"]
    recs[0], recs[1] = recs[1], recs[0]


def _point_at_the_next_record(index):
    recs = index["records"]["slots"]
    recs[0][1:] = recs[1][1:]


def _shift_first_offset(index):
    index["records"]["slots"][0][1] += 1


HOSTILE_INDEXES = {
    "not-json": lambda raw: b"not json",
    "empty": lambda raw: b"",
    "a-list": lambda raw: b"[1, 2, 3]",
    "a-string": lambda raw: b'"records"',
    "nested-too-deep": lambda raw: b"[" * 5000 + b"]" * 5000,
    "nested-garbage": _edit(lambda index: index.update(records={"slots": [[[["1-0"]]]]})),
    "no-format": _edit(lambda index: index.pop("format")),
    "segment-as-string": _edit(lambda index: index.update(segment="1")),
    "another-segment": _edit(lambda index: index.update(segment=2)),
    "negative-length": _edit(lambda index: index.update(length=-1)),
    "length-past-the-file": _edit(lambda index: index.update(length=10**12)),
    "records-a-list": _edit(lambda index: index.update(records=[])),
    "stream-records-an-object": _edit(lambda index: index["records"].update(slots={"1000-0": 8})),
    "record-of-two": _set_record(slice(0, 3), ["1000-0", 8]),
    "huge-offset": _set_record(1, 2**62),
    "u64-offset": _set_record(1, 2**64 - 1),
    "negative-offset": _set_record(1, -8),
    "offset-in-the-magic": _set_record(1, 0),
    "negative-size": _set_record(2, -1),
    "huge-size": _set_record(2, 2**40),
    "offset-a-string": _set_record(1, "8"),
    "offset-a-bool": _set_record(1, True),
    "offset-a-float": _set_record(1, 8.0),
    "id-not-an-id": _set_record(0, "not-an-id"),
    "id-a-number": _set_record(0, 1000),
    "id-too-long": _set_record(0, "9" * 5000 + "-0"),
    "ids-out-of-order": _edit(_swap_first_two),
    "points-at-another-record": _edit(_point_at_the_next_record),
    "points-inside-a-record": _edit(_shift_first_offset),
    "padded-to-gigantic": lambda raw: raw + b" " * (5 * 1024 * 1024),
}


@pytest.mark.parametrize("mutate", HOSTILE_INDEXES.values(), ids=HOSTILE_INDEXES.keys())
def test_a_damaged_or_hostile_index_raises_archive_error_and_nothing_else(tmp_path, mutate):
    path, idx, entries = _sealed(tmp_path)
    assert _read_all(tmp_path) == entries
    idx.write_bytes(mutate(idx.read_bytes()))
    with pytest.raises(ArchiveError) as info:  # never MemoryError, OSError, KeyError...
        _read_all(tmp_path)
    message = str(info.value)
    assert str(idx) in message or str(path) in message, message
    assert "delete" in message or "restore" in message.lower(), message


def test_byte_flips_in_a_sealed_segment_or_its_index_read_correctly_or_raise_archive_error(tmp_path):
    path, idx, entries = _sealed(tmp_path)
    pristine = {path: path.read_bytes(), idx: idx.read_bytes()}
    rng = random.Random(8)
    refused = 0
    for attempt in range(1500):
        victim = path if attempt % 2 else idx
        for file, raw in pristine.items():
            file.write_bytes(raw)
        damaged = bytearray(pristine[victim])
        if attempt % 7 == 0:
            del damaged[rng.randrange(len(damaged)) :]
        else:
            damaged[rng.randrange(len(damaged))] ^= rng.randrange(1, 256)
        victim.write_bytes(bytes(damaged))
        try:
            served = _read_all(tmp_path)
        except ArchiveError:
            refused += 1
        else:  # a harmless byte (the segment magic, the index's per-stream summary): nothing may be misread
            assert served == entries, (attempt, victim.name)
    assert refused > 1000


def test_byte_flips_in_an_unsealed_segment_are_a_torn_tail_only_in_its_last_record(tmp_path):
    entries = _entries("slots", 12)
    path, offsets = _unsealed(tmp_path, entries)
    pristine = path.read_bytes()
    rng = random.Random(9)
    for attempt in range(1500):
        damaged = bytearray(pristine)
        if attempt % 5 == 0:  # a crash: everything from the cut on is gone
            cut = rng.randrange(len(SEGMENT_MAGIC), len(pristine))
            del damaged[cut:]
            whole = sum(1 for at, nxt in zip(offsets, offsets[1:] + [len(pristine)]) if nxt <= cut)
            expect_error = False
        else:
            at = rng.randrange(len(pristine))
            damaged[at] ^= rng.randrange(1, 256)
            whole = sum(1 for offset in offsets if offset <= at) - 1  # the records before the damaged one
            expect_error = at < offsets[-1]  # damage anywhere but in the last record has whole records after it
        path.write_bytes(bytes(damaged))
        if expect_error:
            with pytest.raises(ArchiveError, match="not the torn tail"):
                _read_all(tmp_path)
        else:
            assert _read_all(tmp_path) == ({"slots": entries[:whole]} if whole else {}), attempt
