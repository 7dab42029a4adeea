"""Exporting a run to Parquet, from the golden run log in memory (no server): every table read back by
pyarrow equals what the run recorded; without pyarrow the command says what to install."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import orjson
import pytest

from streamgrp.cli.main import main
from streamgrp.errors import ConfigError
from streamgrp.replay.export import INSTALL_HINT, export_run, require_pyarrow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
from runlog import MemorySource  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.mark.parametrize("log", ["run_v2.jsonl", "run_v1.jsonl"])
def test_the_golden_run_exports_one_row_per_fact_equal_to_its_events(tmp_path, log):
    pytest.importorskip("pyarrow")
    from export_checks import check_against_the_record, read_export

    source = MemorySource(GOLDEN / log)
    rows = export_run(None, source.keys, tmp_path / "out", source=source)
    assert rows == {"decisions": 13, "slots": 53, "steps": 3, "step_members": 45}
    tables = read_export(tmp_path / "out")
    check_against_the_record(tables, source, "golden")
    assert {name: len(t) for name, t in tables.items()} == rows
    assert Counter(r["outcome"] for r in tables["slots"]) == {"sample": 48, "rejected": 3, "failed": 2}
    assert sum(r["member"] for r in tables["slots"]) == 46  # two samples were a duplicate and a late result
    failed = tables["steps"][1]
    assert failed["rank_states"] == ["committed", "failed"] and "injected fault" in failed["error"]
    assert failed["committed_at"] is None and tables["steps"][0]["committed_at"] is not None
    meta = orjson.loads((tmp_path / "out" / "run.json").read_bytes())
    assert meta["run"] == "golden" and meta["settings"]["n_samples"] == 4
    assert {name: t["rows"] for name, t in meta["tables"].items()} == rows
    assert not list((tmp_path / "out").glob(".*"))  # no partial file left behind


def test_without_pyarrow_export_says_what_to_install_before_connecting(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # an import of it now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r"pip install 'streamgrp\[export\]'"):
        require_pyarrow()
    # an unreachable server: reaching for it first would wait out the outage budget instead
    assert main(["export", "r1", "--redis-url", "redis://127.0.0.1:1/0", "--outage-budget-s", "1"]) == 2
    assert INSTALL_HINT in capsys.readouterr().err
