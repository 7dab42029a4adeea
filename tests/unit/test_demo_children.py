"""The processes `streamgrp demo` starts for a run: one assembler per partition, each with its own log."""

from __future__ import annotations

import pytest

from streamgrp.cli.demo import _children
from streamgrp.config import DemoConfig, RunConfig


@pytest.mark.parametrize("partitions", [1, 3])
def test_the_demo_starts_one_assembler_per_partition_each_logging_apart(tmp_path, partitions):
    children = _children({}, "r1", RunConfig(partitions=partitions), DemoConfig(), tmp_path / "prompts.jsonl", tmp_path)
    assemblers = [child for child in children if child.role == "assembler"]
    assert [child.args[child.args.index("--partition") + 1] for child in assemblers] == [
        str(p) for p in range(partitions)
    ]
    assert len({child.log_path for child in children}) == len(children)
    if partitions == 1:  # the unpartitioned demo's log keeps its name
        assert assemblers[0].log_path.name == "assembler.log"
