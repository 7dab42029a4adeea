"""Where replay reads a run's record: entry sources over the server's streams (an archive can add its own).

An *entry source* is a callable ``source(stream, ids) -> [fields or None]``: the fields of each entry
id of one of the run's streams, named as in `RunKeys.all_streams` (``"steps"``, ``"slots"``...), in
order, None where the entry is not retained. That is all `streamgrp.replay.replay_step` needs.
Listing steps, verifying and inspecting also scan whole streams and read the run's hashes, which
`RedisSource` offers as ``scan(stream)``, ``hash(name)`` and ``folded_through()``; another source
(an archive on disk) serves them by offering the same methods. Reads only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import redis

from streamgrp import codec
from streamgrp.config import RunConfig
from streamgrp.errors import ConfigError, DecodeError
from streamgrp.events import RunStarted
from streamgrp.keys import ASSEMBLER_GROUP, RunKeys
from streamgrp.streams import entry_id_str, read_entries

__all__ = ["EntrySource", "RedisSource", "decode_all", "id_key", "recorded_config"]

#: ``source(stream, ids)``: the fields of each entry id of a run's stream (a `RunKeys.all_streams`
#: name), in order, None where the entry is not retained.
EntrySource = Callable[[str, Sequence[str]], Sequence[Mapping[bytes, bytes] | None]]


def id_key(entry_id: str) -> tuple[int, int]:
    """Stream order of an entry id (``ms-seq``), for sorting ids taken from different places."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class RedisSource:
    """The default entry source: the run's streams on the server. Also scans streams and reads hashes,
    which `list_steps`, `verify` and `inspect_task` need (an archive source would offer the same)."""

    def __init__(self, client: redis.Redis, keys: RunKeys) -> None:
        self.client = client
        self.keys = keys
        self._streams = keys.all_streams()

    def _key(self, stream: str) -> str:
        try:
            return self._streams[stream]
        except KeyError:
            raise ValueError(f"unknown stream {stream!r}; expected one of {sorted(self._streams)}") from None

    def __call__(self, stream: str, ids: Sequence[str]) -> list[dict[bytes, bytes] | None]:
        return read_entries(self.client, self._key(stream), list(ids))

    def scan(self, stream: str, page: int = 2000) -> Iterator[tuple[str, dict[bytes, bytes]]]:
        """Every entry of ``stream`` in order, read in pages."""
        key, start = self._key(stream), "-"
        while True:
            entries = self.client.xrange(key, start, "+", count=page)
            if not entries:
                return
            for raw_id, fields in entries:
                yield entry_id_str(raw_id), fields
            start = "(" + entry_id_str(entries[-1][0])

    def hash(self, name: str) -> dict[str, str]:
        """A run hash (``committed``, ``decided``) as text."""
        return {k.decode(): v.decode() for k, v in self.client.hgetall(getattr(self.keys, name)).items()}

    def folded_through(self) -> str | None:
        """The last slot-log entry the assembler read (its consumer group position), None without one."""
        try:
            groups = self.client.xinfo_groups(self.keys.slots)
        except redis.ResponseError:
            return None
        for group in groups:
            if group["name"] in (ASSEMBLER_GROUP, ASSEMBLER_GROUP.encode()):
                return entry_id_str(group["last-delivered-id"])
        return None


def decode_all(source: RedisSource, stream: str) -> Iterator[tuple[str, Any]]:
    """Decoded events of a stream; entries that do not decode are skipped (the services dead-letter them)."""
    for entry_id, fields in source.scan(stream):
        try:
            yield entry_id, codec.decode(fields)
        except DecodeError:
            continue


def recorded_config(source: RedisSource) -> RunConfig:
    for _, event in decode_all(source, "control"):
        if isinstance(event, RunStarted):
            return RunConfig(**event.settings)
        break
    raise ConfigError(f"run {source.keys.run!r} has no run_started record; list runs with `streamgrp runs`")
