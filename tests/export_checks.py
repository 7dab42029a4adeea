"""Checks shared by the export tests: the Parquet files read back, and compared with the run's own events."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, GroupDiscarded, SlotResult, StepManifest, TaskIssued
from streamgrp.replay.export import TABLES, columns
from streamgrp.replay.steps import list_steps
from streamgrp.store.streams import entry_time


def _events(source, stream):
    return [(entry_id, codec.decode(fields)) for entry_id, fields in source.scan(stream)]


def read_export(out: Path) -> dict[str, list[dict]]:
    """Every table as rows, checking each file's columns are the documented ones."""
    tables = {}
    for name in TABLES:
        table = pq.read_table(out / f"{name}.parquet")
        assert table.column_names == columns(name), name
        assert table.schema.metadata[b"streamgrp.table"] == name.encode()
        assert all(field.metadata[b"description"] for field in table.schema)
        tables[name] = table.to_pylist()
    return tables


def check_against_the_record(tables: dict[str, list[dict]], source, run: str) -> None:
    """The exported rows are the run's own events, field by field (shared with the integration tests)."""
    decisions = [(e, d) for e, d in _events(source, "decisions") if isinstance(d, GroupDecided)]
    manifests = [m for _, m in _events(source, "steps") if isinstance(m, StepManifest)]
    placed = {g.decision_entry: (m.step, s.rank) for m in manifests for s in m.shards for g in s.groups}
    discarded = {d.decision_entry: d.reason for _, d in _events(source, "discarded") if isinstance(d, GroupDiscarded)}
    assert len(tables["decisions"]) == len(decisions)
    for row, (entry_id, d) in zip(tables["decisions"], decisions):
        assert row["run"] == run and row["entry_id"] == entry_id
        assert (row["task_id"], row["decision"], row["reason"], row["closed_by"], row["error"]) == (
            d.task_id,
            d.decision,
            d.reason,
            d.closed_by,
            d.error,
        )
        assert (row["issued_at"], row["decided_at"], row["producer"]) == (d.issued_at, d.decided_at, d.producer)
        assert {k: row[k] for k in d.stats.to_builtins()} == d.stats.to_builtins()
        assert row["member_slots"] == [m.slot for m in d.members] and row["version"] == d.version
        assert row["slot_outcomes"] == [d.slot_outcomes[str(i)] for i in range(d.stats.target_slot_count)]
        assert (row["rows"], row["tokens"]) == (sum(m.rows for m in d.members), d.valid_tokens)
        assert (row["step"], row["rank"]) == placed.get(entry_id, (None, None))
        assert row["discarded"] == discarded.get(entry_id)

    log = _events(source, "slots")
    results = [(e, r) for e, r in log if isinstance(r, SlotResult)]
    issued = {t.task_id: t.issued_at for _, t in log if isinstance(t, TaskIssued)}
    members = {m.entry for _, d in decisions for m in d.members}
    assert len(tables["slots"]) == len(results)
    for row, (entry_id, r) in zip(tables["slots"], results):
        summary = (
            r.sample.to_builtins()
            if r.sample is not None
            else dict.fromkeys(("rows", "tokens", "version", "reward", "digest"))
        )
        assert row == {
            "run": run,
            "entry_id": entry_id,
            "task_id": r.task_id,
            "slot": r.slot,
            "outcome": r.outcome,
            "error": r.error,
            **summary,
            "producer": r.producer,
            "seq": r.seq,
            "issued_at": issued.get(r.task_id),
            "published_at": entry_time(entry_id),
            "member": entry_id in members,
            "text": _text_of(source, entry_id) if r.sample else None,
        }

    statuses = list_steps(None, source.keys, source=source)
    assert [row["step"] for row in tables["steps"]] == [m.step for m in manifests] == [s.step for s in statuses]
    for row, m, status in zip(tables["steps"], manifests, statuses):
        assert (row["version"], row["created_at"], row["imbalance"]) == (m.version, m.created_at, m.imbalance)
        assert row["shard_tokens"] == [s.tokens for s in m.shards] and row["tokens"] == sum(row["shard_tokens"])
        assert row["shard_groups"] == [len(s.groups) for s in m.shards] == list(status.groups)
        assert row["shard_rows"] == list(status.rows)
        assert row["rank_states"] == [r.state for r in status.ranks]
        assert row["complete_groups"] == status.decisions.get("complete", 0)
    assert tables["step_members"] == [
        {
            "run": run,
            "step": m.step,
            "rank": s.rank,
            "task_id": g.task_id,
            "decision_entry": g.decision_entry,
            "slot": p.slot,
            "entry_id": p.entry,
            "rows": p.rows,
            "tokens": p.tokens,
            "version": p.version,
        }
        for m in manifests
        for s in m.shards
        for g in s.groups
        for p in g.members
    ]


def _text_of(source, entry_id: str) -> str | None:
    """The completion text the sample's payload recorded (its meta's ``text``), decoded as a reader would."""
    [fields] = source("payloads", [entry_id])
    if fields is None:
        return None
    text = codec.decode(fields).sample.meta.get("text")
    return text if isinstance(text, str) else None
