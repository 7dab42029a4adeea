"""A trainer's shard load at memory speed: fetched payload entries to the shard's padded tensors, against the
same bytes copied into preallocated tensors with one copy per row, in one process (issue 36, item 4).

    python bench/bench_loader.py [--tokens 1024 32768] [--groups 4] [--members 8] [--repeats 5]

A shard of ``--groups`` groups of ``--members`` one-row samples, each ``tokens`` tokens (int32 token ids,
uint8 loss mask, float32 logprobs: 9 bytes a token on the wire), encoded by streamgrp's own encoder, so its
entries are byte for byte what the payloads stream holds. Two shapes: ``equal`` (every row ``tokens``
long: no padding) and ``ragged`` (rows from ``tokens / 2`` to ``tokens``: padded to the longest).

Paths, each from the entries' fields to the [rows, T] int64 token ids, bool loss mask and float32
logprobs (plus attention mask, rewards, versions):

- ``build_batch``: `streamgrp.train.loader.build_batch` as a trainer rank calls it (no digests: the
  trainer's default), entries from an in-memory ``fetch``; every payload header is checked;
- ``build_batch + digests``: the same, checking every group's digest first (replay's call);
- ``baseline``: the strongest honest floor: the payload bytes already in hand as numpy views (made
  before the clock starts), the three output tensors allocated for the shard (a trainer keeps each
  step's tensors, so they are new every step) and zeroed only where there is padding (the whole tensor
  first for narrow rows, each row's tail after for rows of 4096 tokens or more), and one ``np.copyto``
  per row and field (widening int32 to int64 and uint8 to bool in the same pass). Nothing is checked,
  no header is read.

Times are CPU time of this process (one thread), so a busy machine disturbs them less than wall time.
GB/s counts the payloads' tensor bytes (what the entries carry); µs per row is the shard's time over
its rows. Median over ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from streamgrp.core import codec
from streamgrp.core.events import DecidedMember, GroupDecided, GroupStats, StepManifest
from streamgrp.core.manifest import make_manifest
from streamgrp.core.values import RawArray, Sample
from streamgrp.train.loader import build_batch

Entries = dict[str, dict[bytes, bytes]]


def shard(tokens: int, groups: int, members: int, ragged: bool) -> tuple[StepManifest, Entries, list[int]]:
    """A one-rank step of ``groups`` groups of ``members`` samples, its payload entries by id, and each row's
    length."""
    rng = np.random.default_rng(tokens)
    entries: Entries = {}
    decided = []
    lengths = []
    for task in range(groups):
        placed = []
        for slot in range(members):
            n = tokens - (slot * tokens // (2 * members) if ragged else 0)
            lengths.append(n)
            sample = Sample(
                token_ids=RawArray(dtype="int32", shape=(n,), data=rng.integers(0, 32_000, n, dtype="<i4").tobytes()),
                loss_mask=RawArray(dtype="uint8", shape=(n,), data=np.ones(n, dtype=np.uint8).tobytes()),
                logprobs=RawArray(dtype="float32", shape=(n,), data=(-rng.random(n, dtype=np.float32)).tobytes()),
                row_lengths=(n,),
                rewards=(float(slot),),
                version=3,
            )
            entry = f"{1000 + task}-{slot}"
            result, entries[entry] = codec.sample_result(f"t{task}", slot, sample, producer="worker-a", seq=slot)
            placed.append(
                DecidedMember(
                    slot=slot, entry=entry, rows=1, tokens=n, version=3, digest=result.sample.digest, reward=float(slot)
                )
            )
        decided.append(
            (
                f"{2000 + task}-0",
                GroupDecided.of(
                    task_id=f"t{task}",
                    decision="complete",
                    closed_by="all_slots",
                    members=placed,
                    slot_outcomes={str(i): "sample" for i in range(members)},
                    stats=GroupStats.of(members, members, members),
                ),
            )
        )
    return make_manifest(5, 3, decided, 1, 0.0), entries, lengths


def baseline(entries: Entries, lengths: list[int]) -> Callable[[], object]:
    """One ``np.copyto`` per row and field from views made beforehand, into tensors allocated per shard and zeroed
    only where padding is (the whole tensor first when rows are narrow, each row's tail after when wide)."""
    views = []
    for fields in entries.values():
        blob = fields[codec.BLOB]
        n = len(blob) // 9
        views.append(
            (
                np.frombuffer(blob, "<i4", n, 0),
                np.frombuffer(blob, np.uint8, n, 4 * n),
                np.frombuffer(blob, "<f4", n, 5 * n),
            )
        )
    rows, width = len(lengths), max(lengths)
    padded = min(lengths) < width
    tails = padded and width >= 4096
    allocate = torch.zeros if padded and not tails else torch.empty

    def load() -> object:
        out = (
            allocate(rows, width, dtype=torch.int64),
            allocate(rows, width, dtype=torch.bool),
            allocate(rows, width, dtype=torch.float32),
        )
        arrays = [tensor.numpy() for tensor in out]
        for row, (n, sources) in enumerate(zip(lengths, views)):
            for array, source in zip(arrays, sources):
                np.copyto(array[row, :n], source, casting="unsafe")
                if tails and n < width:
                    array[row, n:] = 0
        return out

    return load


def measure(function: Callable[[], object], seconds: float = 0.3) -> float:
    """CPU seconds per call (this process's: a busy neighbour on a shared machine stretches wall time, not this),
    over enough calls to fill about ``seconds``."""
    function()
    count = 1
    while True:
        started = time.process_time()
        for _ in range(count):
            function()
        took = time.process_time() - started
        if took >= seconds:
            return took / count
        count *= 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 32768])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # build_batch runs on one thread (shard_tensors._one_thread): the baseline too
    print(
        f"{platform.machine()}, CPython {platform.python_version()}, torch {torch.__version__}, numpy "
        f"{np.__version__}; {args.groups} groups x {args.members} rows; median of {args.repeats} runs"
    )
    print("| tokens | shape | path | µs per shard | µs per row | GB/s | vs baseline |")
    print("|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        for ragged in (False, True):
            manifest, entries, lengths = shard(tokens, args.groups, args.members, ragged)
            fetch = lambda stream, ids, entries=entries: [entries.get(i) for i in ids]  # noqa: E731
            wire = sum(len(fields[codec.BLOB]) for fields in entries.values())
            check = build_batch(manifest, 0, 1, fetch, check_digests=False)
            reference = baseline(entries, lengths)()
            for tensor, name in zip(reference, ("token_ids", "loss_mask", "logprobs")):
                assert torch.equal(getattr(check, name), tensor), name
            paths = {
                "baseline": baseline(entries, lengths),
                "build_batch": lambda m=manifest, f=fetch: build_batch(m, 0, 1, f, check_digests=False),
                "build_batch + digests": lambda m=manifest, f=fetch: build_batch(m, 0, 1, f, check_digests=True),
            }
            floor = 0.0
            for name, function in paths.items():
                took = statistics.median(measure(function) for _ in range(args.repeats))
                floor = floor or took
                print(
                    f"| {tokens} | {'ragged' if ragged else 'equal'} | {name} | {took * 1e6:,.0f} | "
                    f"{took * 1e6 / len(lengths):.1f} | {wire / took / 1e9:.2f} | {took / floor:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
