"""Where replay reads a run's record: entry sources over the server's streams (an archive can add its own).

An *entry source* is a callable ``source(stream, ids) -> [fields or None]``: the fields of each entry
id of one of the run's streams, named as in `RunKeys.all_streams` (``"steps"``, ``"slots"``...), in
order, None where the entry is not retained. That is all `streamgrp.replay.steps.replay_step` needs.
Listing steps, verifying and inspecting also scan whole streams and read the run's hashes, which
`RedisSource` offers as ``scan(stream)``, ``hash(name)`` and ``folded_through()``. Reads only.

Three sources offer all of it:

- `RedisSource`: the run's streams and hashes on the server;
- `ArchiveSource`: an archive directory the archiver wrote (`streamgrp.services.archiver`), alone: the
  streams from its segments, the hashes and the assembler's position from its last snapshot;
- `FallbackSource`: the server first, the archive for what retention trimmed (or for a run whose
  keys are gone); a scan merges both in id order, each id once.

`open_run_source` picks one for the inspection commands: ``--archive DIR``, else the archive at the
default place (``<data_dir>/archive/<run>``) when there is one, else the server alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any

import redis

from streamgrp.config import RunConfig
from streamgrp.core import codec
from streamgrp.errors import ConfigError, DecodeError
from streamgrp.store import payloads
from streamgrp.store.archive_layout import default_archive_dir
from streamgrp.store.archive_reader import ArchiveReader
from streamgrp.store.keys import (
    ASSEMBLER_GROUP,
    PartitionKeys,
    RunKeys,
    canonical_stream,
    run_streams,
    stream_key,
)
from streamgrp.store.runs import (
    Run,
    open_run,
    read_record,
    recorded_layout,
    recorded_partitions,
    resolve_run_name,
)
from streamgrp.store.streams import entry_id_str, hash_reply, range_reply, read_entries

__all__ = [
    "ArchiveSource",
    "EntrySource",
    "FallbackSource",
    "RedisSource",
    "decode_all",
    "default_source",
    "folded_through",
    "open_run_source",
    "partition_streams",
    "recorded_config",
    "server_source",
]

#: ``source(stream, ids)``: the fields of each entry id of a run's stream (a `RunKeys.all_streams`
#: name), in order, None where the entry is not retained.
EntrySource = Callable[[str, Sequence[str]], Sequence[Mapping[bytes, bytes] | None]]


def added_counts(hashes: Iterable[Mapping[str, str]]) -> dict[str, str]:
    """Counter hashes added field by field (values as the server keeps them: integers, or floats)."""
    total: dict[str, float] = {}
    for counts in hashes:
        for counter, value in counts.items():
            total[counter] = total.get(counter, 0) + float(value)
    return {counter: str(int(value) if value == int(value) else value) for counter, value in total.items()}


class RedisSource:
    """The default entry source: the run's streams on the server. Also scans streams and reads hashes,
    which `list_steps`, `verify` and `inspect_task` need (an archive source would offer the same)."""

    def __init__(self, client: redis.Redis, keys: RunKeys) -> None:
        self.client = client
        self.keys = keys

    @cached_property
    def partitions(self) -> tuple[PartitionKeys, ...]:
        """The run's partitions, from its record (one when it has none, or no record)."""
        return recorded_partitions(self.client, self.keys)

    @cached_property
    def layout(self) -> str:
        """Where the run keeps payloads (`streamgrp.store.payloads`), from its record."""
        return recorded_layout(self.client, self.keys)

    def _keyed(self, stream: str) -> bool:
        """Whether ``stream`` is a payloads stream whose entries live in payload keys."""
        return stream.partition("@")[0] == "payloads" and self.layout == payloads.KEYS

    def _key(self, stream: str) -> str:
        if stream == "control":  # read before the partitions are known
            return self.keys.control
        return stream_key(self.keys, self.partitions, stream)

    def with_turns(
        self, stream: str, entries: list[tuple[str, dict[bytes, bytes]]]
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        """A sessions stream's entries with their turns' tensors wherever they live (`payloads.with_turns`);
        any other stream's as they are."""
        if stream.partition("@")[0] != "sessions":
            return entries
        return payloads.with_turns(self.client, self._key(stream), entries)

    def __call__(self, stream: str, ids: Sequence[str]) -> list[dict[bytes, bytes] | None]:
        if self._keyed(stream):
            return payloads.read(self.client, self._key(stream), list(ids))
        found = read_entries(self.client, self._key(stream), list(ids))
        if stream.partition("@")[0] == "sessions":
            filled = iter(self.with_turns(stream, [(i, f) for i, f in zip(ids, found) if f is not None]))
            found = [None if fields is None else next(filled)[1] for fields in found]
        return found

    def scan(self, stream: str, page: int = 2000) -> Iterator[tuple[str, dict[bytes, bytes]]]:
        """Every entry of ``stream`` in order, read in pages (a keys-layout run's payloads: those of its
        slot log's entries, in the slot log's order)."""
        keyed = self._keyed(stream)
        key, start = self._key(stream.replace("payloads", "slots") if keyed else stream), "-"
        while True:
            entries = range_reply(self.client.xrange(key, start, "+", count=page))
            if not entries:
                return
            ids = [entry_id_str(raw_id) for raw_id, _ in entries]
            if keyed:
                found = payloads.read(self.client, self._key(stream), ids)
            else:
                found = [f for _, f in self.with_turns(stream, [(i, f) for i, (_, f) in zip(ids, entries)])]
            for entry_id, fields in zip(ids, found):
                if fields is not None:
                    yield entry_id, fields
            start = "(" + ids[-1]

    def hash(self, name: str) -> dict[str, str]:
        """A run hash (``committed``, ``decided``) as text; in a partitioned run ``decided`` joins the
        partitions' and ``counts`` adds theirs to the run's own."""

        def read(key: str) -> dict[str, str]:
            return {k.decode(): v.decode() for k, v in hash_reply(self.client.hgetall(key)).items()}

        if name == "counts":  # with the dead letters' counters, kept apart for least privilege
            layouts = (self.keys, *self.partitions) if len(self.partitions) > 1 else (self.keys,)
            return added_counts(read(key) for layout in layouts for key in (layout.counts, layout.deadletter_counts))
        if len(self.partitions) == 1 or name != "decided":
            return read(getattr(self.keys, name))
        return {task: entry for part in self.partitions for task, entry in read(part.decided).items()}

    def folded_through(self, stream: str = "slots") -> str | None:
        """The last slot-log entry the assembler read (its consumer group position), None without one;
        a partitioned run's ``slots@P`` for partition P's."""
        try:
            groups = self.client.xinfo_groups(self._key(stream))
        except redis.ResponseError:
            return None
        for group in groups:
            if group["name"] in (ASSEMBLER_GROUP, ASSEMBLER_GROUP.encode()):
                return entry_id_str(group["last-delivered-id"])
        return None


class ArchiveSource:
    """An archive directory as an entry source, with no server: `RedisSource`'s calls, served from disk.

    Streams come from the segments (each id once, the last copy wins); ``hash`` and
    ``folded_through`` from the snapshot the archiver took when it last caught up (empty and None
    before its first one). Safe to use while an archiver is writing.
    """

    def __init__(self, directory: str | os.PathLike[str], *, keys: RunKeys | None = None) -> None:
        self.reader = ArchiveReader(directory)
        self.directory = self.reader.directory
        if keys is not None and keys.run != self.reader.run:
            raise ConfigError(
                f"{self.directory} is the archive of run {self.reader.run!r}, not {keys.run!r}; pass "
                "that run's archive (default <data_dir>/archive/<run>)"
            )
        self.keys = keys or RunKeys(self.reader.run)

    @cached_property
    def partitions(self) -> tuple[PartitionKeys, ...]:
        """The run's partitions, from the record in the archived control stream (one without it)."""
        try:
            count = recorded_config(self).partitions
        except (ConfigError, DecodeError):
            count = 1
        return self.keys.partitions(count)

    def _check(self, stream: str) -> str:
        """The archive's name of ``stream`` (`canonical_stream`); ValueError for one the run does not have."""
        if stream == "control":  # read before the partitions are known
            return stream
        name = canonical_stream(stream, len(self.partitions))
        streams = run_streams(self.keys, self.partitions)
        if name not in streams:
            raise ValueError(f"unknown stream {stream!r}; expected one of {sorted(streams)}")
        return name

    def __call__(self, stream: str, ids: Sequence[str]) -> list[dict[bytes, bytes] | None]:
        return self.reader.get(self._check(stream), list(ids))

    def scan(
        self, stream: str, page: int = 2000, *, after: str | None = None, before: str | None = None
    ) -> Iterator[tuple[str, dict[bytes, bytes]]]:
        """Every archived entry of ``stream`` (strictly between ``after`` and ``before`` when given), in order."""
        return self.reader.scan(self._check(stream), after=after, before=before)

    def hash(self, name: str) -> dict[str, str]:
        hashes = (self.reader.snapshot() or {}).get("hashes", {})
        if name == "counts":
            return added_counts([hashes.get("counts", {}), hashes.get("deadletter_counts", {})])
        return dict(hashes.get(name, {}))

    def folded_through(self, stream: str = "slots") -> str | None:
        snapshot = self.reader.snapshot() or {}
        for group in snapshot.get("groups", {}).get(canonical_stream(stream, len(self.partitions)), []):
            if group.get("name") == ASSEMBLER_GROUP:
                return group.get("last_delivered")
        return None

    def close(self) -> None:
        self.reader.close()


class FallbackSource:
    """The server first, the archive for entries the server no longer holds (trimmed, or the run's keys gone).

    A scan reads the server in pages and fills every gap before a page, and after the last one,
    from the archive, so it yields each id once, in order, even while retention trims behind it.
    A hash is the server's while it has one, else the archive snapshot's.
    """

    def __init__(self, server: RedisSource, archive: ArchiveSource) -> None:
        if server.keys.run != archive.keys.run:
            raise ConfigError(
                f"{archive.directory} is the archive of run {archive.keys.run!r}, not "
                f"{server.keys.run!r}; pass that run's archive"
            )
        self.server = server
        self.archive = archive
        self.keys = server.keys

    @property
    def partitions(self) -> tuple[PartitionKeys, ...]:
        """The record's partitions: the server's, or the archive's once the run's keys are gone."""
        return max(self.server.partitions, self.archive.partitions, key=len)

    def __call__(self, stream: str, ids: Sequence[str]) -> list[dict[bytes, bytes] | None]:
        found = self.server(stream, ids)
        missing = [i for i, fields in enumerate(found) if fields is None]
        if missing:
            for i, fields in zip(missing, self.archive(stream, [ids[i] for i in missing])):
                found[i] = fields
        return found

    def scan(self, stream: str, page: int = 2000) -> Iterator[tuple[str, dict[bytes, bytes]]]:
        if self.server._keyed(stream):  # a keys run's payloads: the server's follow the archive's trimmed prefix
            last = None
            for entry_id, fields in self.server.scan(stream, page):
                if last is None:
                    yield from self.archive.scan(stream, before=entry_id)
                last = entry_id
                yield entry_id, fields
            yield from self.archive.scan(stream, after=last)
            return
        key, start, last = self.server._key(stream), "-", None
        while True:
            entries = range_reply(self.server.client.xrange(key, start, "+", count=page))
            if not entries:
                break
            # Whatever the server no longer holds before this page (trimmed) comes from the archive.
            yield from self.archive.scan(stream, after=last, before=entry_id_str(entries[0][0]))
            yield from self.server.with_turns(stream, [(entry_id_str(raw_id), fields) for raw_id, fields in entries])
            last = entry_id_str(entries[-1][0])
            start = "(" + last
        yield from self.archive.scan(stream, after=last)

    def hash(self, name: str) -> dict[str, str]:
        return self.server.hash(name) or self.archive.hash(name)

    def folded_through(self, stream: str = "slots") -> str | None:
        through = self.server.folded_through(stream)
        return through if through is not None else self.archive.folded_through(stream)


def default_source(client: redis.Redis, keys: RunKeys, data_dir: str | os.PathLike[str] | None = None):
    """The server, with the run's archive at the default place behind it when there is one."""
    server = RedisSource(client, keys)
    if data_dir is not None and (default_archive_dir(data_dir, keys.run) / "meta.json").exists():
        return FallbackSource(server, ArchiveSource(default_archive_dir(data_dir, keys.run), keys=keys))
    return server


def open_run_source(
    client: redis.Redis,
    run: str | None,
    *,
    archive: str | os.PathLike[str] | None = None,
    data_dir: str | os.PathLike[str] | None = None,
):
    """The run to inspect and the source to read it through: ``(Run, source)``.

    ``archive`` given: the server backed by it, or the archive alone when the run is not on the server
    (its keys deleted, or another server); its run is the default. Otherwise the server, backed by
    the archive at ``<data_dir>/archive/<run>`` when that exists.
    """
    archived = ArchiveSource(archive) if archive is not None else None
    if run is None and archived is not None:
        run = archived.keys.run
    try:
        opened = open_run(client, resolve_run_name(client, run, create=False))
    except ConfigError:
        if (
            archived is None
            and run is not None
            and data_dir is not None
            and (default_archive_dir(data_dir, run) / "meta.json").exists()
        ):
            archived = ArchiveSource(default_archive_dir(data_dir, run))
        if archived is None:
            raise
        if archived.keys.run != run:
            raise ConfigError(
                f"{archived.directory} is the archive of run {archived.keys.run!r}, not {run!r}; pass "
                f"--run {archived.keys.run} or that run's archive"
            ) from None
        first = next(iter(archived.scan("control")), (None, None))[1]
        record, recorded = read_record(
            archived.keys.run,
            first,
            f"the first control entry of the archive {archived.directory} (was the control stream archived?)",
        )
        return Run(archived.keys, recorded, record), archived
    if archived is not None:
        if archived.keys.run != opened.name:
            raise ConfigError(
                f"{archived.directory} is the archive of run {archived.keys.run!r}, not "
                f"{opened.name!r}; pass --run {archived.keys.run} or that run's archive"
            )
        return opened, FallbackSource(RedisSource(client, opened.keys), archived)
    return opened, default_source(client, opened.keys, data_dir)


def folded_through(source: Any, stream: str = "slots") -> str | None:
    """How far the assembler of ``stream`` (a partitioned run's ``slots@P``) read, from ``source``. An
    unpartitioned run's through the argument-less ``folded_through()`` that entry sources written
    before partitions (a user's own, the golden tests') offer."""
    return source.folded_through() if stream == "slots" else source.folded_through(stream)


def partition_streams(source: Any, stream: str) -> list[tuple[int, str]]:
    """(partition, name) of each partition's ``stream`` (``slots``, ``decisions``...) of the run
    ``source`` reads: ``[(0, "slots")]`` unpartitioned, ``[(0, "slots@0"), (1, "slots@1"), ...]``."""
    count = len(getattr(source, "partitions", ())) or 1
    return [(index, f"{stream}@{index}" if count > 1 else stream) for index in range(count)]


def decode_all(source: RedisSource, stream: str) -> Iterator[tuple[str, Any]]:
    """Decoded events of a stream; entries that do not decode are skipped (the services dead-letter them)."""
    for entry_id, fields in source.scan(stream):
        try:
            yield entry_id, codec.decode(fields)
        except DecodeError:
            continue


def server_source(client: redis.Redis | None, keys: RunKeys) -> RedisSource:
    """The server's entries, for a caller given no other source (it must then give a client)."""
    if client is None:
        raise TypeError("give a client (the server's entries) or a source")
    return RedisSource(client, keys)


def recorded_config(source: RedisSource | ArchiveSource) -> RunConfig:
    first = next(iter(source.scan("control")), (None, None))[1]
    return read_record(source.keys.run, first, "the control stream's first entry")[1]
