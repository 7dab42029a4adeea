"""What the multi-process benchmarks share: child processes, their CPU from /proc, a local server,
and the bits of a streamgrp run a benchmark sets up and tears down.

Children are started with multiprocessing's 'spawn' (a fresh interpreter each, so no role inherits
another's imports or GIL); `get` fails fast when a child died instead of waiting out its timeout.
CPU figures are utime + stime from /proc/<pid>/stat (every thread of the process); a server's
forked children (AOF rewrites) are counted apart, with ``children=True``, once the server has
reaped them. Nothing here is imported by streamgrp.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import threading
import time

#: The context every benchmark child, queue and event comes from.
CTX = mp.get_context("spawn")


# --------------------------------------------------------------------------- CPU accounting


def cpu_seconds(pid: int | None, *, children: bool = False) -> float:
    """User + system CPU of a local process so far (0 when it is not readable, e.g. a remote server).

    With ``children``, the CPU of its children it has waited for (cutime + cstime) instead: for a
    server, its AOF rewrites and other forks."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    first = 13 if children else 11
    return (int(fields[first]) + int(fields[first + 1])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU-seconds all processes of this machine have used so far (/proc/stat; 0 where unavailable)."""
    try:
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- child processes


def spawn(target, *args) -> mp.Process:
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def get(source, procs: list[mp.Process], timeout: float):
    """The next message from ``source``, failing fast (not after ``timeout``) when a child died."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return source.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"bench child pid {dead[0].pid} exited with code {dead[0].exitcode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"no message from the bench children within {timeout:g}s") from None


def wait_ready(ready, procs: list[mp.Process], count: int, timeout: float) -> list:
    return [get(ready, procs, timeout) for _ in range(count)]


def collect(results, procs: list[mp.Process], count: int, timeout: float) -> list:
    return [get(results, procs, timeout) for _ in range(count)]


def join(procs: list[mp.Process], timeout: float = 30) -> None:
    """Reap the children (terminating stragglers); raises afterwards if one failed."""
    for proc in procs:
        proc.join(timeout=timeout)
        if proc.is_alive():
            proc.terminate()
            proc.join()
    failed = [proc for proc in procs if proc.exitcode != 0]
    if failed and sys.exc_info()[0] is None:  # else the exception being handled says more
        raise RuntimeError(f"bench child pid {failed[0].pid} exited with code {failed[0].exitcode}")


# --------------------------------------------------------------------------- servers


def start_server(binary: str | None = None):
    """An `EmbeddedServer` (AOF on, appendfsync everysec: the library default) in a fresh temp dir.

    ``binary``: the server to run (default: the one `streamgrp.cli.server_binary` picks, the bundled
    Valkey). Stop it with `stop_server`, which also removes the directory."""
    from streamgrp.cli.server import EmbeddedServer

    server = EmbeddedServer(tempfile.mkdtemp(prefix="streamgrp-bench-"), binary=binary)
    try:
        server.start()
    except BaseException:
        shutil.rmtree(server.data_dir, ignore_errors=True)
        raise
    return server


def stop_server(server) -> None:
    try:
        server.stop()
    finally:
        shutil.rmtree(server.data_dir, ignore_errors=True)


def wait_rewrites(client, timeout: float = 300.0) -> None:
    """Return once the server runs no AOF rewrite and has none scheduled."""
    from streamgrp.store.run_admin import rewrites_done

    if rewrites_done(client, timeout_s=timeout) is None:
        raise RuntimeError(f"the server's AOF rewrite still runs after {timeout:.0f} s")


def compact_aof(client) -> None:
    """Rewrite the AOF now and wait for it (`streamgrp.store.run_admin.compact_aof`, after any rewrite
    already running), so that the next case starts from a log holding only what is left: each case's
    own writes then decide when rewrites start, whatever ran before it."""
    from streamgrp.store.run_admin import compact_aof as rewrite

    wait_rewrites(client)
    rewrite(client, timeout_s=300.0)
    wait_rewrites(client)


def server_name(client) -> str:
    info = client.info("server")
    return f"{info.get('server_name', 'redis')} {info.get('valkey_version', info.get('redis_version'))}"


# --------------------------------------------------------------------------- streamgrp runs


def issue_tasks(client, run, task_ids: list[str], chunk: int = 500) -> None:
    """Issue one task (empty prompt) per id through `TaskIssuer`, the unfenced task path."""
    from streamgrp.store.tasks import TaskIssuer

    issuer = TaskIssuer(client, run.keys, producer="bench-issuer")
    for i in range(0, len(task_ids), chunk):
        part = task_ids[i : i + chunk]
        issuer.issue([{}] * len(part), task_ids=part)


def drop_run(client, run) -> None:
    """Delete every key of ``run`` and its registry entry."""
    from streamgrp.store.keys import RUNS

    # Every key of the run shares its hash-tagged prefix; UNLINK frees big streams off the main thread.
    pattern = run.keys.control.rsplit(":", 1)[0] + ":*"
    keys = list(client.scan_iter(match=pattern, count=1000))
    if keys:
        client.unlink(*keys)
    client.zrem(RUNS, run.name)


def wait_folded(client, run, expected: int, timeout: float) -> None:
    """Until the assembler has read every issued task (they stay pending until their decision)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for group in client.xinfo_groups(run.keys.slots):
            if group["name"] == b"assembler" and group["pending"] == expected and not group.get("lag"):
                return
        time.sleep(0.02)
    raise RuntimeError(f"the assembler did not read the {expected} issued tasks within {timeout:g}s")


def observe(
    url: str, stream: str, expected: int, seen: list, done: threading.Event, timeout: float
) -> threading.Thread:
    """A thread blocked in XREAD on ``stream`` until ``expected`` entries arrived: appends (entry id,
    fields, wall time received) to ``seen``, then sets ``done``."""
    from streamgrp.store.runs import connect

    client = connect(url)

    def loop() -> None:
        last = "0-0"
        deadline = time.monotonic() + timeout
        while len(seen) < expected and time.monotonic() < deadline:
            reply = client.xread({stream: last}, count=10_000, block=1000)
            now = time.time()
            if reply:
                entries = reply[0][1]
                seen.extend((entry_id, fields, now) for entry_id, fields in entries)
                last = entries[-1][0]
        done.set()
        client.close()

    thread = threading.Thread(target=loop, name="stream-observer", daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------- figures


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
