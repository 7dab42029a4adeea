"""Reusing one server across a run's processes: `ensure_server` and the `ServerHandle` it returns.

Owns the choice a command makes when it needs a server: the URL it was given, else the live server
recorded in its data directory, else a new `EmbeddedServer` there, decided under the directory's
lock so concurrent commands share one server. Starting and stopping servers is `streamgrp.cli.server`'s.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from streamgrp.cli.server import DEFAULT_DATA_DIR, EmbeddedServer
from streamgrp.cli.server_config import DEFAULT_MAXMEMORY
from streamgrp.cli.server_probe import server_url
from streamgrp.cli.server_state import live_state, locked, state_tls
from streamgrp.store.private import private_dir

__all__ = ["ServerHandle", "ensure_server"]

logger = logging.getLogger(__name__)


class ServerHandle:
    """The server a command talks to: ``url``, and whether this process ``owned`` (started) it.

    ``close()`` stops the server only if this handle owns it; a reused or external server keeps
    running for its owner.
    """

    def __init__(self, url: str, *, owned: bool = False, server: EmbeddedServer | None = None) -> None:
        self.url = url
        self.owned = owned
        self.server = server

    def close(self) -> None:
        if self.owned and self.server is not None:
            self.server.stop()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        shown = self.server.display_url if self.server is not None else "<given url>"
        return f"ServerHandle({shown}, owned={self.owned})"


def ensure_server(
    redis_url: str | None,
    data_dir: str | os.PathLike[str] = DEFAULT_DATA_DIR,
    *,
    password: str | None = None,
    appendfsync: str = "everysec",
    maxmemory: str = DEFAULT_MAXMEMORY,
    timeout: float = 10.0,
    cluster: bool = False,
    start_empty: bool = True,
) -> ServerHandle:
    """A server to talk to: ``redis_url`` if given, else the one running in ``data_dir``, else a new one.

    ``start_empty`` False (a command that only reads): a server is started only for data ``data_dir``
    already holds; with none there, `ConfigError` says where it looked and what to pass, instead of an
    empty new server answering "no run exists yet".

    Check-then-start happens under an exclusive flock on ``data_dir/server.lock``, so concurrent
    commands of one run share a single server instead of racing to start two on one AOF.
    ``password``, ``appendfsync`` and ``maxmemory`` apply only when a new server is started (the
    password is also used to reach a reused one). ``cluster`` needs ``redis_url``: the embedded server is one server,
    never a cluster.
    """
    if redis_url:
        return ServerHandle(redis_url, owned=False)
    if cluster:
        from streamgrp.errors import ConfigError

        raise ConfigError(
            "--cluster needs --redis-url of a cluster node (STREAMGRP_REDIS_URL); the embedded server "
            "is a single server, not a cluster"
        )
    if not start_empty and not (Path(data_dir) / "appendonlydir").is_dir():
        from streamgrp.errors import ConfigError

        raise ConfigError(
            f"no server to read: no --redis-url (STREAMGRP_REDIS_URL) was given and "
            f"{Path(data_dir).resolve()} holds no embedded server's data (--data-dir); pass the run's "
            "server with --redis-url, or run this where `streamgrp demo` or `streamgrp server` keeps "
            "its data"
        )
    directory = private_dir(Path(data_dir).resolve())
    with locked(directory):
        state = live_state(directory, password)
        if state is not None:
            tls = state_tls(state) is not None
            url = server_url(str(state["host"]), int(state["port"]), password, tls=tls)
            logger.info(
                "reusing server pid %s at %s", state["pid"], server_url(state["host"], state["port"], None, tls=tls)
            )
            return ServerHandle(url, owned=False)
        server = EmbeddedServer(directory, password=password, appendfsync=appendfsync, maxmemory=maxmemory)
        url = server.start(timeout)
        if not start_empty:
            logger.info("reading the embedded server's data in %s (started for this command)", directory)
        return ServerHandle(url, owned=True, server=server)
