"""Safe defaults that need no server: run names, private files and directories, loopback metrics."""

from __future__ import annotations

import os
import stat

import pytest

from streamgrp.config import AssemblerConfig, WorkerConfig, load
from streamgrp.errors import ConfigError
from streamgrp.store.keys import RunKeys, check_run_name
from streamgrp.store.private import open_private, private_dir, write_private


@pytest.mark.parametrize("name", ["run\n", "run\r", "", "-run", "a b", "a{b}", "a*", "x" * 65, "r\u00e9"])
def test_bad_run_names_are_config_errors_that_name_the_rule(name):
    with pytest.raises(ConfigError, match="1-64 letters, digits") as raised:
        check_run_name(name)
    assert isinstance(raised.value, ValueError)  # callers catching ValueError still do
    with pytest.raises(ConfigError):
        RunKeys(name)


def test_good_run_names_pass_unchanged():
    for name in ("r", "demo-20261202-140057", "a.b_c-9", "x" * 64):
        assert check_run_name(name) == name


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_private_dirs_and_files_are_the_owners_only_whatever_the_umask(tmp_path):
    old = os.umask(0)  # the most permissive umask: the modes must not depend on it
    try:
        nested = private_dir(tmp_path / "a" / "b" / "c")
        write_private(nested / "record.json", "{}")
        with open_private(nested / "log", "ab") as log:
            log.write(b"line\n")
        with open_private(nested / "log", "ab") as log:
            log.write(b"again\n")
    finally:
        os.umask(old)
    for directory in (tmp_path / "a", tmp_path / "a" / "b", nested):
        assert _mode(directory) == 0o700, directory
    assert _mode(nested / "record.json") == 0o600
    assert _mode(nested / "log") == 0o600
    assert (nested / "log").read_bytes() == b"line\nagain\n"


def test_an_existing_directory_keeps_its_mode(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    private_dir(shared)
    assert _mode(shared) == 0o755
    with pytest.raises(ValueError, match="mode"):
        open_private(shared / "x", "r+")


def test_metrics_listen_on_loopback_unless_told_otherwise():
    assert load(WorkerConfig, env={}).metrics_address == "127.0.0.1"
    assert load(AssemblerConfig, env={"STREAMGRP_METRICS_ADDRESS": "0.0.0.0"}).metrics_address == "0.0.0.0"
