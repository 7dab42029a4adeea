"""A run's record as Parquet files for pandas, polars or duckdb: `export_run` (`streamgrp export RUN --out DIR`).

Owns the tables and their columns, `TABLES`, which is also their documentation (each Parquet field
carries its description in its metadata). One row per recorded fact, so a table is what an analyst
would count:

- ``decisions.parquet``: one row per group decision, with its statistics, its members' slots, each
  slot's outcome, and the step and rank that trained it (or why the batcher discarded it);
- ``slots.parquet``: one row per slot result a worker published, duplicates and late ones included
  (a slot that timed out has no result: see ``slot_outcomes`` in decisions), with the worker that
  published it and the server times its task was issued and its result appended;
- ``steps.parquet``: one row per step, totals and per-shard lists, each rank's status, the mean
  reward of its samples and the reference trainer's metrics (JSON) when recorded;
- ``step_members.parquet``: one row per member slot of every group of every shard: what each rank
  trained; join it with ``slots`` on ``entry_id`` for rewards and workers, with ``decisions`` on
  ``decision_entry``;
- ``run.json``: the run's recorded configuration and the row count of each table.

Times are the server's clock in seconds since the epoch (``pd.to_datetime(col, unit="s")``,
duckdb ``to_timestamp(col)``). Entries come from an entry source (`streamgrp.store.sources`): the
server, an archive, or the server backed by its archive, so a run trimmed by retention exports
whole. Reads only. pyarrow is optional (``pip install 'streamgrp[export]'``) and imported only here,
only when exporting.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import redis

from streamgrp.core.events import GroupDecided, GroupDiscarded, SlotResult, StepManifest, TaskIssued
from streamgrp.core.manifest import decision_ref
from streamgrp.errors import ConfigError
from streamgrp.replay.steps import list_steps, recorded_text
from streamgrp.store.keys import RunKeys
from streamgrp.store.sources import RedisSource, decode_all, partition_streams, recorded_config, server_source
from streamgrp.store.streams import entry_time

__all__ = ["INSTALL_HINT", "TABLES", "columns", "export_run", "require_pyarrow"]

INSTALL_HINT = "pip install 'streamgrp[export]'"

#: Table -> (what one row is, its columns as (name, Arrow type, meaning)), in the order they are written.
TABLES: dict[str, tuple[str, tuple[tuple[str, str, str], ...]]] = {
    "decisions": (
        "one group decision (one per decided task)",
        (
            ("run", "string", "the run's name"),
            (
                "entry_id",
                "string",
                (
                    "the decision's entry id in the decisions stream (ID@P in partition P of a "
                    "partitioned run, as every entry id here)"
                ),
            ),
            ("task_id", "string", "the task (prompt) the group sampled"),
            ("decision", "string", "complete, partial or dropped"),
            (
                "reason",
                "string",
                ("why it was dropped (all_unusable, incomplete, below_minimum, contract_violation); null when kept"),
            ),
            ("closed_by", "string", "all_slots (every slot had a result) or deadline"),
            ("issued_at", "float64", "server time the task was issued (seconds since the epoch)"),
            ("decided_at", "float64", "server time of the decision"),
            ("target_slot_count", "int64", "slots asked for (n_samples)"),
            ("usable_slot_count", "int64", "slots with a sample"),
            ("trainable_slot_count", "int64", "usable slots if the group was kept, else 0"),
            ("fully_masked_group", "bool", "no usable slot"),
            ("singleton_slot_group", "bool", "exactly one usable slot"),
            ("pre_filter_usable_slot_yield", "float64", "usable / target slots"),
            ("pre_filter_trainable_slot_yield", "float64", "trainable / target slots"),
            ("version", "int64", "the group's policy version: the oldest of its members' (null without members)"),
            ("rows", "int64", "rows of its members"),
            ("tokens", "int64", "valid loss tokens of its members"),
            ("reward_mean", "float64", "mean of its members' mean rewards (null when none is recorded)"),
            ("member_slots", "list<int64>", "slot indices of its members (its usable slots), in slot order"),
            ("slot_outcomes", "list<string>", "each slot's outcome by slot index: sample, rejected, failed or timeout"),
            ("error", "string", "the contract violation's text; null otherwise"),
            ("step", "int64", "the step that trained it; null when none did (yet)"),
            ("rank", "int64", "the DP rank whose shard held it at that step"),
            ("discarded", "string", "why the batcher did not train it (stale, filtered, leftover); null otherwise"),
            ("producer", "string", "the assembler that wrote the decision"),
        ),
    ),
    "slots": (
        "one slot result as a worker published it (duplicates and late results included)",
        (
            ("run", "string", "the run's name"),
            ("entry_id", "string", "the result's entry id in the slot log"),
            ("task_id", "string", "its task"),
            ("slot", "int64", "its slot index"),
            ("outcome", "string", "sample, rejected or failed"),
            ("error", "string", "a failed slot's exception text; null otherwise"),
            ("rows", "int64", "a sample's rows; null otherwise"),
            ("tokens", "int64", "a sample's valid loss tokens"),
            ("version", "int64", "the policy version that generated the sample"),
            ("reward", "float64", "the sample's mean reward over its rows"),
            ("digest", "string", "digest of the sample's payload entry"),
            ("producer", "string", "the publishing worker's identity"),
            ("seq", "int64", "that worker's sequence number"),
            ("issued_at", "float64", "server time its task was issued; null when the log no longer holds the issue"),
            ("published_at", "float64", "server time the result was appended to the slot log (from its entry id)"),
            ("member", "bool", "its group's decision lists this entry among its members (a sample that was folded)"),
            (
                "text",
                "string",
                (
                    "the completion's text as the worker recorded it (an inference rollout with keep_text, "
                    "the default); null when it recorded none or the payload is gone"
                ),
            ),
        ),
    ),
    "steps": (
        "one optimizer step",
        (
            ("run", "string", "the run's name"),
            ("step", "int64", "the step number"),
            ("version", "int64", "the policy version it was batched at"),
            ("created_at", "float64", "server time the batcher wrote it"),
            ("imbalance", "float64", "the largest shard's tokens over the mean shard's (1 is balanced)"),
            ("ranks", "int64", "shards, one per DP rank"),
            ("groups", "int64", "groups in the step"),
            ("rows", "int64", "rows in the step"),
            ("tokens", "int64", "valid loss tokens in the step"),
            ("shard_groups", "list<int64>", "groups per rank"),
            ("shard_rows", "list<int64>", "rows per rank"),
            ("shard_tokens", "list<int64>", "valid loss tokens per rank"),
            ("complete_groups", "int64", "its groups that were complete"),
            ("partial_groups", "int64", "its groups that were partial"),
            ("reward_mean", "float64", "mean reward of its samples (null when none is recorded)"),
            ("rank_states", "list<string>", "each rank's status: committed, failed, in_progress or pending"),
            ("failures", "int64", "failed attempts over every rank (a rank that failed then committed counts)"),
            ("error", "string", "the last exception text of the first rank that failed and has not committed"),
            ("committed_at", "float64", "server time the last rank committed; null until every rank has"),
            ("trainer_metrics", "string", "the reference trainer's metrics for the step, as JSON; null if none"),
        ),
    ),
    "step_members": (
        "one member slot of a group in a rank's shard of a step",
        (
            ("run", "string", "the run's name"),
            ("step", "int64", "the step"),
            ("rank", "int64", "the DP rank that trained it"),
            ("task_id", "string", "its group's task"),
            ("decision_entry", "string", "its group's decision entry id (decisions.entry_id)"),
            ("slot", "int64", "its slot index"),
            ("entry_id", "string", "its slot result's entry id (slots.entry_id)"),
            ("rows", "int64", "its rows"),
            ("tokens", "int64", "its valid loss tokens"),
            ("version", "int64", "the policy version that generated it"),
        ),
    ),
}

#: Sample payloads read at once for their recorded text (bounds the export's memory on long samples).
TEXT_READ_CHUNK = 256

#: Rows buffered per table before a Parquet row group is written.
ROW_GROUP = 65_536


def require_pyarrow() -> Any:
    """``pyarrow.parquet``, or a `ConfigError` saying what to install."""
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ConfigError(f"exporting to Parquet needs pyarrow, which is not installed: {INSTALL_HINT}") from None
    return parquet


def export_run(
    client: redis.Redis | None, keys: RunKeys, out_dir: str | os.PathLike[str], *, source: RedisSource | None = None
) -> dict[str, int]:
    """Write the run's tables (`TABLES`) and ``run.json`` into ``out_dir``; the rows of each table.

    Each file is written beside its final name and renamed into place, so a reader never sees half a
    file. ``source`` defaults to the server; pass an archive-backed one for a trimmed run."""
    parquet = require_pyarrow()
    source = source or server_source(client, keys)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {out}: {exc.strerror}; pass --out with a writable directory") from None
    run = keys.run

    trained: dict[str, tuple[int, int]] = {}  # decision entry -> (step, rank)
    manifests: list[StepManifest] = []
    for _, manifest in decode_all(source, "steps"):
        if isinstance(manifest, StepManifest):
            manifests.append(manifest)
            for shard in manifest.shards:
                trained.update(
                    (decision_ref(g.partition, g.decision_entry), (manifest.step, shard.rank)) for g in shard.groups
                )
    discarded = {
        event.decision_entry: event.reason
        for _, event in decode_all(source, "discarded")
        if isinstance(event, GroupDiscarded)
    }

    rows: dict[str, int] = {}
    members: set[str] = set()
    decisions: dict[str, GroupDecided] = {}
    # A partitioned run's entries are named `decision_ref`s (``1700000000000-3@2``): ids of different
    # partitions' streams can be equal.
    with _Table(parquet, out, "decisions", run) as table:
        for partition, name in partition_streams(source, "decisions"):
            for entry_id, decision in decode_all(source, name):
                if not isinstance(decision, GroupDecided):
                    continue
                ref = decision_ref(partition, entry_id)
                decisions[ref] = decision
                members.update(decision_ref(partition, m.entry) for m in decision.members)
                step, rank = trained.get(ref, (None, None))
                table.add(_decision_row(run, ref, decision, step, rank, discarded.get(ref)))
    rows["decisions"] = table.rows

    statuses = {status.step: status for status in list_steps(client, keys, source=source)}
    metrics = source.hash("trainer_metrics")
    with _Table(parquet, out, "steps", run) as steps, _Table(parquet, out, "step_members", run) as placed:
        for manifest in manifests:
            steps.add(_step_row(run, manifest, statuses.get(manifest.step), decisions, metrics.get(str(manifest.step))))
            for shard in manifest.shards:
                for group in shard.groups:
                    for m in group.members:
                        placed.add(
                            (
                                run,
                                manifest.step,
                                shard.rank,
                                group.task_id,
                                decision_ref(group.partition, group.decision_entry),
                                m.slot,
                                decision_ref(group.partition, m.entry),
                                m.rows,
                                m.tokens,
                                m.version,
                            )
                        )
    rows["steps"], rows["step_members"] = steps.rows, placed.rows

    issued: dict[str, float] = {}
    with _Table(parquet, out, "slots", run) as table:
        for partition, name in partition_streams(source, "slots"):
            # Rows wait for the next batch of payload reads (their samples' text), in log order.
            pending: list[tuple[tuple[Any, ...], str | None]] = []

            # Bound as defaults: each round of the loop has its own list and stream name.
            def flush(pending: list[tuple[tuple[Any, ...], str | None]] = pending, name: str = name) -> None:
                ids = [entry for _, entry in pending if entry is not None]
                texts = iter(
                    [recorded_text(fields) for fields in source(name.replace("slots", "payloads"), ids)] if ids else []
                )
                for row, entry in pending:
                    table.add((*row, next(texts) if entry is not None else None))
                pending.clear()

            for entry_id, event in decode_all(source, name):
                if isinstance(event, TaskIssued):
                    issued.setdefault(event.task_id, event.issued_at)
                elif isinstance(event, SlotResult):
                    sample = event.sample
                    ref = decision_ref(partition, entry_id)
                    row = (
                        run,
                        ref,
                        event.task_id,
                        event.slot,
                        event.outcome,
                        event.error,
                        # A result whose reward came later carries a placeholder: its reward is the
                        # decision's (the decisions table), not this row's.
                        *(
                            (
                                sample.rows,
                                sample.tokens,
                                sample.version,
                                None if event.reward_pending else sample.reward,
                                sample.digest,
                            )
                            if sample is not None
                            else (None,) * 5
                        ),
                        event.producer,
                        event.seq,
                        issued.get(event.task_id),
                        entry_time(entry_id),
                        ref in members,
                    )
                    pending.append((row, entry_id if sample is not None else None))
                    if len(pending) >= TEXT_READ_CHUNK:
                        flush()
            flush()
    rows["slots"] = table.rows

    record = recorded_config(source)
    _write_atomic(
        out / "run.json",
        orjson.dumps(
            {
                "run": run,
                "settings": record.model_dump(mode="json"),
                "tables": {
                    name: {"file": f"{name}.parquet", "rows": rows[name], "row": TABLES[name][0]} for name in TABLES
                },
            },
            option=orjson.OPT_INDENT_2,
        ),
    )
    return {name: rows[name] for name in TABLES}


def _decision_row(
    run: str, entry_id: str, d: GroupDecided, step: int | None, rank: int | None, discarded: str | None
) -> tuple:
    stats = d.stats
    rewards = [m.reward for m in d.members if m.reward is not None]
    # Slot keys are decimal strings: ordering by (length, text) is numeric order without parsing them.
    outcomes = [outcome for _, outcome in sorted(d.slot_outcomes.items(), key=lambda kv: (len(kv[0]), kv[0]))]
    return (
        run,
        entry_id,
        d.task_id,
        d.decision,
        d.reason,
        d.closed_by,
        d.issued_at,
        d.decided_at,
        stats.target_slot_count,
        stats.usable_slot_count,
        stats.trainable_slot_count,
        stats.fully_masked_group,
        stats.singleton_slot_group,
        stats.pre_filter_usable_slot_yield,
        stats.pre_filter_trainable_slot_yield,
        d.version,
        sum(m.rows for m in d.members),
        d.valid_tokens,
        sum(rewards) / len(rewards) if rewards else None,
        list(d.slots),
        outcomes,
        d.error,
        step,
        rank,
        discarded,
        d.producer,
    )


def _step_row(
    run: str, manifest: StepManifest, status, decisions: dict[str, GroupDecided], metrics: str | None
) -> tuple:
    shards = manifest.shards
    groups = [g for s in shards for g in s.groups]
    used = [decisions[ref] for g in groups if (ref := decision_ref(g.partition, g.decision_entry)) in decisions]
    kinds = [decision.decision for decision in used]
    rewards = [m.reward for decision in used for m in decision.members if m.reward is not None]
    ranks = status.ranks if status is not None else ()
    failed = [r for r in ranks if r.state == "failed"]
    commits = [r.at for r in ranks]
    done = bool(ranks) and all(r.state == "committed" for r in ranks) and None not in commits
    return (
        run,
        manifest.step,
        manifest.version,
        manifest.created_at,
        manifest.imbalance,
        len(shards),
        len(groups),
        sum(g.rows for g in groups),
        sum(s.tokens for s in shards),
        [len(s.groups) for s in shards],
        [sum(g.rows for g in s.groups) for s in shards],
        [s.tokens for s in shards],
        kinds.count("complete"),
        kinds.count("partial"),
        sum(rewards) / len(rewards) if rewards else None,
        [r.state for r in ranks],
        sum(r.failures for r in ranks),
        failed[0].error if failed else None,
        max(commits) if done else None,
        metrics,
    )


class _Table:
    """One table's Parquet file, written in row groups of `ROW_GROUP` rows and renamed into place on success."""

    def __init__(self, parquet: Any, out: Path, name: str, run: str) -> None:
        import pyarrow

        self.pa = pyarrow
        self.path = out / f"{name}.parquet"
        self.partial = out / f".{name}.parquet.partial"
        row, columns = TABLES[name]
        self.names = [column for column, _, _ in columns]
        self.schema = pyarrow.schema(
            [
                pyarrow.field(column, _arrow_type(pyarrow, kind), metadata={"description": about})
                for column, kind, about in columns
            ],
            metadata={"streamgrp.run": run, "streamgrp.table": name, "streamgrp.row": row},
        )
        self.writer = parquet.ParquetWriter(str(self.partial), self.schema)
        self.buffer: list[tuple] = []
        self.rows = 0

    def add(self, row: Sequence[Any]) -> None:
        self.buffer.append(tuple(row))
        if len(self.buffer) >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if not self.buffer:
            return
        columns = [list(column) for column in zip(*self.buffer)]
        self.writer.write_table(
            self.pa.Table.from_arrays(
                [self.pa.array(values, type=self.schema.field(i).type) for i, values in enumerate(columns)],
                schema=self.schema,
            )
        )
        self.rows += len(self.buffer)
        self.buffer = []

    def __enter__(self) -> _Table:
        return self

    def __exit__(self, exc_type, *_: object) -> None:
        try:
            if exc_type is None:
                self._flush()
        finally:
            self.writer.close()
        if exc_type is None:
            os.replace(self.partial, self.path)
        else:
            self.partial.unlink(missing_ok=True)


def _arrow_type(pyarrow: Any, kind: str) -> Any:
    if kind.startswith("list<"):
        return pyarrow.list_(_arrow_type(pyarrow, kind[5:-1]))
    return {
        "string": pyarrow.string(),
        "int64": pyarrow.int64(),
        "float64": pyarrow.float64(),
        "bool": pyarrow.bool_(),
    }[kind]


def _write_atomic(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def columns(table: str) -> list[str]:
    """The column names of ``table``, in order."""
    return [name for name, _, _ in TABLES[table][1]]
