"""Benchmark the agent gateway: its own time per turn (overhead) and its CPU per turn, with many sessions.

``--sessions`` concurrent sessions (256 by default; tasks of 4 slots, opened in online mode) each take
``--turns`` chat turns in a conversation that only grows (user message, the assistant's answer as
returned, a tool message, ...), pausing ``--think-ms`` on average between turns (exponential), like an
agent running a tool. A fake llama-server answers every request (``/apply-template``, ``/tokenize``,
``/completion``, ``/detokenize``) after ``--gen-ms`` for a generation and at once otherwise, in a
process of its own, so the machine's CPU goes to the gateway, the store (Valkey), the fake and the
load generator (raw JSON over aiohttp, not the openai SDK, to keep its share small).

Reported per framework (``--frameworks aiohttp,starlette``: the gateway's HTTP layer on aiohttp, which
ships, or on Starlette under uvicorn with httptools, which the choice was measured against):

- *overhead*: the gateway's own time per turn, as it measures it (`streamgrp.services.gateway.server`:
  body read to last byte sent, less the time its threads spent in requests to the inference server),
  p50 / p99 / max, in ms: parsing, checks, the chat-template logic, thread hand-offs, recording the
  turn (a store round trip), the reply;
- *CPU*: the gateway process's CPU seconds (utime + stime, all threads) over the measured window,
  per turn;
- *client*: what the load generator saw per turn, p50 / p99, less the fake's generation time.

    python bench/bench_gateway.py [--sessions 256] [--turns 8] [--think-ms 1000] [--gen-ms 100] [--frameworks
    aiohttp,starlette]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import CTX, cpu_seconds, drop_run, get, join, server_name, spawn, start_server, stop_server

from streamgrp.cli.children import free_port

TOKEN = "bench-token"
ANSWER = 'The tool says: <tool_call>\n{"name": "lookup", "arguments": {"q": "sea"}}\n</tool_call>'
SPECIAL = {"<|im_start|>": 1, "<|im_end|>": 2}
_SPECIAL = re.compile("(<\\|im_start\\|>|<\\|im_end\\|>)")


# --------------------------------------------------------------------------- the fake llama-server


def _tokenize(text: str, parse_special: bool) -> list[int]:
    ids: list[int] = []
    for part in _SPECIAL.split(text) if parse_special else [text]:
        if part in SPECIAL and parse_special:
            ids.append(SPECIAL[part])
        else:
            ids += [ord(c) + 16 for c in part]
    return ids


def _detokenize(ids: list[int]) -> str:
    names = {v: k for k, v in SPECIAL.items()}
    return "".join(names.get(t) or chr(t - 16) for t in ids)


def fake_llama(port: int, gen_s: float, ready) -> None:
    """A llama-server stand-in: ChatML template, one token per character, a fixed answer after ``gen_s``."""
    import orjson
    from aiohttp import web

    answer_ids = _tokenize(ANSWER, False) + [SPECIAL["<|im_end|>"]]
    entries = [{"id": t, "logprob": -0.25, "token": "", "bytes": [], "top_logprobs": []} for t in answer_ids]

    async def apply_template(request):
        body = orjson.loads(await request.read())
        text = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in body["messages"])
        return web.Response(
            body=orjson.dumps({"prompt": text + "<|im_start|>assistant\n"}), content_type="application/json"
        )

    async def tokenize(request):
        body = orjson.loads(await request.read())
        return web.Response(
            body=orjson.dumps({"tokens": _tokenize(body["content"], body.get("parse_special", False))}),
            content_type="application/json",
        )

    async def detokenize(request):
        body = orjson.loads(await request.read())
        return web.Response(
            body=orjson.dumps({"content": _detokenize(body["tokens"])}), content_type="application/json"
        )

    async def completion(request):
        orjson.loads(await request.read())
        await asyncio.sleep(gen_s)
        return web.Response(
            body=orjson.dumps(
                {
                    "content": ANSWER,
                    "tokens": answer_ids,
                    "stop_type": "eos",
                    "completion_probabilities": entries,
                    "model": "fake@v0",
                }
            ),
            content_type="application/json",
        )

    async def health(request):
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.add_routes(
            [
                web.post("/apply-template", apply_template),
                web.post("/tokenize", tokenize),
                web.post("/detokenize", detokenize),
                web.post("/completion", completion),
                web.get("/health", health),
            ]
        )
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=2048).start()
        ready.put(os.getpid())
        await asyncio.Event().wait()

    asyncio.run(main())


# --------------------------------------------------------------------------- the gateway, on either framework


class Recorder:
    """The gateway's metrics, keeping every turn's overhead besides."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        from streamgrp.cli.metrics import Metrics

        self._metrics = Metrics(CollectorRegistry(), role="gateway")
        self.values: list[float] = []
        outer = self

        class _Overhead:
            def observe(self, value: float) -> None:
                outer.values.append(value)

        self.gateway_overhead = _Overhead()

    def __getattr__(self, name: str):
        return getattr(self._metrics, name)


def gateway_child(
    framework: str,
    redis_url: str,
    run_name: str,
    upstream_url: str,
    port: int,
    threads: int,
    ready,
    results,
    stop,
    profile: str | None = None,
) -> None:
    from streamgrp.config import InferenceConfig
    from streamgrp.services.gateway.gateway import Gateway
    from streamgrp.services.gateway.templates import make_template
    from streamgrp.services.gateway.upstream import Upstream
    from streamgrp.store.runs import connect, open_run

    client = connect(redis_url)
    run = open_run(client, run_name)
    upstream = Upstream.from_config("llamacpp", InferenceConfig(server_url=upstream_url, max_tokens=256))
    recorder = Recorder()
    gateway = Gateway(
        client,
        run,
        upstream,
        make_template(upstream, None),
        public_url=f"http://127.0.0.1:{port}",
        metrics=recorder,
        threads=threads,
    )
    done = threading.Event()
    threading.Thread(target=lambda: (stop.wait(), done.set()), daemon=True).start()
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    if framework == "aiohttp":
        from streamgrp.services.gateway.server import GatewayServer, serve

        asyncio.run(
            serve(GatewayServer(gateway, token=TOKEN), "127.0.0.1", port, done, ready=lambda _: ready.put(os.getpid()))
        )
    else:
        asyncio.run(_serve_starlette(gateway, port, done, ready))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    results.put(recorder.values)
    gateway.close()


async def _serve_starlette(gateway, port: int, stop: threading.Event, ready) -> None:
    """The same gateway behind Starlette on uvicorn (httptools): the routes the benchmark uses."""
    import orjson
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from streamgrp.services.gateway.openai_api import chat_reply
    from streamgrp.services.gateway.turn_timer import TurnTimer

    def reply(value, status: int = 200) -> Response:
        return Response(orjson.dumps(value), status_code=status, media_type="application/json")

    async def chat(request):
        timer = TurnTimer.start()
        try:
            key = request.headers.get("authorization", "")[7:]
            answer, report = await gateway.chat(key, orjson.loads(await request.body()), request.headers, timer)
            response = reply(chat_reply(answer, report))
        except Exception as exc:  # noqa: BLE001
            return reply({"error": {"message": str(exc)}}, 500)
        gateway.metrics.gateway_overhead.observe(timer.own())  # uvicorn writes after return: that part is not counted
        return response

    async def open_sessions(request):
        body = orjson.loads(await request.body())
        opened = await gateway.open_sessions(wait_s=float(body.get("wait_s", 0)))
        return Response(status_code=204) if opened is None else reply(opened)

    async def end(request):
        body = orjson.loads(await request.body())
        return reply(await gateway.end_session(request.path_params["sid"], reward=body.get("reward")))

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/sessions", open_sessions, methods=["POST"]),
            Route("/sessions/{sid}/end", end, methods=["POST"]),
        ]
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            loop="asyncio",
            http="httptools",
            lifespan="off",
            log_level="warning",
            access_log=False,
            backlog=2048,
        )
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    ready.put(os.getpid())
    while not stop.is_set():
        await gateway.refresh()
        await asyncio.sleep(1.0)
    server.should_exit = True
    await task
    await gateway.aclose()


# --------------------------------------------------------------------------- the load


async def _drive(url: str, tasks: int, turns: int, think_s: float, seed: int) -> tuple[list[float], int, float]:
    """Open ``tasks`` tasks' sessions, run every session's conversation, end them; (client latency per turn,
    turns, seconds of the turn phase)."""
    import aiohttp
    import orjson

    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        opened = []
        for _ in range(tasks):
            async with http.post(f"{url}/sessions", json={"wait_s": 5}, headers=headers) as response:
                assert response.status == 200, await response.text()
                opened.append(await response.json())
        sessions = [s for task in opened for s in task["sessions"]]

        async def converse(session: dict) -> None:
            key = {"Authorization": f"Bearer {session['api_key']}", "Content-Type": "application/json"}
            messages = [{"role": "user", "content": "Look up the sea, then answer in one word."}]
            tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
            await asyncio.sleep(rng.uniform(0, 2 * think_s))  # sessions start apart, as agents do
            for turn in range(turns):
                started = time.perf_counter()
                body = orjson.dumps({"model": "policy", "messages": messages, "tools": tools})
                async with http.post(f"{url}/v1/chat/completions", headers=key, data=body) as response:
                    body = await response.json()
                    assert response.status == 200, body
                latencies.append(time.perf_counter() - started)
                message = body["choices"][0]["message"]
                messages.append({k: v for k, v in message.items() if v is not None})
                for call in message.get("tool_calls") or []:
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"result {turn}"})
                await asyncio.sleep(rng.expovariate(1 / think_s) if think_s else 0)
            async with http.post(
                f"{url}/sessions/{session['session_id']}/end", json={"reward": 1.0}, headers=headers
            ) as response:
                assert response.status == 200, await response.text()

        started = time.perf_counter()
        await asyncio.gather(*(converse(s) for s in sessions))
        return latencies, len(latencies), time.perf_counter() - started


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def bench(framework: str, args, redis_url: str, client) -> dict:
    from streamgrp.config import RunConfig
    from streamgrp.store.runs import join_run
    from streamgrp.store.tasks import TaskIssuer

    tasks = args.sessions // 4
    run = join_run(client, f"bench-gw-{uuid.uuid4().hex[:8]}", RunConfig(n_samples=4, group_timeout_s=3600.0))
    TaskIssuer(client, run.keys).issue([{"q": i} for i in range(tasks)])
    ready, results, stop = CTX.Queue(), CTX.Queue(), CTX.Event()
    upstream_port, port = free_port("127.0.0.1"), free_port("127.0.0.1")
    procs = [spawn(fake_llama, upstream_port, args.gen_ms / 1000, ready)]
    get(ready, procs, 30)
    procs.append(
        spawn(
            gateway_child,
            framework,
            redis_url,
            run.name,
            f"http://127.0.0.1:{upstream_port}",
            port,
            args.threads,
            ready,
            results,
            stop,
            args.profile if args.profile != "pid" else None,
        )
    )
    pid = get(ready, procs, 60)
    if args.profile == "pid":
        print(f"gateway pid {pid}", flush=True)
    try:
        cpu0 = cpu_seconds(pid)
        latencies, turns, seconds = asyncio.run(
            _drive(f"http://127.0.0.1:{port}", tasks, args.turns, args.think_ms / 1000, args.seed)
        )
        cpu = cpu_seconds(pid) - cpu0
    finally:
        stop.set()
    overheads = get(results, procs, 60)
    procs[0].terminate()
    join(procs[1:])
    procs[0].join()
    drop_run(client, run)
    gen = args.gen_ms / 1000
    return {
        "framework": framework,
        "turns": turns,
        "seconds": seconds,
        "overheads": overheads,
        "cpu_ms_per_turn": 1000 * cpu / turns,
        "cpu_share": cpu / seconds,
        "client_p50": 1000 * (_pct(latencies, 0.5) - gen),
        "client_p99": 1000 * (_pct(latencies, 0.99) - gen),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--think-ms", type=float, default=1000.0, help="mean pause between a session's turns")
    parser.add_argument("--gen-ms", type=float, default=100.0, help="the fake server's time per generation")
    parser.add_argument("--threads", type=int, default=64, help="the gateway's threads (--gateway-threads)")
    parser.add_argument("--frameworks", default="aiohttp", help="aiohttp, starlette, or both comma-separated")
    parser.add_argument("--redis-url", default=None, help="a server to use (default: a bundled Valkey started here)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="cProfile the gateway's event loop into "
        "FILE ('pid': print the gateway's pid instead, for a sampling profiler)",
    )
    args = parser.parse_args()

    from streamgrp.store.runs import connect

    server = None if args.redis_url else start_server()
    url = args.redis_url or server.url
    client = connect(url)
    try:
        print(
            f"{platform.machine()}, {os.cpu_count()} cores, CPython {platform.python_version()}, "
            f"{server_name(client)}; {args.sessions} sessions x {args.turns} turns, think {args.think_ms:g} ms, "
            f"generation {args.gen_ms:g} ms"
        )
        print(
            "| HTTP layer | turns/s | overhead p50 / p99 / max ms | CPU ms per turn | gateway CPU share | "
            "client p50 / p99 ms (less generation) |"
        )
        print("|---|---|---|---|---|---|")
        for framework in args.frameworks.split(","):
            row = bench(framework.strip(), args, url, client)
            o = [1000 * v for v in row["overheads"]]
            print(
                f"| {row['framework']} | {row['turns'] / row['seconds']:.0f} | {statistics.median(o):.2f} / "
                f"{_pct(o, 0.99):.2f} / {max(o):.2f} | {row['cpu_ms_per_turn']:.2f} | {row['cpu_share']:.0%} | "
                f"{row['client_p50']:.2f} / {row['client_p99']:.2f} |",
                flush=True,
            )
    finally:
        client.close()
        if server is not None:
            stop_server(server)


if __name__ == "__main__":
    main()
