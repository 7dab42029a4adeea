"""The group assembler: folds the run's slot log and emits each group decision exactly once.

Owns delivery on the assembler side: reading the slot log through the `assembler` consumer group
(`streamgrp.services.slot_reader` reads and decodes it), turning fold outputs into the typed records of one
atomic commit per read round (the decision, the "already decided" marker, the counters and the
acknowledgement of every entry the round accounts for, fenced by a lease; `streamgrp.store.assembler_store`
makes the call), ticking deadlines, dead-lettering what does not decode, and rebuilding open groups from
pending entries after a restart or a takeover. Decisions themselves come from the pure fold
(`streamgrp.core.group_fold`).

Why a Lua script and not MULTI/EXEC: the write must be conditional (write the decision only if the
task has no decision yet, and only while this process holds the lease). MULTI/EXEC cannot branch
on a value read inside the transaction; WATCH would turn every round into an optimistic retry
loop. A script runs atomically on the server, so a SIGKILL of the assembler leaves a round either
fully committed or not at all, and the server never sees half a decision.

Why one fold in order: the decision for a group depends only on the log's order (ticks are entries
in the same log), so a restarted assembler that re-reads its pending entries in id order and then
continues reaches the same decisions as an uninterrupted one, and `verify` can re-fold the log.
Only one assembler is active at a time (a lease with a TTL); standbys wait and take over.

Why the assembler reads every sample's payload: a sample that reaches the slot log without passing a
streamgrp worker (a foreign writer, a bug) may hold values that cannot train (NaN logprobs, token ids
beyond the vocabulary) or a payload that disagrees with its summary, and the batcher, which sees only
summaries, would place it in a step its trainer ranks then fail on, at every restart. So before folding
a sample the assembler checks its payload (`streamgrp.core.codec.payload_problem`); a refused sample
is folded as a failed slot (its group closes as it would have, without waiting for its deadline), and
its slot entry is dead-lettered (``invalid_sample``, with what is wrong) in the commit that decides the
group, so until then it stays pending and a restarted assembler refuses it again the same way.

Why a task entry is checked against the task queue: every role that publishes results may append to the
slot log, so it could append task entries of its own until ``max_open_groups`` refused the run's real
tasks. An issued task's log entry names its queue entry (``q``, written in the same call,
`issue_tasks.lua`), which only issuers may append to; a task entry whose queue entry is missing or holds
another header opens no group and is dead-lettered (``task_not_issued``), and `verify` skips it too.

In a partitioned run each partition has its own slot log, decisions, markers, counters and lease
(`streamgrp.store.keys.PartitionKeys`), and its own assembler (``partition``): every key one commit
touches is in the partition's hash slot, so the guarantees above hold per partition on a cluster.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from streamgrp.config import AssemblerConfig
from streamgrp.core import codec, counters
from streamgrp.core.decision import CONTRACT_VIOLATION
from streamgrp.core.events import SlotResult, TaskIssued, Tick
from streamgrp.core.group_fold import (
    DUPLICATE,
    DUPLICATE_TASK,
    LATE,
    OPEN_GROUPS_FULL,
    REWARD_DUPLICATE,
    REWARD_LATE,
    UNKNOWN_TASK,
    Closed,
    FoldState,
    fold,
    next_deadline,
    written_tick,
)
from streamgrp.core.refusal import INVALID_SAMPLE, TICK_FROM_FUTURE
from streamgrp.core.shown import show
from streamgrp.errors import ConfigError
from streamgrp.services import heap
from streamgrp.services.slot_reader import SlotReader
from streamgrp.services.slot_screen import dead_letter as _dead_letter
from streamgrp.services.slot_screen import refuse_unissued, refuse_untrainable
from streamgrp.store import own_connection
from streamgrp.store.assembler_store import Acknowledge, AssemblerStore, LateOrUnknown, Record
from streamgrp.store.lease import Lease, run_while_leased
from streamgrp.store.run_end import RunEndWatch
from streamgrp.store.runs import Run, server_time
from streamgrp.store.streams import producer_name

log = logging.getLogger(__name__)

#: How far a tick may be ahead of the clock the assembler reads it by: a cluster's nodes' clocks differ a little.
TICK_SLACK_S = 1.0

_IGNORED_COUNTER = {
    DUPLICATE: counters.slots("duplicate"),
    LATE: counters.slots("late"),
    DUPLICATE_TASK: counters.TASKS_DUPLICATE,
    REWARD_DUPLICATE: counters.rewards("duplicate"),
    REWARD_LATE: counters.rewards("late"),
}


class Assembler:
    """One assembler process's driver. `run` loops until ``stop`` is set (or, in burst mode, idle)."""

    def __init__(
        self,
        client: redis.Redis,
        run: Run,
        config: AssemblerConfig,
        *,
        name: str | None = None,
        metrics: Any = None,
        partition: int = 0,
    ) -> None:
        if not 0 <= partition < run.config.partitions:
            raise ConfigError(
                f"partition {partition}: run {run.name} has partitions 0 to {run.config.partitions - 1}; "
                "fix --partition"
            )
        self.client = client
        #: The run this assembler folds a partition of (``run`` is the loop).
        self.joined_run = run
        #: The keys of the partition this assembler folds (the run's own layout when it has one).
        self.keys = run.partitions[partition]
        self.config = config
        self.name = name or producer_name("assembler")
        self.metrics = metrics
        self.lease = Lease(client, self.keys.assembler_lease, self.name, config.lease_ttl_s)
        #: The fold while this assembler holds the lease; None while it stands by.
        self.state: FoldState | None = None
        self.decisions_written = 0
        self.store = AssemblerStore(client, self.keys)
        self._last_tick_check = 0.0
        self._seq = 0
        self._round_now: float | None = None
        #: Slot entries of open groups whose samples were refused: entry id -> (what is wrong, its fields),
        #: dead-lettered with their group's decision.
        self._refused: dict[str, tuple[str, Any]] = {}
        self.reader = SlotReader(client, self.keys, config)
        #: The payloads' reads (every sample's, for its check): one buffer a reply (`own_connection`).
        self._own = own_connection.for_client(client)

    # -- the loop ---------------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None, *, burst: bool = False) -> int:
        """Fold until stopped; in burst mode return after the first read that brings nothing new.

        Groups still open at a burst exit stay pending on the server; the next assembler rebuilds them.
        """
        run_end = RunEndWatch(self.client, self.joined_run.keys)
        said: list[str] = []
        last_read = [1]

        def work() -> int:
            last_read[0] = self._work()
            return last_read[0]

        def going() -> bool:
            # Once the run ended, what is still in the slot log is folded (late results and rewards are
            # counted), then the assembler exits at its first round that read nothing.
            if last_read[0]:
                return True
            outcome = run_end.ended()
            if outcome is not None and not said:
                said.append(outcome)
                log.info(
                    "run %s %s: no slot result will be needed; assembler %s exits",
                    self.joined_run.keys.run,
                    outcome,
                    self.name,
                )
            return outcome is None

        run_while_leased(
            self.lease,
            who=f"assembler {self.name}",
            stop=stop or threading.Event(),
            is_active=lambda: self.state is not None,
            activate=self._rebuild,
            work=work,
            deactivate=self._stand_by,
            burst=burst,
            running=going,
        )
        return self.decisions_written

    @property
    def _fold(self) -> FoldState:
        """The fold; only the lease holder's rounds (after `_rebuild`) reach for it."""
        if self.state is None:
            raise RuntimeError(f"assembler {self.name} has no fold while it stands by (it holds no lease)")
        return self.state

    def _work(self) -> int:
        read = self._round(">", block_ms=int(self.config.tick_interval_s * 1000))
        self._maybe_tick()
        return read

    def _stand_by(self) -> None:
        self.state = None
        self._refused.clear()

    def _rebuild(self) -> None:
        """Start a fresh fold from this group's pending entries, oldest first."""
        self.state = FoldState(
            self.joined_run.config.policy(),
            self.joined_run.config.group_timeout_s,
            max_open=self.config.max_open_groups,
        )
        self._refused.clear()
        replayed = 0
        for entries in self.reader.pending():
            replayed += len(entries)
            self._process(entries)
        log.info(
            "assembler %s active: replayed %d pending entries, %d groups open",
            self.name,
            replayed,
            len(self._fold.open),
        )
        heap.settle()  # imports and rebuilt groups: a full collection over them lands on the latency tail

    def _round(self, start: str, *, block_ms: int | None) -> int:
        entries, read_at = self.reader.new(start, block_ms=block_ms)
        if entries:
            self._process(entries, read_at)
        return len(entries)

    # -- folding a round and committing it ---------------------------------------------------------

    def _process(self, entries: list[tuple[Any, Any]], read_at: float | None = None) -> None:
        """Fold a round's entries and commit what they decide; ``read_at``: the server's clock when they
        were read (None: read once for the round's first decision)."""
        records: list[Record] = []
        decisions: list[Closed] = []
        acks: dict[str, list[str]] = {}
        decoded = self.reader.decode(entries, records, acks)
        self._load_decided(decoded)
        decoded = self._refuse_unissued(decoded, records)
        self._refuse_untrainable(decoded)
        self._round_now = read_at
        for entry_id, fields, event in decoded:
            # A sample's digest arrives in its summary, computed once by the publisher.
            if isinstance(event, Tick):  # a tick is never later than the server wrote it, nor than now
                event = written_tick(event, entry_id)
                if self._from_future(event, records, entry_id, fields):
                    continue
            self.state, outputs = fold(self._fold, event, entry_id)
            if isinstance(event, Tick):
                acks.setdefault("ticks", []).append(entry_id)
            for output in outputs:
                if isinstance(output, Closed):
                    decisions.append(self._stamped(output))
                    records.append(decisions[-1])
                    self._dead_letter_refused(records, output.entries)
                    continue
                # Ignored (a duplicate, a late result, ...): accounted as such, refused or not.
                self._refused.pop(output.entry_id, None)
                if output.reason in _IGNORED_COUNTER:
                    acks.setdefault(_IGNORED_COUNTER[output.reason], []).append(output.entry_id)
                elif output.reason == UNKNOWN_TASK:
                    records.append(LateOrUnknown(output.task_id, output.entry_id, output.detail, fields))
                else:
                    if output.reason == OPEN_GROUPS_FULL:
                        log.warning("task %s refused: %s", show(output.task_id), output.detail)
                    _dead_letter(records, output.reason, output.entry_id, output.detail, fields)
        self._fold.decided.clear()  # the server's decided hash is the record; keep only open groups
        records += [Acknowledge(field, tuple(ids)) for field, ids in acks.items()]
        if records:
            self._commit(records, decisions)
        if self.metrics is not None:
            self.metrics.open_groups.set(len(self._fold.open))

    def _from_future(self, tick: Tick, records: list[Record], entry_id: str, fields: Any) -> bool:
        """Dead-letter ``tick`` if it says a time after the server's clock now (where its entry id is in the
        future too, as any writer of the log may choose); the assembler's own ticks never do."""
        if self._round_now is None:
            self._round_now = server_time(self.client)
        if tick.now <= self._round_now + TICK_SLACK_S:
            return False
        why = f"the tick says {tick.now:.3f}, after the server's clock when it was read ({self._round_now:.3f})"
        log.warning("tick entry %s refused: %s", entry_id, why)
        _dead_letter(records, TICK_FROM_FUTURE, entry_id, why, fields)
        return True

    def _refuse_unissued(
        self, decoded: list[tuple[str, Any, Any]], records: list[Record]
    ) -> list[tuple[str, Any, Any]]:
        """``decoded`` without the task entries no issue wrote (dead-lettered into ``records``)."""
        opening = [
            at
            for at, (_, _, event) in enumerate(decoded)
            if isinstance(event, TaskIssued)
            and event.task_id not in self._fold.open
            and event.task_id not in self._fold.decided
        ]
        return refuse_unissued(self.client, self.keys.tasks, decoded, opening, records)

    def _refuse_untrainable(self, decoded: list[tuple[str, Any, Any]]) -> None:
        """Check the payload of every sample this round may fold; a refused one's slot result is replaced in
        ``decoded`` by a failed one saying why, and its entry noted for the dead letter."""
        samples = [
            at
            for at, (_, _, event) in enumerate(decoded)
            if isinstance(event, SlotResult) and event.sample is not None and event.task_id not in self._fold.decided
        ]
        self._refused.update(
            refuse_untrainable(
                self.client,
                self.keys.payloads,
                decoded,
                samples,
                vocab_size=self.joined_run.config.vocab_size,
                max_entry_bytes=self.config.max_entry_bytes,
                layout=self.joined_run.config.payload_layout,
                own=self._own,
            )
        )

    def _dead_letter_refused(self, records: list[Record], entries: tuple[str, ...]) -> None:
        """Dead-letter the refused slot entries among a decided group's ``entries`` (in the decision's commit)."""
        for entry_id in entries:
            found = self._refused.pop(entry_id, None)
            if found is not None:
                problem, fields = found
                log.warning("refused a sample (slot entry %s): %s", entry_id, problem[:200])
                _dead_letter(records, INVALID_SAMPLE, entry_id, problem, fields)

    def _load_decided(self, decoded: list[tuple[str, Any, Any]]) -> None:
        """Tell the fold which tasks named in this round but not open are already decided (one HMGET)."""
        names = sorted(
            {
                event.task_id
                for _, _, event in decoded
                if not isinstance(event, Tick) and event.task_id not in self._fold.open
            }
        )
        if names:
            found = self.client.hmget(self.keys.decided, names)
            self._fold.decided.update(name for name, entry in zip(names, found) if entry is not None)

    def _stamped(self, closed: Closed) -> Closed:
        """``closed`` with its decision stamped: this assembler's producer name and sequence, and when it was
        decided."""
        decision = closed.decision
        self._seq += 1
        update: dict[str, Any] = {"producer": self.name, "seq": self._seq}
        if decision.decided_at is None:
            # A group closed by its last slot: stamped in the server's clock, as deadline closes
            # (the Tick's time) and ``issued_at`` are, so decided_at - issued_at never mixes hosts' clocks.
            if self._round_now is None:
                self._round_now = server_time(self.client)
            update["decided_at"] = self._round_now
        decision = decision.replace(**update)
        if decision.reason == CONTRACT_VIOLATION:
            # Recorded as a dropped decision; the batcher reads it and writes the run's terminal event.
            log.error("run %s fails at the next step: %s", self.keys.run, decision.error)
        return Closed(decision, closed.entries)

    def _commit(self, records: list[Record], decisions: list[Closed]) -> None:
        committed = self.store.commit(self.lease.token, records)
        self.decisions_written += committed.written
        if self.metrics is not None:
            self.metrics.apply_counts(committed.counts)
            for closed in decisions:
                decision = closed.decision
                if decision.issued_at is not None and decision.decided_at is not None:
                    self.metrics.group_assembly.observe(max(0.0, decision.decided_at - decision.issued_at))
        if committed.redundant:
            log.warning(
                "%d decisions were already recorded by another assembler and were not written again",
                committed.redundant,
            )

    # -- deadlines ---------------------------------------------------------------------------------

    def _maybe_tick(self) -> None:
        """Append a tick to the log when the earliest open deadline has passed (server clock)."""
        now_mono = time.monotonic()
        if now_mono - self._last_tick_check < self.config.tick_interval_s:
            return
        self._last_tick_check = now_mono
        earliest = next_deadline(self._fold)
        if earliest is None:
            return
        now = server_time(self.client)
        if now >= earliest:
            self._seq += 1
            # redis-py types the fields as an invariant Dict of its widest key and value types, so no narrower dict fits
            tick = codec.encode(Tick(now=now, producer=self.name, seq=self._seq))
            self.client.xadd(self.keys.slots, tick)  # type: ignore[arg-type]
