"""`streamgrp export --follow`: the run's decisions as Parquet files appended while the run goes.

A follower (`streamgrp.store.follower`, named ``--follow-name``, default ``export``) reads the
decisions as they are written; every ``--flush-s`` seconds (or `ROWS_PER_FILE` decisions) the ones read
since the last file become one more file, ``OUT/decisions/part-<STREAM>-<FIRST ENTRY ID>.parquet``, with
the columns of ``decisions.parquet`` (`streamgrp.replay.export.TABLES`); ``step``, ``rank`` and
``discarded`` are null there, since a decision is exported before a step takes it (the whole-run export
has them). ``pyarrow.dataset`` / ``pd.read_parquet(OUT/decisions)`` / duckdb's ``read_parquet('OUT/decisions/
*.parquet')`` read the directory as one table.

Each file is written beside its name and renamed into place, and only then is the follower's position
recorded: a killed export writes the unrecorded decisions again on restart into a file of the same name
(its first entry is the same), which replaces the first one, so every decision is in exactly one file.
Entries retention trimmed before the export read them (a skip, `streamgrp.store.follower.Skipped`)
are appended to ``OUT/skipped.jsonl``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from streamgrp.core.events import GroupDecided
from streamgrp.core.manifest import decision_ref
from streamgrp.errors import ConfigError
from streamgrp.replay.export import require_pyarrow
from streamgrp.replay.export_tables import TABLES, arrow_type, decision_row
from streamgrp.store.follower import Followed, Follower, Skipped
from streamgrp.store.runs import Run

__all__ = ["ROWS_PER_FILE", "follow_export"]

#: Most decisions in one file.
ROWS_PER_FILE = 65_536


def follow_export(
    client: Any,
    run: Run,
    out_dir: str | os.PathLike[str],
    *,
    name: str = "export",
    flush_s: float = 5.0,
    stop: threading.Event | None = None,
    until_finished: bool = False,
    poll_s: float = 0.5,
    metrics: Any = None,
) -> tuple[int, int]:
    """Append the run's decisions to ``out_dir``/decisions as they come, until ``stop`` (or, ``until_finished``,
    the run's end); returns (files, decisions) written by this call."""
    parquet = require_pyarrow()
    import pyarrow

    stop = stop or threading.Event()
    out = Path(out_dir)
    try:
        (out / "decisions").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create {out / 'decisions'}: {exc.strerror}; pass --out with a writable directory"
        ) from None
    columns = TABLES["decisions"][1]
    schema = pyarrow.schema(
        [pyarrow.field(c, arrow_type(pyarrow, kind), metadata={"description": about}) for c, kind, about in columns],
        metadata={"streamgrp.run": run.name, "streamgrp.table": "decisions"},
    )
    follower = Follower(client, run, name, "decisions", poll_s=poll_s, metrics=metrics)
    partitioned = len(follower.streams) > 1
    held: list[Followed] = []
    files = rows = 0
    last_flush = time.monotonic()
    idle_since: float | None = None

    def flush() -> None:
        nonlocal files, rows, last_flush
        last_flush = time.monotonic()
        by_stream: dict[str, list[Followed]] = {}
        for item in held:
            by_stream.setdefault(item.stream, []).append(item)
        for stream, items in by_stream.items():
            partition = int(stream.partition("@")[2] or 0) if partitioned else 0
            table = [
                decision_row(run.name, decision_ref(partition, i.entry_id), i.event, None, None, None)
                for i in items
                if isinstance(i.event, GroupDecided)
            ]
            if table:
                arrays = [
                    pyarrow.array(list(values), type=schema.field(n).type) for n, values in enumerate(zip(*table))
                ]
                path = out / "decisions" / f"part-{stream}-{items[0].entry_id}.parquet"
                partial = path.with_name(f".{path.name}.partial")
                parquet.write_table(pyarrow.Table.from_arrays(arrays, schema=schema), str(partial))
                os.replace(partial, path)
                files += 1
                rows += len(table)
        for item in held:
            follower.handled(item)
        held.clear()
        follower.record()  # only now: what is recorded is on disk

    while not stop.is_set():
        items = follower.poll()
        for item in items:
            if isinstance(item, Skipped):
                flush()  # what came before the skip, then the skip itself
                with open(out / "skipped.jsonl", "ab") as log:
                    log.write(
                        orjson.dumps(
                            {"stream": item.stream, "after": item.after, "before": item.before, "count": item.count}
                        )
                        + b"\n"
                    )
                follower.handled(item)
                follower.record()
            else:
                held.append(item)
        if held and (len(held) >= ROWS_PER_FILE or time.monotonic() - last_flush >= flush_s):
            flush()
        if items:
            idle_since = None
            continue
        idle_since = idle_since if idle_since is not None else time.monotonic()
        if until_finished and follower.run_ended() and time.monotonic() - idle_since >= 2.0:
            break
        stop.wait(poll_s)
    if held:
        flush()
    return files, rows
