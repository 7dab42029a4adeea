"""The ACL users per role: what each may touch, built from the run's key names, and the shipped ops/acl files."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamgrp.store.acl import ROLES, TEMPLATE_RUN, access, render_run, template_for
from streamgrp.store.keys import RUNS, RunKeys

OPS_ACL = Path(__file__).resolve().parents[2] / "ops" / "acl"


def test_the_shipped_ops_acl_files_are_what_the_code_builds():
    for role, line in zip(ROLES, render_run(TEMPLATE_RUN)):
        shipped = (OPS_ACL / f"{role}.acl").read_text().strip()
        assert shipped == line, f"ops/acl/{role}.acl is stale: rerun `streamgrp acl RUN --role {role} --no-default`"
    assert (OPS_ACL / "default.acl").read_text().strip() == "user default off"


def test_a_template_becomes_another_runs_rules_and_nothing_else():
    text = (OPS_ACL / "worker.acl").read_text()
    assert template_for(text, "myrun").strip() == render_run("myrun", ["worker"])[0]
    with pytest.raises(ValueError):
        template_for(text, "my*run")  # a glob in a run name would widen every key pattern


def test_every_key_is_the_runs_own_and_only_the_batcher_writes_control_decisions_readers_and_steps():
    keys = RunKeys("r1")
    for role in ROLES:
        rights = access(keys, role)
        for key in (*rights.read, *rights.write):
            assert key == RUNS or key.startswith("sg:{r1}:"), (role, key)
        assert not {"config", "flushall", "keys", "debug", "acl", "shutdown"} & set(rights.commands)
    writers = {role: set(access(keys, role).write) for role in ROLES}
    assert [r for r in ROLES if keys.steps in writers[r]] == ["batcher", "archiver"]  # the archiver only trims
    assert [r for r in ROLES if keys.decisions in writers[r]] == ["assembler", "batcher", "archiver"]
    assert [r for r in ROLES if keys.batcher_state in writers[r]] == ["batcher"]  # the terminal markers
    assert keys.control not in writers["worker"] | writers["assembler"] | writers["archiver"]
    assert writers["inspector"] == set()
    assert "xtrim" not in access(keys, "worker").commands and "xtrim" in access(keys, "archiver").commands


def test_an_unknown_role_names_the_roles():
    with pytest.raises(ValueError, match="worker, assembler"):
        access(RunKeys("r1"), "admin")


def test_the_gateway_stages_turns_only_in_a_keys_run_and_each_partition_gets_its_own_turn_keys():
    from streamgrp.store import payloads

    keys = RunKeys("r1")
    staged, turns = payloads.staged_pattern(keys.sessions), payloads.turn_pattern(keys.sessions)
    gateway = access(keys, "gateway")  # `may` compares the rules' key patterns
    assert gateway.may("set", staged) and not gateway.may("set", turns) and not gateway.may("set", keys.sessions)
    assert gateway.may("rename", staged) and gateway.may("persist", turns) and not gateway.may("persist", staged)
    # No selector lets a RENAME move bytes between payload keys and the sessions' keys.
    assert not any(keys.payload_keys in on and turns in on for commands, on in gateway.confined if "rename" in commands)
    assert not any(command in ("del", "unlink") for commands, _ in gateway.confined for command in commands)
    old = access(keys, "gateway", layout="stream")  # its turns keep their tensors in the sessions stream
    assert not old.may("set", staged) and not old.may("rename", staged) and "mget" not in old.commands
    spread, archiver = access(keys, "gateway", partitions=3), access(keys, "archiver", partitions=3)
    for part in keys.partitions(3):
        assert spread.may("set", payloads.staged_pattern(part.sessions))
        assert spread.may("persist", payloads.turn_pattern(part.sessions))
        assert archiver.may("unlink", payloads.turn_pattern(part.sessions))
