"""Slots' segments: the durable prefix of a generation in progress (`SlotSegment`, the segments stream).

Owns writing a segment (``segment.lua``: only the worker that holds the slot's task, pending under its
name in the workers group, may append; a worker whose task was taken over is refused with ``TAKEN``,
raised as `SegmentTaken`; a write also claims the task again for its holder, so a task whose generation
keeps making segments does not turn idle and is not taken over as a stopped worker's) and reading a
task's segments back as one chain per slot (`chains`), which a worker that takes the task over continues
from. A slot's chain is its segments in stream order with
indexes 0, 1, 2, ... and each one starting where the one before ended; a repeat of an index (a write
sent again after a lost reply) is skipped, and the chain ends at the first gap or after a segment that
ends the generation (``stop``/``length``).

A worker streaming several slots at once writes through `SegmentStore.submit`: segments gather in a queue and
are sent in one pipeline, in the order submitted (a slot's segments stay in index order: one batch is on the
wire at a time), and each slot is told how its write went; `record` is the same write, synchronous. The
queue is sent by the slot thread that finds it due, on that thread: a slot that queues a segment while its
previous one is still queued (so a slot never has two waiting: a worker killed loses at most one segment of
each slot, besides the tokens not cut yet and a batch already on the wire), a queue of `_BATCH`, and a slot
whose generation ended (`write_now`: its result waits for its writes). A flusher thread sends what is left
queued every `LINGER_S`, which bounds how long a segment waits when the slots go quiet. A pipeline costs
the worker about what a few segments cost (a send and a receive), and handing a batch to another thread
costs it again (two wake-ups and the interpreter lock passed back and forth): gathering, and sending from a
thread that is running anyway, is what keeps the writes a small share of its CPU.

Segments are never folded as results: the slot's result (`streamgrp.services.worker`) is published as
always, and a sample built on segments says so in its meta (``segments``: how many, and the tokens they
hold), which `check_sample` (and ``streamgrp verify``) compares against the chain.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import redis

from streamgrp.core import codec
from streamgrp.core.events import Sample, SlotSegment
from streamgrp.errors import DecodeError
from streamgrp.store import own_connection, scripts
from streamgrp.store.keys import WORKERS_GROUP, PartitionKeys
from streamgrp.store.streams import entry_id_str, range_reply

log = logging.getLogger(__name__)

#: Entries per XRANGE page when reading a task's segments back.
_PAGE = 512
#: Tasks whose chains a worker keeps read (a task's slots run at once, each asks for its chain).
_CACHED_TASKS = 64
#: Queued segments that are sent at once (a pipeline holds everything queued).
_BATCH = 64
#: The flusher's period: the longest a segment waits in the queue for others to join its pipeline. Long,
#: since it is not what bounds the loss when a worker is killed: a slot's next segment sends the queue (one
#: segment of each slot at most ever waits in it), and a slot that ends sends at once.
LINGER_S = 0.5


class SegmentTaken(Exception):
    """The slot's task is not held by this worker any more: its segments are another worker's to write."""


def _refusal(exc: redis.ResponseError) -> BaseException:
    return SegmentTaken(str(exc)) if scripts.error_code(exc) == "TAKEN" else exc


def chain_of(segments: Sequence[SlotSegment]) -> list[SlotSegment]:
    """The chain of one slot's segments, given in stream order (see the module docstring)."""
    chain: list[SlotSegment] = []
    tokens = 0
    for segment in segments:
        if chain and chain[-1].cause in ("stop", "length"):
            break
        if segment.index < len(chain):
            continue  # a repeat of a segment already in the chain
        if segment.index > len(chain) or segment.start != tokens:
            break
        chain.append(segment)
        tokens += segment.tokens
    return chain


def chain_values(chain: Sequence[SlotSegment]) -> tuple[list[int], list[float], list[tuple[int, int]]]:
    """(token ids, log-probabilities, versions as (version, tokens) runs) of a chain, concatenated."""
    ids: list[int] = []
    logprobs: list[float] = []
    runs: list[tuple[int, int]] = []
    for segment in chain:
        ids += segment.token_ids.to_list()
        logprobs += segment.logprobs.to_list()
        if runs and runs[-1][0] == segment.version:
            runs[-1] = (segment.version, runs[-1][1] + segment.tokens)
        else:
            runs.append((segment.version, segment.tokens))
    return ids, logprobs, runs


def check_sample(sample: Sample, chain: Sequence[SlotSegment]) -> str | None:
    """None when ``sample`` is what its segments say: its meta's ``segments`` (count, tokens) name a prefix
    of ``chain`` whose tokens and log-probabilities are exactly the sample's generated ones, in order;
    else what differs. A sample without ``segments`` in its meta was not built on segments: None."""
    told = sample.meta.get("segments") if isinstance(sample.meta, dict) else None
    if told is None:
        return None
    if not (isinstance(told, dict) and type(told.get("count")) is int and type(told.get("tokens")) is int):
        return f"meta segments {str(told)[:80]} is not {{count, tokens}}"
    if told["count"] > len(chain):
        return f"the sample names {told['count']} segments; the stream holds a chain of {len(chain)}"
    ids, logprobs, _ = chain_values(chain[: told["count"]])
    if len(ids) != told["tokens"]:
        return f"the sample's {told['count']} segments hold {len(ids)} tokens, its meta says {told['tokens']}"
    row_ids, mask, row_logprobs = (sample.token_ids.to_list(), sample.loss_mask.to_list(), sample.logprobs.to_list())
    generated = [at for at, bit in enumerate(mask) if bit]
    if len(generated) != len(ids):
        return f"the sample generated {len(generated)} tokens, its segments hold {len(ids)}"
    if [row_ids[at] for at in generated] != ids:
        return "the sample's generated token ids are not its segments' concatenation"
    if any(abs(row_logprobs[at] - value) > 1e-6 for at, value in zip(generated, logprobs)):
        return "the sample's log-probabilities are not its segments' concatenation"
    return None


def task_segments(client: redis.Redis, stream: str, task_id: str, since: str = "-") -> dict[int, list[SlotSegment]]:
    """Every readable `SlotSegment` of ``task_id`` in ``stream`` from ``since`` (its task's entry id: no segment
    of it is older), by slot, in stream order. Entries that do not decode are skipped (not this reader's to
    judge: retention, the archive and verify see them)."""
    needle = task_id.encode()
    found: dict[int, list[SlotSegment]] = {}
    start = since
    while True:
        page = range_reply(client.xrange(stream, start, "+", count=_PAGE))
        for _, fields in page:
            header = fields.get(codec.HEADER, b"")
            if needle not in header:  # cheap: most entries are other tasks'
                continue
            try:
                event = codec.decode(fields)
            except DecodeError:
                continue
            if isinstance(event, SlotSegment) and event.task_id == task_id:
                found.setdefault(event.slot, []).append(event)
        if len(page) < _PAGE:
            return found
        start = "(" + entry_id_str(page[-1][0])


class SegmentStore:
    """A worker's writes and reads of segments; thread-safe (a worker's slots run on a thread pool)."""

    def __init__(
        self, client: redis.Redis, partitions: Sequence[PartitionKeys], *, name: str, linger_s: float = LINGER_S
    ) -> None:
        self.client = client
        self.linger_s = linger_s
        self.partitions = tuple(partitions)
        self.name = name
        self._write = scripts.register(client, "segment.lua")
        self._lock = threading.Lock()
        self._chains: OrderedDict[str, tuple[dict[int, list[SlotSegment]], set[int]]] = OrderedDict()
        self._seq = itertools.count(1)
        # The queue: a deque (appends and pops need no lock), sent by whichever thread finds it due.
        self._queue: deque[tuple[int, str, SlotSegment, Callable[[str | BaseException], None]]] = deque()
        self._waiting: set[int] = set()  # the seq of every segment queued and not yet taken into a batch
        self._flusher: threading.Thread | None = None
        self._own = own_connection.for_client(client)  # a single server's batches go here (`_pipelined`)
        self._sending = threading.Lock()  # one batch on the wire at a time: a slot's segments stay in order
        #: Pipelines sent and segments written through them (what the batching achieves: see bench/README.md).
        self.batches = 0
        self.written = 0

    def record(self, partition: int, task_entry: str, segment: SlotSegment) -> str:
        """Append ``segment`` of the task at ``task_entry``; its entry id. `SegmentTaken` when this worker
        does not hold the task (any more)."""
        keys, args = self._call(partition, task_entry, segment.replace(**self.stamp()))
        try:
            written = self._write(keys=keys, args=args)
        except redis.ResponseError as exc:
            raise _refusal(exc) from None
        return entry_id_str(written)

    def stamp(self) -> dict[str, Any]:
        """The producer and next sequence number for a segment built to be `submit`-ted (``stamped``)."""
        return {"producer": self.name, "seq": next(self._seq)}  # one C call: atomic under the GIL

    def submit(
        self,
        partition: int,
        task_entry: str,
        segment: SlotSegment,
        done: Callable[[str | BaseException], None],
        *,
        stamped: bool = False,
        now: bool = False,
    ) -> None:
        """Queue ``segment``; ``done`` is called with the entry id, `SegmentTaken` or the error the write met,
        on the thread that sends it. What one slot submits is written in that order. ``stamped``: built with
        `stamp`. ``now``: send the queue from this thread at once (the slot has a segment still queued: see
        `LINGER_S`)."""
        if not stamped:
            segment = segment.replace(**self.stamp())
        self._waiting.add(segment.seq)
        self._queue.append((partition, task_entry, segment, done))
        if now or len(self._queue) >= _BATCH:
            self.write_now()
        elif self._flusher is None:
            with self._lock:
                if self._flusher is None:
                    self._flusher = threading.Thread(target=self._flush, name="segment-flusher", daemon=True)
                    self._flusher.start()

    def write_now(self) -> None:
        """Send everything queued, on the caller's thread; returns once those writes, and any batch another
        thread had on the wire, are answered."""
        with self._sending:
            batch = self._take()
            if batch:
                self._send(batch)

    def waiting(self, seq: int) -> bool:
        """Whether the segment stamped ``seq`` is still queued (not yet in a batch on the wire)."""
        return seq in self._waiting

    def _take(self) -> list[tuple[int, str, SlotSegment, Callable[[str | BaseException], None]]]:
        batch = []
        while self._queue:
            item = self._queue.popleft()
            self._waiting.discard(item[2].seq)
            batch.append(item)
        return batch

    def _call(self, partition: int, task_entry: str, segment: SlotSegment) -> tuple[list[Any], list[Any]]:
        fields = codec.encode(segment)
        part = self.partitions[partition]
        return (
            [part.tasks, part.segments],
            [WORKERS_GROUP, task_entry, self.name, fields[codec.HEADER], fields[codec.BLOB]],
        )

    def _flush(self) -> None:
        """The flusher thread: every ``linger_s``, sends what the slots left queued. It wakes on a timer only,
        never per segment: at a server's pace the slots send almost every batch themselves."""
        while True:
            time.sleep(self.linger_s)
            if self._queue:
                self.write_now()

    def _send(self, batch: list[tuple[int, str, SlotSegment, Callable[[str | BaseException], None]]]) -> None:
        calls: list[tuple[list[Any], list[Any]] | BaseException] = []
        for partition, task_entry, segment, _ in batch:
            try:
                calls.append(self._call(partition, task_entry, segment))
            except Exception as exc:  # a segment that does not encode fails its slot, not the batch
                calls.append(exc)
        sent = [call for call in calls if not isinstance(call, BaseException)]
        try:
            replies = iter(self._pipelined(sent))
        except Exception as exc:  # the connection: every write of the batch met it
            replies = iter([exc] * len(calls))
        self.batches += 1
        self.written += len(batch)
        for (_, _, _, done), call in zip(batch, calls):
            result = call if isinstance(call, BaseException) else next(replies)
            if isinstance(result, redis.ResponseError) and "function not found" in str(result).lower():
                try:  # the server lost the library: the synchronous call loads it again
                    assert not isinstance(call, BaseException)
                    result = self._write(keys=call[0], args=call[1])
                except Exception as exc:
                    result = exc
            outcome = (
                _refusal(result)
                if isinstance(result, redis.ResponseError)
                else result
                if isinstance(result, BaseException)
                else entry_id_str(result)
            )
            try:
                done(outcome)
            except Exception:  # a slot's hook failing must not stop the others' writes
                log.exception("a segment write's hook failed")

    def _pipelined(self, calls: list[tuple[list[Any], list[Any]]]) -> list[Any]:
        """The replies to ``calls`` (an error reply as its exception), sent in one round trip: on one server
        through a connection of the store's own (`streamgrp.store.own_connection`, about half the worker CPU of
        redis-py's pipeline), on a cluster through redis-py's pipeline, which routes each call to its node.
        Either rides out an outage as the client's pipelines do (`Riding`): the batch is sent again as a whole,
        and a segment written twice is one segment (`chain_of` skips a repeat)."""
        if self._own is None:
            pipe = self.client.pipeline(transaction=False)
            for keys, args in calls:
                self._write(keys=keys, args=args, client=pipe)
            return pipe.execute(raise_on_error=False)
        commands = [("FCALL", self._write.name, len(keys), *keys, *args) for keys, args in calls]
        outage = getattr(self.client, "outage", None) if getattr(self.client, "riding", False) else None
        return self._own.execute(commands) if outage is None else outage.call(self._own.execute, commands)

    def chain(self, partition: int, task_entry: str, task_id: str, slot: int, slots: int = 1) -> list[SlotSegment]:
        """The chain of ``slot`` of the task at ``task_entry``, read once for its ``slots`` slots (the first to
        ask reads every slot's; the last to ask drops the reading, so a task this worker takes over again
        later is read afresh)."""
        with self._lock:
            cached = self._chains.get(task_entry)
            if cached is None:
                found = task_segments(self.client, self.partitions[partition].segments, task_id, task_entry)
                cached = ({index: chain_of(segments) for index, segments in found.items()}, set())
                self._chains[task_entry] = cached
                while len(self._chains) > _CACHED_TASKS:
                    self._chains.popitem(last=False)
            chains, asked = cached
            asked.add(slot)
            if len(asked) >= slots:
                self._chains.pop(task_entry, None)
            return list(chains.get(slot, ()))
