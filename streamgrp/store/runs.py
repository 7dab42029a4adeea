"""Connecting to the server and joining a run: the registry of runs and each run's recorded config.

A run's first event (`RunStarted` on its control stream) records its `RunConfig`. Only the
batcher (or a program acting as the run's owner) creates a run, with `join_run`; every other role
opens it read-only (`open_run`, `await_run`), so its credentials need no write access to the
control stream. Either way a process adopts the recorded values for settings it did not set and
refuses to start, naming the fields, when a setting it did set disagrees.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import cast

import redis

from streamgrp.config import RunConfig, env_name, flag_name
from streamgrp.core import codec
from streamgrp.core.events import RunStarted
from streamgrp.errors import ConfigError, DecodeError, StopRequested
from streamgrp.store import scripts
from streamgrp.store.connection import connect, safe_url  # noqa: F401 - connect is documented here
from streamgrp.store.keys import (
    RUNS,
    PartitionKeys,
    RunKeys,
    check_run_name,
    run_streams,
    stream_key,
)
from streamgrp.store.streams import entry_id_str

log = logging.getLogger(__name__)

#: How often a process waiting for its run to be created says so (and lists the runs there are).
WAIT_LOG_EVERY_S = 30.0


def server_time(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


@dataclass(frozen=True)
class Run:
    """A joined run: its keys and the configuration every process of it uses."""

    keys: RunKeys
    config: RunConfig
    record: RunStarted

    @property
    def name(self) -> str:
        return self.keys.run

    @cached_property
    def partitions(self) -> tuple[PartitionKeys, ...]:
        """The key set of each of the run's partitions, in order (one for an unpartitioned run)."""
        return self.keys.partitions(self.config.partitions)

    def streams(self, partitions: Sequence[int] | None = None) -> dict[str, str]:
        """Stream name -> key: the run-wide streams and those of ``partitions`` (default all), named as
        `stream_key` reads them (``slots``, or ``slots@2`` in a partitioned run)."""
        return run_streams(self.keys, self.partitions, partitions)

    def stream_key(self, name: str) -> str:
        """The key of the run's stream ``name`` (`streamgrp.store.keys.stream_key`)."""
        return stream_key(self.keys, self.partitions, name)


def recorded_partitions(client: redis.Redis, keys: RunKeys) -> tuple[PartitionKeys, ...]:
    """The key sets of the partitions the run's record names: one (the run's own layout) when it is not
    partitioned, has no record yet, or its record does not read."""
    first = client.xrange(keys.control, "-", "+", count=1)
    count = 1
    if first:
        try:
            count = read_record(keys.run, first[0][1], "the control stream's first entry")[1].partitions
        except (ConfigError, DecodeError):
            count = 1
    return keys.partitions(count)


def recorded_layout(client: redis.Redis, keys: RunKeys) -> str:
    """The run's payload layout (`streamgrp.store.payloads`): ``keys`` as this version records it, ``stream``
    for a run recorded before the layout existed; a run without a readable record yet is a ``keys`` run
    (the one this version would create)."""
    first = client.xrange(keys.control, "-", "+", count=1)
    if first:
        try:
            return read_record(keys.run, first[0][1], "the control stream's first entry")[1].payload_layout
        except (ConfigError, DecodeError):
            pass
    return "keys"


def latest_run(client: redis.Redis) -> str | None:
    newest = cast("list[bytes]", client.zrevrange(RUNS, 0, 0))  # streamgrp's clients read bytes
    return newest[0].decode() if newest else None


def list_runs(client: redis.Redis) -> list[tuple[str, float]]:
    scored = cast("list[tuple[bytes, float]]", client.zrange(RUNS, 0, -1, withscores=True))  # bytes, as above
    return [(name.decode(), score) for name, score in scored]


def resolve_run_name(client: redis.Redis, run: str | None, *, create: bool) -> str:
    """The run to use: the given name, else (for inspection) the latest, else (to create) a new name."""
    if run:
        return check_run_name(run)
    existing = latest_run(client)
    if existing and not create:
        return existing
    if not create:
        raise ConfigError(
            "no run exists yet on this server; start the run's batcher (it creates the run), or pass --run NAME"
        )
    return time.strftime("run-%Y%m%d-%H%M%S")


def join_run(client: redis.Redis, run: str, config: RunConfig, *, producer: str = "") -> Run:
    """Create the run with ``config`` or join it; refuse when an explicitly set field disagrees."""
    keys = RunKeys(run)
    now = server_time(client)
    settings = config.model_dump(mode="json")
    if settings.get("partitions") == 1:
        del settings["partitions"]  # an unpartitioned run's record stays what it was (older readers open it)
    record_event = RunStarted(run=run, policy=config.policy(), settings=settings, started_at=now, producer=producer)
    entry_id, fields, vouched = scripts.register(client, "create_run.lua")(
        keys=[keys.control, keys.batcher_state], args=[codec.encode(record_event)[codec.HEADER]]
    )
    if not int(vouched):
        raise ConfigError(
            f"run {run!r}: the first entry of its control stream ({entry_id_str(entry_id)}) was not "
            "written by a batcher (another role's credential wrote it before the run was created); "
            "nothing it says is adopted. Delete the run (`streamgrp delete`, as an administrator) and "
            "start its batcher again"
        )
    client.zadd(RUNS, {run: now}, nx=True)
    record, recorded = read_record(run, _pairs(fields), f"the control stream's first entry {entry_id!r}")
    return Run(keys, _reconcile(run, recorded, config), record)


def open_run(client: redis.Redis, run: str, config: RunConfig | None = None) -> Run:
    """Read an existing run's record, writing nothing. With ``config``, refuse (naming the fields) when a
    setting it set explicitly disagrees with the record, as `join_run` does."""
    keys = RunKeys(run)
    first = client.xrange(keys.control, "-", "+", count=1)
    if not first:
        raise ConfigError(
            f"run {run!r} does not exist on this server; list runs with `streamgrp runs`, or start "
            "the run's batcher, which creates it"
        )
    record, recorded = read_record(run, first[0][1], "the control stream's first entry")
    return Run(keys, _reconcile(run, recorded, config) if config is not None else recorded, record)


def await_run(
    client: redis.Redis,
    run: str,
    config: RunConfig | None = None,
    *,
    stop: threading.Event,
    wait: bool = True,
    poll_s: float = 1.0,
    who: str = "this process",
) -> Run:
    """`open_run`, waiting (while ``wait``) until the run's batcher has created it; `ConfigError` when it
    does not exist and ``wait`` is False; `StopRequested` (a quiet exit) when ``stop`` is set first. While
    it waits it says so every `WAIT_LOG_EVERY_S`, with the runs the server holds (a typo in the name
    shows there)."""
    logged_at: float | None = None
    started = time.monotonic()
    while True:
        try:
            return open_run(client, run, config)
        except ConfigError:
            if not wait:
                raise
            if not _exists_later(client, run):
                # created between the two reads (or a damaged record): read it again, which raises for damage
                return open_run(client, run, config)
        now = time.monotonic()
        if logged_at is None or now - logged_at >= WAIT_LOG_EVERY_S:
            others = [name for name, _ in list_runs(client)]
            shown = ", ".join(others[-10:]) if others else "none"
            log.log(
                logging.INFO if logged_at is None else logging.WARNING,
                "%s waits for run %s to be created by its batcher (for %.0fs so far; runs on this server: %s)",
                who,
                run,
                now - started,
                shown,
            )
            logged_at = now
        if stop.is_set() or stop.wait(poll_s):
            raise StopRequested(f"stopped while waiting for run {run!r} to be created by its batcher")


def _exists_later(client: redis.Redis, run: str) -> bool:
    """True while the run may still appear: its control stream is empty, not a damaged record."""
    return not client.xrange(RunKeys(run).control, "-", "+", count=1)


def read_record(run: str, fields, where: str) -> tuple[RunStarted, RunConfig]:
    """The run's recorded start event and configuration from the fields of its first control entry.

    The one reader of a run's record (joining, opening, verifying, retention, archives), so that a
    damaged record gives the same clear error everywhere."""
    try:
        record = codec.decode(fields) if fields is not None else None
    except DecodeError as exc:
        raise ConfigError(f"run {run!r}: {where} does not decode ({exc}); the run's record is damaged") from None
    if not isinstance(record, RunStarted):
        raise ConfigError(f"run {run!r}: {where} is not a run_started record; list runs with `streamgrp runs`")
    # A record written before runs recorded their payload layout is a stream run (streamgrp.store.payloads).
    settings = {"payload_layout": "stream", **record.settings}
    try:
        return record, RunConfig(**settings)
    except ValueError as exc:
        raise ConfigError(
            f"run {run!r}: the recorded configuration does not validate with this streamgrp version: {exc}"
        ) from None


def _reconcile(run: str, recorded: RunConfig, mine: RunConfig) -> RunConfig:
    differing = [name for name in sorted(mine.model_fields_set) if getattr(mine, name) != getattr(recorded, name)]
    if differing:
        lines = [
            f"  {name}: recorded {getattr(recorded, name)!r}, this process {getattr(mine, name)!r} "
            f"(from {flag_name(name)} / {env_name(name)} / the config file)"
            for name in differing
        ]
        raise ConfigError(
            f"run {run!r} was started with a different configuration; this process refuses to join:\n"
            + "\n".join(lines)
            + "\nUse the recorded values (or unset them to adopt the record), or start a new run with --run."
        )
    return recorded


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2]))
