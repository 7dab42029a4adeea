"""Handlers that keep a server tidy: ``runs --sizes`` (what each run holds) and ``delete RUN``.

Owns what these commands print and the order of a delete: the archiver check, the keys
(`streamgrp.store.run_admin`, which also decides whether a run is live), the archive when asked
(`streamgrp.store.archive_admin`), then the rewrite of the embedded server's append-only file, whose
size is what slows the server's next start. A server given by URL is left to rewrite its own file:
a rewrite forks the server, which is its administrator's call.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from streamgrp.cli.context import connected, settings
from streamgrp.config import DeleteConfig
from streamgrp.core.shown import printable
from streamgrp.errors import ArchiveError, ConfigError

__all__ = ["cmd_delete", "print_sizes"]


def print_sizes(client, data_dir: Path) -> None:
    """Every run on the server (registered or not) and every archive under ``data_dir``: keys, memory,
    entries per stream, archive size; then the totals."""
    from streamgrp.store.archive_admin import archive_bytes, archived_runs
    from streamgrp.store.run_admin import RunUsage, human_bytes, usage_by_run
    from streamgrp.store.runs import list_runs

    registry = dict(list_runs(client))
    usage = usage_by_run(client)
    archives = archived_runs(data_dir)
    names = [*registry, *sorted(set(usage) - set(registry)), *sorted(set(archives) - set(registry) - set(usage))]
    print(f"{'RUN':<28} {'STARTED':<19} {'KEYS':>6} {'MEMORY':>10} {'ARCHIVE':>10}")
    archived_total = 0
    for name in names:
        started = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(registry[name]))
            if name in registry
            else "not registered"
            if name in usage
            else "archive only"
        )
        held = usage.get(name, RunUsage(name))
        archived = archive_bytes(archives[name]) if name in archives else None
        archived_total += archived or 0
        print(
            f"{printable(name):<28} {started:<19} {held.keys:>6} {human_bytes(held.bytes):>10} "
            f"{'-' if archived is None else human_bytes(archived):>10}"
        )
        if held.entries:
            print("  entries  " + ", ".join(f"{stream} {count}" for stream, count in held.entries.items()))
    held_total = sum(u.bytes for u in usage.values())
    print(
        f"total: {len(names)} run{'' if len(names) == 1 else 's'}, {human_bytes(held_total)} on the server, "
        f"{human_bytes(archived_total)} in archives under {Path(data_dir) / 'archive'}"
    )


def _confirm_delete(run: str, url: str, usage, archive: Path | None) -> None:
    """Ask on a terminal before deleting; without one (a script, CI) refuse unless --yes was given,
    since nothing can be undone after it."""
    from streamgrp.store.credentials import safe_url
    from streamgrp.store.run_admin import human_bytes

    what = f"run {run!r} ({usage.keys} keys, {human_bytes(usage.bytes)}) on {safe_url(url)}" + (
        f" and its archive {archive}" if archive is not None else ""
    )
    if not sys.stdin.isatty():
        raise ConfigError(
            f"delete would remove {what} and cannot be undone; pass --yes (STREAMGRP_YES=1) to delete "
            "without a terminal to confirm on"
        )
    try:
        answer = input(f"Delete {what}? This cannot be undone. [y/N] ")
    except EOFError:
        answer = ""
    if answer.strip().lower() not in ("y", "yes"):
        raise ConfigError(f"not deleted: {run!r} is kept (answer y to delete, or pass --yes)")


def cmd_delete(args: argparse.Namespace) -> int:
    from streamgrp.store.archive_admin import archive_bytes, archive_in_use, remove_archive
    from streamgrp.store.archive_layout import default_archive_dir, read_meta
    from streamgrp.store.keys import RunKeys
    from streamgrp.store.run_admin import compact_aof, delete_run, human_bytes

    config = settings(args, DeleteConfig)
    keys = RunKeys(args.target)
    with connected(args) as (client, connection, handle):
        archive = Path(args.archive) if args.archive else default_archive_dir(connection.data_dir, keys.run)
        try:
            meta = read_meta(archive)
        except ArchiveError as exc:
            raise ConfigError(f"{exc}; pass the run's archive with --archive DIR") from None
        if meta is not None and meta.get("run") != keys.run:
            raise ConfigError(
                f"{archive} is the archive of run {meta.get('run')!r}, not {keys.run!r}; pass the run's "
                "archive with --archive DIR"
            )
        if meta is None and args.archive:
            raise ConfigError(f"--archive {archive} is not a streamgrp archive (no meta.json); fix the path")
        if meta is not None and not config.force and archive_in_use(archive):
            raise ConfigError(
                f"run {keys.run!r} is live: an archiver is writing its archive {archive}. Stop it first, "
                "or pass --force (STREAMGRP_FORCE=1) to delete it anyway"
            )
        doomed_archive = archive if meta is not None and config.delete_archive else None
        confirm = None if config.yes else (lambda usage: _confirm_delete(keys.run, handle.url, usage, doomed_archive))
        deleted = delete_run(client, keys, force=config.force, idle_s=config.idle_s, confirm=confirm)
        if not deleted.keys and not deleted.registered and not (meta is not None and config.delete_archive):
            kept = f"; its archive {archive} is kept (--delete-archive removes it)" if meta is not None else ""
            raise ConfigError(
                f"run {keys.run!r} has no keys on this server and is not in its registry{kept}; list "
                "the runs with `streamgrp runs --sizes`"
            )
        print(
            f"run {keys.run}: deleted {deleted.keys} keys ({human_bytes(deleted.bytes)})"
            + (" and its registry entry" if deleted.registered else "")
        )
        if deleted.reappeared:
            print(
                f"streamgrp delete: {deleted.reappeared} keys of run {keys.run} exist again: a process of the run "
                "is still running; stop it and delete again",
                file=sys.stderr,
            )
        if meta is not None and config.delete_archive:
            print(f"  archive {archive} removed ({human_bytes(remove_archive(archive, keys.run, force=config.force))})")
        elif meta is not None:
            print(f"  archive {archive} kept ({human_bytes(archive_bytes(archive))}); --delete-archive removes it")
        if deleted.keys and connection.redis_url is None:  # the embedded server: ours to compact
            print(f"  {compact_aof(client)}")
    return 0
