"""One slot's segments, as an inference adapter sees them: what to continue from, and where each new
segment goes (`streamgrp.store.segments` owns the stream and its function).

`SlotSegments` is made per slot by `InferenceRollout` when its worker bound a segment store (``segment_tokens``
above 0): `resumed` is the slot's durable prefix (read only for a task taken over from a worker that stopped:
a task delivered for the first time has none) as a `Completion` to continue, `record` the hook the adapter
calls with every segment it cuts (from a stream, or a chunk asked for on its own, or an aborted part), and
`meta` what the sample records of them. Writes are queued in the store (`SegmentStore.submit`, batched with
other slots'), so a stream is not held up by each one; a segment cut while the slot's previous one is still
queued sends the queue from this slot's thread, so the slot never has two waiting. `settle` (and `meta`),
called once the generation is done, sends what is queued from the slot's own thread and waits for the
slot's writes, so its segments are durable before its result is published, and raises the error a write
met (the slot fails, as it would have writing synchronously). When the task was taken over from this worker
(``TAKEN``), the slot goes on without segments: its result is published as any slot's (the first result of
a slot wins), only it no longer says it is built on segments.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from streamgrp.core.events import RawArray, SlotSegment
from streamgrp.store.segments import SegmentStore, SegmentTaken, chain_values

log = logging.getLogger(__name__)


class SlotSegments:
    """The segments of one slot of one task (``request``: the worker's `SlotRequest`)."""

    def __init__(self, store: SegmentStore, request: Any) -> None:
        self.store = store
        self.request = request
        self.chain = (
            store.chain(request.partition, request.task_entry, request.task_id, request.slot, request.n_samples)
            if request.reclaimed
            else []
        )
        self.resumed_tokens = sum(segment.tokens for segment in self.chain)
        self.tokens = self.resumed_tokens
        self.count = len(self.chain)
        self.runs: list[tuple[int, int]] = chain_values(self.chain)[2]
        self.taken = False
        self._last_seq: int | None = None  # the seq of the slot's last segment submitted
        self._pending = 0
        self._failed: BaseException | None = None
        self._settled = threading.Condition()

    @property
    def ended(self) -> bool:
        """The chain holds the whole generation (its last segment ended it): nothing is left to generate."""
        return bool(self.chain) and self.chain[-1].cause in ("stop", "length")

    def resumed_values(self) -> tuple[list[int], list[float], list[int | None]]:
        """(token ids, log-probabilities, one version per segment) of the durable prefix."""
        ids, logprobs, _ = chain_values(self.chain)
        return ids, logprobs, [segment.version for segment in self.chain]

    def record(self, token_ids: list[int], logprobs: list[float], version: int | None, cause: str) -> None:
        """Make one segment of the slot durable (the adapter's hook; the write is queued); after ``TAKEN``, only
        its tokens' versions are kept."""
        if not token_ids:
            return
        version = self.request.version if version is None else version
        if self.runs and self.runs[-1][0] == version:
            self.runs[-1] = (version, self.runs[-1][1] + len(token_ids))
        else:
            self.runs.append((version, len(token_ids)))
        with self._settled:
            if self._failed is not None:
                raise self._failed
            if self.taken:
                return
            self._pending += 1
        segment = SlotSegment(
            task_id=self.request.task_id,
            slot=self.request.slot,
            index=self.count,
            start=self.tokens,
            token_ids=RawArray.from_values(token_ids, "int32"),
            logprobs=RawArray.from_values(logprobs, "float32"),
            version=version,
            cause=cause,  # type: ignore[arg-type]  # a literal, checked as it is encoded
            **self.store.stamp(),
        )
        self.count += 1
        self.tokens += len(token_ids)
        # the slot's last segment still waits in the queue: the queue is sent now, from here, so a slot never
        # has two waiting (a killed worker loses at most one segment's tokens, besides those not cut)
        now = self._last_seq is not None and self.store.waiting(self._last_seq)
        self._last_seq = segment.seq
        self.store.submit(
            self.request.partition, self.request.task_entry, segment, self._written, stamped=True, now=now
        )

    def _written(self, outcome: str | BaseException) -> None:
        with self._settled:
            self._pending -= 1
            if isinstance(outcome, SegmentTaken):
                if not self.taken:
                    log.warning(
                        "task %s slot %d goes on without segments: %s", self.request.task_id, self.request.slot, outcome
                    )
                self.taken = True
            elif isinstance(outcome, BaseException) and self._failed is None:
                self._failed = outcome
            self._settled.notify_all()

    def settle(self) -> None:
        """Wait for the slot's queued writes; the error one met, raised."""
        if self._pending:
            self.store.write_now()  # the slot is done and its result waits for them: sent now, from here
        with self._settled:
            while self._pending:
                self._settled.wait()
            if self._failed is not None:
                raise self._failed

    def meta(self) -> dict[str, Any]:
        """What the sample records, once the slot's writes are done (`settle`): its segments (count and tokens:
        `streamgrp.store.segments.check_sample` compares them), the tokens it continued from, and its tokens'
        versions as ``[version, tokens]`` runs (the per-token versions, compactly; the sample's version is still
        the oldest)."""
        self.settle()
        out: dict[str, Any] = {"token_versions": [list(run) for run in self.runs]}
        if not self.taken:
            out["segments"] = {"count": self.count, "tokens": self.tokens}
        if self.resumed_tokens:
            out["resumed_tokens"] = self.resumed_tokens
        return out
