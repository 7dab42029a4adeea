"""The batcher: turns group decisions into steps, one manifest per step, each step exactly once.

Owns, for one run: reading decisions through the `batcher` consumer group, discarding stale and
filtered groups, forming batches (fixed: ``batch_size`` groups; dynamic: the trainable groups a
round produced, at least ``dp_size``), partitioning them over ranks, the stall bound, the end of the
run, and (through `streamgrp.feeder`) issuing tasks within the staleness window.

Exactly once: a step's manifest, the next-step counter and the acknowledgement of the decision
entries it uses are one Lua call (`batch_commit.lua`), fenced by the batcher lease; manifests are
written at explicit entry ids (``{step}-1``), so a step number can neither be skipped nor written
twice. Groups buffered for a later step stay pending in the consumer group, so a restarted batcher
rebuilds its buffer from its pending entries, in order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from streamgrp import codec, scripts
from streamgrp.batching import is_stale, make_manifest
from streamgrp.config import BatcherConfig
from streamgrp.connection import MAX_BLOCK_MS, outage_of, replicate
from streamgrp.deadletter import DeadLetters
from streamgrp.errors import DecodeError
from streamgrp.events import GroupDecided, GroupDiscarded, RunFinished, RunTerminated
from streamgrp.feeder import Feeder
from streamgrp.keys import BATCHER_CONSUMER, BATCHER_GROUP
from streamgrp.lease import Lease, LeaseLost, run_while_leased
from streamgrp.metrics import pairs_to_counts
from streamgrp.runs import Run, server_time
from streamgrp.stall import StallTracker, stall_message
from streamgrp.streams import ensure_group, entry_id_str, producer_name

log = logging.getLogger(__name__)

GroupFilter = Callable[[GroupDecided], bool]


class Batcher:
    """One batcher process's driver; `run` loops until stopped, finished, failed, or (burst) idle."""

    def __init__(self, client: redis.Redis, run: Run, config: BatcherConfig, *, name: str | None = None,
                 group_filter: GroupFilter | None = None, dataset=None, metrics: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.run_ = run
        self.keys = run.keys
        self.settings = run.config
        self.config = config
        self.name = name or producer_name("batcher")
        self.group_filter = group_filter
        self.dataset = dataset
        self.metrics = metrics
        self.clock = clock
        self.lease = Lease(client, self.keys.batcher_lease, self.name, config.lease_ttl_s)
        self.stall = StallTracker(self.settings.max_empty_rounds, self.settings.stall_timeout_s)
        self.steps_written = 0
        self.outcome = "running"  # running, finished, failed
        self._commit = scripts.register(client, "batch_commit.lua")
        self._active = False
        self._buffer: list[tuple[str, GroupDecided]] = []
        self._next_step = 0
        self._feeder: Feeder | None = None
        self._control_last = "0-0"
        self._seq = 0
        self._inactive_since: float | None = None
        self.outage = outage_of(client)
        self.dead_letters = DeadLetters(client, self.keys, metrics=metrics)
        ensure_group(client, self.keys.decisions, BATCHER_GROUP)

    # -- the loop ---------------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None, *, burst: bool = False) -> str:
        """Returns the outcome: ``finished``, ``failed``, or ``running`` when stopped from outside."""
        stop = stop or threading.Event()
        run_while_leased(self.lease, who=f"batcher {self.name}", stop=stop, is_active=lambda: self._active,
                         activate=self._activate, work=lambda: self.round(stop), deactivate=self._stand_by,
                         burst=burst, running=lambda: self.outcome == "running")
        return self.outcome

    def _stand_by(self) -> None:
        self._active = False
        self._inactive_since = self.clock()

    def _activate(self) -> None:
        """Take over: the next step from the server, the buffer from pending decisions."""
        state = {k.decode(): v.decode() for k, v in self.client.hgetall(self.keys.batcher_state).items()}
        if "terminal" in state or "finished" in state:
            self.outcome = "failed" if "terminal" in state else "finished"
            log.info("run %s already %s; batcher exits", self.keys.run, self.outcome)
            return
        self._next_step = int(state.get("next_step", 0))
        self._buffer = []
        self._active = True
        if self._inactive_since is not None:  # standing by (an outage, a lost lease) is not stalling
            self.stall.shift(self.clock() - self._inactive_since)
            self._inactive_since = None
        last = "0"
        while True:
            reply = self.client.xreadgroup(BATCHER_GROUP, BATCHER_CONSUMER, {self.keys.decisions: last}, count=512)
            entries = reply[0][1] if reply else []
            if not entries:
                break
            last = entry_id_str(entries[-1][0])
            self._take(entries)
        if self._feeder is not None:
            self._feeder.resume()  # the same dataset iterator: continue it, never re-open or re-skip it
        elif self.dataset is not None:
            self._feeder = Feeder(self.client, self.keys, self.dataset, batch_size=self.settings.batch_size,
                                  max_staleness=self.settings.max_staleness, producer=self.name)
        log.info("batcher %s active at step %d with %d buffered groups", self.name, self._next_step, len(self._buffer))

    def round(self, stop: threading.Event | None = None) -> int:
        """One collection round: feed, read decisions until the round ends, emit due steps, check the stall."""
        self.lease.renew_if_due()
        started = self.clock()
        outages = self.outage.count
        ends = started + self.config.round_s
        added = read = 0
        self._feed()
        while True:
            remaining = ends - self.clock()
            if remaining <= 0 or (stop is not None and stop.is_set()):
                break
            reply = self.client.xreadgroup(BATCHER_GROUP, BATCHER_CONSUMER, {self.keys.decisions: ">"}, count=512,
                                           block=max(1, min(MAX_BLOCK_MS, int(min(remaining, self.config.lease_ttl_s / 3) * 1000))))
            entries = reply[0][1] if reply else []
            read += len(entries)
            added += self._take(entries)
            if self.settings.batch_mode == "fixed":
                self._emit_fixed()
                self._feed()
            self.lease.renew_if_due()
            if self._finished():
                return read
        if self.settings.batch_mode == "dynamic":
            while self._buffer and self._emit(list(self._buffer)):
                pass  # more than max_batch_size groups waiting: several steps
        self._check_terminal_from_others()
        if self.outage.count != outages:  # the server was away during this round: not a stall
            self.stall.shift(self.clock() - started)
        else:
            self._check_stall(added)
        self._finished()
        return read

    # -- taking decisions ----------------------------------------------------------------------------

    def _take(self, entries) -> int:
        """Buffer trainable groups; acknowledge dropped ones; discard filtered ones. Returns trainable added."""
        ops: list[Any] = []
        dropped: list[str] = []
        added = 0
        for raw_id, fields in entries:
            entry_id = entry_id_str(raw_id)
            try:
                decision = codec.decode(fields) if fields is not None else None
            except DecodeError as exc:
                self.dead_letters.send(self.keys.decisions, entry_id, exc.reason, exc.detail, fields,
                                       group=BATCHER_GROUP, counter="invalid:decisions")
                continue
            if fields is not None and not isinstance(decision, GroupDecided):
                self.dead_letters.send(self.keys.decisions, entry_id, "unexpected_kind",
                                       f"a {decision.kind} event does not belong in the decisions stream", fields,
                                       group=BATCHER_GROUP, counter="invalid:decisions")
                continue
            if decision is None or decision.decision == "dropped":
                dropped.append(entry_id)
                continue
            verdict = self._filter(decision)
            if verdict is not None:
                ops += ["G", "filtered", self._discard(decision, entry_id, "filtered", verdict), entry_id]
                continue
            self._buffer.append((entry_id, decision))
            added += 1
        if dropped:
            ops += ["A", len(dropped), *dropped]
        self._apply(ops)
        return added

    def _filter(self, decision: GroupDecided) -> str | None:
        """None to keep the group, else why the user filter dropped it."""
        if self.group_filter is None:
            return None
        try:
            keep = self.group_filter(decision)
        except Exception as exc:  # a user bug must not stop the batcher; the group is dropped and says why
            log.exception("group filter raised on task %s", decision.task_id)
            return f"the group filter raised {type(exc).__name__}: {exc}"
        return None if keep else "the group filter returned False"

    def _discard(self, decision: GroupDecided, entry_id: str, reason: str, detail: str, version: int | None = None) -> bytes:
        self._seq += 1
        event = GroupDiscarded(task_id=decision.task_id, reason=reason, decision_entry=entry_id,
                               group_version=decision.version, current_version=version, detail=detail,
                               producer=self.name, seq=self._seq)
        return codec.encode(event)[codec.HEADER]

    # -- emitting steps -------------------------------------------------------------------------------

    def _current_version(self) -> int:
        return int(self.client.get(self.keys.version) or 0)

    def _emit_fixed(self) -> None:
        size = self.settings.batch_size
        while len(self._buffer) >= size and not self._max_steps_reached():
            self._emit(self._buffer[:size])

    def _emit(self, candidates: list[tuple[str, GroupDecided]], *, final: bool = False) -> bool:
        """Write one step from ``candidates`` (stale ones are discarded first) if enough remain.

        Fixed mode needs exactly ``batch_size`` fresh groups, except for the ``final`` step of a run;
        no step takes more than ``max_batch_size`` (the rest wait for the next one). True when a
        step was written.
        """
        if not candidates or self._max_steps_reached():
            return False
        version = self._current_version()
        ops: list[Any] = []
        fresh = []
        used = set()
        for entry_id, decision in candidates:
            if is_stale(decision, version, self.settings.max_staleness):
                detail = f"group version {decision.version}, policy version {version}, max_staleness {self.settings.max_staleness}"
                ops += ["G", "stale", self._discard(decision, entry_id, "stale", detail, version), entry_id]
                used.add(entry_id)
            else:
                fresh.append((entry_id, decision))
        fresh = fresh[:self.settings.max_batch_size]
        written = len(fresh) >= self.settings.dp_size and (self.settings.batch_mode == "dynamic" or final
                                                          or len(fresh) == self.settings.batch_size)
        if written:
            self._step_op(ops, version, fresh)
            used.update(entry for entry, _ in fresh)
        self._buffer = [item for item in self._buffer if item[0] not in used]
        self._apply(ops)
        return written

    def _step_op(self, ops: list[Any], version: int, fresh: list[tuple[str, GroupDecided]]) -> None:
        manifest = make_manifest(self._next_step, version, fresh, self.settings.dp_size, server_time(self.client))
        self._seq += 1
        header = codec.encode(manifest.model_copy(update={"producer": self.name, "seq": self._seq}))[codec.HEADER]
        ops += ["S", self._next_step, header, len(fresh), len(fresh), *(entry for entry, _ in fresh)]
        self._next_step += 1
        if self.metrics is not None:
            self.metrics.batch_imbalance.set(manifest.imbalance)
            self.metrics.policy_version.set(version)
            for _, decision in fresh:
                self.metrics.staleness.observe(max(0, version - (decision.version or 0)))
        self.steps_written += 1
        log.info("step %d: %d groups over %d ranks, imbalance %.3f", manifest.step, len(fresh),
                 self.settings.dp_size, manifest.imbalance)

    def _apply(self, ops: list[Any]) -> None:
        if not ops:
            return
        keys = [self.keys.decisions, self.keys.steps, self.keys.discarded, self.keys.counts, self.keys.batcher_lease,
                self.keys.batcher_state, self.keys.control]
        try:
            _, *applied = self._commit(keys=keys, args=[self.lease.token, BATCHER_GROUP, *ops])
        except redis.ResponseError as exc:
            # STEP: the step was written already (by a batcher that took over, or by this call's first
            # attempt, whose reply an outage lost): rebuild from the server's record either way.
            if "LEASE" in str(exc) or "STEP" in str(exc):
                self._active = False
                raise LeaseLost(str(exc)) from None
            raise
        replicate(self.client)
        if self.metrics is not None:
            self.metrics.apply_counts(pairs_to_counts(applied))

    # -- feeding, finishing, failing ----------------------------------------------------------------

    def _feed(self) -> None:
        if self._feeder is None:
            return
        try:
            self._feeder.feed(self._current_version(), self.lease.token)
        except redis.ResponseError as exc:
            if "LEASE" in str(exc) or "CURSOR" in str(exc):
                self._active = False
                raise LeaseLost(str(exc)) from None
            raise

    def _max_steps_reached(self) -> bool:
        return self.config.max_steps is not None and self._next_step >= self.config.max_steps

    def _finished(self) -> bool:
        """Write `RunFinished` once max_steps is reached or the dataset is used up and all of it decided."""
        if self._max_steps_reached():
            return self._finish()
        feeder = self._feeder
        if feeder is None or not feeder.exhausted:
            return False
        if self.client.hlen(self.keys.decided) < feeder.cursor or not self._read_every_decision():
            return False
        if self._buffer:
            self._emit(list(self._buffer), final=True)  # the last, possibly smaller, step
        ops: list[Any] = []
        for entry_id, decision in self._buffer:  # fewer than dp_size groups remain: nothing can train them
            ops += ["G", "leftover", self._discard(decision, entry_id, "leftover", "dataset ended"), entry_id]
        self._buffer = []
        self._apply(ops)
        return self._finish()

    def _read_every_decision(self) -> bool:
        last_written = self.client.xinfo_stream(self.keys.decisions)["last-generated-id"]
        for group in self.client.xinfo_groups(self.keys.decisions):
            if group["name"] in (BATCHER_GROUP, BATCHER_GROUP.encode()):
                return group["last-delivered-id"] == last_written
        return False

    def _finish(self) -> bool:
        self._seq += 1
        event = RunFinished(steps=self._next_step, producer=self.name, seq=self._seq)
        self._apply(["F", codec.encode(event)[codec.HEADER]])
        self.outcome = "finished"
        log.info("run %s finished after %d steps", self.keys.run, self._next_step)
        return True

    def _check_stall(self, added: int) -> None:
        now = self.clock()
        waiting = self._waiting_for_trainers()
        stalled = self.stall.round(added, now, waiting_for_trainers=waiting)
        if self.metrics is not None:
            self.metrics.stall_seconds.set(self.stall.stall_seconds(now))
            self.metrics.empty_rounds.set(self.stall.empty_rounds)
            if waiting and not added:
                self.metrics.trainer_wait_rounds.inc()
        if not stalled:
            if self.stall.should_warn(now):
                log.warning("no trainable group for %d rounds (%.0fs); the run fails after %d rounds and %gs "
                            "(%d rounds so far were spent waiting for trainers, which do not count)",
                            self.stall.empty_rounds, self.stall.stall_seconds(now), self.stall.max_empty_rounds,
                            self.stall.stall_timeout_s, self.stall.trainer_wait_rounds)
            return
        counts = {k.decode(): int(float(v)) for k, v in self.client.hgetall(self.keys.counts).items()}
        self._fail("stall", stall_message(self.stall, now, counts, server_note=self._memory_note()))

    def _waiting_for_trainers(self) -> bool:
        """The feeder's window is full and a written step is not committed by every rank yet: the
        round waits for trainers, not for rollouts (SPEC section 4). Without a feeder the batcher
        holds no window, so every round without a trainable group is empty."""
        if self._feeder is None or not self._feeder.window_full:
            return False
        if self._next_step == 0:
            return False
        committed = self.client.hvals(self.keys.committed)
        ranks = self.settings.dp_size
        lowest = min((int(v) for v in committed), default=-1) if len(committed) >= ranks else -1
        return lowest < self._next_step - 1

    def _memory_note(self) -> str:
        """A sentence for the stall message when the server is full (writes refused under noeviction)."""
        memory = self.client.info("memory")
        maxmemory, used = int(memory.get("maxmemory", 0) or 0), int(memory.get("used_memory", 0) or 0)
        if maxmemory and used >= 0.95 * maxmemory:
            return (f"The server is full ({used} of maxmemory {maxmemory} bytes): it refuses writes (OOM) until "
                    "maxmemory is raised or retention trims the run (streamgrp archiver --retention).")
        return ""

    def _check_terminal_from_others(self) -> None:
        """Stamp the assembler's terminal event (contract violation) with the step ranks fail at."""
        reply = self.client.xread({self.keys.control: self._control_last}, count=100)
        for _, entries in reply:
            for raw_id, fields in entries:
                self._control_last = entry_id_str(raw_id)
                try:
                    event = codec.decode(fields)
                except DecodeError as exc:
                    self.dead_letters.send(self.keys.control, self._control_last, exc.reason, exc.detail, fields,
                                           counter="invalid:control")
                    continue
                if isinstance(event, RunTerminated) and event.step is None:
                    self._fail(event.reason, event.message)
                    return

    def _fail(self, reason: str, message: str) -> None:
        self._seq += 1
        event = RunTerminated(reason=reason, message=message, step=self._next_step, producer=self.name, seq=self._seq)
        self._apply(["T", codec.encode(event)[codec.HEADER]])
        self.outcome = "failed"
        log.error("run %s failed at step %d: %s", self.keys.run, self._next_step, message)
