"""Benchmark the server's CPU per recorded agent-session turn, by payload layout: the turn's tensors as an
argument of ``session_turn`` (layout ``stream``, what runs recorded before the ``keys`` layout do: every byte
copied into Lua and XADDed from there) or staged with ``SET NX PX`` beside the call and renamed to a turn key
(layout ``keys``: no tensor byte passes through Lua), against a raw ``XADD h b`` of the same bytes.

Each round opens one session in a fresh run of the layout and records ``--turns`` turns of ``--tokens``
tokens (prompt and generated ids, the generated tokens' log-probabilities), ``--pipeline`` calls per round
trip, the calls encoded before the clock starts; the figure is the server's ``used_cpu_sys + used_cpu_user``
(INFO cpu) over the round, per turn, the median of ``--rounds`` rounds (the layouts take turns, round by
round). Then the same turns one call at a time on an event loop, as the gateway records them
(`SessionStore.record_on_loop`), with this process's CPU per turn beside the server's. The server is a
fresh local one (AOF on, appendfsync everysec) unless ``--url`` names another.

    python bench/bench_turns.py [--tokens 4096] [--turns 1000] [--pipeline 32] [--rounds 5] [--binary PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import drop_run, server_name, start_server, stop_server

from streamgrp.config import RunConfig
from streamgrp.core import codec
from streamgrp.core.events import RawArray, TurnRecorded
from streamgrp.services.worker_client import WorkerClient
from streamgrp.store import loop_client, payloads
from streamgrp.store.connection import connect
from streamgrp.store.runs import join_run
from streamgrp.store.scripts import ensure_library
from streamgrp.store.sessions import SessionStore, new_key, new_session_id
from streamgrp.store.tasks import TaskIssuer

#: Generated tokens per turn (the rest of ``--tokens`` is its prompt).
GENERATED = 512


def server_cpu(client) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def turns(session: str, task_id: str, count: int, tokens: int) -> list[TurnRecorded]:
    prompt = RawArray.from_values([i % 50000 for i in range(tokens - GENERATED)], "int32")
    return [
        TurnRecorded(
            session=session,
            task_id=task_id,
            slot=0,
            turn=n,
            prompt_ids=prompt,
            completion_ids=RawArray.from_values([(n + i) % 50000 for i in range(GENERATED)], "int32"),
            logprobs=RawArray.from_values([-0.5] * GENERATED, "float32"),
            version=0,
            finish="stop",
            meta={"text": "x"},
        )
        for n in range(1, count + 1)
    ]


def opened(client, layout: str, args: argparse.Namespace):
    """A fresh run of ``layout`` with one open session: (run, its store, its turns' calls)."""
    config = RunConfig(n_samples=1, payload_layout="stream" if layout == "stream" else "keys")
    run = join_run(client, f"bench-turns-{uuid.uuid4().hex[:8]}", config)
    TaskIssuer(client, run.keys).issue([{"q": 1}])
    [taken] = WorkerClient(client, run.keys).take(1, block_ms=None)
    store = SessionStore(client, run.partitions, producer="bench")
    session = new_session_id(0)
    store.open_task(0, taken.entry_id, taken.event, [(session, 0, new_key(session))], deadline=None, version=0)
    return run, store, [store.record_call(t) for t in turns(session, taken.event.task_id, args.turns, args.tokens)]


def on_loop(client, layout: str, args: argparse.Namespace) -> tuple[float, float]:
    """(server, gateway-side CPU µs per turn) of one round of ``layout``'s turns recorded as the gateway records
    them: one `SessionStore.record_on_loop` at a time on an event loop (the call, and in a ``keys`` run the
    staging write beside it in one pipeline); the gateway side is this process's CPU."""
    run, store, calls = opened(client, layout, args)

    async def record_all() -> None:
        aclient = loop_client.loop_client(client)
        assert aclient is not None, "a cluster client has no loop client"
        try:
            for call in calls:
                assert await store.record_on_loop(aclient, call) is not None
        finally:
            await aclient.aclose()

    cpu, own = server_cpu(client), time.process_time()
    asyncio.run(record_all())
    cpu, own = server_cpu(client) - cpu, time.process_time() - own
    drop_run(client, run)
    return cpu / len(calls) * 1e6, own / len(calls) * 1e6


def one_round(client, layout: str, args: argparse.Namespace) -> tuple[float, float]:
    """(server CPU µs per turn, wall µs per turn) of one round of ``layout`` (``stream``, ``keys`` or ``raw``)."""
    run, store, calls = opened(client, layout, args)
    name = store._turn.name
    cpu, wall = server_cpu(client), time.perf_counter()
    for start in range(0, len(calls), args.pipeline):
        pipe = client.pipeline(transaction=False)
        for call in calls[start : start + args.pipeline]:
            if layout == "raw":
                pipe.xadd(run.keys.sessions, {codec.HEADER: call.frame[0], codec.BLOB: call.frame[1]})
                continue
            if call.staged is not None:
                pipe.set(call.staged, payloads.frame(*call.frame), nx=True, px=payloads.STAGED_TTL_MS)
            pipe.fcall(name, len(call.keys), *call.keys, *call.args)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception):
                raise reply
    cpu, wall = server_cpu(client) - cpu, time.perf_counter() - wall
    drop_run(client, run)
    return cpu / len(calls) * 1e6, wall / len(calls) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per turn (512 of them generated)")
    parser.add_argument("--turns", type=int, default=1000, help="turns per round (at most 4096)")
    parser.add_argument("--pipeline", type=int, default=32, help="record calls per round trip")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--binary", default=None, help="the server binary to start (default: the bundled one)")
    parser.add_argument("--url", default=None, help="a running server to use instead of starting one")
    args = parser.parse_args()
    server = None if args.url else start_server(args.binary)
    client = connect(args.url or server.url)
    try:
        ensure_library(client)
        blob = codec.encode(turns(new_session_id(0), "t", 1, args.tokens)[0])[codec.BLOB]
        print(
            f"{server_name(client)}; {args.tokens} tokens per turn ({len(blob)} tensor bytes), {args.turns} turns "
            f"per round, {args.pipeline} per round trip, median of {args.rounds} rounds"
        )
        results: dict[str, list[tuple[float, float]]] = {layout: [] for layout in LAYOUTS}
        for _ in range(args.rounds):  # the layouts in turn, round by round: the machine's drift hits each alike
            for layout in LAYOUTS:
                results[layout].append(one_round(client, layout, args))
        raw = statistics.median(cpu for cpu, _ in results["raw"])
        print(f"{'layout':<8} {'server CPU µs/turn':>19} {'x raw XADD':>11} {'wall µs/turn':>13}")
        for layout, rounds in results.items():
            cpu = statistics.median(c for c, _ in rounds)
            wall = statistics.median(w for _, w in rounds)
            print(f"{layout:<8} {cpu:>19.1f} {cpu / raw:>11.2f} {wall:>13.1f}")
        print("one call at a time on an event loop, as the gateway records a turn:")
        print(f"{'layout':<8} {'server CPU µs/turn':>19} {'gateway CPU µs/turn':>20}")
        looped: dict[str, list[tuple[float, float]]] = {"stream": [], "keys": []}
        for _ in range(args.rounds):
            for layout in looped:
                looped[layout].append(on_loop(client, layout, args))
        for layout, rounds in looped.items():
            cpu, own = statistics.median(c for c, _ in rounds), statistics.median(o for _, o in rounds)
            print(f"{layout:<8} {cpu:>19.1f} {own:>20.1f}")
    finally:
        client.close()
        if server is not None:
            stop_server(server)


#: ``stream``: the tensors through Lua (before); ``keys``: staged beside the call (now); ``raw``: XADD h b.
LAYOUTS = ("stream", "keys", "raw")

if __name__ == "__main__":
    main()
