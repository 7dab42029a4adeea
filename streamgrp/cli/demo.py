"""`streamgrp demo`: a real asynchronous RL loop on the embedded server, as separate OS processes.

Owns orchestration only: start the server, write the toy dataset, start the batcher (with its
feeder), the assembler, the workers and the trainer ranks, show progress, stop every process it
started (on success, on SIGINT or SIGTERM, or when a role fails, naming it), and print the summary.
A stop signal reaches it as the process's stop event (`streamgrp.cli.context.stop_event`), also when
a script started it in the background with SIGINT ignored; the demo then exits 128 + the signal. With
``--prometheus`` every process serves its metrics and a local Prometheus (`streamgrp.cli.prom`) scrapes
them. Workers may die and the run goes on (another worker reclaims their tasks); any other role
failing ends it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from streamgrp.cli import children
from streamgrp.cli.children import free_port
from streamgrp.cli.server_reuse import ensure_server
from streamgrp.config import (
    ConnectionConfig,
    DemoConfig,
    RunConfig,
    env_name,
    load_callable,
)
from streamgrp.core import counters
from streamgrp.core.shown import printable_lines
from streamgrp.errors import RoleFailed
from streamgrp.replay.summary import format_summary, run_summary
from streamgrp.store.credentials import safe_url
from streamgrp.store.private import open_private, private_dir
from streamgrp.store.runs import connect, join_run
from streamgrp.store.sources import RedisSource

log = logging.getLogger(__name__)

#: The demo's prompts and rollout function; an example, so named by string, never imported here.
TOY_TASK = "streamgrp.consumers.toy_task"
OPTIONAL_ROLES = ("worker",)


@dataclass
class Child:
    role: str
    index: int
    args: list[str]
    log_path: Path
    #: What the child gets on top of the demo's environment: the server's URL (with its password) goes
    #: here, never in ``args``, which every user of the machine can read in /proc/PID/cmdline.
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def label(self) -> str:
        return f"{self.role} {self.index}"

    @property
    def process(self) -> subprocess.Popen:
        """The child's process, once `start` ran."""
        if self.proc is None:
            raise RuntimeError(f"{self.label} has not been started")
        return self.proc

    def start(self) -> None:
        # Same session as the demo: a Ctrl-C stops the roles too, each shutting down cleanly.
        self.proc = children.spawn(
            [sys.executable, "-m", "streamgrp", "--log-level", "INFO", self.role, *self.args],
            self.log_path,
            new_session=False,
            env={**os.environ, **self.env},
        )

    def tail(self, lines: int = 12) -> str:
        return children.log_tail(self.log_path, lines)


def run_demo(
    connection: ConnectionConfig,
    run_settings: RunConfig,
    demo: DemoConfig,
    *,
    out=sys.stdout,
    err=sys.stderr,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Run the demo to the end and return its summary (also printed); raises `RoleFailed`."""
    stop = stop or threading.Event()
    if demo.prometheus:
        from streamgrp.cli.prom import prometheus_binary

        prometheus_binary()  # fail before anything starts when it is missing
    started = time.monotonic()
    run_name = connection.run or time.strftime("demo-%Y%m%d-%H%M%S")
    settings = run_settings.model_copy(update={"dp_size": demo.ranks, "reward_norm": run_settings.reward_norm})
    password, tls = connection.secret(), connection.tls()
    with ensure_server(
        connection.redis_url,
        connection.data_dir,
        password=password,
        maxmemory=connection.maxmemory,
        cluster=connection.cluster,
    ) as server:
        client = connect(server.url, password=password, tls=tls, cluster=connection.cluster)
        run = join_run(client, run_name, RunConfig(**settings.model_dump()))
        log_dir = Path(connection.data_dir) / "logs" / run_name
        private_dir(log_dir)
        dataset = _write_dataset(log_dir / "prompts.jsonl", run.config, demo)
        children = _children(_child_env(server.url, connection), run_name, run.config, demo, dataset, log_dir)
        prometheus = _prometheus(children, run.config, log_dir / "prometheus") if demo.prometheus else None
        print(
            f"streamgrp demo: run {run_name} on {safe_url(server.url)} ({len(children)} processes; logs in {log_dir})",
            file=err,
            flush=True,
        )
        try:
            # A stop that arrived while the server or Prometheus started ends the demo before any role starts.
            _check_stop(stop)
            if prometheus is not None:
                print(
                    f"streamgrp demo: Prometheus at {prometheus.start()} (config and data in {prometheus.data_dir})",
                    file=err,
                    flush=True,
                )
            for child in children:
                _check_stop(stop)
                child.start()
            _watch(client, run.keys, children, demo, started, stop, err)
        finally:
            stop_children(children)
            if prometheus is not None:
                prometheus.stop()
        seconds = time.monotonic() - started
        from streamgrp.store.sources import default_source

        # An archiver (with retention) may have trimmed the server: read what it trimmed from its archive.
        summary = run_summary(client, run.keys, source=default_source(client, run.keys, connection.data_dir))
        summary["seconds"] = round(seconds, 2)
        print(printable_lines(format_summary(summary, seconds)), file=out)  # reasons come from the counts hash
        print(
            f"  replay       streamgrp replay {max(summary['steps'] - 1, 0)} --rank 0 --run {run_name}"
            + ("" if connection.redis_url else f" --data-dir {connection.data_dir}"),
            file=out,
        )
        if demo.as_json:
            print(orjson.dumps(summary).decode(), file=out)
        client.close()
    return summary


def _check_stop(stop: threading.Event) -> None:
    if stop.is_set():
        raise KeyboardInterrupt


def stop_children(roles: list[Child], timeout: float = 10.0) -> None:
    """Stop the trainer ranks together, then every other role together (SIGTERM, SIGKILL after ``timeout``).

    Ranks first, so none waits for a batch from a batcher already gone; all ranks at once, so they
    stop after the same step (`streamgrp.train.trainer`), not one in a collective its peer left."""
    for group in ([c for c in roles if c.role == "trainer"], [c for c in roles if c.role != "trainer"]):
        children.stop_all([c.proc for c in group], timeout)


def _write_dataset(path: Path, run: RunConfig, demo: DemoConfig) -> Path:
    prompts = load_callable(f"{TOY_TASK}:prompts")
    count = demo.steps * run.batch_size * 4 + 64  # enough for drops and the staleness window
    with open_private(path, "wb") as handle:
        for prompt, _ in zip(prompts(seed=0, reject_rate=demo.reject_rate, fail_rate=demo.fail_rate), range(count)):
            handle.write(orjson.dumps(prompt) + b"\n")
    return path


def _child_env(url: str, connection: ConnectionConfig) -> dict[str, str]:
    """How the roles reach the server: its URL, whether it is a cluster, and the connection's secrets and
    TLS files, by environment."""
    env = {"STREAMGRP_REDIS_URL": url}
    if connection.cluster:
        env[env_name("cluster")] = "1"
    if connection.password is not None:
        env["STREAMGRP_PASSWORD"] = connection.password.get_secret_value()
    for name in ("password_file", "tls_cert_file", "tls_key_file", "tls_ca_cert_file"):
        value = getattr(connection, name)
        if value is not None:
            env[env_name(name)] = str(Path(value).resolve())
    return env


def _children(
    env: dict[str, str], run_name: str, run: RunConfig, demo: DemoConfig, dataset: Path, log_dir: Path
) -> list[Child]:
    common = ["--run", run_name]
    dist_url = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    children = [
        Child(
            "batcher",
            0,
            [*common, "--dataset", str(dataset), "--max-steps", str(demo.steps), "--round-s", "0.5"],
            log_dir / "batcher.log",
            env,
        ),
    ]
    for partition in range(run.partitions):  # one assembler per partition; one log name as ever without
        name = "assembler.log" if run.partitions == 1 else f"assembler-{partition}.log"
        children.append(
            Child(
                "assembler",
                partition,
                [*common, "--tick-interval-s", "0.2", "--partition", str(partition)],
                log_dir / name,
                env,
            )
        )
    for index in range(demo.workers):
        children.append(
            Child(
                "worker",
                index,
                [*common, "--rollout", f"{TOY_TASK}:rollout", "--concurrency", "4", "--claim-idle-s", "5"],
                log_dir / f"worker-{index}.log",
                env,
            )
        )
    for rank in range(demo.ranks):
        extra = ["--fail-at-step", str(demo.trainer_fail_at_step)] if demo.trainer_fail_at_step is not None else []
        children.append(
            Child(
                "trainer",
                rank,
                [*common, "--rank", str(rank), "--world-size", str(demo.ranks), "--dist-url", dist_url, *extra],
                log_dir / f"trainer-{rank}.log",
                env,
            )
        )
    return children


def _prometheus(children: list[Child], run: RunConfig, directory: Path):
    """Give every child a free metrics port, list them in a targets file, and return Prometheus (not started).

    The alert rules get the run's own stall bounds, so the stall alert means the same thing as in the run.
    """
    from streamgrp.cli import prom

    ports: set[int] = set()
    targets = []
    for child in children:
        port = free_port("127.0.0.1")
        while port in ports:
            port = free_port("127.0.0.1")
        ports.add(port)
        child.args += ["--metrics-port", str(port)]
        targets.append(prom.Target(child.role, child.index, port))
    config = prom.prepare(
        directory, targets, max_empty_rounds=run.max_empty_rounds, stall_timeout_s=run.stall_timeout_s
    )
    return prom.Prometheus(config, directory)


def _watch(client, keys, children: list[Child], demo: DemoConfig, started: float, stop: threading.Event, err) -> None:
    """Wait until every trainer finished; raise `RoleFailed` when a needed role exits with an error."""
    trainers = [c for c in children if c.role == "trainer"]
    progress = _Progress(demo.steps, err)
    while True:
        if stop.is_set():
            raise KeyboardInterrupt
        for child in children:
            code = child.process.poll()
            # Workers and the assembler exit by themselves (0) once the batcher has ended the run.
            if code is None or (code == 0 and (child.role in ("trainer", "batcher") or _batcher_done(children))):
                continue
            if child.role in OPTIONAL_ROLES and any(c.process.poll() is None for c in children if c.role == child.role):
                if not getattr(child, "_reported", False):
                    print(f"\nstreamgrp demo: {child.label} exited ({code}); the others take over its tasks", file=err)
                    child._reported = True  # type: ignore[attr-defined]
                continue
            raise RoleFailed(
                f"{child.label} failed with exit code {code}; last lines of {child.log_path}:\n{child.tail()}"
            )
        if all(c.process.poll() == 0 for c in trainers):
            progress.update(client, keys, final=True)
            return
        if time.monotonic() - started > demo.timeout_s:
            raise RoleFailed(f"the demo did not finish within {demo.timeout_s:g}s (--timeout-s); see the logs")
        progress.update(client, keys)
        stop.wait(0.25)


def _batcher_done(children: list[Child]) -> bool:
    return any(c.role == "batcher" and c.process.poll() == 0 for c in children)


class _Progress:
    """One status line: a bar of steps, the yields, and the newest step's reward."""

    def __init__(self, steps: int, err) -> None:
        self.steps = steps
        self.err = err
        self.tty = err.isatty()
        self._last_line = 0.0
        self._source: RedisSource | None = None

    def update(self, client, keys, final: bool = False) -> None:
        now = time.monotonic()
        if not (self.tty or final or now - self._last_line >= 5):
            return
        self._last_line = now
        if self._source is None:
            self._source = RedisSource(client, keys)  # its counts: the run's and every partition's
        counts = {name: float(value) for name, value in self._source.hash("counts").items()}
        done = int(counts.get(counters.STEPS, 0))
        usable, trainable = counters.slot_yields(counts) or (0.0, 0.0)
        metrics = client.hget(keys.trainer_metrics, max(done - 1, 0))
        reward = orjson.loads(metrics)["reward_mean"] if metrics else None
        filled = int(20 * min(done, self.steps) / self.steps)
        line = (
            f"[{'#' * filled}{'.' * (20 - filled)}] step {done}/{self.steps}  yields usable {usable:.2f} "
            f"trainable {trainable:.2f}  reward {'-' if reward is None else f'{reward:.3f}'}"
        )
        print(
            ("\r" + line) if self.tty else line, end="\n" if (final or not self.tty) else "", file=self.err, flush=True
        )
