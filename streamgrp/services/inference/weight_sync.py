"""`streamgrp weight-sync`: after a step commits, every inference server is told to serve the new weights.

Owns following the run's policy version (the ``version`` key trainers advance when every rank has
committed a step), finding that version's weights directory (``WEIGHTS_DIR/vNNNNNN/``, which the
trainer writes as safetensors before it commits, `streamgrp.train.weights.save_version`), telling each
server to load it the way its dialect does, and recording one `WeightsServed` event per server and
version in the run's control stream, so staleness analysis and replay know which server served what.

A version whose directory is missing is skipped with a warning (the trainer may not export every
version); a server that fails to load is recorded with ``ok: false`` and the reason, and the role
goes on: the next version is tried on it again. Versions only go forward; a restarted role hands
the current version to every server once more (loading what a server already has is harmless).

llama.cpp cannot load weights over HTTP, so for ``--dialect llamacpp`` this role owns the server:
`LlamaServerProcess` (re)starts ``--llama-server-cmd`` with ``--model vNNNNNN/model.gguf --alias
NAME@vN`` and waits for ``/health``; the alias is how the adapter learns the version it got.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import threading
import time
from pathlib import Path

import redis

from streamgrp.core import codec
from streamgrp.core.events import WeightsServed
from streamgrp.services.inference.dialect import Dialect
from streamgrp.services.inference.http import InferenceError, request_json
from streamgrp.store.keys import RunKeys
from streamgrp.store.streams import producer_name

log = logging.getLogger(__name__)


def version_dir(root: Path, version: int) -> Path:
    """The directory of one version's weights: ``root/v000012``."""
    return Path(root) / f"v{version:06d}"


class LlamaServerProcess:
    """A llama-server this process starts, restarts on a new GGUF file, and stops."""

    def __init__(self, command: str, url: str, *, alias: str = "policy", log_path: Path | None = None,
                 ready_timeout_s: float = 120.0) -> None:
        self.command = shlex.split(command)
        self.url = url.rstrip("/")
        self.alias = alias
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None

    def serve(self, model: Path, version: int) -> str:
        """Stop the running server (if any), start one on ``model`` as ``ALIAS@vVERSION``, wait until healthy."""
        if not Path(model).is_file():
            raise InferenceError(f"no GGUF file at {model}: llama.cpp serves GGUF only; have the trainer export "
                                 "model.gguf into each version directory, or serve with vLLM or SGLang")
        self.stop()
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen([*self.command, "--model", str(model), "--alias", f"{self.alias}@v{version}"],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            if self.log_path:
                out.close()
        wait_healthy(self.url, self.ready_timeout_s, proc=self.proc)
        return f"llama-server restarted on {model} as {self.alias}@v{version} (pid {self.proc.pid})"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


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

    def __init__(self, client: redis.Redis, keys: RunKeys, dialect: Dialect, urls: list[str], weights_dir: Path, *,
                 load_timeout_s: float = 600.0, llama: LlamaServerProcess | None = None) -> None:
        self.client = client
        self.keys = keys
        self.dialect = dialect
        self.urls = [url.rstrip("/") for url in urls]
        self.weights_dir = Path(weights_dir)
        self.load_timeout_s = load_timeout_s
        self.llama = llama
        self.name = producer_name("weight-sync")
        self.served: dict[str, int] = {}
        self._missing_warned: set[int] = set()
        self._seq = 0

    def run(self, stop: threading.Event, *, poll_s: float = 0.5, burst: bool = False) -> int:
        """Follow the run's version until ``stop``; returns how many loads succeeded."""
        loaded = 0
        while not stop.is_set():
            loaded += self.sync(int(self.client.get(self.keys.version) or 0))
            if burst:
                break
            stop.wait(poll_s)
        return loaded

    def sync(self, version: int) -> int:
        """Load ``version`` (or the newest one on disk up to it) on every server still behind it."""
        found = self._newest_on_disk(version)
        if found is None:
            return 0
        version, path = found
        loaded = 0
        for url in self.urls:
            if self.served.get(url, -1) >= version:
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
                log.warning("no weights directory %s for version %d; serving the newest older one on disk", path,
                            candidate)
        return None

    def _record(self, url: str, version: int, ok: bool, detail: str, seconds: float) -> None:
        self._seq += 1
        event = WeightsServed(server=url, version=version, dialect=self.dialect.name, ok=ok, detail=detail[:2000],
                              seconds=round(seconds, 3), at=time.time(), producer=self.name, seq=self._seq)
        self.client.xadd(self.keys.control, codec.encode(event))
