"""End-to-end benchmark: streamgrp's publish-to-decision path against the raw Redis stream pattern.

Three measurements, each with real OS processes (multiprocessing 'spawn') so the GIL of one role
never slows another:

1. raw baseline: producers XADD the exact encoded bytes of SlotResult entries (one XADD round trip
   per entry, as workers do); one consumer XREADGROUP COUNT 512 BLOCK and one XACK per batch.
   Rate = entries / (first XADD .. last XACK returned).
2. streamgrp throughput: G tasks (n_samples=4) are issued and folded by the assembler (its own
   process) before the clock starts; producers publish 4 pre-built samples per task through
   `WorkerClient.publish` (no `take`: queue overhead only, no rollout compute). Rate = 4G slots /
   (first publish .. the last `GroupDecided` entry seen by an observer blocked in XREAD on the
   decisions stream).
3. latency at ~50% of the best streamgrp rate for each token size: one paced producer publishes
   whole groups; per group, last slot -> decision, three ways:
     ids       decision entry id ms - last slot entry id ms (server clock, 1 ms resolution)
     decided   `decided_at` (assembler wall clock, set when the decision is built, i.e. before the
               commit script runs) - publisher wall time right after the last slot's XADD returned
     observed  wall time at which an XREAD BLOCK reader of the decisions stream received the entry
               - publisher wall time after the last XADD (includes the commit and the delivery)

The goal reported against: streamgrp >= 0.5 x raw, latency p99 < 10 ms.

Diagnostics printed beside the numbers, because on a small machine the answer is usually "who had
the CPU": CPU microseconds per slot for every role (from /proc: producers, consumer or assembler,
server) and the cores other processes of the machine used meanwhile; every GC pause of the
assembler process (gc.callbacks) and every server AOF rewrite (polled INFO), matched against the
groups slower than 10 ms; the server's own LATENCY LATEST events (embedded server only).
``--profile`` re-runs the largest case with the assembler under cProfile; ``--gc-freeze`` is an
experiment (gc.freeze() in the assembler process after start-up), not library behaviour.
Throughput cases run ``--repeat`` times, interleaved; the median is reported. Every key the
bench creates is removed at the end of its case; with the default embedded server (appendonly
everysec, the library default) nothing outlives the bench.

    python bench/bench_e2e.py [--groups 2000] [--tokens 256 1024] [--workers 1 4] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
import uuid

from _harness import (
    CTX,
    collect,
    cpu_seconds,
    drop_run,
    issue_tasks,
    join,
    machine_busy,
    observe,
    percentile,
    spawn,
    start_server,
    stop_server,
    wait_folded,
    wait_ready,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

N_SAMPLES = 4
READ_COUNT = 512
SAMPLE_POOL = 8  # distinct pre-built samples per producer, reused round robin
RAW_GROUP = "bench"
READY_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 120.0


# --------------------------------------------------------------------------- helpers (any process)


def _samples(tokens: int) -> list:
    from streamgrp.services.synthetic import make_sample

    return [make_sample(tokens=tokens, seed=i, reward=i / SAMPLE_POOL) for i in range(SAMPLE_POOL)]


def _id_ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


def _task_ids(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(count)]


def _shares(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


# --------------------------------------------------------------------------- child processes


def _raw_producer(url: str, stream: str, tokens: int, task_ids: list[str], ready, start, results) -> None:
    """XADD the encoded SlotResult fields of every (task, slot), one round trip each."""
    from streamgrp.core import codec
    from streamgrp.store.runs import connect

    client = connect(url)
    samples = _samples(tokens)
    name = f"rawbench-{os.getpid()}"
    payloads = []
    for t, task_id in enumerate(task_ids):
        for slot in range(N_SAMPLES):
            event, payload = codec.sample_result(
                task_id, slot, samples[(t * N_SAMPLES + slot) % SAMPLE_POOL], producer=name, seq=len(payloads)
            )
            payloads.append({**payload, b"s": codec.encode(event)[codec.HEADER]})  # what one sample costs
    ready.put(("producer", os.getpid()))
    start.wait()
    xadd = client.xadd
    cpu = time.process_time()
    began = time.time()
    for fields in payloads:
        xadd(stream, fields)
    results.put(("producer", began, time.time(), len(payloads), time.process_time() - cpu))


def _raw_consumer(url: str, stream: str, total: int, ready, results) -> None:
    """XREADGROUP COUNT 512 BLOCK, one XACK per batch, until ``total`` entries are acknowledged."""
    from streamgrp.store.runs import connect

    client = connect(url)
    ready.put(("consumer", os.getpid()))
    cpu = time.process_time()
    acked = 0
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while acked < total and time.monotonic() < deadline:
        reply = client.xreadgroup(RAW_GROUP, "c", {stream: ">"}, count=READ_COUNT, block=1000)
        if not reply:
            continue
        ids = [entry_id for entry_id, _ in reply[0][1]]
        acked += client.xack(stream, RAW_GROUP, *ids)
    results.put(("consumer", time.time(), acked, time.process_time() - cpu))


def _sg_producer(
    url: str,
    run_name: str,
    tokens: int,
    task_ids: list[str],
    ready,
    start,
    results,
    group_interval_s: float | None = None,
) -> None:
    """Publish 4 slots per task through `WorkerClient.publish`; paced per group when an interval is given."""
    from streamgrp.services.worker import WorkerClient
    from streamgrp.store.keys import RunKeys
    from streamgrp.store.runs import connect

    client = connect(url)
    worker = WorkerClient(client, RunKeys(run_name))
    samples = _samples(tokens)
    ready.put(("producer", os.getpid()))
    start.wait()
    publish = worker.publish
    marks = []  # (task id, last slot entry id, wall time after its XADD returned)
    cpu = time.process_time()
    began = time.time()
    origin = time.perf_counter()
    for t, task_id in enumerate(task_ids):
        if group_interval_s is not None:
            delay = origin + t * group_interval_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        for slot in range(N_SAMPLES):
            entry_id = publish(task_id, slot, samples[(t * N_SAMPLES + slot) % SAMPLE_POOL])
        marks.append((task_id, entry_id, time.time()))
    finished = time.time()
    cpu = time.process_time() - cpu
    results.put(
        ("producer", began, finished, len(task_ids) * N_SAMPLES, marks if group_interval_s is not None else None, cpu)
    )


def _assembler(url: str, run_name: str, stop, ready, results, profile_path: str | None, gc_freeze: bool) -> None:
    from streamgrp.config import AssemblerConfig, RunConfig
    from streamgrp.services.assembler import Assembler
    from streamgrp.store.runs import connect, join_run

    client = connect(url)
    run = join_run(client, run_name, RunConfig(n_samples=N_SAMPLES, group_timeout_s=600))
    assembler = Assembler(client, run, AssemblerConfig(read_count=READ_COUNT))
    pauses = _GcPauses()
    if gc_freeze:  # experiment: what the assembler's entry point could do after start-up
        gc.collect()
        gc.freeze()
    ready.put(("assembler", os.getpid()))
    if profile_path:
        profiler = cProfile.Profile()
        profiler.enable()
        written = assembler.run(stop)
        profiler.disable()
        profiler.dump_stats(profile_path)
    else:
        written = assembler.run(stop)
    results.put(("assembler", written, pauses.summary()))


class _GcPauses:
    """Times every garbage collection of this process (gc.callbacks): count, total and longest per
    generation, and the wall-clock span of every pause of 1 ms or more (to line up with latency spikes)."""

    def __init__(self) -> None:
        self.stats = {0: [0, 0.0, 0.0], 1: [0, 0.0, 0.0], 2: [0, 0.0, 0.0]}
        self.spans: list[tuple[int, float, float]] = []
        self._began = 0.0
        self._began_wall = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began_wall = time.time()
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        entry = self.stats[info["generation"]]
        entry[0] += 1
        entry[1] += took
        entry[2] = max(entry[2], took)
        if took >= 0.001:
            self.spans.append((info["generation"], self._began_wall, self._began_wall + took))

    def summary(self) -> dict:
        return {"stats": {gen: tuple(values) for gen, values in self.stats.items()}, "spans": self.spans}


# --------------------------------------------------------------------------- parent side


class Bench:
    def __init__(self, url: str, groups: int, server_pid: int | None = None, *, gc_freeze: bool = False) -> None:
        from streamgrp.store.runs import connect

        self.url = url
        self.server_pid = server_pid
        self.gc_freeze = gc_freeze
        self.groups = groups
        self.client = connect(url)
        self.tag = uuid.uuid4().hex[:6]

    # -- 1. raw baseline

    def raw(self, tokens: int, workers: int) -> dict:
        """One raw run: entries/s, its wall time and CPU per role."""
        stream = f"streamgrp-bench:{self.tag}:raw-{tokens}-{workers}"
        self.client.delete(stream)
        self.client.xgroup_create(stream, RAW_GROUP, id="0", mkstream=True)
        task_ids = _task_ids(f"raw{tokens}x{workers}", self.groups)
        ready, start, results = CTX.Queue(), CTX.Event(), CTX.Queue()
        total = self.groups * N_SAMPLES
        procs = [spawn(_raw_consumer, self.url, stream, total, ready, results)]
        procs += [
            spawn(_raw_producer, self.url, stream, tokens, share, ready, start, results)
            for share in _shares(task_ids, workers)
        ]
        try:
            wait_ready(ready, procs, len(procs), READY_TIMEOUT_S)
            server_cpu, busy = cpu_seconds(self.server_pid), machine_busy()
            start.set()
            replies = collect(results, procs, len(procs), RUN_TIMEOUT_S)
            server_cpu, busy = cpu_seconds(self.server_pid) - server_cpu, machine_busy() - busy
        finally:
            join(procs)
            self.client.unlink(stream)
        producers = [r for r in replies if r[0] == "producer"]
        ((_, ended, acked, consumer_cpu),) = [r for r in replies if r[0] == "consumer"]
        if acked != total:
            raise RuntimeError(f"raw consumer acknowledged {acked} of {total} entries")
        began = min(r[1] for r in producers)
        cpu = {"consumer": consumer_cpu, "producers": sum(r[4] for r in producers), "server": server_cpu}
        cpu["others"] = max(0.0, busy - sum(cpu.values()))  # other sessions' processes on this machine
        return {"rate": total / (ended - began), "seconds": ended - began, "cpu": cpu}

    # -- 2. and 3. streamgrp

    def _new_run(self, label: str, task_ids: list[str]):
        from streamgrp.config import RunConfig
        from streamgrp.store.runs import join_run

        run = join_run(self.client, f"bench-{self.tag}-{label}", RunConfig(n_samples=N_SAMPLES, group_timeout_s=600))
        issue_tasks(self.client, run, task_ids)
        return run

    def _poll_rewrites(self, spans: list[tuple[float, float]], done: threading.Event) -> threading.Thread:
        """A thread noting (wall) when the server is rewriting its AOF (a forked child competing for CPU)."""
        from streamgrp.store.runs import connect

        client = connect(self.url)

        def loop() -> None:
            began = None
            while not done.is_set():
                busy = client.info("persistence").get("aof_rewrite_in_progress") == 1
                now = time.time()
                if busy and began is None:
                    began = now
                elif not busy and began is not None:
                    spans.append((began, now))
                    began = None
                time.sleep(0.005)
            if began is not None:
                spans.append((began, time.time()))
            client.close()

        thread = threading.Thread(target=loop, name="aof-rewrite-poller", daemon=True)
        thread.start()
        return thread

    def streamgrp(
        self,
        tokens: int,
        workers: int,
        *,
        paced_rate: float | None = None,
        groups: int | None = None,
        profile_path: str | None = None,
    ) -> dict:
        """Throughput (``paced_rate`` None) or paced latency run; returns the measurements."""
        groups = groups or self.groups
        label = f"{'lat' if paced_rate else 'tp'}{tokens}x{workers}{'p' if profile_path else ''}"
        task_ids = _task_ids(label, groups)
        run = self._new_run(label, task_ids)
        ready, start, stop, results = CTX.Queue(), CTX.Event(), CTX.Event(), CTX.Queue()
        assembler = spawn(_assembler, self.url, run.name, stop, ready, results, profile_path, self.gc_freeze)
        procs = [assembler]
        try:
            wait_ready(ready, procs, 1, READY_TIMEOUT_S)
            wait_folded(self.client, run, groups, READY_TIMEOUT_S)
            interval = None if paced_rate is None else N_SAMPLES / paced_rate
            procs += [
                spawn(_sg_producer, self.url, run.name, tokens, share, ready, start, results, interval)
                for share in _shares(task_ids, workers)
            ]
            wait_ready(ready, procs, workers, READY_TIMEOUT_S)
            seen: list = []
            done = threading.Event()
            observer = observe(self.url, run.keys.decisions, groups, seen, done, RUN_TIMEOUT_S)
            rewrites: list[tuple[float, float]] = []
            poller = self._poll_rewrites(rewrites, done) if paced_rate is not None else None
            # Producers exit when done, so they report their own CPU time.
            roles = {"assembler": [assembler.pid], "server": [self.server_pid], "observer": [os.getpid()]}
            cpu_before = {role: sum(map(cpu_seconds, pids)) for role, pids in roles.items()}
            busy = machine_busy()
            gc.disable()  # the observer (this process) must not pause; the roles keep their own GC
            start.set()
            replies = collect(results, procs, workers, RUN_TIMEOUT_S)
            done.wait(RUN_TIMEOUT_S)
            observer.join()
            if poller is not None:
                poller.join()
            gc.enable()
            cpu = {role: sum(map(cpu_seconds, pids)) - cpu_before[role] for role, pids in roles.items()}
            cpu["producers"] = sum(reply[5] for reply in replies)
            cpu["others"] = max(0.0, machine_busy() - busy - sum(cpu.values()))
            stop.set()
            ((_, written, gc_pauses),) = collect(results, procs, 1, RUN_TIMEOUT_S)
        finally:
            gc.enable()
            stop.set()
            join(procs)
        counts = {k.decode(): int(v) for k, v in self.client.hgetall(run.keys.counts).items()}
        drop_run(self.client, run)
        if len(seen) != groups or written != groups or counts.get("decisions:complete") != groups:
            raise RuntimeError(
                f"expected {groups} complete decisions; observed {len(seen)}, "
                f"assembler wrote {written}, "
                f"counts {counts}"
            )
        began = min(r[1] for r in replies)
        published = max(r[2] for r in replies)
        # Only pauses inside the measured window (folding the pre-issued tasks at start-up also collects).
        gc_pauses["spans"] = [span for span in gc_pauses["spans"] if span[2] >= began]
        ended = max(t for _, _, t in seen)
        out = {
            "slots": groups * N_SAMPLES,
            "seconds": ended - began,
            "rate": groups * N_SAMPLES / (ended - began),
            "publish_rate": groups * N_SAMPLES / (published - began),
            "cpu": cpu,
            "gc": gc_pauses,
        }
        if paced_rate is not None:
            out["latency"], out["slow"] = _latencies(replies, seen, gc_pauses["spans"], rewrites)
            out["rewrites"] = rewrites
        return out


def _latencies(
    replies: list[tuple], seen: list, pauses: list[tuple[int, float, float]], rewrites: list[tuple[float, float]]
):
    """Per-group latencies in ms, and the groups observed over 10 ms with whether an assembler GC
    pause, or a server AOF rewrite, overlapped their publish-to-observed window."""
    from streamgrp.core import codec

    last_slot = {}
    for reply in replies:
        for task_id, entry_id, wall in reply[4]:
            last_slot[task_id] = (_id_ms(entry_id), wall)
    ids, decided, observed, slow = [], [], [], []
    for entry_id, fields, received in seen:
        decision = codec.decode(fields)
        slot_ms, published = last_slot[decision.task_id]
        ids.append(float(_id_ms(entry_id) - slot_ms))
        decided.append((decision.decided_at - published) * 1000)
        observed.append((received - published) * 1000)
        if observed[-1] > 10:
            slow.append(
                (
                    decision.task_id,
                    any(b < received and e > published for _, b, e in pauses),
                    any(b < received and e > published for b, e in rewrites),
                )
            )
    return {"ids": ids, "decided": decided, "observed": observed}, slow


def _print_profile(path: str, top: int) -> None:
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        stats = pstats.Stats(path, stream=text)
        stats.strip_dirs().sort_stats(order).print_stats(top)
        lines = text.getvalue().splitlines()
        first = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
        print(f"\nassembler cProfile, top {top} by {order} ({lines[first - 3].strip() if first >= 3 else ''}):")
        print("\n".join(lines[first - 1 : first + top + 1]))


# --------------------------------------------------------------------------- main


def _entry_bytes(tokens: int) -> int:
    from streamgrp.core import codec

    event, payload = codec.sample_result(
        "tp1024x4-1999", 3, _samples(tokens)[0], producer="worker-host-12345-abcdef", seq=1999
    )
    return sum(len(k) + len(v) for fields in (codec.encode(event), payload) for k, v in fields.items())


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _us(seconds: float, count: int) -> float:
    return seconds / count * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=2000, help="tasks per throughput run (4 slots each)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024], help="tokens per sample")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="producer processes")
    parser.add_argument("--redis-url", default=None, help="server to use; default: an embedded Valkey in a temp dir")
    parser.add_argument("--repeat", type=int, default=3, help="throughput runs per case (the median is reported)")
    parser.add_argument("--latency-seconds", type=float, default=5.0, help="length of each paced latency run")
    parser.add_argument("--load", type=float, default=0.5, help="latency run rate as a fraction of the best rate")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="experiment: gc.freeze() in the assembler process after start-up (not what the library does)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="afterwards, re-run the largest case with the assembler under cProfile and print it",
    )
    parser.add_argument("--profile-top", type=int, default=25)
    args = parser.parse_args(argv)

    server = start_server() if args.redis_url is None else None
    url = args.redis_url or server.url
    wall = time.monotonic()
    load = os.getloadavg()[0]
    try:
        bench = Bench(url, args.groups, server.pid if server else None, gc_freeze=args.gc_freeze)
        info = bench.client.info("server")
        print(
            f"server: {info.get('server_name', 'redis')} {info.get('valkey_version', info.get('redis_version'))} "
            f"({'embedded, appendonly everysec' if server else 'given URL'}); {os.cpu_count()} CPUs; "
            f"{args.groups} groups x {N_SAMPLES} slots per throughput run; median of {args.repeat} runs\n"
            f"slot entry sizes: {', '.join(f'{t} tokens {_entry_bytes(t):,} B' for t in args.tokens)}; "
            f"1-min load average before start {load:.2f}"
            f"{'; EXPERIMENT: assembler runs with gc.freeze()' if args.gc_freeze else ''}",
            flush=True,
        )
        cases = [(tokens, workers) for tokens in args.tokens for workers in args.workers]
        raws: dict = {case: [] for case in cases}
        sgs: dict = {case: [] for case in cases}
        for _ in range(args.repeat):  # interleaved, so slow drift of the machine hits every case alike
            for case in cases:
                raws[case].append(bench.raw(*case))
                sgs[case].append(bench.streamgrp(*case))
        slots = args.groups * N_SAMPLES

        print("\nthroughput, end to end (entries/s; median [min-max])")
        print(
            f"{'tokens':>6} {'workers':>7} {'raw XADD->XACK':>22} {'streamgrp publish->decision':>28} "
            f"{'publish only':>12} {'sg/raw':>6} {'goal>=0.5':>9}"
        )
        best: dict[int, float] = {}
        for case in cases:
            raw = [r["rate"] for r in raws[case]]
            sg = [r["rate"] for r in sgs[case]]
            ratio = _median(sg) / _median(raw)
            best[case[0]] = max(best.get(case[0], 0.0), _median(sg))
            print(
                f"{case[0]:>6} {case[1]:>7} {_median(raw):>8,.0f} [{min(raw):>5,.0f}-{max(raw):>6,.0f}] "
                f"{_median(sg):>14,.0f} [{min(sg):>5,.0f}-{max(sg):>6,.0f}] "
                f"{_median([r['publish_rate'] for r in sgs[case]]):>12,.0f} {ratio:>6.2f} "
                f"{'ok' if ratio >= 0.5 else 'MISSED':>9}"
            )

        print(
            "\nCPU per entry during the throughput runs (microseconds of CPU per slot, mean over runs);\n"
            f"cores = this bench's CPU-s / wall-s; others = cores used meanwhile by other processes on this "
            f"{os.cpu_count()}-CPU machine;\nraw/sg CPU = CPU per raw entry / CPU per streamgrp slot (observer "
            f"excluded): the throughput ratio to expect when the CPU, not round trips, is the limit"
        )
        print(
            f"{'tokens':>6} {'workers':>7} | {'raw: producers':>14} {'consumer':>8} {'server':>6} {'cores':>5} "
            f"{'others':>6} | {'sg: producers':>13} {'assembler':>9} {'server':>6} {'observer':>8} {'cores':>5} "
            f"{'others':>6} | {'raw/sg CPU':>10}"
        )
        for case in cases:
            rc = {k: statistics.fmean(r["cpu"][k] for r in raws[case]) for k in raws[case][0]["cpu"]}
            sc = {k: statistics.fmean(r["cpu"][k] for r in sgs[case]) for k in sgs[case][0]["cpu"]}
            rw = statistics.fmean(r["seconds"] for r in raws[case])
            sw = statistics.fmean(r["seconds"] for r in sgs[case])
            ours_raw = sum(v for k, v in rc.items() if k != "others")
            ours_sg = sum(v for k, v in sc.items() if k != "others")
            print(
                f"{case[0]:>6} {case[1]:>7} | {_us(rc['producers'], slots):>14.0f} "
                f"{_us(rc['consumer'], slots):>8.0f} "
                f"{_us(rc['server'], slots):>6.0f} {ours_raw / rw:>5.2f} {rc['others'] / rw:>6.2f} | "
                f"{_us(sc['producers'], slots):>13.0f} {_us(sc['assembler'], slots):>9.0f} "
                f"{_us(sc['server'], slots):>6.0f} {_us(sc['observer'], slots):>8.0f} {ours_sg / sw:>5.2f} "
                f"{sc['others'] / sw:>6.2f} | {ours_raw / (ours_sg - sc['observer']):>10.2f}"
            )
        spans = [span for case in cases for r in sgs[case] for span in r["gc"]["spans"]]
        gen2 = [e - b for gen, b, e in spans if gen == 2]
        print(
            f"assembler GC pauses inside the measured windows of the {len(cases) * args.repeat} streamgrp runs: "
            f"{len(gen2)} full (gen2) collections, longest {max(gen2, default=0) * 1000:.1f} ms; "
            f"longest gen0/1 {max((e - b for gen, b, e in spans if gen < 2), default=0) * 1000:.1f} ms",
            flush=True,
        )

        print(
            f"\nlatency, last slot -> decision, one paced producer at ~{args.load:.0%} of the best streamgrp rate "
            f"for the token size"
        )
        print(
            f"{'tokens':>6} {'target/s':>8} {'achieved':>8} {'groups':>6} {'clock':>8} "
            f"{'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'goal p99<10':>11}"
        )
        for tokens in args.tokens:
            target = best[tokens] * args.load
            groups = max(50, min(args.groups, int(target / N_SAMPLES * args.latency_seconds)))
            if server is not None:  # our own server: record its own stalls (fork, AOF writes, slow commands)
                bench.client.config_set("latency-monitor-threshold", 2)
                bench.client.execute_command("LATENCY", "RESET")
            rewrites = bench.client.info("persistence").get("aof_rewrites", 0)
            lat = bench.streamgrp(tokens, 1, paced_rate=target, groups=groups)
            rewrites = bench.client.info("persistence").get("aof_rewrites", 0) - rewrites
            events = bench.client.execute_command("LATENCY", "LATEST") if server is not None else []
            for clock in ("ids", "decided", "observed"):
                values = lat["latency"][clock]
                p99 = percentile(values, 0.99)
                print(
                    f"{tokens:>6} {target:>8,.0f} {lat['publish_rate']:>8,.0f} {groups:>6} {clock:>8} "
                    f"{percentile(values, 0.5):>7.2f} {p99:>7.2f} {max(values):>7.2f} "
                    f"{'ok' if p99 < 10 else 'MISSED':>11}",
                    flush=True,
                )
            slow = lat["slow"]
            spans = lat["gc"]["spans"]
            print(
                f"{'':>6} groups observed over 10 ms: {len(slow)}; overlapping an assembler GC pause >= 1 ms: "
                f"{sum(1 for s in slow if s[1])}, an AOF rewrite: {sum(1 for s in slow if s[2])}, "
                f"neither: {sum(1 for s in slow if not (s[1] or s[2]))}"
            )
            stalls = ", ".join(f"{e[0].decode()} max {e[3]} ms" for e in events) or "none over 2 ms"
            print(
                f"{'':>6} assembler GC pauses >= 1 ms: {len(spans)}, longest "
                f"{max((e - b for _, b, e in spans), default=0) * 1000:.1f} ms; server: AOF rewrites {rewrites} "
                f"({sum(e - b for b, e in lat['rewrites']):.2f} s), stalls (LATENCY LATEST) {stalls}; "
                f"other processes used {lat['cpu']['others'] / lat['seconds']:.2f} cores"
            )
        print(
            "  ids: server clock, decision entry id ms - last slot entry id ms (1 ms resolution)\n"
            "  decided: decided_at (assembler wall clock, set before the commit) - publisher wall time after "
            "the XADD\n"
            "  observed: arrival at an XREAD BLOCK reader of decisions - publisher wall time after the XADD"
        )

        if args.profile:
            tokens, workers = max(args.tokens), max(args.workers)
            path = os.path.join(server.data_dir if server else tempfile.gettempdir(), f"assembler-{os.getpid()}.prof")
            sg = bench.streamgrp(tokens, workers, profile_path=path)
            print(f"\nprofiled re-run tokens={tokens} workers={workers}: {sg['rate']:,.0f} slots/s under cProfile")
            _print_profile(path, args.profile_top)
        print(
            f"\ntotal wall time {time.monotonic() - wall:.1f}s; 1-min load average {load:.2f} before, "
            f"{os.getloadavg()[0]:.2f} after"
        )
    finally:
        if server is not None:
            stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
