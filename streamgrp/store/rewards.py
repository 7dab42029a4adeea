"""Rewards as events, the store side: what a rewarder reads and how any scorer posts a reward.

Owns the rewarders' consumer group on the group log (``rewarders``), taking the results that wait for
their reward (``reward_pending``) with their payloads and their task's prompt, reclaiming those a
killed rewarder held, keeping a live rewarder's claims fresh, and posting `SlotRewarded` events
through the ``reward_post`` function: with the group, the result is acknowledged in the same call and
a reward is written only once per result, whichever rewarder scored it; without it (`post_reward`,
a late reward from anywhere) the assembler's fold counts a second reward as a duplicate and one for a
slot that waits for none as late. Scoring, concurrency and retries belong to
`streamgrp.services.rewarder`; this module ignores them.

Every other entry of the group log (tasks, results with their rewards, rewards, ticks) is acknowledged
in the group as it is read; tasks are remembered (their prompts) for the results that follow them.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from streamgrp.core import codec
from streamgrp.core.events import Sample, SamplePayload, SlotResult, SlotRewarded, TaskIssued
from streamgrp.errors import ConfigError, DecodeError
from streamgrp.store import payloads, scripts
from streamgrp.store.keys import PartitionKeys, RunKeys, task_partition
from streamgrp.store.runs import recorded_layout, recorded_partitions
from streamgrp.store.streams import (
    ensure_group,
    entry_id_str,
    producer_name,
    range_reply,
    read_entries,
    read_in_turn,
    read_reply,
)

__all__ = ["REWARDERS_GROUP", "PendingResult", "RewardClient", "post_reward"]

log = logging.getLogger(__name__)

#: The rewarders' consumer group on each partition's group log.
REWARDERS_GROUP = "rewarders"
#: Prompts of tasks remembered for the results that follow them (a task's results come within its
#: group's deadline, so a bound far above the open groups forgets only decided tasks).
PROMPTS_KEPT = 100_000
#: Group-log entries read backwards to find a task a restarted rewarder did not see issued.
LOOKBACK_ENTRIES = 200_000
_LOOKBACK_CHUNK = 2_000


@dataclass(frozen=True, slots=True)
class PendingResult:
    """A sample that waits for its reward: where its result is, its task's prompt and the sample."""

    entry_id: str
    partition: int
    task_id: str
    slot: int
    prompt: dict[str, Any] | None
    sample: Sample
    producer: str

    @property
    def published_at(self) -> float:
        """When its result was published, in the server's clock (seconds)."""
        return int(self.entry_id.split("-", 1)[0]) / 1000.0


class RewardClient:
    """A rewarder's access to one run: `take` results waiting for rewards, `post` each one's reward.

    ``claim_idle_s``: a result another rewarder has held this long without posting (it died) is taken
    over; a live rewarder `refresh`es the claims it is still scoring well within it."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        *,
        name: str | None = None,
        claim_idle_s: float = 30.0,
        partitions: Sequence[PartitionKeys] | None = None,
    ) -> None:
        if claim_idle_s <= 0:
            raise ConfigError(f"claim_idle_s={claim_idle_s}: give a positive number of seconds")
        self.client = client
        self.keys = keys
        self.name = name or producer_name("rewarder")
        self.partitions = tuple(partitions) if partitions else recorded_partitions(client, keys)
        #: Where the run keeps payloads (`streamgrp.store.payloads`), from its record.
        self.layout = recorded_layout(client, keys)
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self._prompts: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._post = scripts.register(client, "reward_post.lua")
        self._claim_cursors = {part.index: "0-0" for part in self.partitions}
        # A result turns idle only after claim_idle_s: scanning for them more often than a tenth of that finds
        # them no sooner, and costs a round trip per partition on every take (the rewarder takes every 50 ms).
        self._scan_every_s = min(1.0, claim_idle_s / 10)
        self._scanned_at = float("-inf")
        self._seq = 0
        for part in self.partitions:
            ensure_group(client, part.slots, REWARDERS_GROUP)

    # -- taking ------------------------------------------------------------------------------------

    def take(self, count: int, *, block_ms: int | None = 1000) -> list[PendingResult]:
        """Up to ``count`` results waiting for rewards: first those a dead rewarder held, then new ones."""
        taken: list[PendingResult] = []
        scan = time.monotonic() - self._scanned_at >= self._scan_every_s
        if scan:
            self._scanned_at = time.monotonic()
        for part in self.partitions if scan else ():
            cursor, entries, *_ = self.client.xautoclaim(
                part.slots,
                REWARDERS_GROUP,
                self.name,
                self.claim_idle_ms,
                start_id=self._claim_cursors[part.index],
                count=count,
            )
            self._claim_cursors[part.index] = entry_id_str(cursor)
            found = self._pending(part, entries)
            for result in found:
                log.info(
                    "took over the reward of task %s slot %s (result %s) from a rewarder that stopped",
                    result.task_id,
                    result.slot,
                    result.entry_id,
                )
            taken += found
            if len(taken) >= count:
                return taken
        if taken:
            return taken

        def read(part: PartitionKeys, block: int | None) -> list[PendingResult]:
            reply = self.client.xreadgroup(REWARDERS_GROUP, self.name, {part.slots: ">"}, count=count, block=block)
            return self._pending(part, [entry for _, entries in read_reply(reply) for entry in entries])

        for _, found in read_in_turn(self.partitions, read, block_ms, first=False):
            taken += found
        return taken

    def refresh(self, results: Sequence[PendingResult]) -> None:
        """Tell the others these results are still being scored (their idle time starts again)."""
        by_partition: dict[int, list[str]] = {}
        for result in results:
            by_partition.setdefault(result.partition, []).append(result.entry_id)
        for index, ids in by_partition.items():
            # redis-py's hint takes a list of every id type (a list's item type is invariant) or a 1-tuple.
            self.client.xclaim(
                self.partitions[index].slots,
                REWARDERS_GROUP,
                self.name,
                0,
                ids,  # type: ignore[arg-type]
                justid=True,
            )

    def _pending(self, part: PartitionKeys, entries: list[Any]) -> list[PendingResult]:
        """The results among ``entries`` that wait for a reward; the rest is acknowledged here."""
        waiting: list[tuple[str, SlotResult]] = []
        done: list[str] = []
        for entry_id, fields in entries:
            entry_id = entry_id_str(entry_id)
            event = None
            if fields:
                try:
                    event = codec.decode(fields)
                except DecodeError:
                    pass  # the assembler dead-letters it; nothing here to score
            if isinstance(event, TaskIssued):
                self._remember(event.task_id, event.prompt)
            if isinstance(event, SlotResult) and event.reward_pending:
                waiting.append((entry_id, event))
            else:
                done.append(entry_id)
        if done:
            self.client.xack(part.slots, REWARDERS_GROUP, *done)
        if not waiting:
            return []
        ids = [entry_id for entry_id, _ in waiting]
        found = (
            payloads.read(self.client, part.payloads, ids, views=True)
            if self.layout == payloads.KEYS
            else read_entries(self.client, part.payloads, ids)
        )
        out = []
        for (entry_id, result), fields in zip(waiting, found):
            sample = _sample_of(fields, result)
            if sample is None:
                # No payload to score (trimmed, or not streamgrp's): the slot times out at its deadline.
                log.warning(
                    "result %s of task %s slot %s has no readable payload; not scored",
                    entry_id,
                    result.task_id,
                    result.slot,
                )
                self.client.xack(part.slots, REWARDERS_GROUP, entry_id)
                continue
            out.append(
                PendingResult(
                    entry_id,
                    part.index,
                    result.task_id,
                    result.slot,
                    self._prompt(part, result.task_id, entry_id),
                    sample,
                    result.producer,
                )
            )
        return out

    def _remember(self, task_id: str, prompt: dict[str, Any]) -> None:
        self._prompts[task_id] = prompt
        self._prompts.move_to_end(task_id)
        while len(self._prompts) > PROMPTS_KEPT:
            self._prompts.popitem(last=False)

    def _prompt(self, part: PartitionKeys, task_id: str, before: str) -> dict[str, Any] | None:
        """The task's prompt: remembered, or found by reading the group log backwards from its result (a
        restarted rewarder did not see the task issued); None when it is not within `LOOKBACK_ENTRIES`."""
        prompt = self._prompts.get(task_id)
        if prompt is not None:
            return prompt
        needle = b'"task_id":' + orjson.dumps(task_id)
        end, read = before, 0
        while read < LOOKBACK_ENTRIES:
            entries = range_reply(self.client.xrevrange(part.slots, max=end, min="-", count=_LOOKBACK_CHUNK))
            for _entry_id, fields in entries:
                header = fields.get(codec.HEADER) or b""
                if b'"task_issued"' in header and needle in header:
                    try:
                        event = codec.decode(fields)
                    except DecodeError:
                        continue
                    if isinstance(event, TaskIssued) and event.task_id == task_id:
                        self._remember(task_id, event.prompt)
                        return event.prompt
            if len(entries) < _LOOKBACK_CHUNK:
                return None
            read += len(entries)
            end = "(" + entry_id_str(entries[-1][0])
        return None

    # -- posting -----------------------------------------------------------------------------------

    def post(
        self,
        result: PendingResult,
        *,
        rewards: Sequence[float] | None = None,
        reason: str | None = None,
        error: str | None = None,
    ) -> str | None:
        """Post ``result``'s reward (one value per row), rejection ``reason`` or scoring ``error``; returns
        the reward's entry id, or None when another rewarder posted this result's reward first."""
        self._seq += 1
        event = SlotRewarded(
            task_id=result.task_id,
            slot=result.slot,
            rewards=None if rewards is None else tuple(float(r) for r in rewards),
            reason=reason,
            error=error,
            scorer=self.name,
            producer=self.name,
            seq=self._seq,
        )
        written = self._post(
            keys=[self.partitions[result.partition].slots],
            args=[REWARDERS_GROUP, result.entry_id, codec.encode(event)[codec.HEADER]],
        )
        return entry_id_str(written) if written else None


def post_reward(
    client: redis.Redis,
    keys: RunKeys,
    *,
    task_id: str,
    slot: int,
    reward: float | Sequence[float] | None = None,
    reason: str | None = None,
    error: str | None = None,
    scorer: str = "",
    partitions: Sequence[PartitionKeys] | None = None,
) -> str:
    """Post a reward for slot ``slot`` of ``task_id`` from anywhere (a late score: a human, an external
    app, a reward-model job): ``reward`` (one number for every row, or one per row), a rejection
    ``reason`` or an ``error``. Returns the reward's entry id. The slot must have been published with
    its reward pending (`streamgrp.RewardLater`) and its group still open, else the assembler counts
    the reward as late; a second reward for a slot is counted as a duplicate (the first one stands)."""
    parts = tuple(partitions) if partitions else recorded_partitions(client, keys)
    rewards: tuple[float, ...] | None
    if reward is None:
        rewards = None
    elif isinstance(reward, (int, float)):
        rewards = (float(reward),)  # the fold gives it to every row
    else:
        rewards = tuple(float(r) for r in reward)
    event = SlotRewarded(
        task_id=task_id,
        slot=slot,
        rewards=rewards,
        reason=reason,
        error=error,
        scorer=scorer,
        producer=scorer,
        seq=time.time_ns(),
    )
    part = parts[task_partition(task_id, len(parts))]
    written = scripts.register(client, "reward_post.lua")(
        keys=[part.slots], args=["", "", codec.encode(event)[codec.HEADER]]
    )
    return entry_id_str(written)


def _sample_of(fields: Any, result: SlotResult) -> Sample | None:
    if not fields:
        return None
    try:
        payload = codec.decode(fields)
    except DecodeError:
        return None
    if not isinstance(payload, SamplePayload) or payload.task_id != result.task_id or payload.slot != result.slot:
        return None
    return payload.sample
