"""What each role's metrics object exports: its own figures, its process metrics, and its run on every series."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from streamgrp.cli.metrics import OWNED, Metrics

# Written out here rather than derived from OWNED, so the test says what each role is for.
ONLY = {
    "worker": {"streamgrp_slots_total", "streamgrp_policy_version"},
    "assembler": {"streamgrp_slots_total", "streamgrp_groups_total", "streamgrp_target_slots_total",
                  "streamgrp_usable_slots_total", "streamgrp_trainable_slots_total", "streamgrp_open_groups",
                  "streamgrp_group_assembly_seconds"},
    "batcher": {"streamgrp_steps_total", "streamgrp_stall_seconds", "streamgrp_empty_rounds",
                "streamgrp_trainer_wait_rounds_total", "streamgrp_policy_version", "streamgrp_batch_imbalance_ratio",
                "streamgrp_staleness_versions", "streamgrp_served_version", "streamgrp_served_behind_seconds"},
    "trainer": {"streamgrp_steps_total", "streamgrp_step_failures_total", "streamgrp_batch_wait_seconds",
                "streamgrp_policy_version", "streamgrp_steps_retrained_total"},
    "weight-sync": set(),
    "rewarder": {"streamgrp_rewards_total", "streamgrp_reward_latency_seconds", "streamgrp_rewards_in_flight",
                 "streamgrp_reward_failures_total"},
    "follower": set(),  # its series are labelled by the follower's name and stream: none before it reads
    "gateway": {"streamgrp_gateway_turns_total", "streamgrp_gateway_replayed_turns_total",
                "streamgrp_gateway_tokens_total", "streamgrp_gateway_sessions_opened_total",
                "streamgrp_gateway_sessions_total", "streamgrp_gateway_open_sessions",
                "streamgrp_gateway_overhead_seconds", "streamgrp_gateway_upstream_seconds"},
}
EVERY = set().union(*ONLY.values())


def _exported(metrics: Metrics) -> dict[str, list]:
    """Sample name (histograms by family name) -> samples, as a scrape would parse them."""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            key = family.name if family.type == "histogram" else sample.name
            found.setdefault(key, []).append(sample)
    return found


@pytest.mark.parametrize("role", sorted(ONLY))
def test_a_role_exports_its_own_metrics_its_process_and_its_run(role):
    metrics = Metrics(role=role, run="run-a")
    exported = _exported(metrics)
    streamgrp = {name for name in exported if name.startswith("streamgrp_") and name != "streamgrp_run_info"}
    assert streamgrp == ONLY[role]
    assert not (EVERY - ONLY[role]) & set(exported)
    assert "process_cpu_seconds_total" in exported and "process_resident_memory_bytes" in exported
    [info] = exported["streamgrp_run_info"]
    assert info.labels["run"] == "run-a" and info.labels["version"] and info.value == 1
    unlabelled = [s for samples in exported.values() for s in samples if s.labels.get("run") != "run-a"]
    assert unlabelled == []


def test_the_worker_counts_what_it_publishes_and_the_assembler_every_outcome():
    worker = {s.labels["outcome"] for s in _exported(Metrics(role="worker"))["streamgrp_slots_total"]}
    assembler = {s.labels["outcome"] for s in _exported(Metrics(role="assembler"))["streamgrp_slots_total"]}
    assert worker == {"sample", "rejected", "failed"}
    assert assembler == {"sample", "rejected", "failed", "timeout", "duplicate", "late", "invalid"}


def test_counts_mirror_only_into_the_roles_own_metrics():
    increments = {"slots:sample": 3, "decisions:partial": 1, "dropped:stale": 2, "steps": 1, "target_slots": 6,
                  "groups:batched": 8, "deadletter:bad_header": 1}
    assembler, batcher = Metrics(role="assembler"), Metrics(role="batcher")
    for metrics in (assembler, batcher):
        metrics.apply_counts(increments)
    value = lambda m, name, **labels: m.registry.get_sample_value(name, labels)  # noqa: E731
    assert value(assembler, "streamgrp_slots_total", outcome="sample") == 3
    assert value(assembler, "streamgrp_target_slots_total") == 6
    assert value(assembler, "streamgrp_dead_letters_total", reason="bad_header") == 1
    assert value(assembler, "streamgrp_steps_total") is None
    assert value(batcher, "streamgrp_steps_total") == 1
    assert value(batcher, "streamgrp_groups_dropped_total", reason="stale") == 2
    assert value(batcher, "streamgrp_slots_total", outcome="sample") is None


def test_a_metric_of_another_role_is_an_error_that_names_the_role():
    with pytest.raises(AttributeError, match="the worker process does not export 'open_groups'"):
        Metrics(role="worker").open_groups  # noqa: B018
    with pytest.raises(ValueError, match="unknown role 'feeder'"):
        Metrics(role="feeder")
    assert set(OWNED) == set(ONLY)


def test_without_a_role_every_metric_is_there_on_the_given_registry():
    """A process running several services (tests do) gets them all, on the registry it passes."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    assert metrics.registry is registry
    assert EVERY <= set(_exported(metrics))
    assert "streamgrp_run_info" not in _exported(metrics)


def test_a_follower_exports_entries_skips_and_lag_by_name_and_stream():
    metrics = Metrics(role="follower", run="run-a")
    metrics.follow_entries.labels("eval", "decisions").inc(3)
    metrics.follow_lag.labels("eval", "decisions").set(1.5)
    exported = _exported(metrics)
    [entries] = exported["streamgrp_follow_entries_total"]
    assert (entries.labels["consumer"], entries.labels["stream"], entries.value) == ("eval", "decisions", 3)
    assert exported["streamgrp_follow_lag_seconds"][0].value == 1.5
