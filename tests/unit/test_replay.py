"""The pure parts of replay: rebuilding a shard from entries in memory, batch files, read-only batches,
and the report text. No server."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from streamgrp.core import codec
from streamgrp.core.events import SlotResult, TaskIssued
from streamgrp.core.group_fold import Closed, run_fold
from streamgrp.core.manifest import make_manifest
from streamgrp.core.policy import GroupPolicy, NormSpec
from streamgrp.errors import StreamgrpError
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
from streamgrp.train.trainer import DigestMismatch, ReadOnlyBatch, build_batch

POLICY = GroupPolicy(n_samples=2, reward_norm=NormSpec("group", "group"))


def _log(tasks: int = 4) -> dict[str, dict[bytes, bytes]]:
    """Slot-log entries by id: each task issued, then two samples of different lengths."""
    entries = {}
    for task in range(tasks):
        entries[f"{task + 1}-0"] = codec.encode(TaskIssued(task_id=f"t{task}", issued_at=0.0))
        for slot in range(2):
            sample = make_sample(tokens=2 + task + slot, reward=slot, seed=10 * task + slot, prompt_tokens=1)
            entries[f"{task + 1}-{slot + 1}"] = codec.encode(SlotResult(task_id=f"t{task}", slot=slot,
                                                                         outcome="sample", sample=sample))
    return entries


def _step(entries):
    _, outputs = run_fold(POLICY, ((entry_id, codec.decode(fields), codec.entry_digest(fields))
                                   for entry_id, fields in entries.items()))
    groups = [(f"{100 + i}-0", output.decision) for i, output in enumerate(outputs) if isinstance(output, Closed)]
    return make_manifest(7, 3, groups, 2, 123.0)


def _batch(entries=None, rank=0):
    entries = entries or _log()
    manifest = _step(_log())
    return build_batch(manifest, rank, 2, lambda ids: [entries.get(i) for i in ids], run="r1")


def test_a_shard_is_rebuilt_from_any_entry_source():
    batch = _batch()
    assert (batch.run, batch.step, batch.rank, batch.world_size, batch.version) == ("r1", 7, 0, 2, 3)
    assert batch.group_sizes.tolist() == [2] * len(batch.task_ids)
    assert batch.rows == 2 * len(batch.task_ids)
    assert batch.attention_mask.sum(dim=1).tolist() == [len(s.loss_mask.data) for s in batch.samples]


def test_changed_or_missing_entries_raise_digest_mismatch():
    entries = _log()
    manifest = _step(entries)
    victim = manifest.shards[0].groups[0].members[0].entry
    changed = dict(entries)
    blob = bytearray(changed[victim][codec.BLOB])
    blob[0] ^= 0xFF
    changed[victim] = {**changed[victim], codec.BLOB: bytes(blob)}
    with pytest.raises(DigestMismatch, match="do not match the digest"):
        build_batch(manifest, 0, 2, lambda ids: [changed.get(i) for i in ids])
    del changed[victim]
    with pytest.raises(DigestMismatch, match=f"slot entry {victim} is gone"):
        build_batch(manifest, 0, 2, lambda ids: [changed.get(i) for i in ids])


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
    for name in TENSOR_FIELDS:
        mine, theirs = getattr(batch, name), getattr(loaded, name)
        assert mine.dtype == theirs.dtype and mine.equal(theirs), name
    for name in ("run", "step", "rank", "world_size", "version", "task_ids", "digest", "step_loss_tokens"):
        assert getattr(loaded, name) == getattr(batch, name), name
    with pytest.raises(ReadOnlyBatch):
        loaded.commit()
    assert not list(tmp_path.glob("*.partial"))


def test_batch_files_use_the_safetensors_layout(tmp_path):
    raw = save_batch(_batch(), tmp_path / "b.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    assert size % 8 == 0
    header = json.loads(raw[8:8 + size])
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
    assert set(tensors) == set(TENSOR_FIELDS)
    assert all(tensors[name].equal(getattr(batch, name)) for name in TENSOR_FIELDS)


def test_empty_tensors_and_other_dtypes_round_trip(tmp_path):
    batch = _batch()
    batch.logprobs = batch.logprobs.to(torch.bfloat16)
    batch.rewards = torch.zeros((0,), dtype=torch.float32)
    loaded = load_batch(save_batch(batch, tmp_path / "b.st"))
    assert loaded.logprobs.dtype == torch.bfloat16 and loaded.logprobs.equal(batch.logprobs)
    assert loaded.rewards.shape == (0,)


@pytest.mark.parametrize("content", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{}", b"\xff" * 16,
                                     struct.pack("<Q", 2) + b"{}"])
def test_other_files_are_refused_with_a_clear_error(tmp_path, content):
    path = tmp_path / "not-a-batch"
    path.write_bytes(content)
    with pytest.raises(StreamgrpError, match="is not a streamgrp batch file"):
        load_batch(path)


def test_report_text_names_each_difference_and_the_verdict():
    report = VerifyReport("r1", entries_folded=10, decisions_checked=3, steps_checked=1)
    assert report.ok and format_report(report).endswith("checked 3 decisions and 1 steps: all match")
    report.differences.append(Difference("decision_differs", "task t1", "members", (0, 1), (0, 1, 2)))
    text = format_report(report)
    assert text.splitlines()[0] == "decision_differs: task t1 members: recorded (0, 1), recomputed (0, 1, 2)"
    assert text.endswith("1 differences") and not report.ok


def test_batch_summary_shows_identity_and_sums():
    text = format_batch(_batch())
    assert "step 7 rank 0/2 of run r1" in text and "group sizes [2, 2]" in text and "sums" in text
