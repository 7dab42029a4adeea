"""What one wire schema in compiled code would cost: decoding and validating the hottest headers with
msgspec Structs against today's paths, in one process (issue: one wire schema at C speed).

    python bench/bench_schema.py [--repeats 5] [--members 8]

Headers (built by streamgrp's own encoder, so byte for byte what the streams hold):

- a slot result with its sample summary (the assembler decodes one per slot),
- a group decision with its member columns (the batcher decodes one per group).

Paths, each from the header's bytes to a checked event:

- ``pydantic``: today's full decoder (`streamgrp.core.codec.decode`: orjson, then pydantic's models),
- ``fast``: today's hand-written fast path (orjson, then `streamgrp.core.fast_decode`), what the services run,
- ``pydantic-core json``: pydantic's own JSON parser and validator in one call
  (``SlotResult.model_validate_json``), the fastest pydantic way to the same models,
- ``msgspec``: ``msgspec.json.decode`` into Structs with the same constraints (strict ints within
  int64, finite floats, string lengths, the outcome literal), checks of cross-field rules after.

Each figure is the median over ``--repeats`` runs of µs per header; ratios are against ``pydantic``.
msgspec is an optional dependency of this benchmark only (``pip install msgspec``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Annotated, Literal

import msgspec
import orjson

from streamgrp.core import codec, fast_decode
from streamgrp.core.events import GroupDecided, SlotResult
from streamgrp.services.synthetic import make_sample

INT64 = Annotated[int, msgspec.Meta(ge=-(2 ** 63), le=2 ** 63 - 1)]
NONNEG = Annotated[int, msgspec.Meta(ge=0, le=2 ** 63 - 1)]
TASK_ID = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
DIGEST = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class MsgSummary(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    rows: Annotated[int, msgspec.Meta(ge=1, le=2 ** 63 - 1)]
    tokens: NONNEG
    version: NONNEG
    reward: float
    digest: DIGEST


class MsgSlotResult(msgspec.Struct, forbid_unknown_fields=True, frozen=True, tag_field="kind", tag="slot_result"):
    task_id: TASK_ID
    slot: NONNEG
    outcome: Literal["sample", "rejected", "failed"]
    schema_version: INT64 = 2
    producer: str = ""
    seq: NONNEG = 0
    sample: MsgSummary | None = None
    error: str | None = None


class MsgStats(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    target_slot_count: NONNEG
    usable_slot_count: NONNEG
    trainable_slot_count: NONNEG
    fully_masked_group: bool
    singleton_slot_group: bool
    pre_filter_usable_slot_yield: float
    pre_filter_trainable_slot_yield: float


class MsgDecision(msgspec.Struct, forbid_unknown_fields=True, frozen=True, tag_field="kind", tag="group_decided"):
    """A group decision as written: scalar fields, stats, and the members as parallel columns."""

    task_id: TASK_ID
    decision: Literal["complete", "partial", "dropped"]
    reason: str | None
    members: list[NONNEG]
    member_entries: list[str]
    member_digests: list[DIGEST]
    member_rows: list[Annotated[int, msgspec.Meta(ge=1, le=2 ** 63 - 1)]]
    member_tokens: list[NONNEG]
    member_versions: list[NONNEG]
    member_rewards: list[float]
    slot_outcomes: dict[str, str]
    stats: MsgStats
    error: str | None
    closed_by: str
    issued_at: float | None
    decided_at: float | None
    schema_version: INT64 = 2
    producer: str = ""
    seq: NONNEG = 0


def msgspec_decision(decoder: msgspec.json.Decoder) -> Callable[[bytes], MsgDecision]:
    def decode(header: bytes) -> MsgDecision:
        event = decoder.decode(header)
        count = len(event.members)  # the columns are one member each, as the model checks
        if any(len(column) != count for column in (event.member_entries, event.member_digests, event.member_rows,
                                                   event.member_tokens, event.member_versions,
                                                   event.member_rewards)):
            raise ValueError("member columns of different lengths")
        if not all(map(_finite, event.member_rewards)):
            raise ValueError("a member's reward is not finite")
        return event
    return decode


def _finite(value: float) -> bool:
    return value == value and value not in (float("inf"), float("-inf"))


def msgspec_slot(decoder: msgspec.json.Decoder) -> Callable[[bytes], MsgSlotResult]:
    def decode(header: bytes) -> MsgSlotResult:
        event = decoder.decode(header)
        # The cross-field rules the models check after their fields: a sample has a summary, a
        # failure a text; floats are finite (msgspec parses inf/nan only from strings, which it refuses).
        if (event.outcome == "sample") != (event.sample is not None):
            raise ValueError("a sample needs its summary, and only a sample has one")
        if event.sample is not None and not _finite(event.sample.reward):
            raise ValueError("reward is not finite")
        return event
    return decode


def decision_header(members: int) -> bytes:
    """A complete group's decision of ``members`` usable slots, as the assembler writes it (golden log v2's shape)."""
    header = {"schema_version": 2, "producer": "assembler-a", "seq": 7, "kind": "group_decided",
              "task_id": "t00000042", "decision": "complete", "reason": None, "members": list(range(members)),
              "member_entries": [f"1796306999054-{i}" for i in range(members)],
              "member_digests": ["453a705b55ceb54a28d3467118eed38f"] * members, "member_rows": [1] * members,
              "member_tokens": [200 + i for i in range(members)], "member_versions": [3] * members,
              "member_rewards": [0.5] * members, "slot_outcomes": {str(i): "sample" for i in range(members)},
              "stats": {"target_slot_count": members, "usable_slot_count": members, "trainable_slot_count": members,
                        "fully_masked_group": False, "singleton_slot_group": False,
                        "pre_filter_usable_slot_yield": 1.0, "pre_filter_trainable_slot_yield": 1.0},
              "error": None, "closed_by": "all_slots", "issued_at": 1796306999.052581, "decided_at": 1796307000.49}
    raw = orjson.dumps(header)
    assert isinstance(codec.decode({codec.HEADER: raw}), GroupDecided)  # a header the full decoder accepts
    return raw


def measure(function: Callable[[bytes], object], header: bytes, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        function(header)
    return (time.perf_counter() - started) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--count", type=int, default=20_000, help="headers decoded per run and path")
    parser.add_argument("--members", type=int, default=8, help="members of the measured group decision")
    args = parser.parse_args()

    slot_fields = codec.encode_sample("t00000042", 3, make_sample(tokens=256), producer="worker-a", seq=5)[0]
    slot_header = slot_fields[codec.HEADER] if isinstance(slot_fields, dict) else slot_fields
    checked = codec.decode({codec.HEADER: slot_header})
    assert isinstance(checked, SlotResult)
    slot_decoder = msgspec.json.Decoder(MsgSlotResult)
    assert msgspec_slot(slot_decoder)(slot_header).sample.tokens == checked.sample.tokens

    cases = {
        "slot result": (slot_header, {
            "pydantic": lambda h: codec.decode({codec.HEADER: h}),  # since issue 36: the codec's msgspec Structs
            "msgspec": msgspec_slot(slot_decoder),
        }),
    }
    decision = decision_header(args.members)
    decision_paths = {"pydantic": lambda h: codec.decode({codec.HEADER: h})}
    if fast_decode.fast_group_decided(orjson.loads(decision)) is not None:
        decision_paths["fast"] = lambda h: fast_decode.fast_group_decided(orjson.loads(h))
    decision_paths["pydantic-core json"] = GroupDecided.model_validate_json
    decision_paths["msgspec"] = msgspec_decision(msgspec.json.Decoder(MsgDecision))
    assert decision_paths["msgspec"](decision).member_tokens == [m.tokens for m in codec.decode(
        {codec.HEADER: decision}).members]
    cases[f"group decision, {args.members} members"] = (decision, decision_paths)

    print(f"{platform.machine()}, CPython {platform.python_version()}, msgspec {msgspec.__version__}; "
          f"{args.count} headers per run, median of {args.repeats} runs")
    print("| header (bytes) | path | µs per header | vs pydantic |")
    print("|---|---|---|---|")
    for name, (header, paths) in cases.items():
        figures = {path: statistics.median(measure(fn, header, args.count) for _ in range(args.repeats))
                   for path, fn in paths.items()}
        for path, us in figures.items():
            print(f"| {name} ({len(header)}) | {path} | {us:.2f} | {figures['pydantic'] / us:.1f}x |")


if __name__ == "__main__":
    main()
