"""The gateway's metrics (`streamgrp.cli.metrics`, role ``gateway``): what a scrape shows from the first one,
the run on every series; and the command's refusals that need no server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from streamgrp.cli.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]


def _samples(registry: CollectorRegistry) -> dict[str, list]:
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            found.setdefault(family.name if family.type == "histogram" else sample.name, []).append(sample)
    return found


def test_the_gateway_exports_its_figures_with_the_run_on_every_series():
    metrics = Metrics(role="gateway", run="run-a")
    metrics.gateway_turns.labels("chat").inc()
    metrics.gateway_tokens.labels("completion").inc(7)
    metrics.gateway_overhead.observe(0.0012)
    metrics.gateway_sessions.labels("timeout").inc()
    metrics.gateway_errors.labels("410").inc()
    exported = _samples(metrics.registry)
    assert [s.value for s in exported["streamgrp_gateway_errors_total"]] == [1]
    assert sorted(s.labels["kind"] for s in exported["streamgrp_gateway_tokens_total"]) == ["completion", "prompt"]
    outcomes = {s.labels["outcome"]: s.value for s in exported["streamgrp_gateway_sessions_total"]}
    assert outcomes == {"sample": 0, "rejected": 0, "failed": 0, "timeout": 1}  # there from the first scrape
    assert all(s.labels.get("run") == "run-a" for samples in exported.values() for s in samples)
    assert "process_cpu_seconds_total" in exported and "streamgrp_run_info" in exported
    bare = Metrics(CollectorRegistry(), role="gateway")
    assert "streamgrp_run_info" not in _samples(bare.registry)


def test_a_reachable_gateway_without_a_token_does_not_start():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamgrp",
            "gateway",
            "--gateway-host",
            "0.0.0.0",
            "--redis-url",
            "redis://127.0.0.1:1/0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "reachable from other machines" in done.stderr and "--gateway-token-file" in done.stderr
