"""The `streamgrp` command as users run it: real processes, TOML and environment settings."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from streamgrp import __version__
from streamgrp.core import codec
from streamgrp.store.keys import RunKeys


def streamgrp(
    *args: str, env: dict[str, str] | None = None, cwd=None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamgrp", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        timeout=timeout,
    )


def test_version_and_help_show_environment_variables():
    assert streamgrp("--version").stdout.strip() == f"streamgrp {__version__}"
    help_text = streamgrp("worker", "--help").stdout
    assert "--n-samples" in help_text and "STREAMGRP_N_SAMPLES" in help_text
    assert "STREAMGRP_REDIS_URL" in help_text


def test_toml_file_and_environment_configure_a_run_and_a_burst_drain(client, redis_url, run_name, tmp_path, issuer):
    config = tmp_path / "streamgrp.toml"
    config.write_text(
        f'[connection]\nrun = "{run_name}"\n\n[run]\nn_samples = 3\nreward_norm = '
        '{ mean_level = "group", std_level = "group" }\n\n[worker]\nconcurrency = 2\n'
    )
    env = {"STREAMGRP_CONFIG": str(config), "STREAMGRP_REDIS_URL": redis_url, "STREAMGRP_GROUP_TIMEOUT_S": "120"}
    result = streamgrp("batcher", "--burst", env=env)  # the batcher creates the run; the others only open it
    assert result.returncode == 0, result.stderr
    from streamgrp.store.runs import open_run

    run = open_run(client, run_name)
    assert (run.config.n_samples, run.config.group_timeout_s) == (3, 120.0)
    assert run.config.reward_norm.mean_level == "group"
    issuer(run).issue([{"tokens": 8}] * 5)
    assert streamgrp("worker", "--burst", env=env).returncode == 0
    assert streamgrp("assembler", "--burst", env=env).returncode == 0
    decisions = [codec.decode(f) for _, f in client.xrange(RunKeys(run_name).decisions)]
    assert len(decisions) == 5 and all(d.decision == "complete" for d in decisions)


def test_a_process_with_a_different_policy_refuses_to_start(redis_url, run_name):
    first = streamgrp("batcher", "--burst", "--redis-url", redis_url, "--run", run_name, "--n-samples", "4")
    assert first.returncode == 0, first.stderr
    refused = streamgrp(
        "worker",
        "--burst",
        "--redis-url",
        redis_url,
        "--run",
        run_name,
        "--n-samples",
        "8",
        "--reward-norm",
        "group,group",
    )
    assert refused.returncode == 2
    assert "refuses to join" in refused.stderr
    assert "n_samples: recorded 4, this process 8" in refused.stderr
    assert "reward_norm: recorded None" in refused.stderr


def test_bad_settings_say_what_to_change(redis_url):
    result = streamgrp("worker", "--redis-url", redis_url, "--reward-norm", "mean-only")
    assert result.returncode == 2 and "write 'MEAN,STD'" in result.stderr
    result = streamgrp("worker", "--redis-url", redis_url, "--rollout", "nowhere_module:fn", "--burst")
    assert result.returncode == 2 and "cannot import 'nowhere_module'" in result.stderr
    # an absent server is waited for (it may be restarting), then named with the budget to raise
    result = streamgrp("worker", "--redis-url", "redis://127.0.0.1:1/0", "--burst", "--outage-budget-s", "1")
    assert result.returncode == 2 and "over the outage budget of 1s" in result.stderr
    assert result.stderr.count("is unavailable") == 1  # one line per outage, not one per attempt


def test_without_a_url_the_embedded_server_starts_and_keeps_runs_across_commands(tmp_path):
    first = streamgrp("batcher", "--burst", "--run", "persisted", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / ".streamgrp").is_dir()
    listed = streamgrp("runs", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("persisted\t")
    assert "reading the embedded server's data in" in listed.stderr or "reusing server" in listed.stderr


def test_an_inspection_command_with_no_server_anywhere_says_where_it_looked_and_starts_nothing(tmp_path):
    done = streamgrp("steps", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "streamgrp steps: no server to read: no --redis-url (STREAMGRP_REDIS_URL) was given and "
            f"{tmp_path / '.streamgrp'}"
        )
    )
    assert not (tmp_path / ".streamgrp").exists()  # no empty server, no empty data directory


def test_only_the_batcher_creates_a_run_and_the_others_wait_for_it(client, redis_url, run_name):
    refused = streamgrp("assembler", "--burst", "--redis-url", redis_url, "--run", run_name)
    assert refused.returncode == 2 and "does not exist" in refused.stderr and "batcher" in refused.stderr
    assert not client.exists(RunKeys(run_name).control)  # it wrote nothing
    waiting = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamgrp",
            "worker",
            "--redis-url",
            redis_url,
            "--run",
            run_name,
            "--max-tasks",
            "1",
            "--n-samples",
            "2",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2.0)
        assert waiting.poll() is None  # waiting for the run, not failing
        created = streamgrp("batcher", "--burst", "--redis-url", redis_url, "--run", run_name, "--n-samples", "2")
        assert created.returncode == 0, created.stderr
        from streamgrp.store.tasks import TaskIssuer

        TaskIssuer(client, RunKeys(run_name)).issue([{"tokens": 4}])
        _, err = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode == 0, err
    assert "waits for run" in err and f"joined run {run_name}" in err


def test_a_bad_run_name_is_a_clear_error_not_a_traceback(redis_url):
    for name in ("bad name", "a{b}", "-dash"):
        result = streamgrp("steps", "--redis-url", redis_url, f"--run={name}")
        assert result.returncode == 2, result.stderr
        assert "is not allowed" in result.stderr and "Traceback" not in result.stderr
