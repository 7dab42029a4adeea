"""The pure parts of replay: rebuilding a shard from entries in memory, batch files, read-only batches,
and the report text. No server."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from streamgrp.core import codec
from streamgrp.core.events import RawArray, Sample, TaskIssued
from streamgrp.core.group_fold import Closed, run_fold
from streamgrp.core.legacy import SlotResultV1
from streamgrp.core.manifest import make_manifest
from streamgrp.core.policy import GroupPolicy, NormSpec
from streamgrp.errors import DigestMismatch, ReadOnlyBatch, StreamgrpError
from streamgrp.replay import (
    BATCH_FORMAT,
    TENSOR_FIELDS,
    Difference,
    VerifyReport,
    format_batch,
    format_report,
    load_batch,
    save_batch,
)
from streamgrp.services.synthetic import make_sample
from streamgrp.train.batchfile import OPTIONAL_FIELDS
from streamgrp.train.loader import build_batch

POLICY = GroupPolicy(n_samples=2, reward_norm=NormSpec("group", "group"))


def _samples(tasks: int = 4) -> dict[tuple[int, int], Sample]:
    return {
        (task, slot): make_sample(tokens=2 + task + slot, reward=slot, seed=10 * task + slot, prompt_tokens=1)
        for task in range(tasks)
        for slot in range(2)
    }


def _log(tasks: int = 4, *, schema: int = 2) -> dict[str, dict[str, dict[bytes, bytes]]]:
    """A run's slot log and payloads by id: each task issued, then two samples of different lengths.

    ``schema=1``: the samples inline in the slot log, as logs written before payloads were split off."""
    log: dict[str, dict[str, dict[bytes, bytes]]] = {"slots": {}, "payloads": {}}
    for task in range(tasks):
        log["slots"][f"{task + 1}-0"] = codec.encode(TaskIssued(task_id=f"t{task}", issued_at=0.0))
    for (task, slot), sample in _samples(tasks).items():
        entry = f"{task + 1}-{slot + 1}"
        if schema == 1:
            log["slots"][entry] = codec.encode(
                SlotResultV1(task_id=f"t{task}", slot=slot, outcome="sample", sample=sample)
            )
        else:
            event, payload = codec.sample_result(f"t{task}", slot, sample)
            log["slots"][entry], log["payloads"][entry] = codec.encode(event), payload
    return log


def _fetch(log):
    return lambda stream, ids: [log.get(stream, {}).get(i) for i in ids]  # a stream it lacks: entries gone


def _step(log):
    _, outputs = run_fold(POLICY, ((entry_id, codec.decode(fields)) for entry_id, fields in log["slots"].items()))
    groups = [(f"{100 + i}-0", output.decision) for i, output in enumerate(outputs) if isinstance(output, Closed)]
    return make_manifest(7, 3, groups, 2, 123.0)


def _batch(log=None, rank=0, **options):
    log = log or _log()
    return build_batch(_step(log), rank, 2, _fetch(log), run="r1", **options)


def test_a_shard_is_rebuilt_from_any_entry_source():
    batch = _batch()
    assert (batch.run, batch.step, batch.rank, batch.world_size, batch.version) == ("r1", 7, 0, 2, 3)
    assert batch.group_sizes.tolist() == [2] * len(batch.task_ids)
    assert batch.rows == 2 * len(batch.task_ids)


def test_the_tensors_hold_each_samples_rows_exactly_padded_with_zeros():
    samples = _samples()
    for rank in (0, 1):
        batch = _batch(rank=rank)
        expected = [samples[(int(task[1:]), slot)] for task in batch.task_ids for slot in range(2)]
        lengths = [sample.row_lengths[0] for sample in expected]
        assert batch.attention_mask.sum(dim=1).tolist() == lengths
        for row, sample in enumerate(expected):
            n = lengths[row]
            assert batch.token_ids[row, :n].tolist() == sample.token_ids.to_list()
            assert batch.loss_mask[row, :n].tolist() == [bool(v) for v in sample.loss_mask.to_list()]
            assert batch.logprobs[row, :n].tolist() == sample.logprobs.to_list()
            assert not batch.token_ids[row, n:].any() and not batch.loss_mask[row, n:].any()
            assert batch.rewards[row].item() == sample.rewards[0] and batch.versions[row].item() == sample.version
        assert (batch.token_ids.dtype, batch.loss_mask.dtype, batch.logprobs.dtype) == (
            torch.int64,
            torch.bool,
            torch.float32,
        )


def test_a_schema_1_log_with_samples_in_the_slot_log_rebuilds_the_same_tensors():
    old, new = _batch(_log(schema=1)), _batch(_log())
    for name in ("token_ids", "loss_mask", "logprobs", "attention_mask", "rewards", "versions", "group_sizes"):
        assert getattr(old, name).equal(getattr(new, name)), name
    assert old.task_ids == new.task_ids


@pytest.mark.parametrize("schema", [1, 2])
def test_changed_or_missing_entries_raise_digest_mismatch(schema):
    log = _log(schema=schema)
    manifest = _step(log)
    stream = "slots" if schema == 1 else "payloads"
    victim = manifest.shards[0].groups[0].members[0].entry
    changed = {name: dict(entries) for name, entries in log.items()}
    blob = bytearray(changed[stream][victim][codec.BLOB])
    blob[0] ^= 0xFF
    changed[stream][victim] = {**changed[stream][victim], codec.BLOB: bytes(blob)}
    with pytest.raises(DigestMismatch, match="do not match the digest"):
        build_batch(manifest, 0, 2, _fetch(changed))
    build_batch(manifest, 0, 2, _fetch(changed), check_digests=False)  # what a trainer told not to hash loads
    del changed[stream][victim]
    if schema == 2:
        del changed["slots"][victim]
    with pytest.raises(DigestMismatch, match=f"slot entry {victim} is gone"):
        build_batch(manifest, 0, 2, _fetch(changed))


def test_a_group_published_across_the_digest_change_checks_each_member_as_its_decision_recorded():
    """One member's slot result carries an untagged BLAKE2b digest (an older worker), the others today's:
    the combined digest matches neither algorithm alone, so the loader checks each member against the
    digest its decision recorded; a changed byte in either kind still fails."""
    log = _log()
    slot = codec.decode(log["slots"]["1-1"])  # task t0, slot 0
    legacy = codec.entry_digest(log["payloads"]["1-1"], like=codec.UNTAGGED)
    assert legacy != slot.sample.digest and not legacy.startswith(codec.DIGEST_PREFIX)
    log["slots"]["1-1"] = codec.encode(slot.replace(sample=slot.sample.replace(digest=legacy)))
    _, outputs = run_fold(POLICY, ((entry_id, codec.decode(fields)) for entry_id, fields in log["slots"].items()))
    groups = [(f"{100 + i}-0", output.decision) for i, output in enumerate(outputs) if isinstance(output, Closed)]
    manifest = make_manifest(7, 3, groups, 2, 123.0)
    rank = next(r for r, shard in enumerate(manifest.shards) if "t0" in {g.task_id for g in shard.groups})
    with pytest.raises(DigestMismatch, match="do not match the digest"):  # without the decisions to ask
        build_batch(manifest, rank, 2, _fetch(log))
    log["decisions"] = {ref: codec.encode(decision) for ref, decision in groups}
    assert "t0" in build_batch(manifest, rank, 2, _fetch(log)).task_ids
    for entry in ("1-1", "1-2"):  # the old member, then today's
        changed = {**log, "payloads": dict(log["payloads"])}
        blob = bytearray(changed["payloads"][entry][codec.BLOB])
        blob[-1] ^= 0x01
        changed["payloads"][entry] = {**changed["payloads"][entry], codec.BLOB: bytes(blob)}
        with pytest.raises(DigestMismatch, match="do not match the digest"):
            build_batch(manifest, rank, 2, _fetch(changed))


@pytest.mark.parametrize(
    "damage",
    [
        lambda h, b: (h.replace(b'"sample_payload"', b'"slot_result"'), b),
        lambda h, b: (h.replace(b'"slot":0', b'"slot":1'), b),
        lambda h, b: (h, b[:-1]),
        lambda h, b: (h.replace(b'"row_lengths":[', b'"row_lengths":[0,'), b),
        lambda h, b: (h.replace(b'"int32"', b'"float99"'), b),
        lambda h, b: (b"{not json", b),
        lambda h, b: (b"[1, 2]", b),
        lambda h, b: (h.replace(b'"row_lengths":[', b'"row_lengths":[true,'), b),
        lambda h, b: (h.replace(b'"rewards":[', b'"rewards":["1",'), b),
        lambda h, b: (h.replace(b'"version":0', b'"version":-1'), b),
        lambda h, b: (h.replace(b'"__raw__":["uint8"', b'"x":1,"__raw__":["uint8"'), b),
        lambda h, b: (h.replace(b'"__raw__":["int32",[', b'"__raw__":["int32",[1,'), b),
        lambda h, b: (h.replace(b'"__raw__":["int32",[', b'"__raw__":["int64",['), b),
    ],
    ids=[
        "kind",
        "slot",
        "short-blob",
        "zero-row",
        "dtype",
        "not-json",
        "not-object",
        "bool-row",
        "text-reward",
        "negative-version",
        "descriptor-key",
        "shape",
        "dtype-size",
    ],
)
def test_a_payload_that_does_not_fit_its_description_is_refused_naming_the_entry(damage):
    log = _log()
    manifest = _step(log)
    victim = next(m.entry for m in manifest.shards[0].groups[0].members if m.slot == 0)
    fields = log["payloads"][victim]
    header, blob = damage(fields[codec.HEADER], fields[codec.BLOB])
    log["payloads"][victim] = {codec.HEADER: header, codec.BLOB: blob}
    with pytest.raises(DigestMismatch, match=f"entry {victim} does not hold the sample payload"):
        build_batch(manifest, 0, 2, _fetch(log), check_digests=False)


def test_a_replayed_batch_cannot_commit_or_fail():
    batch = _batch()
    with pytest.raises(ReadOnlyBatch, match="replay"):
        batch.commit()
    with pytest.raises(ReadOnlyBatch, match="cannot fail step 7 rank 0"):
        batch.fail(RuntimeError("x"))


def test_batch_files_round_trip_bit_for_bit(tmp_path):
    batch = _batch(rank=1)
    path = save_batch(batch, tmp_path / "b.safetensors")
    loaded = load_batch(path)
    for name in (*TENSOR_FIELDS, *OPTIONAL_FIELDS):
        mine, theirs = getattr(batch, name), getattr(loaded, name)
        assert mine.dtype == theirs.dtype and mine.equal(theirs), name
    for name in (
        "run",
        "step",
        "rank",
        "world_size",
        "version",
        "task_ids",
        "digest",
        "step_loss_tokens",
        "stale_masked_tokens",
    ):
        assert getattr(loaded, name) == getattr(batch, name), name
    with pytest.raises(ReadOnlyBatch):
        loaded.commit()
    assert not list(tmp_path.glob("*.partial"))


def test_batch_files_use_the_safetensors_layout(tmp_path):
    raw = save_batch(_batch(), tmp_path / "b.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    assert size % 8 == 0
    header = json.loads(raw[8 : 8 + size])
    meta = header.pop("__metadata__")
    assert meta["format"] == BATCH_FORMAT and json.loads(meta["streamgrp"])["step"] == 7
    assert all(isinstance(value, str) for value in meta.values())  # safetensors metadata is str -> str
    spans = sorted(spec["data_offsets"] for spec in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - size
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no gaps
    assert header["loss_mask"]["dtype"] == "BOOL" and header["token_ids"]["dtype"] == "I64"


def test_the_safetensors_library_reads_batch_files(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    batch = _batch()
    tensors = safetensors_torch.load_file(str(save_batch(batch, tmp_path / "b.safetensors")))
    assert set(tensors) == {*TENSOR_FIELDS, *OPTIONAL_FIELDS}
    assert all(tensors[name].equal(getattr(batch, name)) for name in (*TENSOR_FIELDS, *OPTIONAL_FIELDS))


def test_empty_tensors_and_other_dtypes_round_trip(tmp_path):
    batch = _batch()
    batch.logprobs = batch.logprobs.to(torch.bfloat16)
    batch.rewards = torch.zeros((0,), dtype=torch.float32)
    loaded = load_batch(save_batch(batch, tmp_path / "b.st"))
    assert loaded.logprobs.dtype == torch.bfloat16 and loaded.logprobs.equal(batch.logprobs)
    assert loaded.rewards.shape == (0,)


@pytest.mark.parametrize(
    "content", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{}", b"\xff" * 16, struct.pack("<Q", 2) + b"{}"]
)
def test_other_files_are_refused_with_a_clear_error(tmp_path, content):
    path = tmp_path / "not-a-batch"
    path.write_bytes(content)
    with pytest.raises(StreamgrpError, match="is not a streamgrp batch file"):
        load_batch(path)


def test_report_text_names_each_difference_and_the_verdict():
    report = VerifyReport("r1", entries_folded=10, decisions_checked=3, steps_checked=1)
    assert report.ok and format_report(report).endswith("checked 3 decisions, 0 payloads and 1 steps: all match")
    report.differences.append(Difference("decision_differs", "task t1", "members", (0, 1), (0, 1, 2)))
    text = format_report(report)
    assert text.splitlines()[0] == "decision_differs: task t1 members: recorded (0, 1), recomputed (0, 1, 2)"
    assert text.endswith("1 differences") and not report.ok


def test_batch_summary_shows_identity_and_sums():
    text = format_batch(_batch())
    assert "step 7 rank 0/2 of run r1" in text and "group sizes [2, 2]" in text and "sums" in text


def test_samples_of_other_dtypes_are_widened_to_the_batch_dtypes():
    """A worker may write int64 tokens, a bool mask or float16 logprobs; the batch has one dtype per field."""
    log = _log()
    manifest = _step(log)
    victim = next(m for m in manifest.shards[0].groups[0].members)
    task = manifest.shards[0].groups[0].task_id
    sample = _samples()[(int(task[1:]), victim.slot)]
    wide = sample.replace(
        token_ids=RawArray.from_values(sample.token_ids.to_list(), "int64"),
        loss_mask=RawArray.from_values([bool(v) for v in sample.loss_mask.to_list()], "bool"),
        logprobs=RawArray.from_values(sample.logprobs.to_list(), "float64"),
    )
    _, log["payloads"][victim.entry] = codec.sample_result(task, victim.slot, wide)
    mixed, plain = build_batch(manifest, 0, 2, _fetch(log), check_digests=False), _batch()
    for name in ("token_ids", "loss_mask", "logprobs", "attention_mask", "rewards", "versions"):
        assert getattr(mixed, name).dtype == getattr(plain, name).dtype, name
        assert getattr(mixed, name).equal(getattr(plain, name)), name


def test_a_shard_is_built_on_one_thread_and_the_callers_thread_count_is_restored(monkeypatch):
    from streamgrp.train import shard_tensors

    seen = []
    build = shard_tensors._shard_tensors
    monkeypatch.setattr(
        shard_tensors, "_shard_tensors", lambda samples: seen.append(torch.get_num_threads()) or build(samples)
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = _batch()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1] and batch.rows == 2 * len(batch.task_ids)


def test_a_run_that_masks_stale_tokens_gets_the_same_masked_shard_every_time_it_is_built():
    from streamgrp.config import RunConfig

    masking = RunConfig(n_samples=2, dp_size=2, max_staleness=1, staleness="mask")  # the step is at version 3
    plain, masked, again = _batch(), _batch(run_config=masking), _batch(run_config=masking)
    assert masked.stale_masked_tokens == int(plain.loss_mask.sum()) > 0  # every sample is of version 0 < 3 - 1
    assert not masked.loss_mask.any() and torch.equal(masked.loss_mask, again.loss_mask)
    assert torch.equal(
        _batch(run_config=RunConfig(n_samples=2, dp_size=2, max_staleness=3, staleness="mask")).loss_mask,
        plain.loss_mask,
    )


@pytest.mark.parametrize("check_digests", [False, True])
def test_payload_bytes_in_any_buffer_give_the_same_shard(check_digests):
    """A fetch may hand each payload's bytes as a slice of a larger buffer (a memoryview) or a bytearray, not
    bytes: the loader reads any buffer, and builds the same tensors from it."""
    log = _log()
    manifest = _step(log)
    arena = bytearray()
    spans = {}
    for entry, fields in log["payloads"].items():
        arena += b"\xee" * 3  # bytes between them: a slice must not read past its own
        spans[entry] = slice(len(arena), len(arena) + len(fields[codec.BLOB]))
        arena += fields[codec.BLOB]
    view = memoryview(bytes(arena))
    sliced = {
        "payloads": {
            entry: {
                codec.HEADER: fields[codec.HEADER],
                codec.BLOB: view[spans[entry]] if i % 2 else bytearray(fields[codec.BLOB]),
            }
            for i, (entry, fields) in enumerate(log["payloads"].items())
        }
    }
    for rank in (0, 1):
        plain = build_batch(manifest, rank, 2, _fetch(log), check_digests=check_digests)
        other = build_batch(manifest, rank, 2, _fetch(sliced), check_digests=check_digests)
        for name in ("token_ids", "loss_mask", "logprobs", "attention_mask", "rewards", "versions"):
            assert getattr(other, name).equal(getattr(plain, name)), name
