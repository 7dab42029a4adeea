"""Hostile entries on a real server with every service running: none of them stops a service.

Over 10,000 entries made by mutating the bytes of valid encoded entries, and every named class of
malformed entry from `malformed.MALFORMED` that a stream can hold (plus classes that only a
running service can judge: unknown task, slot out of range, a wrong kind for the stream, an entry
over the assembler's size limit), are written into the slot log, the task queue and the control
stream while the assembler, a worker, the batcher and a trainer rank run as real processes, with
valid tasks issued before, between and after them. Each hostile entry is dead-lettered exactly
once with the reason the decoder (or the fold) gives and counted; the valid tasks are decided and
trained exactly as without the noise.
"""

from __future__ import annotations

import random
from collections import Counter

from malformed import MALFORMED, VALID, mutate_entry
from pipeline import Pipeline, events
from processes import wait_until

from streamgrp.config import RunConfig
from streamgrp.core import codec
from streamgrp.core.entry_fields import entry_fields
from streamgrp.core.events import GroupDecided, SlotResult, StepCommitted, StepManifest
from streamgrp.core.legacy import SlotResultV1
from streamgrp.errors import DecodeError
from streamgrp.services.synthetic import make_sample
from streamgrp.store.runs import connect, join_run
from streamgrp.store.sources import RedisSource
from streamgrp.store.tasks import TaskIssuer

MUTANTS = 10_200
VALID_TASKS = 60
MAX_ENTRY_BYTES = 65_536
STREAMS = ("slots", "tasks", "control")


def _storable_pairs(fields) -> list[tuple[bytes, bytes]] | None:
    """The (name, value) pairs a stream entry can hold for ``fields``, or None when it cannot hold them."""
    if not isinstance(fields, dict) or getattr(fields, "malformed", None):
        return None
    pairs = getattr(fields, "pairs", None) or list(fields.items())
    out = []
    for name, value in pairs:
        try:
            out.append(tuple(item if isinstance(item, bytes) else item.encode() for item in (name, value)))
        except (AttributeError, UnicodeEncodeError):  # an int or a lone surrogate: no server gives these
            return None
    return out or None


def _as_read(pairs: list[tuple[bytes, bytes]]):
    """The fields a reader gets back for ``pairs`` (repeated names kept, as `connect` clients do)."""
    return entry_fields([item for pair in pairs for item in pair])


def _decode_reason(pairs) -> str | None:
    try:
        codec.decode(_as_read(pairs), max_entry_bytes=MAX_ENTRY_BYTES)
    except DecodeError as exc:
        return exc.reason
    return None


def _mutants(rng: random.Random, count: int) -> list[tuple[list[tuple[bytes, bytes]], str]]:
    """``count`` mutated valid entries that a stream can hold and the decoder refuses, with its reason."""
    out = []
    while len(out) < count:
        pairs = _storable_pairs(mutate_entry(rng, rng.choice(VALID)))
        reason = pairs and _decode_reason(pairs)
        if reason:
            out.append((pairs, reason))
    return out


def _named_classes() -> list[tuple[str, list[tuple[bytes, bytes]], str]]:
    classes = []
    for param in MALFORMED:
        fields, reason = param.values
        pairs = _storable_pairs(fields)
        if pairs is not None and _decode_reason(pairs) == reason:
            classes.append((param.id, pairs, reason))
    return classes


def _add(client, stream: str, pairs) -> str:
    return client.execute_command("XADD", stream, "*", *[item for pair in pairs for item in pair]).decode()


def test_hostile_entries_in_every_stream_are_dead_lettered_and_valid_traffic_trains(redis_url, run_name, tmp_path):
    client = connect(redis_url)
    run = join_run(client, run_name, RunConfig(n_samples=2, dp_size=1, batch_size=2))
    keys = {"slots": run.keys.slots, "tasks": run.keys.tasks, "control": run.keys.control}
    pipeline = Pipeline(
        redis_url,
        run_name,
        tmp_path,
        None,
        ["--n-samples", "2", "--dp-size", "1", "--batch-size", "2"],
        dp_size=1,
        workers=1,
        trainer_step_s=0.02,
        assembler_flags=("--max-entry-bytes", str(MAX_ENTRY_BYTES)),
    )
    rng = random.Random(5)
    issuer = TaskIssuer(client, run.keys)
    valid: list[str] = []
    expected: dict[tuple[str, str], str] = {}  # (stream key, entry id) -> reason

    def issue(n: int) -> None:
        valid.extend(t.task_id for t in issuer.issue([{"tokens": 12, "seed": len(valid) + i} for i in range(n)]))

    def inject(stream: str, pairs, reason: str) -> None:
        expected[(keys[stream], _add(client, keys[stream], pairs))] = reason

    named = _named_classes()
    assert len(named) >= 30, [name for name, _, _ in named]
    # every decode reason but bad_fields (no server returns such fields) and oversized (added below)
    assert {reason for _, _, reason in named} == codec.DECODE_REASONS - {"bad_fields", "oversized"}
    pipeline.start()
    try:
        issue(20)
        for number, (pairs, reason) in enumerate(_mutants(rng, MUTANTS)):
            inject(STREAMS[number % 3], pairs, reason)
            if number == MUTANTS // 2:
                issue(20)
        for _, pairs, reason in named:
            for stream in STREAMS:
                inject(stream, pairs, reason)
        # classes that only a running service can judge
        some_task = valid[0]
        inject(
            "slots",
            list(codec.encode(SlotResult(task_id="never-issued", slot=0, outcome="rejected")).items()),
            "unknown_task",
        )
        inject(
            "slots",
            list(codec.encode(SlotResult(task_id=some_task, slot=7, outcome="rejected")).items()),
            "slot_out_of_range",
        )
        inject("slots", list(codec.encode(StepCommitted(step=0, rank=0, world_size=1)).items()), "unexpected_kind")
        inject(
            "tasks",
            list(codec.encode(SlotResult(task_id=some_task, slot=0, outcome="rejected")).items()),
            "unexpected_kind",
        )
        # a schema-1 slot result, its sample inline: what a large entry in the slot log can still be
        big = SlotResultV1(task_id=some_task, slot=1, outcome="sample", sample=make_sample(tokens=40_000))
        inject("slots", list(codec.encode(big).items()), "oversized")
        issue(20)

        def all_handled() -> bool:
            assert not pipeline.exited(), pipeline.exited()
            return (
                client.xlen(run.keys.deadletter) >= len(expected)
                and client.hlen(run.keys.decided) >= len(valid)
                and client.xlen(run.keys.steps) >= len(valid) // 2
            )

        wait_until(all_handled, timeout=240, interval=0.5, message="every hostile entry dead-lettered")
        wait_until(
            lambda: len(events(client, run.keys.commits, StepCommitted)) >= len(valid) // 2,
            timeout=60,
            message="the trainer to commit every step",
        )
        assert not pipeline.exited(), pipeline.exited()
    finally:
        codes = pipeline.stop()
    # SIGTERM is a clean stop for each service (the trainer script has no handler for it)
    assert {code for name, code in codes.items() if not name.startswith("trainer")} == {0}, codes
    for role in pipeline.roles:
        assert "Traceback" not in role.output(), (role.role, role.output()[-3000:])

    # each hostile entry dead-lettered once, with its reason, and counted
    letters = [fields for _, fields in client.xrange(run.keys.deadletter)]
    got = Counter((f[b"stream"].decode(), f[b"entry"].decode()) for f in letters)
    assert got == Counter(expected.keys()), "an entry was dead-lettered twice, or not at all"
    reasons = {(f[b"stream"].decode(), f[b"entry"].decode()): f[b"reason"].decode() for f in letters}
    wrong = {key: (reasons[key], reason) for key, reason in expected.items() if reasons[key] != reason}
    assert not wrong, list(wrong.items())[:10]
    counts = {k: int(v) for k, v in RedisSource(client, run.keys).hash("counts").items()}  # with the dead letters'
    by_stream = Counter(stream for stream, _ in expected)
    assert counts.get("slots:invalid", 0) == by_stream[run.keys.slots]
    assert counts.get("invalid:tasks", 0) == by_stream[run.keys.tasks]
    assert counts.get("invalid:control", 0) == by_stream[run.keys.control]
    for reason, n in Counter(expected.values()).items():
        assert counts.get(f"deadletter:{reason}", 0) == n, reason
    assert len(set(expected.values())) >= 12

    # a dead letter of an entry with a repeated field name keeps both values
    repeated = next(key for key, reason in expected.items() if reason == "repeated_field" and key[0] == run.keys.slots)
    letter = next(f for f in letters if (f[b"stream"].decode(), f[b"entry"].decode()) == repeated)
    [(_, original)] = client.xrange(run.keys.slots, repeated[1], repeated[1])
    copied = [pair for pair in letter.pairs if pair[0].startswith(b"f:")]
    assert [(b"f:" + name, value) for name, value in original.pairs] == copied
    assert len({name for name, _ in copied}) < len(copied)

    # the valid tasks: decided complete from their own slots, batched once, trained once
    decisions = [codec.decode(fields) for _, fields in client.xrange(run.keys.decisions)]
    assert sorted(d.task_id for d in decisions) == sorted(valid)
    for decision in decisions:
        assert isinstance(decision, GroupDecided) and decision.decision == "complete", decision
        members = [codec.decode(client.xrange(run.keys.slots, e, e)[0][1]) for e in (m.entry for m in decision.members)]
        assert [(m.task_id, m.slot, m.outcome) for m in members] == [
            (decision.task_id, 0, "sample"),
            (decision.task_id, 1, "sample"),
        ]
    manifests = [codec.decode(fields) for _, fields in client.xrange(run.keys.steps)]
    assert all(isinstance(m, StepManifest) for m in manifests)
    batched = [g.task_id for m in manifests for s in m.shards for g in s.groups]
    assert sorted(batched) == sorted(valid)
    assert Counter(e.step for e in events(client, run.keys.commits, StepCommitted)) == Counter(range(len(manifests)))
