"""The `streamgrp` command: one entry point, one subcommand per role or inspection.

Every setting of `streamgrp.config` is a flag ``--name`` and an environment variable
``STREAMGRP_NAME`` (shown in `--help`); a TOML file (``--config`` / ``STREAMGRP_CONFIG``) fills
the rest. Logging handlers are installed here and nowhere else.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

from streamgrp._version import __version__
from streamgrp.config import (
    ArchiverConfig,
    AssemblerConfig,
    BatcherConfig,
    ConnectionConfig,
    DemoConfig,
    RunConfig,
    TrainerConfig,
    WorkerConfig,
    env_name,
    flag_name,
    load,
    load_callable,
    parse_env_value,
    read_toml,
)
from streamgrp.errors import StopRequested, StreamgrpError

#: The reference GRPO trainer `streamgrp trainer` runs; an example, so named by string, never imported here.
REFERENCE_TRAINER = "consumers.grpo_trainer:train"

log = logging.getLogger("streamgrp")


def _add_model_flags(parser: argparse.ArgumentParser, model: type, title: str) -> None:
    group = parser.add_argument_group(title)
    for name, field in model.model_fields.items():
        help_text = f"{field.description or ''} [env {env_name(name)}; default {field.default!r}]"
        extra: dict[str, Any] = {"nargs": "?", "const": True} if field.annotation is bool else {}
        group.add_argument(flag_name(name, model), dest=name, default=None, metavar=name.upper(), help=help_text,
                           type=_flag_parser(model, name), **extra)


def _flag_parser(model: type, name: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return parse_env_value(model, name, text)
        except StreamgrpError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamgrp",
                                     description="Event-sourced rollout queue for asynchronous RL post-training.")
    parser.add_argument("--version", action="version", version=f"streamgrp {__version__}")
    parser.add_argument("--log-level", default=None, help="logging level [env STREAMGRP_LOG_LEVEL; default INFO]")
    parser.add_argument("--config", default=None, help="TOML settings file [env STREAMGRP_CONFIG]")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    server = commands.add_parser("server", help="run the embedded Valkey server in the foreground")
    _add_model_flags(server, ConnectionConfig, "connection")
    server.add_argument("--port", type=int, default=6379, help="TCP port [default 6379]")
    server.add_argument("--bind", default="127.0.0.1", help="address to listen on [default 127.0.0.1]")
    server.add_argument("--appendfsync", choices=["always", "everysec", "no"], default="everysec",
                        help="AOF fsync policy (see README: what each mode can lose)")
    server.set_defaults(handler=_cmd_server)

    # Each role takes the connection flags, the run's settings, and its own.
    for name, help_text, model, handler in (
        ("worker", "run a rollout worker process", WorkerConfig, _cmd_worker),
        ("assembler", "run the group assembler (one active, others stand by)", AssemblerConfig, _cmd_assembler),
        ("batcher", "run the batcher and task feeder (one active, others stand by)", BatcherConfig, _cmd_batcher),
        ("trainer", "run a reference GRPO trainer rank (consumers.grpo_trainer)", TrainerConfig, _cmd_trainer),
        ("demo", "run a whole asynchronous RL loop on the embedded server and summarize it", DemoConfig, _cmd_demo),
    ):
        role = commands.add_parser(name, help=help_text)
        for section, title in ((ConnectionConfig, "connection"), (RunConfig, "run"), (model, name)):
            _add_model_flags(role, section, title)
        role.set_defaults(handler=handler)

    runs = commands.add_parser("runs", help="list the runs on the server, newest last")
    _add_model_flags(runs, ConnectionConfig, "connection")
    runs.set_defaults(handler=_cmd_runs)

    report = commands.add_parser("report", help="render the run's timeline as one self-contained HTML page")
    _add_model_flags(report, ConnectionConfig, "connection")
    report.add_argument("--out", default=None, metavar="FILE", help="where to write [default report-RUN.FORMAT]")
    report.add_argument("--format", choices=["html", "png"], default="html",
                        help="html (default; needs nothing) or png (needs matplotlib)")
    report.set_defaults(handler=_cmd_report)

    archiver = commands.add_parser("archiver", help="copy the run's streams to segment files on disk; with "
                                   "--retention, trim the server behind the archive and every reader")
    for model, title in ((ConnectionConfig, "connection"), (ArchiverConfig, "archiver")):
        _add_model_flags(archiver, model, title)
    archiver.set_defaults(handler=_cmd_archiver)
    _add_replay_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:

    parser = build_parser()
    args = parser.parse_args(argv)
    level = (args.log_level or os.environ.get("STREAMGRP_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.handler(args) or 0)
    except StopRequested as exc:
        log.info("%s", exc)  # shutting down while the server is away is not an error
        return 0
    except StreamgrpError as exc:
        print(f"streamgrp {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _settings(args: argparse.Namespace, model: type) -> Any:
    return load(model, toml=read_toml(args.config), overrides=vars(args))


@contextmanager
def _connected(args: argparse.Namespace, *, role: bool = False):
    """A client for --redis-url, or for the embedded server (started here if none is running).

    A long-running ``role`` gets the process's stop event, so SIGTERM ends an outage wait quietly;
    inspection commands keep Ctrl-C as KeyboardInterrupt."""
    from streamgrp.cli.server import ensure_server
    from streamgrp.store.connection import connect

    connection = _settings(args, ConnectionConfig)
    with ensure_server(connection.redis_url, connection.data_dir) as handle:
        client = connect(handle.url, outage_budget_s=connection.outage_budget_s, stop=_stop_event() if role else None,
                         wait_replicas=connection.wait_replicas, wait_timeout_ms=connection.wait_timeout_ms)
        try:
            yield client, connection, handle
        finally:
            client.close()


def _serve_metrics(port: int, client=None, streams=()):
    """The process's metrics, served on ``port`` when it is not 0; None when off."""
    if not port:
        return None
    from streamgrp.cli.metrics import Metrics

    metrics = Metrics()
    if client is not None:
        metrics.watch_streams(client, streams)
    metrics.serve(port)
    return metrics


_STOP: list[threading.Event] = []


def _stop_event() -> threading.Event:
    """The process's stop event, set on SIGTERM or SIGINT, so a role finishes its round and releases
    what it holds, and a wait for an absent server ends quietly. Installed once per process."""
    if not _STOP:
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda *_: stop.set())
        _STOP.append(stop)
    return _STOP[0]


def _cmd_server(args: argparse.Namespace) -> int:
    from streamgrp.cli.server import serve_forever

    connection = _settings(args, ConnectionConfig)
    return serve_forever(connection.data_dir, port=args.port, bind=args.bind, appendfsync=args.appendfsync)


def _join(client, connection: ConnectionConfig, args: argparse.Namespace, role: str):
    from streamgrp.store.runs import join_run, resolve_run_name

    run_name = resolve_run_name(client, connection.run, create=True)
    run = join_run(client, run_name, _settings(args, RunConfig))
    log.info("%s joined run %s", role, run.name)
    return run


def _cmd_worker(args: argparse.Namespace) -> int:
    from streamgrp.services.worker import WorkerClient, WorkerProcess

    config = _settings(args, WorkerConfig)
    rollout = load_callable(config.rollout)
    with _connected(args, role=True) as (client, connection, handle):
        run = _join(client, connection, args, "worker")
        # Rollout code (e.g. loading weights) finds the server and run the same way the worker did.
        os.environ["STREAMGRP_REDIS_URL"], os.environ["STREAMGRP_RUN"] = handle.url, run.name
        metrics = _serve_metrics(config.metrics_port)
        worker = WorkerClient(client, run.keys, claim_idle_s=config.claim_idle_s, max_entry_bytes=config.max_entry_bytes,
                              metrics=metrics)
        process = WorkerProcess(worker, rollout, config, n_samples=run.config.n_samples,
                                version=lambda: int(client.get(run.keys.version) or 0), metrics=metrics)
        done = process.run(_stop_event())
        log.info("worker %s finished %d tasks", worker.name, done)
    return 0


def _cmd_assembler(args: argparse.Namespace) -> int:
    from streamgrp.services.assembler import Assembler

    config = _settings(args, AssemblerConfig)
    with _connected(args, role=True) as (client, connection, _):
        run = _join(client, connection, args, "assembler")
        metrics = _serve_metrics(config.metrics_port, client, run.keys.all_streams().values())
        assembler = Assembler(client, run, config, metrics=metrics)
        written = assembler.run(_stop_event(), burst=config.burst)
        log.info("assembler %s wrote %d decisions", assembler.name, written)
    return 0


def _cmd_batcher(args: argparse.Namespace) -> int:
    from streamgrp.services.batcher import Batcher
    from streamgrp.services.feeder import load_dataset
    config = _settings(args, BatcherConfig)
    group_filter = load_callable(config.group_filter) if config.group_filter else None
    dataset = load_dataset(config.dataset) if config.dataset else None
    with _connected(args, role=True) as (client, connection, _):
        run = _join(client, connection, args, "batcher")
        metrics = _serve_metrics(config.metrics_port, client, run.keys.all_streams().values())
        batcher = Batcher(client, run, config, group_filter=group_filter, dataset=dataset, metrics=metrics)
        outcome = batcher.run(_stop_event(), burst=config.burst)
        log.info("batcher %s: run %s is %s after %d steps written here", batcher.name, run.name, outcome,
                 batcher.steps_written)
    return 1 if outcome == "failed" else 0


def _cmd_trainer(args: argparse.Namespace) -> int:
    train = load_callable(REFERENCE_TRAINER)
    config = _settings(args, TrainerConfig)
    with _connected(args, role=True) as (client, connection, _):
        run = _join(client, connection, args, f"trainer rank {config.rank}")
        steps = train(client, run, config, metrics=_serve_metrics(config.metrics_port))
        log.info("trainer rank %d committed %d steps", config.rank, steps)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from streamgrp.cli.demo import run_demo

    toml = read_toml(args.config)
    connection = load(ConnectionConfig, toml=toml, overrides=vars(args))
    run_settings = load(RunConfig, toml=toml, overrides=_demo_run_defaults(args))
    demo = load(DemoConfig, toml=toml, overrides=vars(args))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        run_demo(connection, run_settings, demo, stop=stop)
    except KeyboardInterrupt:
        print("\nstreamgrp demo: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    return 0


def _demo_run_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The demo's run settings: GRPO-style group normalization and a short deadline unless overridden."""
    from streamgrp.core.policy import NormSpec

    defaults: dict[str, Any] = {"n_samples": 6, "batch_size": 8, "max_staleness": 1, "group_timeout_s": 30.0,
                                "reward_norm": NormSpec("group", "group"), "stall_timeout_s": 120.0}
    return {**defaults, **{k: v for k, v in vars(args).items() if v is not None}}


def _cmd_report(args: argparse.Namespace) -> int:
    from streamgrp.errors import ConfigError
    from streamgrp.replay.report import (
        build_report,
        render_html,
        render_png,
        require_png,
    )
    from streamgrp.store.runs import open_run, resolve_run_name
    from streamgrp.store.sources import default_source

    if args.format == "png":
        require_png()  # before connecting: say what to install without starting a server
    with _connected(args) as (client, connection, _handle):
        run = open_run(client, resolve_run_name(client, connection.run, create=False))
        data = build_report(client, run.keys, source=default_source(client, run.keys, connection.data_dir))
    out = args.out or f"report-{run.name}.{args.format}"
    try:
        with open(out, "wb") as file:
            file.write(render_png(data) if args.format == "png" else render_html(data).encode())
    except OSError as exc:
        raise ConfigError(f"cannot write the report to {out}: {exc.strerror}; pass --out with a writable path") from None
    print(f"run {run.name}: {len(data.steps)} steps, report written to {out}")
    return 0


def _cmd_archiver(args: argparse.Namespace) -> int:
    import time

    from streamgrp.errors import ConfigError
    from streamgrp.services.archiver import Archiver, default_archive_dir
    from streamgrp.store.runs import open_run, resolve_run_name

    config = _settings(args, ArchiverConfig)
    stop = _stop_event()
    with _connected(args, role=True) as (client, connection, _):
        while True:  # the archiver never creates a run: it waits for the one it was given
            try:
                run = open_run(client, resolve_run_name(client, connection.run, create=False))
                break
            except ConfigError:
                if config.burst or connection.run is None or stop.wait(1.0):
                    raise
        directory = config.archive_dir or default_archive_dir(connection.data_dir, run.name)
        archiver = Archiver(client, run.keys, directory, config, dp_size=run.config.dp_size)
        log.info("archiver for run %s writing to %s (retention %s)", run.name, directory,
                 "on" if config.retention else "off")
        started = time.monotonic()
        archived = archiver.run(stop, burst=config.burst)
        log.info("archiver: %d entries archived in %.1fs, %d trimmed from the server", archived,
                 time.monotonic() - started, archiver.trimmed)
    return 0


def _cmd_runs(args: argparse.Namespace) -> int:
    import time

    from streamgrp.store.runs import list_runs

    with _connected(args) as (client, _, _handle):
        for name, started in list_runs(client):
            print(f"{name}\t{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}")
    return 0


# -- replay: steps, replay, verify, inspect (streamgrp.replay) ---------------------------------------------


def _add_replay_commands(commands: Any) -> None:
    steps = commands.add_parser("steps", help="list the run's steps and each rank's status (committed, failed, ...)")
    _add_model_flags(steps, ConnectionConfig, "connection")
    steps.add_argument("--failed", action="store_true", help="only steps a rank failed, with the exception text")
    _add_archive_flag(steps)
    steps.set_defaults(handler=_cmd_steps)

    replay = commands.add_parser("replay", help="rebuild the exact tensors a rank consumed at a step, digests checked")
    _add_model_flags(replay, ConnectionConfig, "connection")
    replay.add_argument("step", type=int, metavar="STEP", help="the step to rebuild")
    replay.add_argument("--rank", type=int, default=None, help="the rank to rebuild [default: every rank]")
    replay.add_argument("--out", default=None, metavar="FILE",
                        help="save the batch (safetensors layout, no pickle); for several ranks FILE gets .rankR")
    replay.add_argument("--run-fn", default=None, metavar="MODULE:FUNCTION",
                        help="call this with the replayed streamgrp.train.trainer.Batch and print what it returns "
                        "(the module may sit in the current directory)")
    _add_archive_flag(replay)
    replay.set_defaults(handler=_cmd_replay)

    verify = commands.add_parser("verify", help="re-fold the slot log and re-partition the steps; exit 1 on any "
                                 "difference from the record")
    _add_model_flags(verify, ConnectionConfig, "connection")
    verify.add_argument("--from", dest="from_step", type=int, default=None, metavar="STEP",
                        help="first step to re-partition [default: 0]")
    verify.add_argument("--to", dest="to_step", type=int, default=None, metavar="STEP",
                        help="last step to re-partition [default: the last]")
    _add_archive_flag(verify)
    verify.set_defaults(handler=_cmd_verify)

    inspect = commands.add_parser("inspect", help="one task's timeline: issue, slot results, decision, step and rank")
    _add_model_flags(inspect, ConnectionConfig, "connection")
    inspect.add_argument("task_id", metavar="TASK_ID")
    _add_archive_flag(inspect)
    inspect.set_defaults(handler=_cmd_inspect)


def _add_archive_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archive", default=os.environ.get("STREAMGRP_ARCHIVE"), metavar="DIR",
                        help="read entries the server no longer holds from this archive (the whole run, when it is "
                        "not on the server) [env STREAMGRP_ARCHIVE; default DATA_DIR/archive/RUN when it exists]")


@contextmanager
def _inspected_run(args: argparse.Namespace):
    """A client, --run (default: the latest run, or the archive's) and the entry source to read it through."""
    from streamgrp.store.sources import open_run_source

    with _connected(args) as (client, connection, _handle):
        run, source = open_run_source(client, connection.run, archive=args.archive, data_dir=connection.data_dir)
        yield client, run, source


def _cmd_steps(args: argparse.Namespace) -> int:
    from streamgrp.replay import format_steps, list_steps

    with _inspected_run(args) as (client, run, source):
        steps = list_steps(client, run.keys, source=source)
        shown = [s for s in steps if s.failed] if args.failed else steps
        print(f"run {run.name}: {len(steps)} steps" + (f", {len(shown)} with a failed rank" if args.failed else ""))
        if shown:
            print(format_steps(shown))
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    import pprint
    import traceback
    from pathlib import Path

    from streamgrp.replay import (
        format_batch,
        read_manifest,
        replay_step,
        save_batch,
    )
    from streamgrp.train.trainer import DigestMismatch
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
                print(f"streamgrp replay: digest mismatch, the log no longer holds what rank {rank} trained: {exc}",
                      file=sys.stderr)
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


def _cmd_verify(args: argparse.Namespace) -> int:
    from streamgrp.replay import format_report, verify

    with _inspected_run(args) as (client, run, source):
        report = verify(client, run.keys, args.from_step, args.to_step, source=source)
    print(format_report(report))
    return 0 if report.ok else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    from streamgrp.replay import format_timeline, inspect_task

    with _inspected_run(args) as (client, run, source):
        timeline = inspect_task(client, run.keys, args.task_id, source=source)
    print(f"task {args.task_id} in run {run.name}")
    print(format_timeline(timeline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
