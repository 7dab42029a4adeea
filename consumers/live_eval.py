"""A live evaluation beside training: pass rates per prompt and per difficulty, from decisions as they happen.

    python -m streamgrp.consumers.live_eval --run RUN --state eval.json [--name live-eval] [--threshold 0.5]

A follower (`streamgrp.store.follower`) of the run's decisions: each decided group adds its slots to
its prompt's tally, a slot passing when it produced a sample whose reward is at least ``--threshold``
(rejected, failed and timed-out slots count as tried and not passed). A prompt's difficulty is its
``--difficulty-key`` field (default ``difficulty``; ``unknown`` without one), read from the task's
`TaskIssued` in the slot log. Nothing it does reaches the trainer: it reads, and records its position.

The tallies live in ``--state`` (JSON, replaced atomically), written after each read and before the
follower's position is recorded, with the last entry applied per stream: a decision that comes again
after a crash (read but not recorded) is recognized by its entry id and not counted twice. So the
tallies count every decision exactly once, whatever kills the process. ``--keep-ids`` keeps every applied entry id, in
order, in the state (what the tests check).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, TaskIssued
from streamgrp.errors import DecodeError
from streamgrp.store.follower import Followed, Follower, Skipped
from streamgrp.store.keys import id_key
from streamgrp.store.streams import entry_time


class LiveEval:
    """Pass rates per prompt and per difficulty, folded from decisions; its state is JSON."""

    def __init__(self, state: dict | None = None, *, threshold: float = 0.5, keep_ids: bool = False) -> None:
        self.state = state or {"last": {}, "prompts": {}, "skipped": 0}
        self.threshold = threshold
        self.keep_ids = keep_ids
        if keep_ids:
            self.state.setdefault("ids", [])

    def apply(self, stream: str, entry_id: str, decision: GroupDecided, difficulty: str) -> bool:
        """Count ``decision`` unless its entry was counted already (at or before the stream's last one)."""
        last = self.state["last"].get(stream)
        if last is not None and id_key(entry_id) <= id_key(last):
            return False
        self.state["last"][stream] = entry_id
        passed = sum(1 for m in decision.members if m.reward is not None and m.reward >= self.threshold)
        tally = self.state["prompts"].setdefault(decision.task_id, {"difficulty": difficulty, "passed": 0, "slots": 0})
        tally["passed"] += passed
        tally["slots"] += decision.stats.target_slot_count
        if self.keep_ids:
            self.state["ids"].append(entry_id)
        return True

    def skipped(self, item: Skipped) -> None:
        self.state["skipped"] += item.count
        self.state["last"][item.stream] = max(self.state["last"].get(item.stream, "0-0"), item.before, key=id_key)

    def rates(self) -> dict[str, Any]:
        """Pass rate per prompt, and per difficulty over its prompts' slots."""
        prompts = self.state["prompts"]
        by_difficulty: dict[str, dict[str, float]] = {}
        for tally in prompts.values():
            level = by_difficulty.setdefault(tally["difficulty"], {"prompts": 0, "passed": 0, "slots": 0})
            level["prompts"] += 1
            level["passed"] += tally["passed"]
            level["slots"] += tally["slots"]
        for level in by_difficulty.values():
            level["pass_rate"] = level["passed"] / level["slots"] if level["slots"] else 0.0
        return {
            "prompts": {task: t["passed"] / t["slots"] if t["slots"] else 0.0 for task, t in prompts.items()},
            "difficulty": by_difficulty,
        }


class Difficulties:
    """Each task's difficulty (its prompt's ``key`` field), from its `TaskIssued` in the slot log near the
    decision's ``issued_at``. The feeder issues tasks in batches, so one read finds a batch's issues: all
    of them are kept (up to `KEEP`), and the batch's other decisions need no read."""

    KEEP = 100_000

    def __init__(self, client: Any, run: Any, key: str) -> None:
        self.client = client
        self.run = run
        self.key = key
        self.known: dict[str, str] = {}

    def __call__(self, stream: str, decision: GroupDecided) -> str:
        found = self.known.pop(decision.task_id, None)  # a task is decided once: its entry is not needed again
        if found is not None or decision.issued_at is None:
            return found or "unknown"
        slots = self.run.stream_key(stream.replace("decisions", "slots"))
        start = f"{max(0, int(decision.issued_at * 1000) - 5)}-0"
        for _ in range(4):  # the issue sits among the first entries from there
            page = self.client.xrange(slots, start, "+", count=128)
            for _raw_id, fields in page:
                if b'"kind":"task_issued"' not in fields.get(b"h", b""):  # a bytes test before decoding
                    continue
                try:
                    event = codec.decode(fields)
                except DecodeError:
                    continue
                if isinstance(event, TaskIssued) and len(self.known) < self.KEEP:
                    self.known[event.task_id] = str(event.prompt.get(self.key, "unknown"))
            found = self.known.pop(decision.task_id, None)
            if found is not None:
                return found
            if len(page) < 128 or entry_time(page[-1][0].decode()) > decision.issued_at + 5:
                break
            start = "(" + page[-1][0].decode()
        return "unknown"


def _save(path: Path, state: dict) -> None:
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as f:
        f.write(orjson.dumps(state))
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def run_eval(
    client: Any,
    run: Any,
    state_path: Path,
    *,
    name: str = "live-eval",
    threshold: float = 0.5,
    difficulty_key: str = "difficulty",
    keep_ids: bool = False,
    stop: threading.Event | None = None,
    until_finished: bool = True,
    delay_s: float = 0.0,
    batch: int = 256,
) -> LiveEval:
    """Follow the run's decisions into ``state_path`` until ``stop`` (or the run's end)."""
    stop = stop or threading.Event()
    state = orjson.loads(state_path.read_bytes()) if state_path.exists() else None
    evaluation = LiveEval(state, threshold=threshold, keep_ids=keep_ids)
    follower = Follower(client, run, name, "decisions", batch=batch)
    difficulty_of = Difficulties(client, run, difficulty_key)
    idle_since = None
    while not stop.is_set():
        items = follower.poll()  # one read: applied, saved once, then recorded as handled
        for item in items:
            if isinstance(item, Skipped):
                evaluation.skipped(item)
            elif isinstance(item, Followed) and isinstance(item.event, GroupDecided):
                evaluation.apply(item.stream, item.entry_id, item.event, difficulty_of(item.stream, item.event))
                if delay_s:
                    stop.wait(delay_s)  # a slow consumer (the tests')
            follower.handled(item)
        if items:
            _save(state_path, evaluation.state)  # before the position is recorded
            follower.record()
            idle_since = None
            continue
        idle_since = idle_since if idle_since is not None else time.monotonic()
        if until_finished and follower.run_ended() and time.monotonic() - idle_since >= 2.0:
            break
        stop.wait(0.2)
    return evaluation


def main(argv: list[str] | None = None) -> int:
    from streamgrp.store.runs import await_run, connect

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=os.environ.get("STREAMGRP_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--run", default=os.environ.get("STREAMGRP_RUN"), required="STREAMGRP_RUN" not in os.environ)
    parser.add_argument("--name", default="live-eval")
    parser.add_argument("--state", type=Path, default=Path("live-eval.json"))
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--difficulty-key", default="difficulty")
    parser.add_argument("--keep-ids", action="store_true")
    parser.add_argument("--delay-s", type=float, default=0.0, help="pause after each decision (a slow consumer)")
    parser.add_argument("--batch", type=int, default=256, help="decisions read, applied and recorded at once")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = connect(args.redis_url)
    evaluation = run_eval(
        client,
        await_run(client, args.run, stop=stop),
        args.state,
        name=args.name,
        threshold=args.threshold,
        difficulty_key=args.difficulty_key,
        keep_ids=args.keep_ids,
        stop=stop,
        delay_s=args.delay_s,
        batch=args.batch,
    )
    rates = evaluation.rates()
    for level, figures in sorted(rates["difficulty"].items()):
        print(f"difficulty {level}: {figures['prompts']} prompts, pass rate {figures['pass_rate']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
