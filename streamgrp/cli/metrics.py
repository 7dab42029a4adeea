"""Prometheus metrics: one object per process, built on an injectable registry (SPEC section 7).

Owns building a role's metrics from the catalogue (`streamgrp.cli.metric_catalog`: the metric names,
their bounded labels, never a task id, and explicit histogram buckets; which role exports which,
`OWNED`); the ``run`` label and ``streamgrp_run_info``; the process's own ``process_*`` metrics; the
mapping from the run's durable counters (``counts`` hash fields, as the commit scripts report the
increments they applied) to Prometheus counters; and a collector that reads consumer lag and pending
entries from the server at scrape time. Yields are ratios of counter
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
from collections.abc import Mapping

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    Info,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from streamgrp._version import __version__
from streamgrp.cli.metric_catalog import (
    DEFINITIONS,
    GENERATION_PRESETS,
    MAX_EXCEPTION_TYPES,
    OWNED,
    PRESET_LABELS,
    every_preset,
)
from streamgrp.core import counters
from streamgrp.errors import ConfigError

log = logging.getLogger(__name__)

#: The label every series of a run's process carries.
RUN_LABEL = "run"
#: A trainer rank's series carry its rank (scrape targets' own ``index`` label need not be the rank).
RANK_LABEL = "rank"


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
        presets = PRESET_LABELS.get(role, {}) if role is not None else every_preset()
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
