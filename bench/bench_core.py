"""Benchmark the assembler's per-entry cost: the pure fold, the codec, and the two together.

Fold: slot events per second through `streamgrp.core.group_fold.run_fold` over an in-memory event list built
before timing: G groups of ``n_samples=4`` (a `TaskIssued`, then four `SlotResult`s, about 80%
samples of 256 tokens, 10% rejected, 10% failed), interleaved across 64 concurrently open groups
in random arrival order, a redelivered duplicate about every 50 slot results, and a `Tick` every
500 entries. Policy ``GroupPolicy(n_samples=4, reward_norm=NormSpec("group", "group"))`` with a
600 s group timeout (no deadline fires: the ticks stay well inside it). It is timed twice: on
ready-made event objects (also with the garbage collector off, to show its share: here the
whole event list is live, so full collections cost more than in the assembler), and with every
entry first decoded from pre-encoded stream fields (`codec.decode`), which is what the assembler
does per entry. Otherwise the garbage collector stays on, as in the assembler.

Codec: median microseconds to encode and decode one `SlotResult` carrying a one-row sample of
1024 (and 256) tokens, with streamgrp's codec (orjson header beside raw little-endian bytes)
against a baseline that writes the same fields as plain orjson lists. Both decoders end in the
same validated `SlotResult`; the baseline's ``orjson.loads`` alone is shown too, labelled as such.
These loops use `timeit` (garbage collector off while timing).

Neither part touches Redis.

    python bench/bench_core.py [--events 80000] [--repeat 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time
import timeit
from collections import Counter
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import msgspec  # noqa: E402
import orjson  # noqa: E402

from streamgrp.core import codec  # noqa: E402
from streamgrp.core.events import RawArray, Sample, SlotResult, TaskIssued, Tick  # noqa: E402
from streamgrp.core.group_fold import Closed, Ignored, run_fold  # noqa: E402
from streamgrp.core.legacy import SlotResultV1  # noqa: E402
from streamgrp.core.policy import GroupPolicy, NormSpec  # noqa: E402
from streamgrp.services.synthetic import make_sample  # noqa: E402

N_SAMPLES = 4
OPEN_GROUPS = 64
DUPLICATE_EVERY = 50  # slot results between redelivered duplicates, on average
TICK_EVERY = 500  # entries between ticks
GROUP_TIMEOUT_S = 600.0
SAMPLE_POOL = 64  # distinct 256-token samples the slot results point at (the fold only reads them)

Entry = tuple[str, Any]


# ---------------------------------------------------------------------------------------- fold


def build_events(groups: int, rng: random.Random) -> tuple[list[Entry], Counter[str]]:
    """Entries ``(entry_id, event)`` in a realistic arrival order, and a count of what was built."""
    pool = [make_sample(tokens=256, seed=k, version=k % 4, reward=rng.random()) for k in range(SAMPLE_POOL)]
    entries: list[Entry] = []
    counts: Counter[str] = Counter()
    # task_id -> slots still to arrive (in a shuffled order) and the slot events already sent
    open_groups: dict[str, tuple[list[int], list[SlotResult]]] = {}
    issued = 0
    now = 0.0

    def add(event: Any, what: str) -> None:
        nonlocal now
        entries.append((f"{len(entries) + 1}-0", event))
        counts[what] += 1
        if len(entries) % TICK_EVERY == 0:
            now += 1.0  # one simulated second per tick: 600 s is never reached below ~300k entries
            entries.append((f"{len(entries) + 1}-0", Tick(now=now)))
            counts["tick"] += 1

    while issued < groups or open_groups:
        while issued < groups and len(open_groups) < OPEN_GROUPS:
            task_id = f"task-{issued:07d}"
            issued += 1
            pending = list(range(N_SAMPLES))
            rng.shuffle(pending)
            open_groups[task_id] = (pending, [])
            add(TaskIssued(task_id=task_id, issued_at=0.0), "task_issued")
        task_id = rng.choice(list(open_groups))
        pending, sent = open_groups[task_id]
        slot = pending.pop()
        draw = rng.random()
        if draw < 0.8:
            event = codec.sample_result(task_id, slot, pool[rng.randrange(SAMPLE_POOL)])[0]
        elif draw < 0.9:
            event = SlotResult(task_id=task_id, slot=slot, outcome="rejected")
        else:
            event = SlotResult(task_id=task_id, slot=slot, outcome="failed", error="x")
        sent.append(event)
        add(event, f"slot_{event.outcome}")
        if not pending:
            del open_groups[task_id]
        if rng.random() < 1.0 / DUPLICATE_EVERY:
            # A redelivery of an earlier slot result: usually of a still-open group (folded as a
            # duplicate), sometimes of the group that just closed (folded as late).
            candidates = [g for g in open_groups.values() if g[1]]
            if candidates and rng.random() < 0.8:
                again = rng.choice(rng.choice(candidates)[1])
            else:
                again = event
            add(again, "slot_duplicate")
    return entries, counts


def time_runs(fn: Callable[[], Any], repeat: int) -> tuple[list[float], Any]:
    """Wall seconds of ``repeat`` calls, and the last call's result."""
    seconds = []
    result = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - t0)
    return seconds, result


def summarize(outputs: list[Any]) -> str:
    closed = Counter(out.decision.decision for out in outputs if isinstance(out, Closed))
    ignored = Counter(out.reason for out in outputs if isinstance(out, Ignored))
    parts = [f"{k} {closed[k]}" for k in ("complete", "partial", "dropped")]
    parts += [f"ignored {k} {v}" for k, v in sorted(ignored.items())]
    return ", ".join(parts)


def bench_fold(args: argparse.Namespace) -> None:
    groups = max(1, args.events // N_SAMPLES)
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    entries, counts = build_events(groups, rng)
    encoded = [(entry_id, codec.encode(event)) for entry_id, event in entries]
    built = time.perf_counter() - t0
    slot_events = sum(v for k, v in counts.items() if k.startswith("slot_"))
    policy = GroupPolicy(n_samples=N_SAMPLES, reward_norm=NormSpec("group", "group"))

    def fold_only() -> list[Any]:
        return run_fold(policy, entries, GROUP_TIMEOUT_S)[1]

    def decode_only() -> int:
        decode = codec.decode
        for _, fields in encoded:
            decode(fields)
        return len(encoded)

    def decode_and_fold() -> list[Any]:
        decode = codec.decode
        return run_fold(policy, ((entry_id, decode(fields)) for entry_id, fields in encoded), GROUP_TIMEOUT_S)[1]

    fold_s, outputs = time_runs(fold_only, args.repeat)
    gc.disable()
    try:
        fold_nogc_s, _ = time_runs(fold_only, args.repeat)
    finally:
        gc.enable()
    decode_s, _ = time_runs(decode_only, args.repeat)
    both_s, outputs_decoded = time_runs(decode_and_fold, args.repeat)
    if [o.decision if isinstance(o, Closed) else o for o in outputs] != [
        o.decision if isinstance(o, Closed) else o for o in outputs_decoded
    ]:
        raise SystemExit("decoded events folded to different outputs than the originals")

    print(f"1. Fold throughput: {groups} groups x {N_SAMPLES} slots, {OPEN_GROUPS} open at a time, seed {args.seed}")
    print(
        f"   entries: {len(entries)} = {counts['task_issued']} task_issued + {slot_events} slot results "
        f"({counts['slot_sample']} sample of 256 tokens, {counts['slot_rejected']} rejected, "
        f"{counts['slot_failed']} failed, {counts['slot_duplicate']} redelivered) + {counts['tick']} ticks"
    )
    print(f"   outputs: {summarize(outputs)}")
    print(f"   (built and encoded in {built:.1f} s, not timed; median of {args.repeat} runs, gc on unless noted)")
    print()
    print(f"   {'path':<34}{'median s':>10}{'slot events/s':>15}{'entries/s':>12}{'us/entry':>10}")
    for label, seconds in (
        ("fold (run_fold, events in memory)", fold_s),
        ("  same, gc off", fold_nogc_s),
        ("codec.decode only", decode_s),
        ("codec.decode + fold", both_s),
    ):
        median = statistics.median(seconds)
        print(
            f"   {label:<34}{median:>10.3f}{slot_events / median:>15,.0f}{len(entries) / median:>12,.0f}"
            f"{median / len(entries) * 1e6:>10.2f}"
        )
    print()


# --------------------------------------------------------------------------------------- codec


def baseline_encode(event: SlotResultV1) -> bytes:
    """The same fields as one orjson document, tensors as Python lists."""
    sample = event.sample
    assert sample is not None
    return orjson.dumps(
        {
            "schema_version": event.schema_version,
            "producer": event.producer,
            "seq": event.seq,
            "kind": event.kind,
            "task_id": event.task_id,
            "slot": event.slot,
            "outcome": event.outcome,
            "error": event.error,
            "sample": {
                "token_ids": sample.token_ids.to_list(),
                "loss_mask": sample.loss_mask.to_list(),
                "logprobs": sample.logprobs.to_list(),
                "row_lengths": sample.row_lengths,
                "rewards": sample.rewards,
                "version": sample.version,
                "meta": sample.meta,
            },
        }
    )


def baseline_document(event: SlotResultV1) -> dict[str, Any]:
    """What a worker holding Python lists already would hand to ``orjson.dumps``."""
    return orjson.loads(baseline_encode(event))


def baseline_decode(data: bytes) -> SlotResultV1:
    """``orjson.loads``, then the lists back into RawArrays, then the same validation (the event's Struct)."""
    fields = orjson.loads(data)
    sample = fields["sample"]
    sample["token_ids"] = RawArray.from_values(sample["token_ids"], "int32")
    sample["loss_mask"] = RawArray.from_values(sample["loss_mask"], "uint8")
    sample["logprobs"] = RawArray.from_values(sample["logprobs"], "float32")
    return msgspec.convert(fields, SlotResultV1, builtin_types=(bytes,))


def median_us(fn: Callable[[], Any], repeat: int, run_s: float = 0.1) -> float:
    """Median microseconds per call over ``repeat`` timeit runs of about ``run_s`` seconds each."""
    timer = timeit.Timer(fn)
    number = 1
    while (elapsed := timer.timeit(number)) < run_s / 10:
        number *= 2
    number = max(1, round(number * run_s / elapsed))
    runs = timer.repeat(repeat=repeat, number=number)
    return statistics.median(runs) / number * 1e6


def bench_codec(args: argparse.Namespace) -> None:
    repeat = max(args.repeat, 5)
    print(
        f"2. Codec: one SlotResult with a one-row sample (int32 tokens, uint8 mask, float32 logprobs); "
        f"median us of {repeat} timeit runs of ~0.1 s"
    )
    for tokens in (1024, 256):
        sample: Sample = make_sample(tokens=tokens, seed=args.seed, reward=0.25, version=3)
        # a schema-1 slot result (the sample inline): the tensor-carrying entry the codec is measured on
        event = SlotResultV1(
            task_id="task-0001234", slot=2, outcome="sample", sample=sample, producer="worker-07", seq=123456
        )
        fields = codec.encode(event)
        data = baseline_encode(event)
        document = baseline_document(event)
        if codec.decode_v1_slot_result(fields) != event or baseline_decode(data) != event:
            raise SystemExit(f"a {tokens}-token round trip did not give back the same SlotResult")
        raw_size = sum(len(key) + len(value) for key, value in fields.items())
        header, blob = len(fields[codec.HEADER]), len(fields.get(codec.BLOB, b""))

        raw_enc = median_us(lambda: codec.encode(event), repeat)
        raw_dec = median_us(lambda: codec.decode(fields), repeat)
        base_enc = median_us(lambda: baseline_encode(event), repeat)
        base_dumps = median_us(lambda: orjson.dumps(document), repeat)
        base_dec = median_us(lambda: baseline_decode(data), repeat)
        base_loads = median_us(lambda: orjson.loads(data), repeat)

        print()
        print(f"   {tokens} tokens        {'encode us':>10}{'decode us':>11}{'bytes':>9}")
        print(
            f"   {'streamgrp codec':<19}{raw_enc:>10.2f}{raw_dec:>11.2f}{raw_size:>9,}"
            f"   (header {header:,} + raw {blob:,} + 2 field names)"
        )
        print(
            f"   {'orjson lists':<19}{base_enc:>10.2f}{base_dec:>11.2f}{len(data):>9,}"
            f"   (encode includes to_list; decode to a validated SlotResult)"
        )
        print(
            f"   {'  orjson only':<19}{base_dumps:>10.2f}{base_loads:>11.2f}{'':>9}"
            f"   (dumps of prebuilt lists; loads only, no SlotResult)"
        )
        print(
            f"   {'ratio lists/codec':<19}{base_enc / raw_enc:>9.1f}x{base_dec / raw_dec:>10.1f}x"
            f"{len(data) / raw_size:>8.1f}x   (full baseline over streamgrp)"
        )
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--events",
        type=int,
        default=80_000,
        help="slot results to fold, before duplicates (groups = events / 4; default 80000)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="timed runs per measurement; medians are reported (default 5, codec at least 5)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of random.Random for the event order (default 0)")
    args = parser.parse_args(argv)
    if args.events < 1 or args.repeat < 1:
        parser.error("--events and --repeat must be positive")
    started = time.perf_counter()
    print(
        f"streamgrp core benchmark: Python {platform.python_version()} ({platform.python_implementation()}), "
        f"orjson {orjson.__version__}"
    )
    print(f"machine: {platform.machine()} {platform.system()}, os.cpu_count() = {os.cpu_count()}")
    print()
    bench_fold(args)
    bench_codec(args)
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
