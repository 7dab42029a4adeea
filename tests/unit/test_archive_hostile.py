"""Hostile archive files: links to /dev/zero, FIFOs, devices and directories where segments, indexes and
records should be, sparse segments of gigabytes, and records that pass their checksum but do not decode.
Each is refused with `ArchiveError` naming the file (and the offset, in a segment), or read within
bounded memory and time; never MemoryError, a hang, or another exception. No server.

Reads that could hang or exhaust memory on a regression run in a child process with an address-space
limit and a timeout, so a failing test fails instead of taking the machine with it.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import orjson
import pytest

from streamgrp.errors import ArchiveError
from streamgrp.store.archive_admin import archive_in_use
from streamgrp.store.archive_reader import ArchiveReader
from streamgrp.store.archive_writer import ArchiveWriter
from streamgrp.store.segment_file import scan_segment
from streamgrp.store.segment_format import RECORD_MAGIC, encode_record

ROOT = Path(__file__).resolve().parents[2]
MEMORY_LIMIT = 512 * 1024 * 1024
GiB = 1024**3

_CHILD = f"""
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))
from streamgrp.errors import ArchiveError
from streamgrp.store.archive_admin import archive_in_use
from streamgrp.store.archive_reader import ArchiveReader
from streamgrp.store.archive_writer import ArchiveWriter
started = time.monotonic()
try:
    if sys.argv[2] == "read":
        with ArchiveReader(sys.argv[1]) as reader:
            served = {{name: sum(1 for _ in reader.scan(name)) for name in reader.streams()}}
            reader.snapshot()
        print("served", served)
    elif sys.argv[2] == "write":
        ArchiveWriter(sys.argv[1], run="r1").close()
        print("started")
    else:
        print("in use", archive_in_use(sys.argv[1]))
except ArchiveError as exc:
    print("ArchiveError:", exc)
print("seconds", round(time.monotonic() - started, 2))
"""


def _in_child(directory: Path, action: str = "read") -> str:
    """What ``action`` on the archive at ``directory`` printed, in a child limited to 512 MiB and 20 s."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(directory), action], capture_output=True, text=True, timeout=20, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{action} of {directory} hung for 20 s")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _archive(directory: Path, *, seal: bool = True, count: int = 6) -> Path:
    """An archive of run r1 holding ``count`` slots entries in one segment (sealed or left open); the segment."""
    writer = ArchiveWriter(directory, run="r1")
    for i in range(count):
        writer.append("slots", f"{1000 + i}-0", {b"h": b"entry %d" % i})
    writer.sync()
    if seal:
        writer.close()
    else:
        writer.segment.abandon()
        writer._lock.close()
    return directory / "segments" / "00000001.seg"


def _to_dev_zero(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


def _to_fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


# -- links and special files ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where, seal", [("seg", False), ("idx", True), ("seg", True)], ids=["open-segment", "index", "sealed-segment"]
)
@pytest.mark.parametrize("make", [_to_dev_zero, _to_fifo], ids=["link-to-dev-zero", "fifo"])
def test_a_segment_or_index_that_is_a_link_or_a_fifo_is_refused_at_once(tmp_path, where, seal, make):
    segment = _archive(tmp_path, seal=seal)
    victim = segment.with_suffix(f".{where}")
    make(victim)
    kind = "symbolic link" if make is _to_dev_zero else "FIFO"
    # A reader; and an archiver starting on the directory, which seals (reads) only segments without an index.
    for action in ("read", "write") if not seal else ("read",):
        out = _in_child(tmp_path, action)
        assert "ArchiveError:" in out and str(victim) in out and kind in out, out
        assert "regular file" in out and ("copy" in out or "remove it" in out), out


@pytest.mark.parametrize("name", ["meta.json", "snapshot.json", "LOCK"])
@pytest.mark.parametrize("make", [_to_dev_zero, _to_fifo], ids=["link-to-dev-zero", "fifo"])
def test_the_archive_record_snapshot_and_lock_must_be_regular_files_too(tmp_path, name, make):
    _archive(tmp_path)
    (tmp_path / "snapshot.json").write_bytes(orjson.dumps({"hashes": {}, "groups": {}}))
    make(tmp_path / name)
    actions = ("in-use", "write") if name == "LOCK" else ("read",)
    for action in actions:
        out = _in_child(tmp_path, action)
        assert "ArchiveError:" in out and str(tmp_path / name) in out and "regular file" in out, (action, out)


def test_a_directory_named_like_a_segment_is_refused(tmp_path):
    _archive(tmp_path)
    (tmp_path / "segments" / "00000002.seg").mkdir()
    with pytest.raises(ArchiveError, match=r"00000002\.seg is a directory, not a regular file"):
        list(ArchiveReader(tmp_path).scan("slots"))


@pytest.mark.parametrize(
    "snapshot",
    [
        [1, 2],
        {"hashes": []},
        {"hashes": {"decided": [1]}},
        {"hashes": {"c": {"0": 3}}},
        {"groups": {"slots": {"name": "x"}}},
        {"groups": {"slots": [{"last_delivered": 5}]}},
    ],
    ids=["a-list", "hashes-a-list", "a-hash-a-list", "a-number-value", "groups-an-object", "position-a-number"],
)
def test_a_snapshot_of_the_wrong_shape_is_refused(tmp_path, snapshot):
    _archive(tmp_path)
    (tmp_path / "snapshot.json").write_bytes(orjson.dumps(snapshot))
    with pytest.raises(ArchiveError, match=r"snapshot\.json is damaged .*delete it"):
        ArchiveReader(tmp_path).snapshot()


# -- sparse segments ------------------------------------------------------------------------------------


def test_a_sparse_three_gib_tail_is_a_torn_tail_read_in_bounded_memory_and_time(tmp_path):
    segment = _archive(tmp_path, seal=False)
    with open(segment, "r+b") as handle:
        handle.truncate(3 * GiB)  # a hole: no block is written
    out = _in_child(tmp_path)
    assert "served {'slots': 6}" in out, out
    assert float(out.split("seconds")[1]) < 10, out
    out = _in_child(tmp_path, "write")  # the restarted archiver seals what is readable
    assert "started" in out, out
    assert list(ArchiveReader(tmp_path).scan("slots")) == [(f"{1000 + i}-0", {b"h": b"entry %d" % i}) for i in range(6)]


def test_a_record_after_a_three_gib_hole_is_damage_found_without_reading_the_hole(tmp_path):
    segment = _archive(tmp_path, seal=False)
    record = encode_record("slots", "2000-0", {b"h": b"after the hole"})
    with open(segment, "r+b") as handle:
        handle.seek(3 * GiB)
        handle.write(record)
    out = _in_child(tmp_path)
    assert "ArchiveError:" in out and str(segment) in out and f"a whole record follows at offset {3 * GiB}" in out, out
    assert float(out.split("seconds")[1]) < 10, out


# -- records that pass their checksum but do not decode -----------------------------------------------------


def _forged(header: object, body: bytes = b"") -> bytes:
    """A record whose checksum matches whatever ``header`` (JSON, or raw bytes) says."""
    raw = header if isinstance(header, bytes) else orjson.dumps(header)
    crc = zlib.crc32(body, zlib.crc32(raw))
    return struct.pack("<4sIII", RECORD_MAGIC, len(raw), len(body), crc) + raw + body


FORGED = {
    "not-json": (b"{nope", b""),
    "a-list": ([1, 2], b""),
    "stream-a-number": ({"s": 5, "i": "1-0", "f": []}, b""),
    "stream-empty": ({"s": "", "i": "1-0", "f": []}, b""),
    "no-stream": ({"i": "1-0", "f": []}, b""),
    "id-not-an-id": ({"s": "slots", "i": "x", "f": []}, b""),
    "id-three-parts": ({"s": "slots", "i": "1-2-3", "f": []}, b""),
    "id-a-number": ({"s": "slots", "i": 7, "f": []}, b""),
    "sizes-an-object": ({"s": "slots", "i": "1-0", "f": {"a": 1}}, b"ab"),
    "size-negative": ({"s": "slots", "i": "1-0", "f": [[-1, 3]]}, b"ab"),
    "size-a-bool": ({"s": "slots", "i": "1-0", "f": [[True, True]]}, b"ab"),
    "size-a-float": ({"s": "slots", "i": "1-0", "f": [[1.0, 1]]}, b"ab"),
    "size-a-string": ({"s": "slots", "i": "1-0", "f": ["ab"]}, b"ab"),
    "sizes-past-the-body": ({"s": "slots", "i": "1-0", "f": [[1, 5]]}, b"ab"),
    "sizes-short-of-the-body": ({"s": "slots", "i": "1-0", "f": [[1, 0]]}, b"ab"),
}


@pytest.mark.parametrize("at", ["middle", "tail"])
@pytest.mark.parametrize("header, body", FORGED.values(), ids=FORGED.keys())
def test_a_checksummed_record_that_does_not_decode_is_refused_naming_file_and_offset(tmp_path, header, body, at):
    segment = _archive(tmp_path, seal=False)
    offset = segment.stat().st_size
    with open(segment, "ab") as handle:
        handle.write(_forged(header, body))
        if at == "middle":
            handle.write(encode_record("slots", "5000-0", {b"h": b"after"}))
    for read in (
        lambda: scan_segment(segment, 1),
        lambda: list(ArchiveReader(tmp_path).scan("slots")),
        lambda: ArchiveWriter(tmp_path, run="r1"),
    ):  # a torn tail would be sealed; this is refused
        with pytest.raises(ArchiveError) as info:
            read()
        message = str(info.value)
        assert str(segment) in message and f"damaged at offset {offset}" in message, message
        assert "checksum matches" in message and "Restore" in message, message
    assert not segment.with_suffix(".idx").exists()


def test_a_sealed_index_pointing_at_a_checksummed_undecodable_record_is_refused(tmp_path):
    segment = _archive(tmp_path)
    idx = segment.with_suffix(".idx")
    index = orjson.loads(idx.read_bytes())
    offset = segment.stat().st_size
    forged = _forged({"s": "slots", "i": "1-0", "f": [[1, 5]]}, b"ab")
    with open(segment, "ab") as handle:
        handle.write(forged)
    index["length"] = offset + len(forged)
    index["records"]["slots"].append(["9999-0", offset, len(forged)])
    idx.write_bytes(orjson.dumps(index))
    with pytest.raises(ArchiveError, match=f"{segment} is damaged at offset {offset}"):
        list(ArchiveReader(tmp_path).scan("slots"))


def test_a_lock_probe_on_a_plain_archive_still_works(tmp_path):
    _archive(tmp_path)
    assert archive_in_use(tmp_path) is False
    writer = ArchiveWriter(tmp_path, run="r1")
    try:
        assert archive_in_use(tmp_path) is True
    finally:
        writer.close()
