"""The batcher: turns group decisions into steps, one manifest per step, each step exactly once.

Owns, for one run: reading decisions through the `batcher` consumer group, discarding stale and
filtered groups, forming batches (fixed: ``batch_size`` groups; dynamic: the trainable groups a
round produced, at least ``dp_size``), splitting them over ranks, the stall bound, the end of the
run, and (through `streamgrp.services.feeder`) issuing tasks within the staleness window.

Decisions are read and decoded by `streamgrp.services.decision_reader`; what the fold puts out is stamped
and committed by `streamgrp.services.batch_writer`.

Exactly once: a step's manifest, the next-step counter and the acknowledgement of the decision
entries it uses are one function call (`batch_commit.lua`), fenced by the batcher lease; the fold's
outputs reach it as typed records through the store adapter (`streamgrp.store.batcher_store`).
Manifests are written at explicit entry ids (``{step}-1``), so a step number can neither be skipped
nor written twice. Groups buffered for a later step stay pending in the consumer group, so a restarted batcher
rebuilds its buffer from its pending entries, in order.

A partitioned run's decisions are in each partition's own hash slot, which one script call cannot
reach together with the steps stream on a cluster. There the commit records the decisions it uses
in ``batcher:unacked`` (run slot, same call) and the batcher acknowledges them in their partitions
afterwards; a batcher taking over applies what is recorded before it reads any pending decision, so
a decision a written step used is never buffered again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from streamgrp.config import BatcherConfig
from streamgrp.core import batch_fold
from streamgrp.core.batch_fold import BatchRules, BatchState, GroupFilter
from streamgrp.core.events import RunFinished
from streamgrp.core.manifest import decision_ref
from streamgrp.core.served import ServedTracker
from streamgrp.core.stall import StallTracker
from streamgrp.errors import LeaseLost
from streamgrp.services import heap, outcomes
from streamgrp.services.batch_writer import BatchWriter
from streamgrp.services.decision_reader import Batches, DecisionReader
from streamgrp.services.feeder import DatasetIdentity, Feeder, check_feed
from streamgrp.store import batcher_store
from streamgrp.store.batcher_store import Settle
from streamgrp.store.connection import MAX_BLOCK_MS, outage_of
from streamgrp.store.lease import Lease, run_while_leased
from streamgrp.store.runs import Run
from streamgrp.store.streams import hash_reply, producer_name
from streamgrp.store.version import VersionReader

log = logging.getLogger(__name__)

__all__ = ["Batcher", "GroupFilter"]


class Batcher:
    """One batcher process's driver; `run` loops until stopped, finished, failed, or (burst) idle."""

    def __init__(
        self,
        client: redis.Redis,
        run: Run,
        config: BatcherConfig,
        *,
        name: str | None = None,
        group_filter: GroupFilter | None = None,
        dataset=None,
        dataset_identity: DatasetIdentity | None = None,
        metrics: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.joined_run = run
        self.keys = run.keys
        self._version = VersionReader(run.keys)
        self.settings = run.config
        self.config = config
        self.name = name or producer_name("batcher")
        self.group_filter = group_filter
        self.dataset = dataset
        # What this batcher feeds the run, recorded by the first one active: one taking over must agree.
        self.feed = dataset_identity or DatasetIdentity(
            "(none: tasks are issued outside the batcher)" if dataset is None else "(an iterable given in Python)"
        )
        self.max_steps = "none" if config.max_steps is None else str(config.max_steps)
        self.metrics = metrics
        self.clock = clock
        self.lease = Lease(client, self.keys.batcher_lease, self.name, config.lease_ttl_s)
        self.rules = BatchRules.of(self.settings, config.max_steps)
        self.state = BatchState(self.rules, group_filter)
        self.served = ServedTracker(self.settings.max_staleness)  # is the served policy keeping up?
        self._finished_outcome: str | None = None  # found already finished or failed at activation
        self._active = False
        self._feeder: Feeder | None = None
        self._inactive_since: float | None = None
        self.outage = outage_of(client)
        self.partitions = run.partitions
        self.writer = BatchWriter(
            client, run.keys, run.partitions, self.settings, self.lease, name=self.name, metrics=metrics
        )
        self.store = self.writer.store
        self.reader = DecisionReader(client, run.keys, run.partitions, self._version, metrics=metrics)
        self._check_feed(self._state())  # a standby with another dataset is refused at its start, not at takeover

    @property
    def outcome(self) -> str:
        """``running``, ``finished`` or ``failed``."""
        return self._finished_outcome or self.state.outcome

    @property
    def stall(self) -> StallTracker:
        return self.state.stall

    @property
    def steps_written(self) -> int:
        return self.writer.steps_written

    # -- the loop ---------------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None, *, burst: bool = False) -> str:
        """Returns the outcome: ``finished``, ``failed``, or ``running`` when stopped from outside."""
        stop = stop or threading.Event()
        run_while_leased(
            self.lease,
            who=f"batcher {self.name}",
            stop=stop,
            is_active=lambda: self._active,
            activate=self._activate,
            work=lambda: self.round(stop),
            deactivate=self._stand_by,
            burst=burst,
            running=lambda: self.outcome == "running",
        )
        return self.outcome

    def _stand_by(self) -> None:
        self._active = False
        self._inactive_since = self.clock()

    def _activate(self) -> None:
        """Take over: the next step from the server, the buffer from pending decisions."""
        self.store.acknowledge_recorded()  # owed by the batcher before this one, finished run or not
        state = self._state()
        if "terminal" in state or "finished" in state:
            self._finished_outcome = "failed" if "terminal" in state else "finished"
            log.info("run %s already %s; batcher exits", self.keys.run, self._finished_outcome)
            return
        self._check_feed(state)
        self.client.hsetnx(self.keys.batcher_state, "feed:dataset", self.feed.record())
        self.client.hsetnx(self.keys.batcher_state, "feed:max_steps", self.max_steps)
        stall = self.state.stall
        if self._inactive_since is not None:  # standing by (an outage, a lost lease) is not stalling
            stall.shift(self.clock() - self._inactive_since)
            self._inactive_since = None
        self.state = BatchState(self.rules, self.group_filter, next_step=int(state.get("next_step", 0)), stall=stall)
        self._active = True
        # The feeder first: under wait, the decisions replayed below are held by the tasks it knows in flight.
        if self._feeder is not None:
            self._feeder.resume()  # the same dataset iterator: continue it, never re-open or re-skip it
        elif self.dataset is not None:
            self._feeder = Feeder(
                self.client,
                self.keys,
                self.dataset,
                batch_size=self.settings.batch_size,
                max_staleness=self.settings.max_staleness,
                producer=self.name,
                partitions=self.partitions,
                track_in_flight=self.rules.staleness == "wait",
            )
        for batches in self.reader.pending():
            self._take(batches, replaying=True)
        self._set_window()
        log.info(
            "batcher %s active at step %d with %d buffered groups",
            self.name,
            self.state.next_step,
            len(self.state.buffer),
        )
        heap.settle()  # imports and the replayed buffer: out of the collector's way while steps are made

    def _state(self) -> dict[str, str]:
        state = hash_reply(self.client.hgetall(self.keys.batcher_state))
        return {k.decode(): v.decode(errors="replace") for k, v in state.items()}

    def _check_feed(self, state: dict[str, str]) -> None:
        check_feed(self.keys.run, state, self.feed, self.max_steps)

    def round(self, stop: threading.Event | None = None) -> int:
        """One collection round: feed, read decisions until the round ends, emit due steps, check the stall."""
        self.lease.renew_if_due()
        started = self.clock()
        outages = self.outage.count
        ends = started + self.config.round_s
        read = 0
        self._feed()
        while self.outcome == "running":
            remaining = ends - self.clock()
            if remaining <= 0 or (stop is not None and stop.is_set()):
                break
            block = max(1, min(MAX_BLOCK_MS, int(min(remaining, self.config.lease_ttl_s / 3) * 1000)))
            batches, version = self.reader.new(block)
            read += sum(len(entries) for _, entries in batches)
            self._take(batches, version=version)
            if self.settings.batch_mode == "fixed":
                self._feed()
            self.lease.renew_if_due()
        if self.outcome == "running":
            self._end_round(started, away=self.outage.count != outages)
        return read

    # -- from the server into the fold ----------------------------------------------------------------

    def _take(self, batches: Batches, *, replaying: bool = False, version: int | None = None) -> None:
        """Fold read batches of decision entries (each from one partition), then see whether the dataset
        is done: only after every batch, since one partition's read being folded says nothing of the
        others'. Dead-letter the entries that are not decisions. ``version``: the policy version read
        with the batches (else read now)."""
        self._fold(batch_fold.VersionSet(self._current_version() if version is None else version))
        self._set_window()
        decided = self.reader.decode(batches)
        for _, _, decision in decided:
            if decision is not None and decision.members and not replaying:
                self.served.decided(max(member.version for member in decision.members), self.clock())
        settled = (
            None
            if len(self.partitions) == 1
            else batcher_store.settled_tasks(
                self.client,
                self.keys,
                [decision.task_id for _, _, decision in decided if decision is not None],
                self.state.buffer,
            )
        )
        for partition, entry_id, decision in decided:
            ref = decision_ref(partition, entry_id)
            if settled is not None and decision is not None:
                if decision.task_id in settled:
                    log.warning(
                        "task %s was decided again in partition %d (entry %s) after a step or discard used "
                        "it (did that partition's server lose writes?); the repeat is dropped",
                        decision.task_id,
                        partition,
                        entry_id,
                    )
                    self.writer.pending.append(batch_fold.Acked((ref,)))
                    continue
                settled.add(decision.task_id)
                if decision.decision == "dropped":  # acknowledged now (the fold's Acked): used, so settled
                    self.writer.pending.append(Settle((decision.task_id,)))
            self._fold(batch_fold.Decided(ref, decision), defer=True)
        self._flush()
        if self._feeder is not None and self._feeder.track_in_flight:
            self._feeder.settle([decision.task_id for _, _, decision in decided if decision is not None])
            self._set_window()
        outcomes.decided(None if replaying else self.metrics, [d for _, _, d in decided if d is not None])
        if not replaying and self.outcome == "running" and self._dataset_done():
            self._fold(batch_fold.VersionSet(self._current_version()))
            self._fold(batch_fold.DatasetEnded())

    def _set_window(self) -> None:
        """Under ``staleness="wait"``: tell the fold the oldest in-flight task and the trainers' commits
        (`streamgrp.core.batch_fold.window_allows`); the steps that lets through are written."""
        if self.rules.staleness == "wait":  # without a feeder no task is known in flight: only groups left behind
            feeder = self._feeder
            self._fold(
                batch_fold.WindowSet(
                    feeder.oldest_in_flight() if feeder is not None else None, self._lowest_committed()
                )
            )

    def _end_round(self, started: float, *, away: bool) -> None:
        self._fold(batch_fold.VersionSet(self._current_version()))
        self._set_window()
        if self._dataset_done():
            self._fold(batch_fold.DatasetEnded())
            return
        window_full = self._feeder is not None and self._feeder.window_full
        waits_before, holds_before = self.state.stall.trainer_wait_rounds, self.state.stall.held_rounds
        now = self.clock()
        self._fold(
            batch_fold.RoundEnded(
                now,
                window_full=window_full,
                lowest_committed=self._lowest_committed() if window_full else -1,
                server_away=away,
                duration=now - started,
            )
        )
        if self.metrics is not None and not away:
            self.metrics.stall_seconds.set(self.state.stall.stall_seconds(now))
            self.metrics.empty_rounds.set(self.state.stall.empty_rounds)
            if self.state.stall.trainer_wait_rounds > waits_before:
                self.metrics.trainer_wait_rounds.inc()
            if self.state.stall.held_rounds > holds_before:
                self.metrics.held_rounds.inc()
        if not away:
            self._check_served(now)

    def _check_served(self, now: float) -> None:
        """Say so when the workers' policy stopped keeping up with the run's (`streamgrp.core.served`)."""
        message = self.served.warning(self.state.version, now)
        if message is not None:
            log.warning("%s", message)
        if self.metrics is not None:
            if self.served.served is not None:
                self.metrics.served_version.set(self.served.served)
            self.metrics.served_behind.set(self.served.behind_seconds(self.state.version, now))

    # -- from the fold onto the server ------------------------------------------------------------------

    def _fold(self, event: batch_fold.Event, *, defer: bool = False) -> None:
        """Apply ``event`` and carry out its outputs. ``defer`` holds them for `_flush` (one script call
        for a read batch's acknowledgements and discards, then one per step, as the batch was read)."""
        self.state, outputs = batch_fold.fold(self.state, event)
        for output in outputs:
            if isinstance(output, batch_fold.Acked):
                self.writer.pending.append(output)
            elif isinstance(output, batch_fold.Discarded):
                if output.reason == batch_fold.FILTERED and "raised" in output.detail:
                    log.warning("task %s: %s", output.decision.task_id, output.detail)
                outcomes.discarded(self.metrics, output.decision, output.reason)
                self.writer.pending.append(self.writer.discard(output))
            elif isinstance(output, batch_fold.StepDue):
                self.writer.pending_steps.append(output)
            elif isinstance(output, batch_fold.Finished):
                self._flush()
                self._apply([self.writer.stamped(RunFinished(steps=output.steps))])
                log.info("run %s finished after %d steps", self.keys.run, output.steps)
            elif isinstance(output, batch_fold.Failed):
                self._flush()
                self._write_failure(output)
            elif isinstance(output, batch_fold.Stalling):
                log.warning(
                    "no trainable group for %d rounds (%.0fs); the run fails after %d rounds and %gs "
                    "(%d rounds so far were spent waiting for trainers, which do not count)",
                    output.empty_rounds,
                    output.stall_seconds,
                    self.rules.max_empty_rounds,
                    self.rules.stall_timeout_s,
                    self.state.stall.trainer_wait_rounds,
                )
        if not defer:
            self._flush()

    def _flush(self) -> None:
        try:
            self.writer.flush()
        except LeaseLost:
            self._active = False
            raise

    def _write_failure(self, failed: batch_fold.Failed) -> None:
        event = self.writer.failure(failed, self.state.stall, self.clock())
        self._apply([event])
        log.error("run %s failed at step %d: %s", self.keys.run, failed.step, event.message)

    def _apply(self, records: list[batcher_store.Record]) -> None:
        """Commit ``records`` (`BatchWriter.commit`); a lost lease makes this batcher stand by."""
        try:
            self.writer.commit(records)
        except LeaseLost:
            self._active = False
            raise

    # -- what the fold is told: version, trainers, dataset, others' terminal events ---------------------

    def _current_version(self) -> int:
        return self._version.read(self.client)

    def _feed(self) -> None:
        if self._feeder is None or self.outcome != "running":
            return
        if not batch_fold.may_issue(self.state):  # wait: a task issued now would be stale once trained
            self._feeder.window_full = True
            return
        try:
            self._feeder.feed(self._current_version(), self.lease.token)
        except LeaseLost:
            self._active = False
            raise

    def _dataset_done(self) -> bool:
        """The feeder issued the whole dataset, every issued task is decided, and every decision read."""
        feeder = self._feeder
        if feeder is None or not feeder.exhausted:
            return False
        decided = sum(self.client.hlen(part.decided) for part in self.partitions)
        return decided >= feeder.cursor and all(
            batcher_store.read_every_decision(self.client, part) for part in self.partitions
        )

    def _lowest_committed(self) -> int:  # the last step every rank committed (-1: some rank none)
        return batcher_store.lowest_committed(self.client, self.keys, self.settings.dp_size)
