"""Benchmark the checks that refuse untrainable values (`streamgrp.core.value_checks`), per sample.

For one-row samples of 256 and 1024 tokens (int32 token ids below a 151,936-token vocabulary, the
last ones special tokens near its end; a uint8 loss mask whose first eighth is prompt; float32
logprobs, negative with the prompt's at 0.0), median microseconds of:

- the value checks alone (`Sample.value_problem`), without and with a vocabulary: what building a
  `Sample` adds (without), and what the worker adds before publishing (with);
- the same checks when a value sits just under the tolerance (one logprob of +5e-5), which sends the
  logprobs to the exact, value-by-value path; and for int64 token ids, float16 and bfloat16 logprobs;
- the assembler's check of a payload against its slot result (`codec.payload_problem`: decode the
  payload with its values checked, hash it, compare with the summary, the vocabulary), and beside it
  what the worker and assembler already spent per sample: `codec.encode_sample` and decoding the
  slot result's header.

Pure CPU in one process; no server. `timeit` on this process's CPU time (so other work on the
machine inflates the figures less than wall time would), the garbage collector off while timing, the
median of ``--repeat`` runs of ``--number`` calls each.

    python bench/bench_values.py [--repeat 7] [--number 2000]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import struct
import sys
import time
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from streamgrp.core import codec  # noqa: E402
from streamgrp.core.events import RawArray, Sample  # noqa: E402

VOCAB = 151_936


def make(tokens: int, *, ids: str = "int32", logprobs: str = "float32", near_tolerance: bool = False) -> Sample:
    rng = random.Random(tokens)
    prompt = tokens // 8
    token_ids = [rng.randrange(VOCAB - 300) for _ in range(tokens - 3)] + [VOCAB - 291, VOCAB - 290, VOCAB - 1]
    values = [0.0] * prompt + [-rng.expovariate(2.0) for _ in range(tokens - prompt)]
    if near_tolerance:
        values[tokens // 2] = 5e-5
    if logprobs == "bfloat16":
        packed = struct.pack(f"<{tokens}f", *values)
        data = b"".join(packed[at + 2 : at + 4] for at in range(0, len(packed), 4))
    else:
        data = struct.pack(f"<{tokens}{'e' if logprobs == 'float16' else 'f'}", *values)
    return Sample(
        token_ids=RawArray(
            dtype=ids, shape=(tokens,), data=struct.pack(f"<{tokens}{'i' if ids == 'int32' else 'q'}", *token_ids)
        ),
        loss_mask=RawArray.from_values([0] * prompt + [1] * (tokens - prompt), "uint8"),
        logprobs=RawArray(dtype=logprobs, shape=(tokens,), data=data),
        row_lengths=(tokens,),
        rewards=(0.5,),
        version=0,
    )


def median_us(call, repeat: int, number: int) -> float:
    # CPU time of this process, not wall time: the figures hold up on a machine other work keeps busy
    times = timeit.repeat(call, repeat=repeat, number=number, timer=time.process_time)
    return statistics.median(times) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"python {platform.python_version()}, {os.cpu_count()} cores, load average {load:.2f} "
        "(figures scale with the machine's other load)"
    )
    rows = []
    for tokens in (256, 1024):
        sample = make(tokens)
        result, payload = codec.sample_result("task-1", 0, sample, producer="w", seq=1)
        slot_header = codec.encode(result)
        cases = [
            ("value checks, no vocabulary (Sample construction adds this)", lambda: sample.value_problem()),
            ("value checks with the vocabulary (the worker, before publishing)", lambda: sample.value_problem(VOCAB)),
        ]
        for label, variant in (
            ("a logprob of +5e-5 (exact path)", make(tokens, near_tolerance=True)),
            ("int64 token ids", make(tokens, ids="int64")),
            ("float16 logprobs", make(tokens, logprobs="float16")),
            ("bfloat16 logprobs", make(tokens, logprobs="bfloat16")),
        ):
            cases.append((f"  ... with {label}", lambda variant=variant: variant.value_problem(VOCAB)))
        cases += [
            (
                "assembler: payload_problem (decode + values + digest + summary + vocabulary)",
                lambda: codec.payload_problem(payload, result, vocab_size=VOCAB),
            ),
            ("  of which decoding the payload (fast path, values checked)", lambda: codec.decode(payload)),
            ("  of which the digest", lambda: codec.entry_digest(payload)),
            ("for scale: the worker's codec.encode_sample", lambda: codec.encode_sample("task-1", 0, sample)),
            ("for scale: the assembler's decode of the slot header", lambda: codec.decode(slot_header)),
            ("for scale: sum(range(1000)), the machine's speed", lambda: sum(range(1000))),
        ]
        for label, call in cases:
            rows.append((tokens, label, median_us(call, args.repeat, args.number)))
    width = max(len(label) for _, label, _ in rows)
    for tokens in (256, 1024):
        print(f"\n{tokens} tokens: median µs per sample")
        for size, label, micros in rows:
            if size == tokens:
                print(f"  {label:<{width}}  {micros:8.2f}")


if __name__ == "__main__":
    main()
