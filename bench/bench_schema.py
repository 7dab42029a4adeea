"""The wire schema at C speed: decoding and encoding the hottest entries through the one codec, whose events
are msgspec Structs (issue 36, item 1), against the floors under it, in one process.

    python bench/bench_schema.py [--repeats 5] [--count 20000] [--members 8]

Entries (built by streamgrp's own encoder, so byte for byte what the streams hold):

- a slot result with its sample summary (the assembler decodes one per slot),
- a group decision with its member columns (the batcher decodes one per group),
- a step manifest of 8 groups of ``--members`` members on 2 ranks (each trainer rank decodes one per step),
- a 1024-token sample's payload (the assembler checks one per sample; trainer ranks read them).

Decode paths, each from the entry's fields to a checked event:

- ``codec.decode``: what every service runs (entry checks, then msgspec's compiled decoder into the
  event's Struct; a payload's tensors cut out of the entry's bytes and its values checked),
- ``msgspec alone``: the event's compiled decoder on the header, without the codec's entry checks (the
  floor of the codec's path; headers without tensors only),
- ``orjson.loads``: parsing the header into plain objects, nothing checked (what a reader that trusts
  its input would pay).

Encode paths: ``codec.encode`` of the decision (written without decoding it again: `codec.DERIVED`) and
``codec.encode_sample`` of the 1024-token sample (the publisher's call: slot result and payload).
Each figure is the median over ``--repeats`` runs of µs per entry. The same script before this change
(pydantic models and hand-written fast paths) gave the figures bench/README.md lists beside these.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import msgspec
import orjson

from streamgrp.core import codec
from streamgrp.core.events import DecidedMember, GroupDecided, GroupStats, SlotResult, StepManifest
from streamgrp.core.manifest import make_manifest
from streamgrp.core.wire import decoder
from streamgrp.services.synthetic import make_sample


def decision(task: int, members: int) -> GroupDecided:
    """A complete group's decision of ``members`` usable slots, as the assembler writes it."""
    return GroupDecided.of(
        task_id=f"t{task:08d}",
        decision="complete",
        producer="assembler-a",
        seq=7,
        closed_by="all_slots",
        members=[
            DecidedMember(
                slot=i,
                entry=f"1796306999054-{i}",
                rows=1,
                tokens=200 + i,
                version=3,
                digest="sha256:453a705b55ceb54a28d3467118eed38f",
                reward=0.5,
            )
            for i in range(members)
        ],
        slot_outcomes={str(i): "sample" for i in range(members)},
        stats=GroupStats.of(members, members, members),
        issued_at=1796306999.052581,
        decided_at=1796307000.49,
    )


def measure(function: Callable[[], object], count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        function()
    return (time.perf_counter() - started) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--count", type=int, default=20_000, help="entries decoded per run and path")
    parser.add_argument("--members", type=int, default=8, help="members of each group")
    args = parser.parse_args()

    sample = make_sample(tokens=1024)
    slot_header, payload_header, blob = codec.encode_sample("t00000042", 3, sample, producer="worker-a", seq=5)
    group = decision(42, args.members)
    decision_header = codec.encode(group)[codec.HEADER]
    manifest = make_manifest(5, 4, [(f"{100 + i}-0", decision(i, args.members)) for i in range(8)], 2, 1796307001.5)
    manifest_header = codec.encode(manifest)[codec.HEADER]
    payload = {codec.HEADER: payload_header, codec.BLOB: blob}

    def paths(header: bytes, kind: type) -> dict[str, Callable[[], object]]:
        fields = {codec.HEADER: header}
        struct_decoder = decoder(kind)
        assert codec.decode(fields) == struct_decoder.decode(header)
        return {
            "codec.decode": lambda: codec.decode(fields),
            "msgspec alone": lambda: struct_decoder.decode(header),
            "orjson.loads": lambda: orjson.loads(header),
        }

    cases = {
        f"slot result ({len(slot_header)} B)": paths(slot_header, SlotResult),
        f"group decision, {args.members} members ({len(decision_header)} B)": paths(decision_header, GroupDecided),
        f"step manifest, 8 groups ({len(manifest_header)} B)": paths(manifest_header, StepManifest),
        f"sample payload, 1024 tokens ({len(payload_header)} B + {len(blob)} B)": {
            "codec.decode": lambda: codec.decode(payload),
            "orjson.loads": lambda: orjson.loads(payload_header),
        },
        "encode: group decision": {"codec.encode": lambda: codec.encode(group)},
        "encode: 1024-token sample (slot result + payload)": {
            "codec.encode_sample": lambda: codec.encode_sample("t00000042", 3, sample, producer="worker-a", seq=5)
        },
    }
    print(
        f"{platform.machine()}, CPython {platform.python_version()}, msgspec {msgspec.__version__}; "
        f"{args.count} entries per run, median of {args.repeats} runs"
    )
    print("| entry | path | µs per entry |")
    print("|---|---|---|")
    for name, case in cases.items():
        count = (
            args.count
            if "manifest" not in name and "payload" not in name and "encode" not in name
            else max(args.count // 10, 100)
        )
        for path, function in case.items():
            us = statistics.median(measure(function, count) for _ in range(args.repeats))
            print(f"| {name} | {path} | {us:.2f} |")


if __name__ == "__main__":
    main()
