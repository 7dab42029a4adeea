"""The archiver: copies every stream of a run to append-only segment files, and runs retention.

    streamgrp archiver [--archive-dir DIR] [--burst] [--retention]

Owns, for one run: reading each stream of `RunKeys.all_streams` after the last archived id,
appending the entries byte for byte to the archive (`streamgrp.store.archive_writer`), and recording progress
in the run's ``archive`` hash (stream -> last archived id) only after the segment file was fsynced.
An archiver killed at any moment therefore resumes without a gap; what it wrote after its last
recorded progress is written again, and readers keep one copy of each id (the bytes are the same).
When it has caught up it snapshots the hashes replay, verify and the summary read (``decided``,
``counts``, ``committed``, the batcher state, the trainer metrics, the policy version) and every
consumer group's position, so the archive alone serves `streamgrp.store.sources.ArchiveSource`. With
retention on, it calls `streamgrp.services.retention.trim` every ``retention_interval_s`` with its durable
progress, so nothing is trimmed before it is on disk.

One archive belongs to one run and one archiver at a time: the directory is locked while an
archiver writes to it, and the run's hash records the archive's id, so a second archive of the
same run (which would make the recorded progress a lie for one of them) is refused.

A run whose payloads live in keys (`streamgrp.store.payloads`) has them archived as the payloads stream's
entries at their slot entries' ids, read with each page of the slot log: the archive's format is one.

Deliberately ignores what the entries mean: it copies bytes and never decodes an event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from streamgrp.config import ArchiverConfig
from streamgrp.errors import ConfigError
from streamgrp.services.retention import TrimReport, trim
from streamgrp.store import payloads
from streamgrp.store.archive_layout import default_archive_dir
from streamgrp.store.archive_writer import ArchiveWriter
from streamgrp.store.keys import RunKeys, run_streams
from streamgrp.store.sources import RedisSource
from streamgrp.store.streams import entry_id_str, hash_reply

__all__ = ["ARCHIVE_ID_FIELD", "SNAPSHOT_HASHES", "Archiver", "default_archive_dir"]

log = logging.getLogger(__name__)

ARCHIVE_ID_FIELD = "archive_id"
#: Run hashes the snapshot holds, by `RunKeys` attribute: what replay, verify, inspect and the summary read.
SNAPSHOT_HASHES = ("decided", "counts", "deadletter_counts", "committed", "batcher_state", "trainer_metrics")
SNAPSHOT_FORMAT = "streamgrp.archive-snapshot/1"


class Archiver:
    """One archiver process's driver. `run` loops until ``stop`` is set (or, in burst mode, caught up)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        directory: str | Path,
        config: ArchiverConfig | None = None,
        *,
        dp_size: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.keys = keys
        self.config = config or ArchiverConfig()
        self.dp_size = dp_size
        self.clock = clock
        self._server = RedisSource(client, keys)
        #: The run's partitions (from its record): a partitioned run's streams are archived as ``slots@2``...
        self.partitions = self._server.partitions
        self.streams = run_streams(keys, self.partitions)
        self.writer = ArchiveWriter(directory, run=keys.run, segment_bytes=self.config.segment_bytes)
        try:
            self.progress = self._claim_progress()
        except BaseException:
            self.writer.close()
            raise
        self.archived = 0
        self.trimmed = 0
        self.last_trim: TrimReport | None = None
        self._caught_up = True
        self._last_snapshot = float("-inf")
        self._last_retention = float("-inf")
        if self.writer.sealed_on_start:
            log.info("archiver sealed %d segment(s) a previous archiver left open", self.writer.sealed_on_start)

    @property
    def directory(self) -> Path:
        return self.writer.directory

    def _claim_progress(self) -> dict[str, str]:
        """The run's recorded progress, after checking it belongs to this archive (claiming it if new)."""
        mine = self.writer.archive_id
        self.client.hsetnx(self.keys.archive, ARCHIVE_ID_FIELD, mine)
        recorded = {k.decode(): v.decode() for k, v in hash_reply(self.client.hgetall(self.keys.archive)).items()}
        owner = recorded.pop(ARCHIVE_ID_FIELD, mine)
        if owner != mine:
            raise ConfigError(
                f"run {self.keys.run!r} is archived by another archive (id {owner}), not the one in {self.directory} "
                f"(id {mine}); point --archive-dir at that archive, or, to start over, delete the hash "
                f"{self.keys.archive} (entries already trimmed from the server are then only in the old archive)"
            )
        return {name: value for name, value in recorded.items() if name in self.streams}

    # -- the loop ---------------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None, *, burst: bool = False) -> int:
        """Archive until stopped (burst: until caught up); returns the entries archived. Seals on the way out."""
        stop = stop or threading.Event()
        try:
            while not stop.is_set():
                self.archive_once()
                if not self._caught_up:
                    continue  # more is waiting: copy it before anything else
                if burst:
                    break
                now = self.clock()
                if now - self._last_snapshot >= self.config.snapshot_interval_s:
                    self.snapshot()
                if self.config.retention and now - self._last_retention >= self.config.retention_interval_s:
                    self.retain()
                stop.wait(self.config.poll_s)
            self.snapshot()  # drained or stopped: leave the newest state behind
            if burst and self.config.retention:
                self.retain()
        finally:
            self.close()
        return self.archived

    def close(self) -> None:
        self.writer.close()

    def archive_once(self) -> int:
        """Copy up to ``archive_read_count`` new entries of every stream, fsync, then record progress; returns
        how many."""
        pipe = self.client.pipeline(transaction=False)
        # A keys-layout run's payloads are archived with their slot log (`_append_payloads`), as stream entries.
        names = [name for name in self.streams if not self._keyed(name)]
        for name in names:
            after = self.progress.get(name)
            pipe.xrange(self.streams[name], f"({after}" if after else "-", "+", count=self.config.archive_read_count)
        pages = pipe.execute()
        advanced: dict[str, str] = {}
        self._caught_up = True
        for name, entries in zip(names, pages):
            # A sessions stream's turns carry their tensors in the archive, wherever the server keeps them.
            for entry_id, fields in self._server.with_turns(name, [(entry_id_str(i), f) for i, f in entries]):
                self.writer.append(name, entry_id, fields)
                advanced[name] = entry_id
            if entries and self._keyed(name.replace("slots", "payloads")):
                self._append_payloads(name.replace("slots", "payloads"), [entry_id_str(e[0]) for e in entries])
                advanced[name.replace("slots", "payloads")] = advanced[name]
            if len(entries) >= self.config.archive_read_count:
                self._caught_up = False
        if not advanced:
            return 0
        self.writer.sync()  # durable first...
        self._record(advanced)  # ...then recorded: a crash in between copies those entries again
        count = sum(len(entries) for entries in pages)
        self.archived += count
        return count

    def _keyed(self, name: str) -> bool:
        """Whether ``name`` is a payloads stream of a keys-layout run (its payloads in keys, the stream empty)."""
        return name.partition("@")[0] == "payloads" and name in self.streams and self._server.layout == payloads.KEYS

    def _append_payloads(self, name: str, slot_ids: list[str]) -> None:
        """Archive the payloads of these slot entries (those that have one) as entries of the payloads stream
        ``name`` at the same ids, as a stream-layout run's archive holds them. A slot entry and its payload
        key are written in one call, and retention deletes the key only behind this archive's progress, so
        every sample's payload is there to read."""
        for entry_id, fields in zip(slot_ids, payloads.read(self.client, self.streams[name], slot_ids)):
            if fields is not None:
                self.writer.append(name, entry_id, fields)

    def _record(self, advanced: dict[str, str]) -> None:
        # redis-py's hint is a Mapping keyed by every encodable type, and a Mapping's key type is invariant.
        self.client.hset(self.keys.archive, mapping=advanced)  # type: ignore[arg-type]
        self.progress.update(advanced)

    def catch_up(self) -> int:
        """Archive until a pass finds fewer than a page of new entries in every stream."""
        total = 0
        while True:
            total += self.archive_once()
            if self._caught_up:
                return total

    # -- snapshot and retention --------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Record the run's hashes and group positions in the archive, with the entries they point at.

        The hashes are read first and the streams archived after, so every entry id the snapshot
        names (a decision, a committed step) is already in the archive when the snapshot lands.
        """
        if len(self.partitions) == 1:
            pipe = self.client.pipeline(transaction=True)
            for name in SNAPSHOT_HASHES:
                pipe.hgetall(getattr(self.keys, name))
            pipe.get(self.keys.version)
            for key in self.streams.values():
                pipe.xinfo_groups(key)
            replies = pipe.execute(raise_on_error=False)
            hashes = {
                name: {k.decode(): v.decode() for k, v in reply.items()}
                for name, reply in zip(SNAPSHOT_HASHES, replies)
            }
            version = replies[len(SNAPSHOT_HASHES)]
            infos_by_stream = replies[len(SNAPSHOT_HASHES) + 1 :]
        else:  # over several slots: no one transaction; each hash as the server source reads it (joined)
            hashes = {name: self._server.hash(name) for name in SNAPSHOT_HASHES if name != "deadletter_counts"}
            hashes["deadletter_counts"] = {}  # the joined counts hold them already
            version = self.client.get(self.keys.version)
            infos_by_stream = [self._groups_or_error(key) for key in self.streams.values()]
        groups: dict[str, list[dict[str, Any]]] = {}
        for name, infos in zip(self.streams, infos_by_stream):
            if isinstance(infos, Exception):
                continue  # the stream does not exist yet
            groups[name] = [
                {
                    "name": _text(i["name"]),
                    "last_delivered": _text(i["last-delivered-id"]),
                    "pending": int(i.get("pending") or 0),
                }
                for i in infos
            ]
        self.catch_up()
        snapshot = {
            "format": SNAPSHOT_FORMAT,
            "run": self.keys.run,
            "taken_at": time.time(),
            "hashes": hashes,
            "version": int(version) if version and not isinstance(version, Exception) else 0,
            "groups": groups,
            "progress": dict(self.progress),
        }
        self.writer.sync()
        self.writer.write_snapshot(snapshot)
        self._last_snapshot = self.clock()
        return snapshot

    def _groups_or_error(self, key: str) -> Any:
        try:
            return self.client.xinfo_groups(key)
        except redis.ResponseError as exc:  # the stream does not exist yet
            return exc

    def retain(self) -> TrimReport:
        """Trim the run's streams behind this archive's durable progress and every reader
        (`streamgrp.services.retention`)."""
        report = trim(
            self.client,
            self.keys,
            dict(self.progress),
            dp_size=self.dp_size,
            partitions=self.partitions,
            max_follow_lag_s=self.config.max_follow_lag_s,
        )
        self.trimmed += report.removed
        self.last_trim = report
        self._last_retention = self.clock()
        return report


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
