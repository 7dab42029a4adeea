"""The golden run logs (`run_v1.jsonl` as schema 1 wrote it, `run_v2.jsonl` and `run_v3.jsonl` made by
`make_golden.py` with the versions that wrote them) replay to what their trainers consumed.

Served every way a run's record can be read: from memory through the entry-source interface (no
server), from an archive directory (no server), loaded into a fresh run on each real server kind
with the recorded entry ids, archived from there by the archiver, and trimmed on the server with the
archive behind it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from runlog import MemorySource, load_run, write_archive

from streamgrp.config import ArchiverConfig
from streamgrp.core import codec
from streamgrp.errors import ConfigError
from streamgrp.replay import (
    format_report,
    inspect_task,
    list_steps,
    replay_step,
    verify,
)
from streamgrp.services.archiver import Archiver
from streamgrp.store.sources import ArchiveSource, FallbackSource, RedisSource

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Golden:
    """One golden log and what replaying it must give."""

    log: Path
    expected: dict


#: v1: samples inline in the slot log (logs written before payloads were split off); v2: payloads in their own
#: stream, untagged BLAKE2b digests; v3: payloads in keys, ``sha256:`` digests (the version before ``blake3:``).
#: Runs of this version are checked the same way by every replay and verify test that runs the pipeline.
GOLDENS = {
    version: Golden(HERE / f"run_{version}.jsonl", json.loads((HERE / f"expected_{version}.json").read_text()))
    for version in ("v1", "v2", "v3")
}


@pytest.fixture(params=sorted(GOLDENS))
def golden(request) -> Golden:
    return GOLDENS[request.param]


def _check_replays(golden, client, keys, source=None) -> None:
    for step in golden.expected["steps"]:
        for want in step["ranks"]:
            batch = replay_step(client, keys, step["step"], want["rank"], source=source)
            assert (batch.step, batch.rank, batch.version, batch.run) == (
                step["step"],
                want["rank"],
                step["version"],
                keys.run,
            )
            assert batch.digest == want["digest"]
            assert batch.task_ids == want["task_ids"]
            assert batch.group_sizes.tolist() == want["group_sizes"]
            assert list(batch.token_ids.shape) == want["shape"]
            assert int(batch.token_ids.sum()) == want["token_ids_sum"]
            assert int(batch.loss_mask.sum()) == want["loss_mask_sum"]
            assert int(batch.attention_mask.sum()) == want["attention_mask_sum"]
            assert float(batch.logprobs.double().sum()) == want["logprobs_sum"]
            assert batch.rewards.tolist() == want["rewards"]
            assert batch.token_ids[0].tolist() == want["first_row"]
            assert batch.step_loss_tokens == want["step_loss_tokens"]
            assert batch.token_ids.dtype == torch.int64 and batch.loss_mask.dtype == torch.bool


def _check_record(golden, client, keys, source=None) -> None:
    report = verify(client, keys, source=source)
    assert report.ok, format_report(report)
    assert report.decisions_checked == 13 and report.steps_checked == len(golden.expected["steps"])
    statuses = list_steps(client, keys, source=source)
    assert {str(s.step): {str(r.rank): r.state for r in s.ranks} for s in statuses} == golden.expected["rank_states"]
    failed = [(s.step, r.rank, r.error) for s in statuses for r in s.ranks if r.state == "failed"]
    assert failed == [(1, 1, golden.expected["failure"])]
    assert statuses[0].decisions == {"complete": 2, "partial": 2}  # g00, g04 | g01, g02
    timeline = inspect_task(client, keys, "g05", source=source)
    whats = [event.what for event in timeline]
    assert whats == ["issued", "slot", "slot", "slot", "decided", "slot", "trained"]
    decided = timeline[whats.index("decided")]
    assert decided.data["closed_by"] == "deadline" and decided.data["decision"] == "partial"
    assert "late" in timeline[5].text
    trained = [event.data for event in timeline if event.what == "trained"]
    assert trained == [{"step": 2, "rank": 0}]


def test_golden_log_replays_from_an_entry_source_without_a_server(golden):
    source = MemorySource(golden.log)
    _check_replays(golden, None, source.keys, source)
    _check_record(golden, None, source.keys, source)


def test_golden_log_replays_from_an_archive_without_a_server(golden, tmp_path):
    keys = write_archive(golden.log, tmp_path / "archive")
    source = ArchiveSource(tmp_path / "archive")
    assert source.keys == keys
    _check_replays(golden, None, source.keys, source)
    _check_record(golden, None, source.keys, source)


@pytest.mark.cluster
def test_golden_log_archived_by_the_archiver_replays_once_the_server_forgot_it(golden, client, run_name, tmp_path):
    keys = load_run(client, golden.log, run_name)
    # every entry, byte for byte, as the server holds it (a keys-layout run's payloads as their entries)
    before = {name: list(RedisSource(client, keys).scan(name)) for name in keys.all_streams()}
    Archiver(client, keys, tmp_path / "archive").run(burst=True)
    source = ArchiveSource(tmp_path / "archive")
    for name, entries in before.items():
        assert list(source.scan(name)) == entries, name
    client.delete(*keys.all_streams().values(), keys.committed, keys.decided, keys.counts)
    _check_replays(golden, None, keys, source)
    _check_record(golden, None, keys, source)


@pytest.mark.cluster
def test_golden_log_trimmed_on_the_server_replays_through_the_archive(golden, client, run_name, tmp_path):
    keys = load_run(client, golden.log, run_name)
    archiver = Archiver(client, keys, tmp_path / "archive", ArchiverConfig(retention=True))
    archiver.run(burst=True)
    assert archiver.trimmed > 0
    assert client.xlen(keys.steps) < len(golden.expected["steps"])  # steps every rank committed are gone...
    with pytest.raises(ConfigError, match="no longer retained"):
        replay_step(client, keys, 0, 0)
    source = FallbackSource(RedisSource(client, keys), ArchiveSource(tmp_path / "archive"))
    _check_replays(golden, client, keys, source)  # ...and come back from the archive
    _check_record(golden, client, keys, source)
    assert not verify(client, keys).ok  # the server alone cannot check what it no longer holds
    # what a rank has still to train stays on the server, payloads included (they share the slot log's floor)
    committed = {int(rank): int(step) for rank, step in client.hgetall(keys.committed).items()}
    for manifest in (codec.decode(fields) for _, fields in client.xrange(keys.steps)):
        if manifest.step > min(committed.values()):
            for member in (m for shard in manifest.shards for group in shard.groups for m in group.members):
                assert client.xrange(keys.slots, member.entry, member.entry), member.entry
                if golden.log.name == "run_v2.jsonl":
                    assert client.xrange(keys.payloads, member.entry, member.entry), member.entry
    if golden.log.name == "run_v2.jsonl":
        assert 0 < client.xlen(keys.payloads) < sum(1 for _ in ArchiveSource(tmp_path / "archive").scan("payloads"))


@pytest.mark.cluster
def test_golden_log_loaded_on_a_real_server_replays_and_verifies(golden, client, run_name):
    keys = load_run(client, golden.log, run_name)
    _check_replays(golden, client, keys)
    _check_record(golden, client, keys)


def test_golden_log_without_consumer_groups_still_verifies(golden, client, run_name):
    keys = load_run(client, golden.log, run_name, groups=False)
    report = verify(client, keys)
    assert report.ok, format_report(report)
    assert report.unread_entries == 0


@pytest.mark.parametrize("task", ["g03", "g01"])
def test_golden_decisions_are_the_recorded_ones(golden, task):
    source = MemorySource(golden.log)
    decided = next(e for e in inspect_task(None, source.keys, task, source=source) if e.what == "decided")
    assert [decided.data["decision"], decided.data["reason"]] == golden.expected["decisions"][task]


def test_recorded_decisions_and_steps_re_encode_to_the_same_bytes(golden):
    """Members are records in Python and columns on the wire: decoding then encoding a recorded
    decision or manifest gives back its exact header, so schema 1 logs and archives stay readable
    and their digests hold."""
    from streamgrp.core import codec
    from streamgrp.core.events import DecidedMember, GroupDecided, StepManifest

    source = MemorySource(golden.log)
    seen = {GroupDecided: 0, StepManifest: 0}
    for stream in ("decisions", "steps"):
        for fields in source.streams[stream].values():
            event = codec.decode(fields)
            seen[type(event)] += 1
            assert codec.encode(event)[codec.HEADER] == fields[codec.HEADER]
            if isinstance(event, GroupDecided):
                assert all(isinstance(m, DecidedMember) and m.digest for m in event.members)
    assert seen[GroupDecided] >= 10 and seen[StepManifest] >= 3
