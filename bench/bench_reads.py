"""Benchmark a payload read: `streamgrp.store.payloads.read` of 64 payload keys (one MGET) through redis-py and
hiredis, against the same read on a connection of the reader's own (`OwnConnection.values`: the reply into one
buffer, values as views of it, a free buffer read into again), as the assembler and the trainer read.

Each way runs in a fresh process (a reader's memory as it is in a role, not warmed by the other way), on a
server started here (Debian's redis-server 7.0, or the bundled Valkey with ``--server valkey``); CPU µs of the
reading process per value, best of ``--rounds`` rounds of 5 reads, alternating the two ways ``--repeat`` times.

    python bench/bench_reads.py [--sizes 8200 66000 330000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VALUES = 64

CHILD = r"""
import os, sys, time
import redis
from streamgrp.store import payloads
from streamgrp.store.own_connection import OwnConnection
url, way, size, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = redis.Redis.from_url(url)
stream = f"bench:reads:{size}"
ids = [f"{i}-0" for i in range({values})]
pipe = client.pipeline(transaction=False)
for entry_id in ids:
    pipe.set(payloads.key(stream, entry_id), payloads.frame(b'{{"h":1}}', os.urandom(size)))
pipe.execute()
own = OwnConnection(client) if way == "own" else None
best = float("inf")
for _ in range(rounds):
    started = time.process_time()
    for _ in range(5):
        read = payloads.read(client, stream, ids, views=True, own=own)
        del read
    best = min(best, (time.process_time() - started) / (5 * len(ids)))
print(best * 1e6)
""".replace("{values}", str(VALUES))


def _start(kind: str, directory: str):
    sys.path.insert(0, str(ROOT))
    from streamgrp.cli.server import EmbeddedServer

    binary = "/usr/bin/redis-server" if kind == "redis" else None
    server = EmbeddedServer(Path(directory), **({"binary": binary} if binary else {}))
    server.start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8_200, 66_000, 330_000], help="bytes a value")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--server", choices=("redis", "valkey"), default="redis")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as directory:
        server = _start(args.server, directory)
        try:
            print(f"{VALUES} values an MGET, {args.server} server; CPU µs of the reader per value (each run's best)")
            print(f"{'bytes a value':>14} {'redis-py':>20} {'own connection':>20} {'ratio':>7}")
            for size in args.sizes:
                runs: dict[str, list[float]] = {"redis-py": [], "own": []}
                for _ in range(args.repeat):
                    for way in runs:
                        done = subprocess.run(
                            [sys.executable, "-c", CHILD, server.url, way, str(size), str(args.rounds)],
                            capture_output=True,
                            text=True,
                            env=env,
                            check=True,
                        )
                        runs[way].append(float(done.stdout.strip()))
                shown = {way: " ".join(f"{v:.1f}" for v in values) for way, values in runs.items()}
                ratio = min(runs["redis-py"]) / min(runs["own"])
                print(f"{size:>14} {shown['redis-py']:>20} {shown['own']:>20} {ratio:>6.2f}x")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
