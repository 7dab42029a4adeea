"""What the batcher writes: its fold's outputs as stamped events and typed records, committed through the store.

Owns the batcher's producer sequence (every event it writes is stamped with its name and the next number),
the records a read batch's folding queued (acknowledgements, discards) and the steps it made due, turning a
due step into its manifest (the groups over the ranks, stamped with the server's clock), a discard and a
failure into their events, and committing them (`streamgrp.store.batcher_store`), fenced by the batcher's
lease. A lost lease (or a step written already) drops what is queued: the batcher that takes over
rebuilds from the server's record. It deliberately ignores what the fold decides and when: the batcher
(`streamgrp.services.batcher`) folds and hands the outputs over.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis

from streamgrp.config import RunConfig
from streamgrp.core import batch_fold, codec
from streamgrp.core.events import GroupDiscarded, RunTerminated
from streamgrp.core.manifest import make_manifest, ref_order
from streamgrp.core.stall import StallTracker, stall_message
from streamgrp.errors import LeaseLost
from streamgrp.services import outcomes
from streamgrp.store import batcher_store
from streamgrp.store.batcher_store import BatcherStore, Step
from streamgrp.store.keys import PartitionKeys, RunKeys
from streamgrp.store.lease import Lease
from streamgrp.store.runs import server_time

log = logging.getLogger(__name__)

__all__ = ["BatchWriter"]


class BatchWriter:
    """The batcher's writes to its run: queued records and due steps, stamped, committed under ``lease``."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        partitions: Sequence[PartitionKeys],
        settings: RunConfig,
        lease: Lease,
        *,
        name: str,
        metrics: Any = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.partitions = partitions
        self.settings = settings
        self.lease = lease
        self.name = name
        self.metrics = metrics
        self.store = BatcherStore(client, keys, partitions)
        self.steps_written = 0
        self.pending: list[batcher_store.Record] = []  # acks and discards of the read batch being folded
        self.pending_steps: list[batch_fold.StepDue] = []
        self._seq = 0

    def flush(self) -> None:
        """Commit the queued records in one call, then each due step in one call of its own."""
        records, self.pending = self.pending, []
        self.commit(records)
        steps, self.pending_steps = self.pending_steps, []
        for due in steps:
            self.commit([self._step(due)])

    def commit(self, records: list[batcher_store.Record]) -> None:
        """Commit ``records``; a lost lease (or a step already written) drops what is pending."""
        if not records:
            return
        try:
            committed = self.store.commit(self.lease.token, records)
        except LeaseLost:
            # Also raised when the step was written already (by a batcher that took over, or by this
            # call's first attempt, whose reply an outage lost): rebuild from the server's record either way.
            self.pending, self.pending_steps = [], []
            raise
        if self.metrics is not None:
            self.metrics.apply_counts(committed.counts)

    def stamped(self, event: Any) -> Any:
        """``event`` as this batcher writes it: its producer name and next sequence number."""
        self._seq += 1
        return codec.stamped(event, producer=self.name, seq=self._seq)

    def discard(self, output: batch_fold.Discarded) -> GroupDiscarded:
        decision = output.decision
        return self.stamped(
            GroupDiscarded(
                task_id=decision.task_id,
                reason=output.reason,
                decision_entry=output.entry_id,
                group_version=decision.version,
                current_version=output.current_version,
                detail=output.detail,
            )
        )

    def failure(self, failed: batch_fold.Failed, stall: StallTracker, now: float) -> RunTerminated:
        """The run's terminal event for ``failed``; a stall without a message is described from the run's
        counts and the server's memory."""
        message = failed.message
        if failed.reason == "stall" and not message:
            counts = batcher_store.run_counts(self.client, self.keys, self.partitions)
            message = stall_message(stall, now, counts, server_note=batcher_store.memory_note(self.client))
        return self.stamped(RunTerminated(reason=failed.reason, message=message, step=failed.step))

    def _step(self, due: batch_fold.StepDue) -> Step:
        groups: Sequence[batch_fold.Buffered] = due.groups
        if len(self.partitions) > 1:  # read order across partitions is not recorded; this order is (verify)
            groups = sorted(groups, key=lambda group: ref_order(group[0]))
        # Stamped with the server's clock now, after every discard this pass wrote before it: reports
        # count a run's events into the windows between steps' created_at.
        manifest = make_manifest(due.step, due.version, groups, self.settings.dp_size, server_time(self.client))
        entries = tuple(entry for entry, _ in due.groups)
        step = Step(self.stamped(manifest), entries, tuple(decision.task_id for _, decision in due.groups))
        if self.metrics is not None:
            self.metrics.batch_imbalance.set(manifest.imbalance)
            self.metrics.policy_version.set(due.version)
            outcomes.batched(self.metrics, due.version, [decision for _, decision in due.groups])
        self.steps_written += 1
        log.info(
            "step %d: %d groups over %d ranks, imbalance %.3f",
            manifest.step,
            len(entries),
            self.settings.dp_size,
            manifest.imbalance,
        )
        return step
