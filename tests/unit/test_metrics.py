"""What each role's metrics object exports: its own figures, its process metrics, and its run on every series."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from streamgrp._version import __version__
from streamgrp.cli.metrics import MAX_EXCEPTION_TYPES, OWNED, Metrics

# Written out here rather than derived from OWNED, so the test says what each role is for.
ONLY = {
    "worker": {
        "streamgrp_slots_published_total",
        "streamgrp_policy_version",
        "streamgrp_rollouts_in_flight",
        "streamgrp_rollout_seconds",
    },
    "assembler": {
        "streamgrp_slots_total",
        "streamgrp_groups_total",
        "streamgrp_target_slots_total",
        "streamgrp_usable_slots_total",
        "streamgrp_trainable_slots_total",
        "streamgrp_open_groups",
        "streamgrp_group_assembly_seconds",
    },
    "batcher": {
        "streamgrp_steps_written_total",
        "streamgrp_groups_discarded_total",
        "streamgrp_stall_seconds",
        "streamgrp_empty_rounds",
        "streamgrp_trainer_wait_rounds_total",
        "streamgrp_policy_version",
        "streamgrp_batch_imbalance_ratio",
        "streamgrp_staleness_versions",
        "streamgrp_served_version",
        "streamgrp_served_behind_seconds",
        "streamgrp_generations_total",
        "streamgrp_held_rounds_total",
    },
    "trainer": {
        "streamgrp_steps_total",
        "streamgrp_trainer_step",
        "streamgrp_step_failures_total",
        "streamgrp_batch_wait_seconds",
        "streamgrp_policy_version",
        "streamgrp_steps_retrained_total",
        "streamgrp_sample_version_span",
        "streamgrp_token_staleness_versions",
        "streamgrp_stale_masked_tokens_total",
    },
    "weight-sync": set(),
    "rewarder": {
        "streamgrp_rewards_total",
        "streamgrp_reward_latency_seconds",
        "streamgrp_rewards_in_flight",
        "streamgrp_reward_failures_total",
    },
    "follower": set(),  # its series are labelled by the follower's name and stream: none before it reads
    "gateway": {
        "streamgrp_gateway_turns_total",
        "streamgrp_gateway_replayed_turns_total",
        "streamgrp_gateway_tokens_total",
        "streamgrp_gateway_sessions_opened_total",
        "streamgrp_gateway_sessions_total",
        "streamgrp_gateway_open_sessions",
        "streamgrp_gateway_overhead_seconds",
        "streamgrp_gateway_upstream_seconds",
    },
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
    streamgrp = {name for name in exported if name.startswith("streamgrp_")} - {
        "streamgrp_run_info",
        "streamgrp_build_info",
    }
    assert streamgrp == ONLY[role]
    assert not (EVERY - ONLY[role]) & set(exported)
    assert "process_cpu_seconds_total" in exported and "process_resident_memory_bytes" in exported
    [info] = exported["streamgrp_run_info"]
    assert info.labels == {"run": "run-a"} and info.value == 1  # no version beside the policy version's gauge
    [build] = exported["streamgrp_build_info"]
    assert build.labels["version"] == __version__ and build.labels["python"].count(".") == 2 and build.value == 1
    unlabelled = [s for samples in exported.values() for s in samples if s.labels.get("run") != "run-a"]
    assert unlabelled == []


def test_the_worker_counts_what_it_publishes_and_the_assembler_every_outcome():
    worker = {s.labels["outcome"] for s in _exported(Metrics(role="worker"))["streamgrp_slots_published_total"]}
    assembler = {s.labels["outcome"] for s in _exported(Metrics(role="assembler"))["streamgrp_slots_total"]}
    assert worker == {"sample", "rejected", "failed"}
    assert assembler == {"sample", "rejected", "failed", "timeout", "duplicate", "late", "invalid"}


def test_counts_mirror_only_into_the_roles_own_metrics():
    increments = {
        "slots:sample": 3,
        "decisions:partial": 1,
        "dropped:stale": 2,
        "steps": 1,
        "target_slots": 6,
        "groups:batched": 8,
        "deadletter:bad_header": 1,
    }
    assembler, batcher = Metrics(role="assembler"), Metrics(role="batcher")
    for metrics in (assembler, batcher):
        metrics.apply_counts(increments)
    value = lambda m, name, **labels: m.registry.get_sample_value(name, labels)  # noqa: E731
    assert value(assembler, "streamgrp_slots_total", outcome="sample") == 3
    assert value(assembler, "streamgrp_target_slots_total") == 6
    assert value(assembler, "streamgrp_dead_letters_total", reason="bad_header") == 1
    assert value(assembler, "streamgrp_steps_written_total") is None
    assert value(batcher, "streamgrp_steps_written_total") == 1
    assert value(batcher, "streamgrp_groups_discarded_total", reason="stale") == 2
    assert value(batcher, "streamgrp_groups_dropped_total", reason="stale") is None  # the assembler's name
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


def test_one_name_has_one_meaning_whichever_role_exports_it():
    """A sum over every target never adds one role's figure to another's: names two roles export count the same
    thing (dead letters each sends, the policy version each sees)."""
    by_name: dict[str, set[str]] = {}
    for role in OWNED:
        for name in _exported(Metrics(role=role, run="r")):
            if name.startswith("streamgrp_") and name not in ("streamgrp_run_info", "streamgrp_build_info"):
                by_name.setdefault(name, set()).add(role)
    shared = {name: roles for name, roles in by_name.items() if len(roles) > 1}
    assert shared == {"streamgrp_policy_version": {"worker", "batcher", "trainer"}}  # dead letters: none preset


def test_a_trainer_ranks_series_carry_its_rank_and_its_steps():
    trainer = Metrics(role="trainer", run="run-a", rank=1)
    trainer.step_committed(7, version=8, retrained=True)
    exported = _exported(trainer)
    assert all(s.labels["rank"] == "1" for samples in exported.values() for s in samples)
    value = lambda name: trainer.registry.get_sample_value(name, {"run": "run-a", "rank": "1"})  # noqa: E731
    assert (
        value("streamgrp_trainer_step"),
        value("streamgrp_steps_total"),
        value("streamgrp_steps_retrained_total"),
        value("streamgrp_policy_version"),
    ) == (7, 1, 1, 8)


def test_a_worker_counts_rollout_exceptions_by_type_under_a_bounded_label():
    worker = Metrics(role="worker")
    for index in range(MAX_EXCEPTION_TYPES + 5):
        worker.rollout_raised(type(f"Error{index}", (Exception,), {})())
    worker.rollout_raised(ValueError())
    types = {s.labels["type"] for s in _exported(worker)["streamgrp_rollout_exceptions_total"]}
    assert len(types) == MAX_EXCEPTION_TYPES + 1 and "other" in types and "Error0" in types
    assert worker.registry.get_sample_value("streamgrp_rollout_exceptions_total", {"type": "other"}) == 6


def test_a_metrics_port_in_use_is_one_clear_error_not_a_traceback():
    import socket

    from streamgrp.errors import ConfigError

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--metrics-port {port} on 127.0.0.1 cannot be served .*pick another"):
            Metrics(role="worker").serve(port)


def test_a_follower_exports_entries_skips_and_lag_by_name_and_stream():
    metrics = Metrics(role="follower", run="run-a")
    metrics.follow_entries.labels("eval", "decisions").inc(3)
    metrics.follow_lag.labels("eval", "decisions").set(1.5)
    exported = _exported(metrics)
    [entries] = exported["streamgrp_follow_entries_total"]
    assert (entries.labels["consumer"], entries.labels["stream"], entries.value) == ("eval", "decisions", 3)
    assert exported["streamgrp_follow_lag_seconds"][0].value == 1.5


def test_the_bias_monitor_counts_each_generation_once_by_outcome_and_length():
    from streamgrp.core.events import DecidedMember, GroupDecided, GroupStats
    from streamgrp.core.lengths import length_bucket
    from streamgrp.services import outcomes

    def group(task, tokens, outcomes_=None, decision="complete"):
        members = tuple(
            DecidedMember(slot=i, entry=f"{i}-0", rows=1, tokens=n, version=0, reward=0.0) for i, n in enumerate(tokens)
        )
        return GroupDecided.of(
            task_id=task,
            decision=decision,
            reason="all_unusable" if decision == "dropped" else None,
            members=members,
            slot_outcomes=outcomes_ or {},
            stats=GroupStats.of(3, len(members), len(members)),
            closed_by="deadline",
        )

    metrics = Metrics(role="batcher")
    short_and_long = group("a", [100, 5000], {"0": "sample", "1": "sample", "2": "timeout"})
    outcomes.decided(metrics, [short_and_long, group("b", [300], decision="dropped")])
    outcomes.batched(metrics, 3, [short_and_long])
    outcomes.discarded(metrics, group("c", [20000]), "stale")
    counted = {
        tuple(sample.labels.values()): sample.value
        for sample in metrics.generations.collect()[0].samples
        if sample.value
    }
    assert counted == {
        ("timeout", "none"): 1,
        ("dropped", "1k"): 1,
        ("trained", "256"): 1,
        ("trained", "16k"): 1,
        ("stale", "more"): 1,
    }
    assert [length_bucket(n) for n in (1, 256, 257, 4096, 16385)] == ["256", "256", "1k", "4k", "more"]


def test_many_observations_at_once_are_what_as_many_observe_calls_give():
    one, many = Metrics(role="trainer"), Metrics(role="trainer")
    for value, count in ((0, 5), (2, 3), (40, 1)):
        for _ in range(count):
            one.token_staleness.observe(value)
        many.observe_many(many.token_staleness, value, count)
    assert [s.value for s in one.token_staleness.collect()[0].samples] == [
        s.value for s in many.token_staleness.collect()[0].samples
    ]
