"""Handlers of the subcommands that read a run and exit: runs, report, steps, replay, verify, inspect, export.

Owns opening the run to read (``--run``, the latest run, or an archive's through ``--archive``),
printing what `streamgrp.replay` returns, and the exit codes (1 when ``verify`` or ``replay`` finds
a difference). torch is imported only by ``replay``, which rebuilds batches (the ``trainer`` extra);
pyarrow only by ``export`` (the ``export`` extra); matplotlib only by ``report --format png``.
``runs --sizes`` is `streamgrp.cli.housekeeping`'s, beside ``delete``.
"""

from __future__ import annotations

import argparse
import os
import pprint
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from streamgrp.cli.context import connected, settings
from streamgrp.config import ExportConfig, RunsConfig, load_callable
from streamgrp.core.shown import printable
from streamgrp.errors import ConfigError

__all__ = ["cmd_export", "cmd_inspect", "cmd_replay", "cmd_report", "cmd_runs", "cmd_steps", "cmd_verify"]


def cmd_runs(args: argparse.Namespace) -> int:
    from streamgrp.store.runs import list_runs

    with connected(args) as (client, connection, _handle):
        if settings(args, RunsConfig).sizes:
            from streamgrp.cli.housekeeping import print_sizes

            print_sizes(client, connection.data_dir)
            return 0
        for name, started in list_runs(client):
            print(f"{printable(name)}\t{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from streamgrp.replay.report import (
        build_report,
        render_html,
        render_png,
        require_png,
    )
    from streamgrp.store.private import open_private
    from streamgrp.store.runs import open_run, resolve_run_name
    from streamgrp.store.sources import default_source

    if args.format == "png":
        require_png()  # before connecting: say what to install without starting a server
    with connected(args) as (client, connection, _handle):
        run = open_run(client, resolve_run_name(client, connection.run, create=False))
        data = build_report(client, run.keys, source=default_source(client, run.keys, connection.data_dir))
    out = args.out or f"report-{run.name}.{args.format}"
    try:
        with open_private(out, "wb") as file:  # 0600: the report quotes the run's error texts and numbers
            file.write(render_png(data) if args.format == "png" else render_html(data).encode())
    except OSError as exc:
        raise ConfigError(
            f"cannot write the report to {out}: {exc.strerror}; pass --out with a writable path"
        ) from None
    print(f"run {run.name}: {len(data.steps)} steps, report written to {out}")
    return 0


@contextmanager
def _inspected_run(args: argparse.Namespace):
    """A client, --run (default: the latest run, or the archive's) and the entry source to read it through."""
    from streamgrp.store.sources import open_run_source

    with connected(args) as (client, connection, _handle):
        run, source = open_run_source(client, connection.run, archive=args.archive, data_dir=connection.data_dir)
        yield client, run, source


def cmd_steps(args: argparse.Namespace) -> int:
    from streamgrp.replay import format_steps, list_steps

    with _inspected_run(args) as (client, run, source):
        steps = list_steps(client, run.keys, source=source)
        shown = [s for s in steps if s.failed] if args.failed else steps
        print(f"run {run.name}: {len(steps)} steps" + (f", {len(shown)} with a failed rank" if args.failed else ""))
        if shown:
            print(format_steps(shown))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from streamgrp.cli.extras import require

    require("replay (it rebuilds the step's tensors)", "trainer")  # before save_batch below imports torch
    from streamgrp.errors import DigestMismatch
    from streamgrp.replay import (
        format_batch,
        read_manifest,
        replay_step,
        save_batch,
    )

    if args.run_fn and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a debugging function usually sits in a file next to the user
    run_fn = load_callable(args.run_fn) if args.run_fn else None
    with _inspected_run(args) as (client, run, source):
        ranks = [args.rank]
        if args.rank is None:
            manifest = read_manifest(source, args.step)
            ranks = list(range(len(manifest.shards))) if manifest is not None else [0]
        status = 0
        for rank in ranks:
            try:
                batch = replay_step(client, run.keys, args.step, rank, source=source)
            except DigestMismatch as exc:
                print(
                    f"streamgrp replay: digest mismatch, the log no longer holds what rank {rank} trained: {exc}",
                    file=sys.stderr,
                )
                status = 1
                continue
            print(format_batch(batch))
            if args.out:
                out = Path(args.out)
                if len(ranks) > 1:
                    out = out.with_name(f"{out.stem}.rank{rank}{out.suffix}")
                print(f"  saved to {save_batch(batch, out)}")
            if run_fn is not None:
                try:
                    result = run_fn(batch)
                except Exception:
                    print(f"streamgrp replay: {args.run_fn} raised on step {args.step} rank {rank}:", file=sys.stderr)
                    traceback.print_exc()
                    status = 1
                    continue
                print(result if isinstance(result, str) else pprint.pformat(result))
    return status


def cmd_verify(args: argparse.Namespace) -> int:
    from streamgrp.replay import format_report, verify

    with _inspected_run(args) as (client, run, source):
        report = verify(client, run.keys, args.from_step, args.to_step, source=source)
    print(format_report(report))
    return 0 if report.ok else 1


def cmd_inspect(args: argparse.Namespace) -> int:
    from streamgrp.replay import format_timeline, inspect_task

    with _inspected_run(args) as (client, run, source):
        timeline = inspect_task(client, run.keys, args.task_id, source=source)
    print(f"task {printable(args.task_id)} in run {run.name}")
    print(format_timeline(timeline))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from streamgrp.replay.export import export_run, require_pyarrow
    from streamgrp.store.sources import open_run_source

    require_pyarrow()  # before connecting: say what to install without starting a server
    config = settings(args, ExportConfig)
    if config.follow:
        from streamgrp.replay.export_follow import follow_export

        return _export_follow(args, config, follow_export)
    with connected(args) as (client, connection, _handle):
        run, source = open_run_source(
            client, args.target or connection.run, archive=args.archive, data_dir=connection.data_dir
        )
        out = config.out or Path(f"export-{run.name}")
        rows = export_run(client, run.keys, out, source=source)
    print(
        f"run {run.name}: "
        + ", ".join(f"{name}.parquet {count} rows" for name, count in rows.items())
        + f", run.json; written to {out}"
    )
    return 0


def _export_follow(args: argparse.Namespace, config: ExportConfig, follow_export) -> int:
    from streamgrp.cli.context import stop_event
    from streamgrp.store.runs import await_run, resolve_run_name

    stop = stop_event()  # SIGTERM: write what was read, record it, exit 0
    with connected(args, role=True) as (client, connection, _handle):
        run = await_run(
            client,
            resolve_run_name(client, args.target or connection.run, create=False),
            stop=stop,
            who="export --follow",
        )  # started before the run: waits for its batcher to create it
        out = config.out or Path(f"export-{run.name}")
        files, rows = follow_export(
            client, run, out, name=config.follow_name, flush_s=config.flush_s, stop=stop, until_finished=True
        )
    print(f"run {run.name}: {rows} decisions in {files} files appended to {out / 'decisions'}")
    return 0
