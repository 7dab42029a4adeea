"""``streamgrp server``: one server in the foreground until SIGINT or SIGTERM, then a clean stop.

Owns that command's signal handling and noticing a server that exits by itself. The server is
recorded in its data directory like any other, so the roles of a run reuse it through
`streamgrp.cli.server.ensure_server`; how it is started and stopped is `EmbeddedServer`'s.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from streamgrp.cli.server import DEFAULT_DATA_DIR, EmbeddedServer
from streamgrp.cli.server_config import DEFAULT_MAXMEMORY
from streamgrp.cli.server_state import locked
from streamgrp.config import TlsFiles
from streamgrp.store.private import private_dir

__all__ = ["serve_forever"]

logger = logging.getLogger(__name__)


def serve_forever(
    data_dir: str | os.PathLike[str] = DEFAULT_DATA_DIR,
    *,
    port: int = 6379,
    bind: str = "127.0.0.1",
    appendonly: bool = True,
    appendfsync: str = "everysec",
    password: str | None = None,
    binary: str | None = None,
    acl_file: str | os.PathLike[str] | None = None,
    tls: TlsFiles | None = None,
    maxmemory: str = DEFAULT_MAXMEMORY,
    ready: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Run a server in ``data_dir`` until SIGINT/SIGTERM, then stop it cleanly (``streamgrp server``).

    Must run in the main thread (it installs signal handlers, restored on return), unless ``stop`` is
    given: an event the caller's own handlers set (the CLI's process stop event, installed before
    anything started), which then ends the server instead. ``ready`` is called with the URL once the
    server answers. Returns 0 after a requested stop, 1 if the server exited on its own.
    """
    # Built first: a bind other machines reach without a password is refused before anything starts.
    server = EmbeddedServer(
        Path(data_dir).resolve(),
        port=port,
        bind=bind,
        appendonly=appendonly,
        appendfsync=appendfsync,
        password=password,
        binary=binary,
        acl_file=acl_file,
        tls=tls,
        maxmemory=maxmemory,
    )
    directory = private_dir(server.data_dir)
    stop_requested = stop if stop is not None else threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stop_requested.set()

    previous = (
        {} if stop is not None else {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    )
    try:
        with locked(directory):
            url = server.start()
        logger.info(
            "serving %s at %s (%s; data in %s); Ctrl-C to stop",
            Path(server.binary).name,
            server.display_url,
            server.security.describe(),
            directory,
        )
        if ready is not None:
            ready(url)
        while not stop_requested.wait(0.5):
            if not server.running:
                code = server.wait(0)
                logger.error("server pid %s exited by itself with code %s; see %s", server.pid, code, server.log_path)
                server.stop()
                return 1
        logger.info("stopping server pid %s", server.pid)
        return 0
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
