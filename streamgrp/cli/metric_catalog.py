"""The catalogue of streamgrp's Prometheus metrics: every metric's name, help, labels and histogram buckets
(`DEFINITIONS`), which role exports which (`OWNED`), and the label values made up front so a dashboard
panel has data from the first scrape (`PRESET_LABELS`, `GENERATION_PRESETS`).

Data, and one setting: prometheus_client's ``_created`` series are turned off for every metric built from
it. Building the metrics of one process, their ``run`` label and the collectors read at scrape time are
`streamgrp.cli.metrics.Metrics`'s. Labels stay bounded (never a task id); SPEC section 7 names
the metrics.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from streamgrp.core.lengths import LENGTH_LABELS

# `_created` series double every counter's output and no dashboard reads them.
disable_created_metrics()

ASSEMBLY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
#: The gateway's own time per turn: sub-millisecond to the 5 ms it should stay under, and what is too much.
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

#: Distinct exception types a worker counts by name; later ones count as ``other`` (a bounded label).
MAX_EXCEPTION_TYPES = 32

#: Every metric by the `Metrics` attribute that holds it.
DEFINITIONS: dict[str, Callable[[CollectorRegistry], object]] = {
    "slots": lambda r: Counter(
        "streamgrp_slots", "Slot results the assembler folded, by outcome", ["outcome"], registry=r
    ),
    "slots_published": lambda r: Counter(
        "streamgrp_slots_published", "Slot results a worker published, by outcome", ["outcome"], registry=r
    ),
    "groups": lambda r: Counter("streamgrp_groups", "Group decisions by kind", ["decision"], registry=r),
    "groups_dropped": lambda r: Counter(
        "streamgrp_groups_dropped", "Groups the assembler dropped, by reason", ["reason"], registry=r
    ),
    "groups_discarded": lambda r: Counter(
        "streamgrp_groups_discarded",
        "Decided groups the batcher did not train (stale, filtered), by reason",
        ["reason"],
        registry=r,
    ),
    "target_slots": lambda r: Counter(
        "streamgrp_target_slots", "Slots asked for (n_samples per decided group)", registry=r
    ),
    "usable_slots": lambda r: Counter("streamgrp_usable_slots", "Usable slots of decided groups", registry=r),
    "trainable_slots": lambda r: Counter(
        "streamgrp_trainable_slots", "Usable slots of groups that were kept", registry=r
    ),
    "steps_written": lambda r: Counter("streamgrp_steps_written", "Steps the batcher wrote", registry=r),
    # SPEC section 7's step counter: what the trainer ranks committed (the batcher's are steps_written).
    "steps_committed": lambda r: Counter("streamgrp_steps", "Steps this trainer rank committed", registry=r),
    "trainer_step": lambda r: Gauge("streamgrp_trainer_step", "The step this trainer rank committed last", registry=r),
    "step_failures": lambda r: Counter("streamgrp_step_failures", "Trainer steps that raised", registry=r),
    "steps_retrained": lambda r: Counter(
        "streamgrp_steps_retrained",
        "Steps a trainer rank trained again after its "
        "group rolled back to a checkpoint (their first training was lost)",
        registry=r,
    ),
    "dead_letters": lambda r: Counter(
        "streamgrp_dead_letters", "Entries sent to the dead-letter stream", ["reason"], registry=r
    ),
    "stall_seconds": lambda r: Gauge(
        "streamgrp_stall_seconds", "Seconds since the last round that added a trainable group", registry=r
    ),
    "empty_rounds": lambda r: Gauge(
        "streamgrp_empty_rounds", "Consecutive batcher rounds without a trainable group", registry=r
    ),
    "trainer_wait_rounds": lambda r: Counter(
        "streamgrp_trainer_wait_rounds",
        "Batcher rounds spent waiting for trainers to commit (staleness window full); never empty rounds",
        registry=r,
    ),
    "held_rounds": lambda r: Counter(
        "streamgrp_held_rounds",
        "Batcher rounds spent holding a step for a generation still in flight (--staleness wait); never empty rounds",
        registry=r,
    ),
    "open_groups": lambda r: Gauge("streamgrp_open_groups", "Groups the assembler holds open", registry=r),
    "policy_version": lambda r: Gauge("streamgrp_policy_version", "Current policy version", registry=r),
    "served_version": lambda r: Gauge(
        "streamgrp_served_version",
        "Newest policy version among the samples of the groups decided: what the workers are served",
        registry=r,
    ),
    "served_behind": lambda r: Gauge(
        "streamgrp_served_behind_seconds",
        "Seconds the served version has been over "
        "max_staleness versions behind the run's while groups are decided (0: keeping "
        "up); are weights being published?",
        registry=r,
    ),
    "batch_imbalance": lambda r: Gauge(
        "streamgrp_batch_imbalance_ratio", "Largest shard tokens over the mean, last step", registry=r
    ),
    "group_assembly": lambda r: Histogram(
        "streamgrp_group_assembly_seconds", "Task issued to group decided", buckets=ASSEMBLY_BUCKETS, registry=r
    ),
    "batch_wait": lambda r: Histogram(
        "streamgrp_batch_wait_seconds",
        "Time a trainer rank waited for its next batch",
        buckets=WAIT_BUCKETS,
        registry=r,
    ),
    "rewards": lambda r: Counter(
        "streamgrp_rewards",
        "Rewards a rewarder posted, by what they made of their slot (sample, rejected, failed)",
        ["outcome"],
        registry=r,
    ),
    "reward_latency": lambda r: Histogram(
        "streamgrp_reward_latency_seconds",
        "Result published to its reward posted",
        buckets=ASSEMBLY_BUCKETS,
        registry=r,
    ),
    "rewards_in_flight": lambda r: Gauge(
        "streamgrp_rewards_in_flight", "Results a rewarder is scoring now", registry=r
    ),
    "reward_failures": lambda r: Counter(
        "streamgrp_reward_failures",
        "Scorings that failed: transient (retried) or error (the slot failed)",
        ["kind"],
        registry=r,
    ),
    "rollouts_in_flight": lambda r: Gauge(
        "streamgrp_rollouts_in_flight", "Slots whose rollout is running in this worker now", registry=r
    ),
    "rollout_seconds": lambda r: Histogram(
        "streamgrp_rollout_seconds",
        "A slot's rollout, called to returned (or raised)",
        buckets=ASSEMBLY_BUCKETS,
        registry=r,
    ),
    "rollout_exceptions": lambda r: Counter(
        "streamgrp_rollout_exceptions",
        f"Rollouts that raised, by exception type (the first {MAX_EXCEPTION_TYPES} types seen, then 'other')",
        ["type"],
        registry=r,
    ),
    "staleness": lambda r: Histogram(
        "streamgrp_staleness_versions",
        "Policy versions a group was behind when batched",
        buckets=STALENESS_BUCKETS,
        registry=r,
    ),
    # The bias monitor (streamgrp.services.outcomes): what became of generations, by length.
    "generations": lambda r: Counter(
        "streamgrp_generations",
        "Generations (decided slots) by what became of them "
        "(trained, stale, filtered, leftover, dropped, timeout) and loss-token length "
        "bucket (256, 1k, 4k, 16k, more; none: timed out)",
        ["outcome", "length"],
        registry=r,
    ),
    # Per-token versions, as a trainer rank loads them (streamgrp.train.step_metrics.observe_versions).
    "version_span": lambda r: Histogram(
        "streamgrp_sample_version_span",
        "Newest minus oldest policy version among a trained row's tokens",
        buckets=STALENESS_BUCKETS,
        registry=r,
    ),
    "token_staleness": lambda r: Histogram(
        "streamgrp_token_staleness_versions",
        "Policy versions a trained loss token was behind its step's version",
        buckets=STALENESS_BUCKETS,
        registry=r,
    ),
    "stale_masked_tokens": lambda r: Counter(
        "streamgrp_stale_masked_tokens", "Loss tokens the staleness mask cleared (--staleness mask)", registry=r
    ),
    # Followers (streamgrp.store.follower): named consumers beside the run, by name and stream.
    "follow_entries": lambda r: Counter(
        "streamgrp_follow_entries", "Entries a follower read", ["consumer", "stream"], registry=r
    ),
    "follow_skipped": lambda r: Counter(
        "streamgrp_follow_skipped",
        "Entries retention trimmed before a follower read them (it fell past --max-follow-lag-s)",
        ["consumer", "stream"],
        registry=r,
    ),
    "follow_lag": lambda r: Gauge(
        "streamgrp_follow_lag_seconds",
        "Age of the newest entry a follower read while more waited (0: caught up)",
        ["consumer", "stream"],
        registry=r,
    ),
    # The agent gateway (streamgrp.services.gateway): sessions and their turns.
    "gateway_turns": lambda r: Counter(
        "streamgrp_gateway_turns",
        "Agent session turns recorded, by endpoint (chat, completions)",
        ["endpoint"],
        registry=r,
    ),
    "gateway_replayed_turns": lambda r: Counter(
        "streamgrp_gateway_replayed_turns",
        "Retried requests answered again from their turn's record, not generated again",
        registry=r,
    ),
    "gateway_tokens": lambda r: Counter(
        "streamgrp_gateway_tokens", "Prompt and completion tokens of the turns recorded", ["kind"], registry=r
    ),
    "gateway_sessions_opened": lambda r: Counter(
        "streamgrp_gateway_sessions_opened", "Agent sessions opened", registry=r
    ),
    "gateway_sessions": lambda r: Counter(
        "streamgrp_gateway_sessions",
        "Agent sessions ended, by outcome (sample, rejected, failed, timeout)",
        ["outcome"],
        registry=r,
    ),
    "gateway_open_sessions": lambda r: Gauge(
        "streamgrp_gateway_open_sessions", "Agent sessions open in the run", registry=r
    ),
    "gateway_overhead": lambda r: Histogram(
        "streamgrp_gateway_overhead_seconds",
        "A turn's time in the gateway apart from its waits for the inference server (template, tokenizer, generation)",
        buckets=OVERHEAD_BUCKETS,
        registry=r,
    ),
    "gateway_upstream": lambda r: Histogram(
        "streamgrp_gateway_upstream_seconds",
        "A turn's waits for the inference server",
        buckets=ASSEMBLY_BUCKETS,
        registry=r,
    ),
    "gateway_errors": lambda r: Counter(
        "streamgrp_gateway_errors", "Gateway requests answered with an error, by HTTP status", ["status"], registry=r
    ),
}

#: What each role exports: the metrics its code changes (worker.py, assembler.py, batcher.py, the
#: trainer functions, and the dead letters each one sends). Lag and pending entries
#: (`Metrics.watch_streams`) come on top, from the roles that read every stream: assembler, batcher.
OWNED: dict[str, tuple[str, ...]] = {
    "worker": (
        "slots_published",
        "dead_letters",
        "policy_version",
        "rollouts_in_flight",
        "rollout_seconds",
        "rollout_exceptions",
    ),
    "assembler": (
        "slots",
        "groups",
        "groups_dropped",
        "target_slots",
        "usable_slots",
        "trainable_slots",
        "dead_letters",
        "open_groups",
        "group_assembly",
    ),
    "batcher": (
        "steps_written",
        "groups_discarded",
        "dead_letters",
        "stall_seconds",
        "empty_rounds",
        "trainer_wait_rounds",
        "policy_version",
        "batch_imbalance",
        "staleness",
        "served_version",
        "served_behind",
        "generations",
        "held_rounds",
    ),
    "trainer": (
        "steps_committed",
        "trainer_step",
        "step_failures",
        "steps_retrained",
        "batch_wait",
        "policy_version",
        "version_span",
        "token_staleness",
        "stale_masked_tokens",
    ),
    "weight-sync": (),
    "rewarder": ("rewards", "reward_latency", "rewards_in_flight", "reward_failures"),
    "follower": ("follow_entries", "follow_skipped", "follow_lag"),
    "gateway": (
        "gateway_turns",
        "gateway_replayed_turns",
        "gateway_tokens",
        "gateway_sessions_opened",
        "gateway_sessions",
        "gateway_open_sessions",
        "gateway_overhead",
        "gateway_upstream",
        "gateway_errors",
    ),
}

#: Label values created up front, so a dashboard panel has data from the first scrape: a worker
#: publishes only samples, rejections and failures; the assembler folds every outcome.
PRESET_LABELS: dict[str, dict[str, tuple[str, ...]]] = {
    "worker": {"slots_published": ("sample", "rejected", "failed")},
    "batcher": {"groups_discarded": ("stale", "filtered", "leftover")},
    "rewarder": {"rewards": ("sample", "rejected", "failed"), "reward_failures": ("transient", "error")},
    "gateway": {
        "gateway_turns": ("chat", "completions"),
        "gateway_tokens": ("prompt", "completion"),
        "gateway_sessions": ("sample", "rejected", "failed", "timeout"),
    },
    "assembler": {
        "slots": ("sample", "rejected", "failed", "timeout", "duplicate", "late", "invalid"),
        "groups": ("complete", "partial", "dropped"),
    },
}


#: The bias monitor's series made up front (two labels, so not in `PRESET_LABELS`): what its dashboard
#: panel divides, trained and stale by length and the timeouts (which have no length).
GENERATION_PRESETS = (
    *((outcome, length) for outcome in ("trained", "stale") for length in LENGTH_LABELS),
    ("timeout", "none"),
)


def every_preset() -> dict[str, tuple[str, ...]]:
    """Every role's preset label values, merged: a process that runs several services has them all."""
    merged: dict[str, dict[str, None]] = {}
    for presets in PRESET_LABELS.values():
        for name, values in presets.items():
            merged.setdefault(name, {}).update(dict.fromkeys(values))
    return {name: tuple(values) for name, values in merged.items()}
