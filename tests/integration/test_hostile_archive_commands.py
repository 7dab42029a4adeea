"""The commands that read a run from its archive (replay, verify, steps) on a hostile archive: a link to
/dev/zero for an index, a FIFO for a segment, a record that passes its checksum but does not decode.
Each command exits 2 with one line naming the file, never a traceback, a hang or MemoryError.

The commands run as child processes limited in address space and time, so a regression fails the
test instead of exhausting the machine. The file-level cases are in tests/unit/test_archive_hostile.py.
"""

from __future__ import annotations

import os
import resource
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import orjson
import pytest

from streamgrp.cli.main import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
from runlog import load_run  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "run_v2.jsonl"
ROOT = Path(__file__).resolve().parents[2]
MEMORY_LIMIT = 3 * 1024**3

pytestmark = pytest.mark.one_server_kind  # about files on disk, not about what the server does


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _command(*argv: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-m", "streamgrp", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            preexec_fn=_limited,
            env={**os.environ, "STREAMGRP_LOG_LEVEL": "ERROR"},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"streamgrp {' '.join(argv)} hung for 60 s")


def _forged_record() -> bytes:
    """A record whose checksum matches but whose entry id is no stream id."""
    header = orjson.dumps({"s": "steps", "i": "not-an-id", "f": []})
    return struct.pack("<4sIII", b"SGR1", len(header), 0, zlib.crc32(b"", zlib.crc32(header))) + header


def _link_index_to_dev_zero(segment: Path) -> Path:
    index = segment.with_suffix(".idx")
    index.unlink()
    index.symlink_to("/dev/zero")
    return index


def _fifo_for_segment(segment: Path) -> Path:
    segment.with_suffix(".idx").unlink()
    segment.unlink()
    os.mkfifo(segment)
    return segment


def _forged_tail(segment: Path) -> Path:
    segment.with_suffix(".idx").unlink()  # unsealed: read by scanning it, where a torn tail is allowed
    with open(segment, "ab") as handle:
        handle.write(_forged_record())
    return segment


@pytest.mark.parametrize(
    "tamper, expect",
    [
        (_link_index_to_dev_zero, "is a symbolic link, not a regular file"),
        (_fifo_for_segment, "is a FIFO, not a regular file"),
        (_forged_tail, "checksum matches but its entry id is 'not-an-id'"),
    ],
    ids=["index-links-to-dev-zero", "segment-is-a-fifo", "checksummed-undecodable-record"],
)
def test_commands_reading_a_hostile_archive_print_one_line_and_exit_2(
    client, redis_url, run_name, tmp_path, capsys, tamper, expect
):
    keys = load_run(client, GOLDEN, run_name)
    archive = tmp_path / "archive"
    assert (
        main(["archiver", "--burst", "--redis-url", redis_url, "--run", run_name, "--archive-dir", str(archive)]) == 0
    )
    capsys.readouterr()
    client.delete(*keys.all_streams().values(), keys.committed, keys.decided, keys.counts)  # the archive alone answers
    segments = sorted((archive / "segments").glob("*.seg"))
    assert segments
    victim = tamper(segments[-1])
    for argv in (("replay", "2"), ("verify",), ("steps",)):
        done = _command(*argv, "--redis-url", redis_url, "--archive", str(archive))
        assert done.returncode == 2, (argv, done.stdout, done.stderr[-3000:])
        assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr, done.stderr[-3000:]
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(f"streamgrp {argv[0]}: ") and str(victim) in line and expect in line, line
