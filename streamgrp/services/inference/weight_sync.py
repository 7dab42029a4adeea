"""`streamgrp weight-sync`: after a step commits, every inference server is told to serve the new weights.

Owns following the run's policy version (the ``version`` key trainers advance when every rank has
committed a step), finding that version's weights directory (``WEIGHTS_DIR/vNNNNNN/``, which the
trainer writes before it commits, `streamgrp.train.weights.save_version`: safetensors, and the lm
trainer's ``model.gguf`` for llama.cpp), telling each
server to load it the way its dialect does, and recording one `WeightsServed` event per server and
version in the run's control stream, so staleness analysis and replay know which server served what.

A version whose directory is missing is skipped with a warning (the trainer may not export every
version); a server that fails to load is recorded with ``ok: false`` and the reason, and the role
goes on: the next version is tried on it again (a llama-server this role owns that does not come up,
leaving nothing serving, ends the role instead). Versions only go forward; a restarted role hands
the current version to every server once more (loading what a server already has is harmless).

llama.cpp cannot load weights over HTTP, so for ``--dialect llamacpp`` this role owns the server:
`LlamaServerProcess` starts ``--llama-server-cmd`` with ``--model vNNNNNN/model.gguf --alias
NAME@vN``; the alias is how the adapter learns the version it got. A new version restarts it: the
old server is killed at once (llama-server does not exit on SIGTERM while requests are in flight:
it waits for them and they for it, which cost 10 s and failed slots per sync), the new one starts
and is waited for, and the workers' adapters, whose server went away, retry the moment its
``/health`` answers; the generations broken off are generated again by the new weights. With
``handover`` the new server starts beside the old on the same port (``--reuse-port``: the kernel
shares incoming connections) and the old is killed only once the new one answers under its alias,
so no moment is without a server; on two cores the two servers slow each other down while the new
one loads, and bench/bench_weight_sync.py measured the restart's gap the shorter there, so restart
is the default. A llama-server that does not come up ends the role with `InferenceError` and the
tail of its output.

``burst`` serves until the run ends (finished or failed), then stops the server and returns.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

import redis

from streamgrp.core import codec
from streamgrp.core.events import WeightsServed
from streamgrp.services.inference.dialect import Dialect
from streamgrp.services.inference.http import InferenceError, request_json
from streamgrp.services.parent_death import pdeathsig_preexec
from streamgrp.store.control import MARKERS
from streamgrp.store.keys import RunKeys
from streamgrp.store.streams import producer_name

log = logging.getLogger(__name__)


def version_dir(root: Path, version: int) -> Path:
    """The directory of one version's weights: ``root/v000012``."""
    return Path(root) / f"v{version:06d}"


class LlamaServerProcess:
    """The llama-server this process starts, replaces by a new one per GGUF file (restart or hand-over), and stops."""

    def __init__(
        self,
        command: str,
        url: str,
        *,
        alias: str = "policy",
        log_path: Path | None = None,
        ready_timeout_s: float = 120.0,
        handover: bool = False,
        restart_grace_s: float = 0.0,
        stop_timeout_s: float = 2.0,
    ) -> None:
        self.command = shlex.split(command)
        self.url = url.rstrip("/")
        self.alias = alias
        self.log_path = Path(log_path) if log_path is not None else _scratch_log()
        self.ready_timeout_s = ready_timeout_s
        self.handover = handover
        self.restart_grace_s = restart_grace_s  # SIGTERM's grace before SIGKILL on a restart (0: kill at once)
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen | None = None

    def serve(self, model: Path, version: int) -> str:
        """Serve ``model`` as ``ALIAS@vVERSION``: stop the running server and start the new one (``handover``:
        start the new one first), and return once it answers. Raises `InferenceError` with the tail of the
        new server's output when it does not come up (after a hand-over the old one is left serving)."""
        if not Path(model).is_file():
            raise InferenceError(
                f"no GGUF file at {model}: llama.cpp serves GGUF only; have the trainer export "
                "model.gguf into each version directory, or serve with vLLM or SGLang"
            )
        alias = f"{self.alias}@v{version}"
        old = self.proc if self.proc is not None and self.proc.poll() is None else None
        if old is not None and not self.handover:
            self.stop(self.restart_grace_s)
            old = None
        reuse = ["--reuse-port"] if self.handover else []
        started_at = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as out:
            try:
                # SIGKILLed when weight-sync dies, however it dies: an orphan would go on serving an old version
                # (and holding its port); it keeps no state, and on SIGTERM it would wait for in-flight requests.
                proc = subprocess.Popen(
                    [*self.command, *reuse, "--model", str(model), "--alias", alias],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=pdeathsig_preexec(signal.SIGKILL),
                )
            except OSError as exc:
                raise InferenceError(
                    f"cannot run {self.command[0]!r} ({exc}); fix --llama-server-cmd (eval "
                    '"$(ops/llama-server.sh)" builds llama-server and sets LLAMA_SERVER)'
                ) from None
        try:
            if old is None:
                wait_healthy(self.url, self.ready_timeout_s, proc=proc)
            else:
                wait_serving(self.url, alias, self.ready_timeout_s, proc=proc)
        except InferenceError as exc:
            _kill(proc)
            raise InferenceError(
                f"llama-server did not come up on {model} ({exc}); its output "
                f"({self.log_path}):\n{_tail(self.log_path, started_at)}"
            ) from None
        self.proc = proc
        if old is not None:
            _kill(old)  # in-flight generations break off; the workers' retries land on the new server
            return f"llama-server handed over to {model} as {alias} (pid {proc.pid}, was {old.pid})"
        return f"llama-server started on {model} as {alias} (pid {proc.pid})"

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s`` (llama-server waits for in-flight requests that wait for it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                _kill(self.proc)
        self.proc = None


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _scratch_log() -> Path:
    handle, path = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
    os.close(handle)
    return Path(path)


def _tail(path: Path, offset: int = 0, lines: int = 30) -> str:
    """The last ``lines`` lines written to ``path`` after ``offset``."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:]) or "(nothing)"


def wait_serving(url: str, alias: str, timeout_s: float, *, proc: subprocess.Popen) -> None:
    """Wait until a server at ``url`` answers ``GET /v1/models`` with ``alias``: with two servers sharing the
    port, that answer can only come from the new one, and it answers only once its model is loaded."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise InferenceError(f"the inference server exited with code {proc.returncode} before it served")
        try:
            reply = request_json("GET", f"{url}/v1/models", timeout_s=2.0).body
            if any(model.get("id") == alias for model in reply.get("data", [])):
                return
            last = f"answered by {[model.get('id') for model in reply.get('data', [])]}"
        except (InferenceError, AttributeError) as exc:
            last = str(exc)
        time.sleep(0.05)
    raise InferenceError(f"{url} did not serve {alias} within {timeout_s:g}s: {last}")


def wait_healthy(url: str, timeout_s: float, *, proc: subprocess.Popen | None = None) -> None:
    """Wait until ``GET url/health`` answers 200 (llama-server answers 503 while it loads the model)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise InferenceError(f"the inference server exited with code {proc.returncode} before it was healthy")
        try:
            request_json("GET", f"{url}/health", timeout_s=2.0)
            return
        except InferenceError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise InferenceError(f"{url} was not healthy within {timeout_s:g}s: {last}")


class WeightSync:
    """Hands each new policy version to every server and records who serves what."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        dialect: Dialect,
        urls: list[str],
        weights_dir: Path,
        *,
        load_timeout_s: float = 600.0,
        llama: LlamaServerProcess | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.dialect = dialect
        self.urls = [url.rstrip("/") for url in urls]
        self.weights_dir = Path(weights_dir)
        self.load_timeout_s = load_timeout_s
        self.llama = llama
        self.name = producer_name("weight-sync")
        self.served: dict[str, int] = {}
        self._failed: dict[str, int] = {}  # a llama-server version that did not come up, not tried again
        self._missing_warned: set[int] = set()
        self._seq = 0

    def run(self, stop: threading.Event, *, poll_s: float = 0.5, burst: bool = False) -> int:
        """Follow the run's version until ``stop`` (``burst``: or until the run ends); returns how many loads
        succeeded. With a llama-server it owns, a server that does not come up raises `InferenceError`."""
        loaded = 0
        while not stop.is_set():
            loaded += self.sync(int(self.client.get(self.keys.version) or 0))
            if burst and self._run_ended():
                break
            stop.wait(poll_s)
        return loaded

    def _run_ended(self) -> bool:
        return any(value is not None for value in self.client.hmget(self.keys.batcher_state, list(MARKERS.values())))

    def sync(self, version: int) -> int:
        """Load ``version`` (or the newest one on disk up to it) on every server still behind it."""
        found = self._newest_on_disk(version)
        if found is None:
            return 0
        version, path = found
        loaded = 0
        for url in self.urls:
            if self.served.get(url, -1) >= version or self._failed.get(url) == version:
                continue
            started = time.monotonic()
            try:
                if self.llama is not None:
                    detail = self.llama.serve(path / "model.gguf", version)
                else:
                    detail = self.dialect.load_weights(url, str(path), version, timeout_s=self.load_timeout_s)
                ok = True
                self.served[url] = version
                loaded += 1
                log.info("%s now serves version %d: %s", url, version, detail)
            except InferenceError as exc:
                ok, detail = False, str(exc)
                log.warning("%s did not load version %d from %s: %s", url, version, path, detail)
                if self.llama is not None:
                    self._failed[url] = version  # the old server goes on serving; the next version is tried
                    if self.llama.proc is None:
                        self._record(url, version, ok, detail, time.monotonic() - started)
                        raise  # nothing serves: the role fails (its supervisor restarts it), rather than idle
            self._record(url, version, ok, detail, time.monotonic() - started)
        return loaded

    def _newest_on_disk(self, version: int) -> tuple[int, Path] | None:
        for candidate in range(version, -1, -1):
            if min((self.served.get(url, -1) for url in self.urls), default=-1) >= candidate:
                return None  # every server already has this or something newer
            path = version_dir(self.weights_dir, candidate)
            if path.is_dir():
                return candidate, path
            if candidate == version and candidate not in self._missing_warned:
                self._missing_warned.add(candidate)
                log.warning(
                    "no weights directory %s for version %d (yet); serving the newest older one on disk, if any",
                    path,
                    candidate,
                )
        return None

    def _record(self, url: str, version: int, ok: bool, detail: str, seconds: float) -> None:
        self._seq += 1
        event = WeightsServed(
            server=url,
            version=version,
            dialect=self.dialect.name,
            ok=ok,
            detail=detail[:2000],
            seconds=round(seconds, 3),
            at=time.time(),
            producer=self.name,
            seq=self._seq,
        )
        # redis-py's stubs want a dict of its own (invariant) union type; fields are bytes to bytes
        self.client.xadd(self.keys.control, cast("dict[Any, Any]", codec.encode(event)))
