"""Prometheus metrics: one object per process, built on an injectable registry (SPEC section 7).

Owns the metric names, their bounded labels (never a task id) and explicit histogram buckets, the
mapping from the run's durable counters (`counts` hash fields, as the commit scripts report the
increments they applied) to Prometheus counters, and a collector that reads consumer lag and
pending entries from the server at scrape time. Yields are ratios of counter rates
(``rate(streamgrp_usable_slots_total) / rate(streamgrp_target_slots_total)``), never gauges, so a
dashboard can show them over any window.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily

from streamgrp.core import counters

# `_created` series double every counter's output and no dashboard reads them.
disable_created_metrics()

log = logging.getLogger(__name__)

ASSEMBLY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)


class Metrics:
    """Every streamgrp metric. Roles update the ones they own; the rest stay at zero."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.slots = Counter("streamgrp_slots", "Slot results by outcome", ["outcome"], registry=r)
        self.groups = Counter("streamgrp_groups", "Group decisions by kind", ["decision"], registry=r)
        self.groups_dropped = Counter("streamgrp_groups_dropped", "Dropped groups by reason", ["reason"], registry=r)
        self.target_slots = Counter("streamgrp_target_slots", "Slots asked for (n_samples per decided group)", registry=r)
        self.usable_slots = Counter("streamgrp_usable_slots", "Usable slots of decided groups", registry=r)
        self.trainable_slots = Counter("streamgrp_trainable_slots", "Usable slots of groups that were kept", registry=r)
        self.steps = Counter("streamgrp_steps", "Steps written by the batcher or committed by a trainer rank", registry=r)
        self.step_failures = Counter("streamgrp_step_failures", "Trainer steps that raised", registry=r)
        self.dead_letters = Counter("streamgrp_dead_letters", "Entries sent to the dead-letter stream", ["reason"],
                                    registry=r)
        self.stall_seconds = Gauge("streamgrp_stall_seconds", "Seconds since the last round that added a trainable group",
                                   registry=r)
        self.empty_rounds = Gauge("streamgrp_empty_rounds", "Consecutive batcher rounds without a trainable group",
                                  registry=r)
        self.trainer_wait_rounds = Counter("streamgrp_trainer_wait_rounds", "Batcher rounds spent waiting for "
                                           "trainers to commit (staleness window full); never empty rounds",
                                           registry=r)
        self.open_groups = Gauge("streamgrp_open_groups", "Groups the assembler holds open", registry=r)
        self.policy_version = Gauge("streamgrp_policy_version", "Current policy version", registry=r)
        self.batch_imbalance = Gauge("streamgrp_batch_imbalance_ratio", "Largest shard tokens over the mean, last step",
                                     registry=r)
        self.group_assembly = Histogram("streamgrp_group_assembly_seconds", "Task issued to group decided",
                                        buckets=ASSEMBLY_BUCKETS, registry=r)
        self.batch_wait = Histogram("streamgrp_batch_wait_seconds", "Time a trainer rank waited for its next batch",
                                    buckets=WAIT_BUCKETS, registry=r)
        self.staleness = Histogram("streamgrp_staleness_versions", "Policy versions a group was behind when batched",
                                   buckets=STALENESS_BUCKETS, registry=r)
        self._families = {counters.SLOTS: self.slots, counters.DECISIONS: self.groups,
                          counters.DROPPED: self.groups_dropped, counters.DEADLETTER: self.dead_letters}
        self._totals = {counters.TARGET_SLOTS: self.target_slots, counters.USABLE_SLOTS: self.usable_slots,
                        counters.TRAINABLE_SLOTS: self.trainable_slots, counters.STEPS: self.steps}
        # Pre-create the label values dashboards plot, so every panel has data from the first scrape.
        for outcome in ("sample", "rejected", "failed", "timeout", "duplicate", "late", "invalid"):
            self.slots.labels(outcome)
        for decision in ("complete", "partial", "dropped"):
            self.groups.labels(decision)

    def apply_counts(self, increments: Mapping[str, int]) -> None:
        """Mirror increments of the run's durable counters (field names of the `counts` hash)."""
        for field, amount in increments.items():
            if amount <= 0:
                continue
            kind, _, label = field.partition(":")
            family = self._families.get(kind) if label else None
            if family is not None:
                family.labels(label).inc(amount)
            elif field in self._totals:
                self._totals[field].inc(amount)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr``:``port`` (0 disables); returns the port. Loopback by default: the
        endpoint has no authentication, so listening on every interface is the caller's explicit choice."""
        if port:
            start_http_server(port, addr=addr, registry=self.registry)
            log.info("metrics on http://%s:%d/metrics", addr, port)
        return port

    def watch_streams(self, client, streams: Iterable[str]) -> None:
        """Export lag and pending entries of every consumer group on ``streams``, read at scrape time."""
        from streamgrp.store.connection import without_retries

        # A scrape during an outage must answer at once (without those series), not wait it out.
        self.registry.register(_StreamCollector(without_retries(client), list(streams)))


class _StreamCollector:
    """Reads XINFO GROUPS on scrape; a server error yields no samples rather than a failed scrape."""

    def __init__(self, client, streams: list[str]) -> None:
        self.client = client
        self.streams = streams

    def collect(self):
        lag = GaugeMetricFamily("streamgrp_consumer_lag_entries", "Entries not yet delivered to a consumer group",
                                labels=["stream", "group"])
        pending = GaugeMetricFamily("streamgrp_pending_entries", "Entries delivered but not acknowledged",
                                    labels=["stream", "group"])
        for stream in self.streams:
            short = stream.rsplit(":", 1)[-1]
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
