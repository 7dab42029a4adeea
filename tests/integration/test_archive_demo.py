"""The archiver beside a real run (`streamgrp demo`, every role its own process): SIGKILLed and
restarted mid-run it still archives every entry exactly once; with retention on it keeps the
server's streams bounded while every rank commits every step, and trimmed steps still replay."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import orjson
import pytest
import redis
from processes import RoleProcess, wait_until

from streamgrp.core import codec
from streamgrp.replay import replay_step, verify
from streamgrp.store.archive_reader import ArchiveReader
from streamgrp.store.keys import RunKeys, step_entry_id
from streamgrp.store.sources import ArchiveSource, FallbackSource, RedisSource

pytestmark = pytest.mark.slow


def demo(redis_url: str, run: str, data_dir, steps: int, log) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamgrp",
            "demo",
            "--redis-url",
            redis_url,
            "--data-dir",
            str(data_dir),
            "--run",
            run,
            "--steps",
            str(steps),
            "--ranks",
            "2",
            "--workers",
            "2",
            "--json",
            "--timeout-s",
            "150",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def summary(log_path) -> dict:
    return orjson.loads(log_path.read_text().strip().splitlines()[-1])


@pytest.mark.one_server_kind
def test_a_sigkilled_archiver_resumes_and_archives_every_entry_exactly_once(client, redis_url, run_name, tmp_path):
    keys = RunKeys(run_name)
    archive = tmp_path / "archive"
    archiver = RoleProcess(
        "archiver",
        [
            "--redis-url",
            redis_url,
            "--run",
            run_name,
            "--archive-dir",
            str(archive),
            "--archive-read-count",
            "7",
            "--segment-bytes",
            "65536",
            "--poll-s",
            "0.02",
            "--snapshot-interval-s",
            "0.3",
        ],
        tmp_path,
    ).start()  # before the run exists
    with open(tmp_path / "demo.log", "wb") as log:
        run = demo(redis_url, run_name, tmp_path / "data", 8, log)
        rng = random.Random(0)
        kills = 0
        progress = client.hgetall(keys.archive)
        while run.poll() is None:
            time.sleep(rng.uniform(0.05, 0.6))
            if client.hgetall(keys.archive) != progress and run.poll() is None:  # this life archived something
                archiver.kill()
                kills += 1
                archiver.start()
                progress = client.hgetall(keys.archive)
        assert run.wait(timeout=150) == 0, (tmp_path / "demo.log").read_text()[-3000:]
    assert kills >= 3
    # Stopped once it is up: a SIGTERM while a loaded machine still imports it would kill it before its handler
    wait_until(
        lambda: archiver.output().count("writing to") == archiver.starts,
        timeout=60,
        message="the last archiver to start",
    )
    assert archiver.stop() == 0, archiver.output()[-3000:]
    assert "sealed 1 segment(s) a previous archiver left open" in archiver.output()

    reader = ArchiveReader(archive)
    assert len(reader.segments()) >= kills  # every life that archived something wrote its own segment
    duplicated = 0
    for name, key in keys.all_streams().items():
        expected = (
            [(raw_id.decode(), fields) for raw_id, fields in client.xrange(key)]
            if name != "payloads"
            else list(RedisSource(client, keys).scan(name))
        )  # a keys run's payloads, at their slot entries' ids
        archived = list(reader.scan(name))
        assert archived == expected, name  # every entry, in order, once, byte for byte
        copies: dict[str, set] = {}
        for entry_id, _, fields in reader.copies(name):
            copies.setdefault(entry_id, set()).add(tuple(fields.items()))
        assert all(len(versions) == 1 for versions in copies.values()), name  # duplicates carry the same bytes
        duplicated += sum(1 for entry_id, _, _ in reader.copies(name)) - len(archived)
    print(
        f"\n{kills} SIGKILLs, {len(reader.segments())} segments, {duplicated} entries copied twice, "
        f"{sum(1 for _ in reader.copies('slots'))} slot-log copies"
    )


class Sampler:
    """Every 0.2 s: the run's slot stream length and the memory of its streams, while the run goes."""

    def __init__(self, url: str, keys: RunKeys) -> None:
        self.client = redis.Redis.from_url(url)
        self.keys = keys
        self.slots: list[int] = []
        self.stream_bytes: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            self.slots.append(self.client.xlen(self.keys.slots))
            self.stream_bytes.append(stream_bytes(self.client, self.keys))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.client.close()


def stream_bytes(client, keys: RunKeys) -> int:
    return sum(client.memory_usage(key, samples=0) or 0 for key in keys.all_streams().values())


@pytest.mark.one_server_kind
def test_retention_bounds_the_server_while_every_rank_commits_every_step(client, redis_url, run_name, tmp_path):
    steps = 30
    data_dir = tmp_path / "data"
    figures = {}
    for variant in ("retained", "kept"):
        keys = RunKeys(f"{run_name}-{variant}")
        archiver = None
        if variant == "retained":
            archiver = RoleProcess(
                "archiver",
                [
                    "--redis-url",
                    redis_url,
                    "--run",
                    keys.run,
                    "--data-dir",
                    str(data_dir),
                    "--retention",
                    "--retention-interval-s",
                    "0.5",
                    "--poll-s",
                    "0.1",
                ],
                tmp_path,
            ).start()
        sampler = Sampler(redis_url, keys)
        log_path = tmp_path / f"demo-{variant}.log"
        with open(log_path, "wb") as log:
            code = demo(redis_url, keys.run, data_dir, steps, log).wait(timeout=200)
        sampler.close()
        assert code == 0, log_path.read_text()[-3000:]
        if archiver is not None:
            assert archiver.stop() == 0, archiver.output()[-3000:]
        result = summary(log_path)
        assert result["committed_steps"] == {"0": steps, "1": steps}  # no rank lost anything it needed
        assert result["steps"] == steps  # the summary reads what was trimmed from the archive
        figures[variant] = {
            "max_slots": max(sampler.slots),
            "end_slots": client.xlen(keys.slots),
            "max_stream_bytes": max(sampler.stream_bytes),
            "end_stream_bytes": stream_bytes(client, keys),
            "published": result["slots_published"] + result["tasks"],
            "keys": keys,
        }
    retained, kept = figures["retained"], figures["kept"]
    print(
        f"\nslot stream length, max during the run / at the end: retained {retained['max_slots']} / "
        f"{retained['end_slots']}, kept {kept['max_slots']} / {kept['end_slots']} (entries written "
        f"{kept['published']}); stream bytes max / end: retained {retained['max_stream_bytes']:,} / "
        f"{retained['end_stream_bytes']:,}, kept {kept['max_stream_bytes']:,} / {kept['end_stream_bytes']:,}"
    )
    # Without retention the slot log holds everything the run wrote; with it, a window of in-flight work.
    assert kept["end_slots"] >= kept["published"] > 1200
    assert retained["max_slots"] < 700 < kept["end_slots"] / 2
    assert retained["max_stream_bytes"] < kept["end_stream_bytes"] / 2

    # A step the server no longer holds replays from the archive with the digest its trainers checked.
    keys = retained["keys"]
    assert not client.xrange(keys.steps, step_entry_id(0), step_entry_id(0))
    source = FallbackSource(RedisSource(client, keys), ArchiveSource(data_dir / "archive" / keys.run))
    for step in (0, steps // 2, steps - 1):
        manifest = codec.decode(source("steps", [step_entry_id(step)])[0])
        for rank in (0, 1):
            assert replay_step(client, keys, step, rank, source=source).digest == manifest.shards[rank].digest
    report = verify(client, keys, source=source)
    assert report.ok, report.differences[:5]
    assert report.steps_checked == steps
