"""The `streamgrp` command: one entry point, one subcommand per role or inspection.

Every setting of `streamgrp.config` is a flag ``--name`` and an environment variable
``STREAMGRP_NAME`` (shown in `--help`); a TOML file (``--config`` / ``STREAMGRP_CONFIG``) fills
the rest. Logging handlers are installed here and nowhere else.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

from streamgrp._version import __version__
from streamgrp.config import (
    AssemblerConfig,
    BatcherConfig,
    ConnectionConfig,
    RunConfig,
    WorkerConfig,
    env_name,
    flag_name,
    load,
    parse_env_value,
    read_toml,
)
from streamgrp.errors import StreamgrpError

log = logging.getLogger("streamgrp")


def _add_model_flags(parser: argparse.ArgumentParser, model: type, title: str) -> None:
    group = parser.add_argument_group(title)
    for name, field in model.model_fields.items():
        help_text = f"{field.description or ''} [env {env_name(name)}; default {field.default!r}]"
        extra: dict[str, Any] = {"nargs": "?", "const": True} if field.annotation is bool else {}
        group.add_argument(flag_name(name), dest=name, default=None, metavar=name.upper(), help=help_text,
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

    worker = commands.add_parser("worker", help="run a rollout worker process")
    for model, title in ((ConnectionConfig, "connection"), (RunConfig, "run"), (WorkerConfig, "worker")):
        _add_model_flags(worker, model, title)
    worker.set_defaults(handler=_cmd_worker)

    assembler = commands.add_parser("assembler", help="run the group assembler (one active, others stand by)")
    for model, title in ((ConnectionConfig, "connection"), (RunConfig, "run"), (AssemblerConfig, "assembler")):
        _add_model_flags(assembler, model, title)
    assembler.set_defaults(handler=_cmd_assembler)

    batcher = commands.add_parser("batcher", help="run the batcher and task feeder (one active, others stand by)")
    for model, title in ((ConnectionConfig, "connection"), (RunConfig, "run"), (BatcherConfig, "batcher")):
        _add_model_flags(batcher, model, title)
    batcher.set_defaults(handler=_cmd_batcher)

    runs = commands.add_parser("runs", help="list the runs on the server, newest last")
    _add_model_flags(runs, ConnectionConfig, "connection")
    runs.set_defaults(handler=_cmd_runs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import os

    parser = build_parser()
    args = parser.parse_args(argv)
    level = (args.log_level or os.environ.get("STREAMGRP_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.handler(args) or 0)
    except StreamgrpError as exc:
        print(f"streamgrp {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _settings(args: argparse.Namespace, model: type) -> Any:
    return load(model, toml=read_toml(args.config), overrides=vars(args))


@contextmanager
def _connected(args: argparse.Namespace):
    """A client for --redis-url, or for the embedded server (started here if none is running)."""
    from streamgrp.runs import connect
    from streamgrp.server import ensure_server

    connection = _settings(args, ConnectionConfig)
    with ensure_server(connection.redis_url, connection.data_dir) as handle:
        client = connect(handle.url)
        try:
            yield client, connection, handle
        finally:
            client.close()


def _stop_event() -> threading.Event:
    """Set on SIGTERM or SIGINT, so a role finishes its round and releases what it holds."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def _cmd_server(args: argparse.Namespace) -> int:
    from streamgrp.server import serve_forever

    connection = _settings(args, ConnectionConfig)
    return serve_forever(connection.data_dir, port=args.port, bind=args.bind, appendfsync=args.appendfsync)


def _join(client, connection: ConnectionConfig, args: argparse.Namespace, role: str):
    from streamgrp.runs import join_run, resolve_run_name

    run_name = resolve_run_name(client, connection.run, create=True)
    run = join_run(client, run_name, _settings(args, RunConfig))
    log.info("%s joined run %s", role, run.name)
    return run


def _cmd_worker(args: argparse.Namespace) -> int:
    from streamgrp.worker import WorkerClient, WorkerProcess, load_callable

    config = _settings(args, WorkerConfig)
    rollout = load_callable(config.rollout)
    with _connected(args) as (client, connection, _):
        run = _join(client, connection, args, "worker")
        worker = WorkerClient(client, run.keys, claim_idle_s=config.claim_idle_s)
        process = WorkerProcess(worker, rollout, config, n_samples=run.config.n_samples,
                                version=lambda: int(client.get(run.keys.version) or 0))
        done = process.run(_stop_event())
        log.info("worker %s finished %d tasks", worker.name, done)
    return 0


def _cmd_assembler(args: argparse.Namespace) -> int:
    from streamgrp.assembler import Assembler

    config = _settings(args, AssemblerConfig)
    with _connected(args) as (client, connection, _):
        run = _join(client, connection, args, "assembler")
        assembler = Assembler(client, run, config)
        written = assembler.run(_stop_event(), burst=config.burst)
        log.info("assembler %s wrote %d decisions", assembler.name, written)
    return 0


def _cmd_batcher(args: argparse.Namespace) -> int:
    from streamgrp.batcher import Batcher
    from streamgrp.feeder import load_dataset
    from streamgrp.worker import load_callable

    config = _settings(args, BatcherConfig)
    group_filter = load_callable(config.group_filter) if config.group_filter else None
    dataset = load_dataset(config.dataset) if config.dataset else None
    with _connected(args) as (client, connection, _):
        run = _join(client, connection, args, "batcher")
        batcher = Batcher(client, run, config, group_filter=group_filter, dataset=dataset)
        outcome = batcher.run(_stop_event(), burst=config.burst)
        log.info("batcher %s: run %s is %s after %d steps written here", batcher.name, run.name, outcome,
                 batcher.steps_written)
    return 1 if outcome == "failed" else 0


def _cmd_runs(args: argparse.Namespace) -> int:
    import time

    from streamgrp.runs import list_runs

    with _connected(args) as (client, _, _handle):
        for name, started in list_runs(client):
            print(f"{name}\t{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
