"""Server memory of the same run with and without retention.

The same `streamgrp demo` (2 ranks, 2 workers, the demo's defaults) runs twice, each on a fresh
embedded Valkey: once alone ("kept": nothing is ever trimmed), once beside `streamgrp archiver
--retention` ("retained": the archiver copies every stream to disk and trims the server behind the
archive and every reader). Every 0.25 s a sampler reads the server's ``INFO memory`` used_memory,
the ``MEMORY USAGE`` of the run's streams (SAMPLES 0: every node counted) and the slot log's length.

Printed per variant: used_memory before the run, at its peak and at the end; the streams' bytes
at the peak and at the end; the slot log's entries at the peak and at the end; the archive's size
on disk; the run's wall time and that every rank committed every step.

    python bench/bench_retention.py [--steps 60] [--retention-interval-s 1]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson  # noqa: E402
import redis  # noqa: E402

from streamgrp.cli.server import EmbeddedServer  # noqa: E402
from streamgrp.store.keys import RunKeys  # noqa: E402


def stream_bytes(client: redis.Redis, keys: RunKeys) -> int:
    return sum(client.memory_usage(key, samples=0) or 0 for key in keys.all_streams().values())


class Sampler:
    def __init__(self, url: str, keys: RunKeys, interval: float = 0.25) -> None:
        self.client = redis.Redis.from_url(url)
        self.keys = keys
        self.interval = interval
        self.rows: list[tuple[int, int, int]] = []  # used_memory, stream bytes, slot entries
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> tuple[int, int, int]:
        return (
            int(self.client.info("memory")["used_memory"]),
            stream_bytes(self.client, self.keys),
            int(self.client.xlen(self.keys.slots)),
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.rows.append(self.sample())

    def close(self) -> tuple[int, int, int]:
        self._stop.set()
        self._thread.join()
        end = self.sample()
        self.client.close()
        return end


def run_variant(variant: str, args, tmp: Path) -> dict:
    run = f"bench-{variant}"
    keys = RunKeys(run)
    data_dir = tmp / variant
    with EmbeddedServer(tmp / f"server-{variant}") as server:
        client = redis.Redis.from_url(server.url)
        before = int(client.info("memory")["used_memory"])
        archiver = None
        if variant == "retained":
            archiver = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "streamgrp",
                    "archiver",
                    "--redis-url",
                    server.url,
                    "--run",
                    run,
                    "--data-dir",
                    str(data_dir),
                    "--retention",
                    "--retention-interval-s",
                    str(args.retention_interval_s),
                ],
                stdout=subprocess.DEVNULL,
                stderr=open(tmp / f"archiver-{variant}.log", "wb"),
            )
        sampler = Sampler(server.url, keys)
        started = time.monotonic()
        demo = subprocess.run(
            [
                sys.executable,
                "-m",
                "streamgrp",
                "demo",
                "--redis-url",
                server.url,
                "--data-dir",
                str(data_dir),
                "--run",
                run,
                "--steps",
                str(args.steps),
                "--ranks",
                "2",
                "--workers",
                "2",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=args.steps * 10 + 120,
        )
        seconds = time.monotonic() - started
        end = sampler.close()
        if archiver is not None:
            archiver.terminate()
            archiver.wait(timeout=30)
        if demo.returncode != 0:
            raise SystemExit(f"the {variant} demo failed:\n{demo.stderr[-3000:]}")
        summary = orjson.loads(demo.stdout.strip().splitlines()[-1])
        archive = data_dir / "archive" / run
        client.close()
    rows = sampler.rows or [end]
    return {
        "used_before": before,
        "used_peak": max(r[0] for r in rows),
        "used_end": end[0],
        "streams_peak": max(r[1] for r in rows),
        "streams_end": end[1],
        "slots_peak": max(r[2] for r in rows),
        "slots_end": end[2],
        "archive_bytes": sum(p.stat().st_size for p in archive.rglob("*") if p.is_file()) if archive.exists() else 0,
        "seconds": seconds,
        "committed": summary["committed_steps"],
        "steps": summary["steps"],
        "written": summary["tasks"] + summary["slots_published"],
    }


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--retention-interval-s", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {variant: run_variant(variant, args, Path(tmp)) for variant in ("kept", "retained")}
    print(f"demo, {args.steps} steps, 2 ranks, 2 workers; retention every {args.retention_interval_s:g} s")
    print(
        f"{'':<9} {'used_memory MiB':>28} {'run streams MiB':>17} {'slot entries':>14} {'archive':>9} "
        f"{'run':>6}  committed"
    )
    print(
        f"{'':<9} {'before':>8} {'peak':>9} {'end':>9} {'peak':>8} {'end':>8} {'peak':>6} {'end':>7} "
        f"{'MiB':>9} {'s':>6}"
    )
    for variant, r in results.items():
        print(
            f"{variant:<9} {mib(r['used_before']):>8} {mib(r['used_peak']):>9} {mib(r['used_end']):>9} "
            f"{mib(r['streams_peak']):>8} {mib(r['streams_end']):>8} {r['slots_peak']:>6} {r['slots_end']:>7} "
            f"{mib(r['archive_bytes']):>9} {r['seconds']:>6.1f}  {r['committed']}"
        )
    kept, retained = results["kept"], results["retained"]
    print(
        f"slot-log entries written: {kept['written']}; peak run-stream memory retained / kept: "
        f"{retained['streams_peak'] / kept['streams_peak']:.3f}; peak used_memory growth retained / kept: "
        f"{(retained['used_peak'] - retained['used_before']) / (kept['used_peak'] - kept['used_before']):.3f}"
    )


if __name__ == "__main__":
    main()
