"""What every subcommand handler shares: its settings, its client, the process's stop event, its metrics.

Owns reading a handler's settings (TOML file, ``STREAMGRP_`` environment, flags), connecting to
``--redis-url`` or to the embedded server (started if none is running), the one stop event SIGTERM
and SIGINT set, and serving metrics when a port is given. ``redis`` and ``prometheus_client`` are
imported only when a handler asks for a client or metrics, so ``--help`` and ``server`` stay light.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

from streamgrp.config import ConnectionConfig, load, read_toml

__all__ = ["connected", "interrupted_exit_code", "serve_metrics", "settings", "stop_event", "stop_signal"]


def settings(args: argparse.Namespace, model: type) -> Any:
    """``model`` filled from the flags, then the environment, then the ``--config`` TOML file."""
    return load(model, toml=read_toml(args.config), overrides=vars(args))


@contextmanager
def connected(args: argparse.Namespace, *, role: bool = False):
    """A client for --redis-url, or for the embedded server (started here if none is running).

    A long-running ``role`` gets the process's stop event, so SIGTERM ends an outage wait quietly;
    inspection commands keep Ctrl-C as KeyboardInterrupt."""
    from streamgrp.cli.server_reuse import ensure_server
    from streamgrp.store.connection import connect
    from streamgrp.store.credentials import command_line_url_warning

    connection = settings(args, ConnectionConfig)
    warning = command_line_url_warning(getattr(args, "redis_url", None))  # the flag's value: never the environment's
    if warning is not None:
        logging.getLogger(__name__).warning("%s", warning)
    password = connection.secret()
    # A command that only reads never starts an empty server of its own to report that nothing is there.
    with ensure_server(
        connection.redis_url,
        connection.data_dir,
        password=password,
        maxmemory=connection.maxmemory,
        cluster=connection.cluster,
        start_empty=role,
    ) as handle:
        # A service rides an outage; a command someone typed says within seconds that the server is not there.
        budget = connection.outage_budget_s if role else connection.command_budget_s
        client = connect(
            handle.url,
            outage_budget_s=budget,
            stop=stop_event() if role else None,
            wait_replicas=connection.wait_replicas,
            wait_timeout_ms=connection.wait_timeout_ms,
            password=password,
            tls=connection.tls(),
            cluster=connection.cluster,
            budget_flag="--outage-budget-s" if role else "--command-budget-s",
        )
        try:
            yield client, connection, handle
        finally:
            client.close()


def serve_metrics(
    config: Any, *, role: str, run: str, client=None, streams: Mapping[str, str] | None = None, rank: int | None = None
):
    """The metrics ``role`` exports, labelled with ``run`` (and a trainer's ``rank``), served on the role's
    ``metrics_address``:``metrics_port`` when the port is not 0; None when off."""
    if not config.metrics_port:
        return None
    from streamgrp.cli.metrics import Metrics

    metrics = Metrics(role=role, run=run, rank=rank)
    if client is not None:
        metrics.watch_streams(client, streams or {})
    metrics.serve(config.metrics_port, config.metrics_address)
    return metrics


_STOP: list[threading.Event] = []
_SIGNALS: list[int] = []


def stop_event() -> threading.Event:
    """The process's stop event, set on SIGTERM or SIGINT, so a role finishes its round and releases
    what it holds, and a wait for an absent server ends quietly. Installed once per process.

    Both handlers are installed whatever the process inherited: a non-interactive shell starts a
    background job (``streamgrp demo &`` in a script) with SIGINT ignored, and Python then installs
    no handler of its own, so without this a SIGINT would be lost."""
    if not _STOP:
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():

            def request_stop(signum: int, frame: object) -> None:
                if not _SIGNALS:
                    _SIGNALS.append(signum)
                stop.set()

            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, request_stop)
        _STOP.append(stop)
    return _STOP[0]


def stop_signal() -> int | None:
    """The first signal that set the stop event (SIGTERM or SIGINT); None when none arrived."""
    return _SIGNALS[0] if _SIGNALS else None


def interrupted_exit_code() -> int:
    """The shell's code for a job that a signal ended, 128 + its number: 130 after SIGINT (or a
    KeyboardInterrupt), 143 after SIGTERM."""
    return 128 + int(stop_signal() or signal.SIGINT)
