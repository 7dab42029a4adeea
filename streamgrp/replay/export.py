"""A run's record as Parquet files for pandas, polars or duckdb: `export_run` (`streamgrp export RUN --out DIR`).

Owns reading the run for the tables and writing their files; the columns, `TABLES` (also their documentation:
each Parquet field carries its description in its metadata), and the rows are `streamgrp.replay.export_tables`'.
One row per recorded fact, so a table is what an analyst would count:

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
from streamgrp.replay.export_tables import (
    TABLES,
    arrow_type,
    columns,
    decision_row,
    step_row,
)
from streamgrp.replay.steps import list_steps, recorded_text
from streamgrp.store.keys import RunKeys
from streamgrp.store.sources import RedisSource, decode_all, partition_streams, recorded_config, server_source
from streamgrp.store.streams import entry_time

__all__ = ["INSTALL_HINT", "TABLES", "columns", "export_run", "require_pyarrow"]

INSTALL_HINT = "pip install 'streamgrp[export]'"

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
                table.add(decision_row(run, ref, decision, step, rank, discarded.get(ref)))
    rows["decisions"] = table.rows

    statuses = {status.step: status for status in list_steps(client, keys, source=source)}
    metrics = source.hash("trainer_metrics")
    with _Table(parquet, out, "steps", run) as steps, _Table(parquet, out, "step_members", run) as placed:
        for manifest in manifests:
            steps.add(step_row(run, manifest, statuses.get(manifest.step), decisions, metrics.get(str(manifest.step))))
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
                pyarrow.field(column, arrow_type(pyarrow, kind), metadata={"description": about})
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


def _write_atomic(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)
