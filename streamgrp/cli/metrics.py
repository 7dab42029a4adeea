"""Prometheus metrics: one object per process, built on an injectable registry (SPEC section 7).

Owns the metric names, their bounded labels (never a task id) and explicit histogram buckets; which
role exports which metric (`OWNED`); the ``run`` label and ``streamgrp_run_info``; the process's own
``process_*`` metrics; the mapping from the run's durable counters (``counts`` hash fields, as the
commit scripts report the increments they applied) to Prometheus counters; and a collector that
reads consumer lag and pending entries from the server at scrape time. Yields are ratios of counter
rates (``rate(streamgrp_usable_slots_total) / rate(streamgrp_target_slots_total)``), never gauges,
so a dashboard can show them over any window.

A role exports only the metrics it changes: a worker has no stall gauges and an assembler no step
counter, so no series sits at zero where it means nothing, and a query that forgets to select a
role cannot add one role's figure to another's. Where two roles do export a name, it is because
both count it (``streamgrp_slots_total``: what workers published and what the assembler folded;
``streamgrp_steps_total``: steps written by the batcher and committed by each trainer rank), and
queries tell them apart by the scrape target's ``role`` label.

Every series of a process whose run is known carries ``run="NAME"``, added when the registry is
collected (so no service passes it around), and ``streamgrp_run_info{run, version} 1`` says which
runs a Prometheus has seen. Two runs scraped by one Prometheus, or one target that a restarted
process serves for another run, never add up into one series.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from streamgrp._version import __version__
from streamgrp.core import counters
from streamgrp.core.lengths import LENGTH_LABELS
from streamgrp.errors import ConfigError

# `_created` series double every counter's output and no dashboard reads them.
disable_created_metrics()

log = logging.getLogger(__name__)

ASSEMBLY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
#: The gateway's own time per turn: sub-millisecond to the 5 ms it should stay under, and what is too much.
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: The label every series of a run's process carries.
RUN_LABEL = "run"
#: A trainer rank's series carry its rank (scrape targets' own ``index`` label need not be the rank).
RANK_LABEL = "rank"
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


def _every_preset() -> dict[str, tuple[str, ...]]:
    """Every role's preset label values, merged: a process that runs several services has them all."""
    merged: dict[str, dict[str, None]] = {}
    for presets in PRESET_LABELS.values():
        for name, values in presets.items():
            merged.setdefault(name, {}).update(dict.fromkeys(values))
    return {name: tuple(values) for name, values in merged.items()}


class Metrics:
    """The metrics of one process: ``role``'s (`OWNED`), or every one when ``role`` is None (a process that
    runs several services, as tests do).

    ``registry`` is what to collect or serve (a new one when not given). With ``run`` the metrics live in
    a registry of their own that ``registry`` collects with the ``run`` label added, beside
    ``streamgrp_run_info``. ``process_*`` metrics (CPU, memory, open files, start time) come with every
    role's. Reading a metric the role does not own raises AttributeError naming the role.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        role: str | None = None,
        run: str | None = None,
        rank: int | None = None,
    ) -> None:
        if role is not None and role not in OWNED:
            raise ValueError(f"unknown role {role!r}; one of {sorted(OWNED)}")
        self.role = role
        self.run = run
        self.registry = registry if registry is not None else CollectorRegistry()
        # Where the metrics are registered: the served registry itself, or one it collects with the run label.
        self._own = CollectorRegistry() if run is not None else self.registry
        owned = OWNED[role] if role is not None else tuple(DEFINITIONS)
        for name in owned:
            setattr(self, name, DEFINITIONS[name](self._own))
        if role is not None:
            ProcessCollector(registry=self._own)
        if run is not None:
            Info(
                "streamgrp_run",
                "The run this process works for (the run label of its every series)",
                registry=self._own,
            ).info({})
            Info(
                "streamgrp_build",
                "The software this process runs: streamgrp's and Python's versions",
                registry=self._own,
            ).info({"version": __version__, "python": platform.python_version()})
            labels = {RUN_LABEL: run, **({RANK_LABEL: str(rank)} if rank is not None else {})}
            self.registry.register(_WithLabels(self._own, labels))
        self._exception_types: set[str] = set()
        presets = PRESET_LABELS.get(role, {}) if role is not None else _every_preset()
        for name, values in presets.items():
            for value in values:
                getattr(self, name).labels(value)
        if "generations" in owned:
            for outcome, length in GENERATION_PRESETS:
                self.generations.labels(outcome, length)
        # The batcher's drop counts are its discards (stale, filtered); the assembler's, its dropped groups.
        dropped = "groups_dropped" if "groups_dropped" in owned else "groups_discarded"
        families = {
            counters.SLOTS: "slots",
            counters.DECISIONS: "groups",
            counters.DROPPED: dropped,
            counters.DEADLETTER: "dead_letters",
        }
        totals = {
            counters.TARGET_SLOTS: "target_slots",
            counters.USABLE_SLOTS: "usable_slots",
            counters.TRAINABLE_SLOTS: "trainable_slots",
            counters.STEPS: "steps_written",
        }
        self._families = {field: getattr(self, name) for field, name in families.items() if name in owned}
        self._totals = {field: getattr(self, name) for field, name in totals.items() if name in owned}

    def __getattr__(self, name: str):
        # Only reached for attributes that were not set: a metric of another role.
        if name in DEFINITIONS:
            raise AttributeError(
                f"the {self.__dict__.get('role')} process does not export {name!r} "
                "(streamgrp.cli.metrics.OWNED says which role exports what)"
            )
        raise AttributeError(name)

    def apply_counts(self, increments: Mapping[str, int]) -> None:
        """Mirror increments of the run's durable counters (field names of the `counts` hash) into the
        metrics this role exports; other fields are another role's figures, or no metric's."""
        for field, amount in increments.items():
            if amount <= 0:
                continue
            kind, _, label = field.partition(":")
            family = self._families.get(kind) if label else None
            if family is not None:
                family.labels(label).inc(amount)
            elif field in self._totals:
                self._totals[field].inc(amount)

    def step_committed(self, step: int, *, version: int | None = None, retrained: bool = False) -> None:
        """A trainer rank committed ``step``: its counters and gauges (``version``: the policy version the
        commit advanced to)."""
        self.steps_committed.inc()
        self.trainer_step.set(step)
        if retrained:
            self.steps_retrained.inc()
        if version is not None:
            self.policy_version.set(version)

    @staticmethod
    def observe_many(histogram: Histogram, value: float, count: int) -> None:
        """``count`` observations of ``value`` at once (prometheus_client observes one at a time; a step's
        tokens are counted per value, not per token)."""
        if count <= 0:
            return
        histogram._sum.inc(value * count)  # what observe() does, count times over
        for bound, bucket in zip(histogram._upper_bounds, histogram._buckets):
            if value <= bound:
                bucket.inc(count)
                break

    def rollout_raised(self, exc: BaseException) -> None:
        """Count a rollout's exception by its type's name (the first `MAX_EXCEPTION_TYPES` names, then ``other``)."""
        name = type(exc).__name__
        if name not in self._exception_types:
            if len(self._exception_types) >= MAX_EXCEPTION_TYPES:
                name = "other"
            else:
                self._exception_types.add(name)
        self.rollout_exceptions.labels(name).inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr``:``port`` (0 disables); returns the port. Loopback by default: the
        endpoint has no authentication, so listening on every interface is the caller's explicit choice."""
        if port:
            try:
                start_http_server(port, addr=addr, registry=self.registry)
            except OSError as exc:
                raise ConfigError(
                    f"--metrics-port {port} on {addr} cannot be served ({exc.strerror or exc}): "
                    "another process holds it, or the address is not this machine's; pick another "
                    "port, or 0 to turn metrics off"
                ) from None
            log.info("metrics on http://%s:%d/metrics", addr, port)
        return port

    def watch_streams(self, client, streams: Mapping[str, str]) -> None:
        """Export lag and pending entries of every consumer group on ``streams`` (stream label -> key,
        `streamgrp.store.runs.Run.streams`), read at scrape time."""
        from streamgrp.store.connection import without_retries

        # A scrape during an outage must answer at once (without those series), not wait it out.
        self._own.register(_StreamCollector(without_retries(client), dict(streams)))


class _WithLabels:
    """Collects ``registry`` with more labels on every sample (constants: the process's run, a trainer's rank)."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self.registry = registry
        self.labels = dict(labels)

    def collect(self):
        for family in self.registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [sample._replace(labels={**sample.labels, **self.labels}) for sample in family.samples]
            yield labelled

    def describe(self):
        return []


class _StreamCollector:
    """Reads XINFO GROUPS on scrape; a server error yields no samples rather than a failed scrape."""

    def __init__(self, client, streams: dict[str, str]) -> None:
        self.client = client
        self.streams = streams

    def collect(self):
        lag = GaugeMetricFamily(
            "streamgrp_consumer_lag_entries",
            "Entries not yet delivered to a consumer group",
            labels=["stream", "group"],
        )
        pending = GaugeMetricFamily(
            "streamgrp_pending_entries", "Entries delivered but not acknowledged", labels=["stream", "group"]
        )
        for short, stream in self.streams.items():
            try:
                groups = self.client.xinfo_groups(stream)
            except Exception:  # noqa: BLE001 - the stream may not exist yet, or the server is away
                continue
            for group in groups:
                name = group["name"].decode() if isinstance(group["name"], bytes) else group["name"]
                pending.add_metric([short, name], float(group.get("pending") or 0))
                if group.get("lag") is not None:
                    lag.add_metric([short, name], float(group["lag"]))
        yield lag
        yield pending

    def describe(self):
        return []
