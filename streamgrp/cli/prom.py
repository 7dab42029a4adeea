"""A local Prometheus for a run: its configuration, its targets file, and the child process.

Owns: finding the ``prometheus`` binary on PATH, writing a scrape configuration (1 s scrapes,
file-based service discovery, the alert rules of ``ops/alerts.yml``, which the package ships as
``streamgrp/cli/alerts.yml``, a link to it in a checkout and a copy in a wheel)
and the targets file that lists each role's ``host:port`` with the labels ``role`` and ``index``,
running Prometheus as a child that dies with its owner, waiting for ``/-/ready``, and stopping it.

It deliberately ignores the metrics themselves (`streamgrp.cli.metrics` owns them) and dashboards
(``grafana/``). Configuration files are written as JSON, which is YAML too, so this module needs no
YAML library. Like the Valkey server (`streamgrp.cli.server`), Prometheus runs in its own session so a
Ctrl-C typed in the owner's terminal reaches only the owner, which then stops it; on Linux the
kernel also sends it SIGTERM when the owning thread dies.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from streamgrp.cli import children
from streamgrp.cli.children import free_port
from streamgrp.errors import ConfigError, ServerError
from streamgrp.store.private import private_dir, write_private

log = logging.getLogger(__name__)

JOB_NAME = "streamgrp"
INSTALL_HINT = "install it (Debian/Ubuntu: apt-get install prometheus) or put it on PATH"
# The two stall bounds (RunConfig defaults) as the alert rules record them; `render_rules` rewrites them.
BOUND_RECORDS = {
    "max_empty_rounds": "streamgrp:max_empty_rounds:bound",
    "stall_timeout_s": "streamgrp:stall_timeout_seconds:bound",
}


@dataclass(frozen=True)
class Target:
    """One process that serves ``/metrics``."""

    role: str
    index: int
    port: int
    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def prometheus_binary() -> str:
    """The ``prometheus`` executable on PATH; `ConfigError` saying how to install it when missing."""
    found = shutil.which("prometheus")
    if found is None:
        raise ConfigError(f"the prometheus binary is not on PATH; {INSTALL_HINT}, or run without --prometheus")
    return found


def default_rules_file() -> Path | None:
    """The alert rules the package ships (``ops/alerts.yml``); None only when a checkout lost the link to it."""
    candidate = Path(__file__).with_name("alerts.yml")
    return candidate if candidate.is_file() else None


def render_rules(text: str, *, max_empty_rounds: int, stall_timeout_s: float) -> str:
    """The alert rules with the recorded stall bounds replaced by a run's own bounds."""
    for name, value in (("max_empty_rounds", max_empty_rounds), ("stall_timeout_s", stall_timeout_s)):
        pattern = re.compile(rf"(record:\s*{re.escape(BOUND_RECORDS[name])}\s*\n\s*expr:\s*)vector\([^)]*\)")

        def bound(m: re.Match[str], v: float = value) -> str:
            return f"{m.group(1)}vector({float(v):.15g})"

        text, count = pattern.subn(bound, text)
        if count != 1:
            raise ConfigError(
                f"the alert rules do not record {BOUND_RECORDS[name]} as 'expr: vector(N)' exactly "
                "once; restore that rule in ops/alerts.yml"
            )
    return text


def targets_document(targets: Iterable[Target]) -> list[dict]:
    """The file-SD document: one entry per target, labelled with its role and index."""
    return [{"targets": [t.address], "labels": {"role": t.role, "index": str(t.index)}} for t in targets]


def write_targets(path: Path, targets: Iterable[Target]) -> Path:
    """Write the targets file atomically (Prometheus watches it and must never read half of it)."""
    private_dir(path.parent)
    partial = path.with_name(path.name + ".tmp")
    write_private(partial, json.dumps(targets_document(targets), indent=2) + "\n")
    os.replace(partial, path)
    return path


def write_config(
    directory: Path, *, targets_file: Path, rules_file: Path | None = None, scrape_interval_s: float = 1.0
) -> Path:
    """Write ``prometheus.yml`` into ``directory``: one job scraping what ``targets_file`` (a path or glob) lists."""
    interval = _duration(scrape_interval_s)
    # Prometheus resolves relative paths against the config file's directory, not the working directory.
    targets_file, rules_file = targets_file.resolve(), rules_file.resolve() if rules_file is not None else None
    config = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "rule_files": [str(rules_file)] if rules_file is not None else [],
        "scrape_configs": [
            {"job_name": JOB_NAME, "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": interval}]}
        ],
    }
    private_dir(directory)
    path = directory / "prometheus.yml"
    write_private(path, json.dumps(config, indent=2) + "\n")
    return path


def _duration(seconds: float) -> str:
    """A Prometheus duration: whole seconds as ``1s``, anything finer in milliseconds (``250ms``)."""
    if seconds <= 0:
        raise ConfigError(f"a scrape interval must be positive, not {seconds:g}s")
    return f"{seconds:g}s" if float(seconds).is_integer() else f"{round(seconds * 1000):d}ms"


def prepare(
    directory: Path,
    targets: Iterable[Target],
    *,
    max_empty_rounds: int | None = None,
    stall_timeout_s: float | None = None,
    scrape_interval_s: float = 1.0,
) -> Path:
    """Targets file, alert rules (with the run's stall bounds when given) and config in ``directory``."""
    private_dir(directory)
    targets_file = write_targets(directory / "targets.json", targets)
    rules_file = default_rules_file()
    if rules_file is not None and max_empty_rounds is not None and stall_timeout_s is not None:
        rendered = directory / "alerts.yml"
        write_private(
            rendered,
            render_rules(rules_file.read_text(), max_empty_rounds=max_empty_rounds, stall_timeout_s=stall_timeout_s),
        )
        rules_file = rendered
    return write_config(
        directory, targets_file=targets_file, rules_file=rules_file, scrape_interval_s=scrape_interval_s
    )


class Prometheus:
    """A Prometheus child process serving ``config_file``, with its TSDB in ``data_dir``."""

    def __init__(
        self,
        config_file: Path,
        data_dir: Path,
        *,
        binary: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        self.config_file = Path(config_file)
        self.data_dir = Path(data_dir)
        self.binary = binary or prometheus_binary()
        self.host = host
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{netloc}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "prometheus.log"

    def start(self, timeout: float = 30.0) -> str:
        """Start and wait until ``/-/ready``; returns the URL. `ServerError` with the log's tail on failure."""
        if self.process is not None and self.process.poll() is None:
            return self.url
        self.port = self.port or free_port(self.host)
        private_dir(self.data_dir)
        command = [
            self.binary,
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
            f"--web.listen-address={self.url.removeprefix('http://')}",
            "--log.level=warn",
        ]
        self.process = children.spawn(command, self.log_path)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(
                    f"prometheus exited with code {self.process.returncode} at start; check "
                    f"{self.config_file} and the log {self.log_path}:\n{self._log_tail()}"
                )
            if self.ready():
                log.info("prometheus (pid %d) at %s", self.process.pid, self.url)
                return self.url
            time.sleep(0.1)
        self.stop()
        raise ServerError(
            f"prometheus did not become ready within {timeout:g}s; see {self.log_path}:\n{self._log_tail()}"
        )

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as response:
                return response.status == 200
        except urllib.error.HTTPError as exc:  # 503 while the TSDB opens
            exc.close()
            return False
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; a no-op when not running."""
        children.stop(self.process, timeout)

    def _log_tail(self, lines: int = 15) -> str:
        return children.log_tail(self.log_path, lines)

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
