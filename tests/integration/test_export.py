"""`streamgrp export` on a real server: Parquet files equal to the run's own events, from the server, from
the server backed by its archive after retention trimmed it, and from the archive alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from export_checks import check_against_the_record, read_export
from streamgrp.cli.main import main
from streamgrp.core.events import Sample
from streamgrp.replay.export import export_run
from streamgrp.replay.steps import inspect_task
from streamgrp.services.worker import WorkerClient
from streamgrp.store.keys import RUNS
from streamgrp.store.sources import RedisSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
from runlog import load_run  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "run_v2.jsonl"
ROWS = {"decisions": 13, "slots": 53, "steps": 3, "step_members": 45}

pq = pytest.importorskip("pyarrow.parquet")


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_export_from_the_server_writes_what_the_run_recorded(client, redis_url, run_name, tmp_path, capsys):
    keys = load_run(client, GOLDEN, run_name)
    client.zadd(RUNS, {run_name: 1.0})
    code, out, err = cli(capsys, "export", run_name, "--redis-url", redis_url, "--out", str(tmp_path / "x"))
    assert code == 0, err
    assert out.strip() == (
        f"run {run_name}: decisions.parquet 13 rows, slots.parquet 53 rows, steps.parquet 3 rows, "
        f"step_members.parquet 45 rows, run.json; written to {tmp_path / 'x'}"
    )
    check_against_the_record(read_export(tmp_path / "x"), RedisSource(client, keys), run_name)


def test_export_after_retention_reads_the_archive_and_equals_the_untrimmed_export(
    client, redis_url, run_name, tmp_path, capsys, monkeypatch
):
    keys = load_run(client, GOLDEN, run_name)
    client.zadd(RUNS, {run_name: 1.0})
    connection = ["--redis-url", redis_url]
    assert main(["export", run_name, *connection, "--out", str(tmp_path / "whole")]) == 0
    whole = read_export(tmp_path / "whole")
    data_dir = tmp_path / "data"
    code, _, err = cli(
        capsys, "archiver", "--burst", "--retention", *connection, "--run", run_name, "--data-dir", str(data_dir)
    )
    assert code == 0, err
    assert client.xlen(keys.steps) == 2 and client.xlen(keys.commits) == 0  # step 0 and the commits were trimmed

    # The server alone has lost part of the run; its archive (found at the default place) fills it in.
    assert (
        main(
            ["export", run_name, *connection, "--data-dir", str(tmp_path / "none"), "--out", str(tmp_path / "trimmed")]
        )
        == 0
    )
    assert len(read_export(tmp_path / "trimmed")["steps"]) == 2
    assert main(["export", run_name, *connection, "--data-dir", str(data_dir), "--out", str(tmp_path / "fb")]) == 0
    assert read_export(tmp_path / "fb") == whole

    # The run deleted from the server: the archive alone answers, its run the default, flags from the environment.
    assert (
        main(["delete", run_name, "--yes", *connection, "--data-dir", str(tmp_path / "none")]) == 0
    )  # keeps the archive
    monkeypatch.setenv("STREAMGRP_ARCHIVE", str(data_dir / "archive" / run_name))
    monkeypatch.setenv("STREAMGRP_OUT", str(tmp_path / "archived"))
    capsys.readouterr()
    code, out, err = cli(capsys, "export", *connection)
    assert code == 0 and out.startswith(f"run {run_name}: decisions.parquet 13 rows"), err
    assert read_export(tmp_path / "archived") == whole
    assert {name: len(rows) for name, rows in whole.items()} == ROWS


def test_a_samples_recorded_text_is_a_column_of_the_export_and_a_line_of_inspect(client, make_run, issuer, tmp_path):
    run = make_run(n_samples=2, batch_size=1, dp_size=1)
    [task] = issuer(run).issue([{}])
    worker = WorkerClient(client, run.keys)
    written = "多字节 🙂 text"
    for slot, meta in enumerate(({"text": written}, {})):
        worker.publish(
            task.task_id,
            slot,
            Sample.from_rows(
                token_ids=[[1, 2, 3]],
                loss_mask=[[0, 1, 1]],
                logprobs=[[0.0, -0.5, -0.25]],
                rewards=[1.0],
                version=0,
                meta=meta,
            ),
        )
    export_run(client, run.keys, tmp_path / "out")
    slots = pq.read_table(tmp_path / "out" / "slots.parquet").to_pylist()
    assert [(row["slot"], row["text"]) for row in slots] == [(0, written), (1, None)]
    lines = [event for event in inspect_task(client, run.keys, task.task_id) if event.what == "slot"]
    assert [event.data.get("text") for event in lines] == [written, None]
    assert written in lines[0].text
