"""The gateway role's store adapter: agent sessions, their turns and their results, through its functions.

Owns the keys of a session (`streamgrp.store.keys`: each under its task's partition tag, like the
task's slot results), the arguments of the gateway's three server functions, and reading a session
back after a restart:

- `open_task` (``session_open.lua``): a task's sessions, one per slot, and the task's acknowledgement,
  in one call; from then on the sessions own the task;
- `record` (``session_turn.lua``): one turn, numbered, before it is answered: a turn the client got an
  answer for is durable. In a ``keys`` run (`streamgrp.store.payloads`) its tensors are staged beside the
  call and renamed to a turn key by it, so they never pass through the function; `load` reads them back
  with `streamgrp.store.payloads.with_turns`, as every reader of turns does;
- `end` (``session_end.lua``): the session's end and its slot result (a sample built from the recorded
  turns, a rejection or a failure), in one call; a timeout ends it and publishes nothing.

Each function checks its whole input before it writes and answers a repeat (the connection sends a
call again after a lost reply) with what the first call did. Their refusals (``UNKNOWN``, ``ENDED``,
``EXPIRED``, ``TURN``, ``TAKEN``, ...) are raised as `SessionRefused` with that code.

A session's key (the bearer token its agent uses) is ``sgk_<session id>_<secret>``; the store keeps only
its SHA-256 digest, so reading the run (the inspector may) never yields a usable key. Deliberately
ignores HTTP, rendering and generation (`streamgrp.services.gateway`).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import re
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import redis
import redis.asyncio

from streamgrp.core import codec
from streamgrp.core.events import (
    Sample,
    SessionEnded,
    SessionOpened,
    SlotResult,
    TaskIssued,
    TurnRecorded,
)
from streamgrp.errors import DecodeError, SessionRefused
from streamgrp.store import loop_client, payloads, scripts
from streamgrp.store.keys import WORKERS_GROUP, PartitionKeys, RunKeys, session_partition
from streamgrp.store.runs import recorded_layout
from streamgrp.store.streams import entry_id_str, entry_size, read_entries

#: A failed slot's error text is cut to this many characters (as a worker cuts it).
MAX_ERROR_CHARS = 4000
_KEY = re.compile(r"sgk_(p[0-9]{1,2}-[0-9a-f]{16})_[0-9a-f]{48}\Z")


def new_session_id(partition: int) -> str:
    """A fresh session id of a task in ``partition``: ``p<partition>-<16 random hex digits>``."""
    return f"p{partition}-{secrets.token_hex(8)}"


def new_key(session_id: str) -> str:
    """A fresh bearer key for ``session_id`` (192 random bits)."""
    return f"sgk_{session_id}_{secrets.token_hex(24)}"


def key_session(key: str) -> str | None:
    """The session a key names, or None for anything that is not a session key."""
    match = _KEY.match(key) if isinstance(key, str) else None
    return match.group(1) if match else None


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_matches(key: str, digest: str) -> bool:
    return hmac.compare_digest(key_digest(key), digest)


@dataclass(frozen=True)
class StoredSession:
    """A session as the store holds it: its state hash and its turns, in order."""

    session_id: str
    task_id: str
    slot: int
    task_entry: str
    deadline: float | None
    version: int
    status: str
    key_digest: str
    result: str = ""
    #: Its sample was published waiting for a reward posted later.
    reward_pending: bool = False
    turns: list[TurnRecorded] = field(default_factory=list)
    #: Turns recorded (also when `load` was asked for the state only).
    turn_count: int = 0


@dataclass(frozen=True)
class TurnCall:
    """One ``session_turn`` call recording a turn (`SessionStore.record_call`): its keys and arguments, the
    turn's (header, tensors), and in a ``keys`` run the staging write of its framed tensors
    (`streamgrp.store.payloads.staging`), sent before the call; the arguments then carry no tensor byte."""

    keys: list[str]
    args: list[object]
    frame: tuple[bytes, bytes]
    staging: tuple[Any, ...] | None = None

    @property
    def staged(self) -> str | None:
        """The staging key (the call's third key), in a ``keys`` run."""
        return None if self.staging is None else self.staging[1]


class SessionStore:
    """The gateway's reads and writes of sessions; thread-safe (the gateway calls it from a thread pool)."""

    def __init__(
        self, client: redis.Redis, partitions: Sequence[PartitionKeys], *, producer: str, layout: str | None = None
    ) -> None:
        self.client = client
        self.partitions = tuple(partitions)
        self.producer = producer
        #: Where the run keeps payloads (`streamgrp.store.payloads`); by default what its record says.
        self.layout = layout or recorded_layout(client, RunKeys(self.partitions[0].run))
        self._seq = itertools.count()
        self._seq_lock = threading.Lock()
        self._open = scripts.register(client, "session_open.lua")
        self._turn = scripts.register(client, "session_turn.lua")
        self._end = scripts.register(client, "session_end.lua")

    def next_seq(self) -> int:
        with self._seq_lock:
            return next(self._seq)

    def part(self, session_id: str) -> PartitionKeys:
        index = session_partition(session_id)
        if index >= len(self.partitions):
            raise SessionRefused(
                "UNKNOWN", f"session {session_id} names partition {index}; the run has {len(self.partitions)}"
            )
        return self.partitions[index]

    # -- writes ---------------------------------------------------------------------------------------------

    def open_task(
        self,
        partition: int,
        task_entry: str,
        task: TaskIssued,
        sessions: Sequence[tuple[str, int, str]],
        *,
        deadline: float | None,
        version: int,
    ) -> str:
        """Open ``sessions`` ((id, slot, key) each) of the task at ``task_entry`` and acknowledge the task;
        'OPENED', or 'REPEAT' when this call had run before. `SessionRefused` ``TAKEN`` when the task is
        not pending any more (its sessions were opened by another call)."""
        part = self.partitions[partition]
        args: list[object] = [
            WORKERS_GROUP,
            task_entry,
            task.task_id,
            "" if deadline is None else repr(deadline),
            version,
            len(sessions),
        ]
        for session_id, slot, key in sessions:
            opened = SessionOpened(
                session=session_id,
                task_id=task.task_id,
                slot=slot,
                deadline=deadline,
                version=version,
                producer=self.producer,
                seq=self.next_seq(),
            )
            args += [session_id, slot, key_digest(key), codec.encode(opened)[codec.HEADER]]
        keys = [part.tasks, part.sessions, part.session_deadlines, *(part.session(s) for s, _, _ in sessions)]
        return _text(self._call(self._open, keys, args))

    def record(self, turn: TurnRecorded) -> str:
        """Record ``turn`` (numbered from 1, in order) before it is answered; its entry id. In a ``keys`` run its
        tensors are staged in the same pipeline (a fresh staging key each attempt: a repeat of a turn recorded
        already is answered with the first entry id, and the key it staged expires unused)."""
        call = self.record_call(turn)
        if call.staged is None:
            return _text(self._call(self._turn, call.keys, call.args))
        part = self.part(turn.session)
        header, blob = call.frame
        try:
            reply = payloads.call_staged(
                self.client,
                part.sessions,
                [(header, blob)],
                self._turn,
                lambda staged: ([*call.keys[:2], *staged], call.args),
            )
        except redis.ResponseError as exc:
            raise self._refusal(exc) from None
        return _text(reply)

    def record_call(self, turn: TurnRecorded) -> TurnCall:
        """The call of ``session_turn`` recording ``turn``: one to send again as it is (its staged key too)."""
        fields = codec.encode(turn)
        header, blob = fields[codec.HEADER], fields.get(codec.BLOB, b"")
        digest = hashlib.blake2b(header + b"\0" + blob, digest_size=16).hexdigest()
        part = self.part(turn.session)
        keys = [part.session(turn.session), part.sessions]
        if self.layout != payloads.KEYS:
            return TurnCall(keys, [turn.turn, digest, header, blob], (header, blob))
        # joined: the loop's connections pack with redis-py's packer (`streamgrp.store.loop_client`)
        staging = payloads.staging(part.sessions, header, blob, pieces=False)
        return TurnCall([*keys, staging[1]], [turn.turn, digest, header, b""], (header, blob), staging)

    async def record_on_loop(self, aclient: redis.asyncio.Redis, call: TurnCall) -> str | None:
        """`record`'s call (`record_call`) through ``aclient`` (`streamgrp.store.loop_client`) on the event loop
        (in a ``keys`` run with its staging write, in one write): the turn's entry id, or None when the server
        gave no answer of the function's own (then `record` it the synchronous way: a repeat is answered with
        what the first call did)."""
        try:
            reply = await loop_client.call(aclient, self._turn.name, call.keys, call.args, staging=call.staging)
        except redis.ResponseError as exc:
            raise self._refusal(exc) from None
        return None if reply is loop_client.UNANSWERED else _text(reply)

    def end(
        self,
        session: StoredSession,
        *,
        turns: int,
        sample: Sample | None = None,
        error: str | None = None,
        timeout: bool = False,
        reward: float | None = None,
        reward_pending: bool = False,
        max_entry_bytes: int | None = None,
    ) -> tuple[str, str]:
        """End ``session`` and publish its slot result, built from its first ``turns`` turns: ``sample``, or a
        failure with ``error``'s text, or a rejection (neither), or nothing (``timeout``). Returns (the outcome
        written, the slot result's entry id, '' for a timeout). With ``reward_pending`` the sample's result
        waits for a `SlotRewarded` (`streamgrp.store.rewards.post_reward`), its rewards being placeholders.
        A sample whose payload would exceed ``max_entry_bytes`` is published as a failure saying so."""
        part = self.part(session.session_id)
        seq = self.next_seq()
        slot_header = payload_header = blob = b""
        if sample is not None and not timeout:
            slot_header, payload_header, blob = codec.encode_sample(
                session.task_id, session.slot, sample, producer=self.producer, seq=seq, reward_pending=reward_pending
            )
            size = entry_size({codec.HEADER: payload_header, codec.BLOB: blob})
            if max_entry_bytes is not None and size > max_entry_bytes:
                error = (
                    f"the session's sample is {size} bytes encoded, over max_entry_bytes={max_entry_bytes}; "
                    "shorten the session (fewer or shorter turns) or raise --max-entry-bytes on the gateway, "
                    "the assembler and the trainers"
                )
                slot_header = payload_header = blob = b""
        outcome: Literal["sample", "rejected", "failed", "timeout"]
        if timeout:
            outcome = "timeout"
        elif payload_header:
            outcome = "sample"
        else:
            refused: Literal["failed", "rejected"] = "failed" if error is not None else "rejected"
            outcome = refused
            error = None if error is None else error[:MAX_ERROR_CHARS]
            slot_header = codec.encode(
                SlotResult(
                    task_id=session.task_id,
                    slot=session.slot,
                    outcome=refused,
                    error=error or None,
                    producer=self.producer,
                    seq=seq,
                )
            )[codec.HEADER]
        ended = SessionEnded(
            session=session.session_id,
            task_id=session.task_id,
            slot=session.slot,
            outcome=outcome,
            turns=turns,
            rows=sample.rows if outcome == "sample" and sample is not None else 0,
            reward=reward if outcome == "sample" else None,
            error=error if outcome == "failed" else None,
            producer=self.producer,
            seq=seq,
        )
        keys = [part.session(session.session_id), part.sessions, part.session_deadlines, part.slots, part.payloads]
        args = [
            session.session_id,
            outcome,
            "" if timeout else turns,
            codec.encode(ended)[codec.HEADER],
            slot_header,
            payload_header,
            blob,
            "1" if reward_pending and outcome == "sample" else "",
        ]
        if payload_header and self.layout == payloads.KEYS:
            return outcome, _text(self._end_staged(part, keys, args))
        return outcome, _text(self._call(self._end, keys, args))

    def _end_staged(self, part: PartitionKeys, keys: list[str], args: Sequence[object]) -> object:
        """session_end.lua with the payload staged in the same pipeline (`streamgrp.store.payloads.call_staged`):
        the function's arguments carry no payload byte."""
        header, blob = args[5], args[6]
        assert isinstance(header, bytes) and isinstance(blob, bytes)
        try:
            return payloads.call_staged(
                self.client,
                part.payloads,
                [(header, blob)],
                self._end,
                lambda staged: ([*keys, *staged], [*args[:5], b"", b"", args[7]]),
            )
        except redis.ResponseError as exc:
            raise self._refusal(exc) from None

    # -- reads ------------------------------------------------------------------------------------------------

    def read_task(self, partition: int, entry_id: str) -> TaskIssued | None:
        """The task at ``entry_id`` of the partition's task queue; None when there is none or it does not decode."""
        entries = self.client.xrange(self.partitions[partition].tasks, entry_id, entry_id, count=1)
        if not entries:
            return None
        try:
            event = codec.decode(entries[0][1])
        except DecodeError:
            return None
        return event if isinstance(event, TaskIssued) else None

    def load(self, session_id: str, *, turns: bool = True) -> StoredSession | None:
        """The session's state (and turns, unless ``turns`` is off) as the store holds them; None for a
        session it does not know."""
        part = self.part(session_id)
        raw = self.client.hgetall(part.session(session_id))
        if not raw:
            return None
        state = {_text(k): _text(v) for k, v in raw.items()}
        count = int(state.get("turns", "0")) if turns else 0
        ids = [state[f"turn:{n}"] for n in range(1, count + 1)]
        recorded: list[TurnRecorded] = []
        entries = [(i, f) for i, f in zip(ids, read_entries(self.client, part.sessions, ids)) if f is not None]
        found = dict(payloads.with_turns(self.client, part.sessions, entries))
        for entry_id in ids:
            fields = found.get(entry_id)
            if fields is None:
                raise SessionRefused(
                    "TRIMMED",
                    f"turn entry {entry_id} of session {session_id} is gone from the "
                    "sessions stream; the session cannot be resumed",
                )
            if codec.BLOB not in fields and self.layout == payloads.KEYS:
                raise SessionRefused(
                    "TRIMMED",
                    f"the tensors of turn entry {entry_id} of session {session_id} are gone "
                    f"({payloads.turn_key(part.sessions, entry_id)}); the session cannot be resumed",
                )
            event = codec.decode(fields)
            if not isinstance(event, TurnRecorded):
                raise SessionRefused(
                    "CORRUPT", f"entry {entry_id} of session {session_id} is a {event.kind}, not a turn"
                )
            recorded.append(event)
        deadline = state.get("deadline", "")
        return StoredSession(
            session_id=session_id,
            task_id=state["task"],
            slot=int(state["slot"]),
            task_entry=state["entry"],
            deadline=float(deadline) if deadline else None,
            version=int(state.get("version", "0")),
            status=state["status"],
            key_digest=state["key"],
            result=state.get("result", ""),
            reward_pending=state.get("pending") == "1",
            turns=recorded,
            turn_count=int(state.get("turns", "0")),
        )

    def due(self, now: float, limit: int = 256) -> list[str]:
        """Open sessions whose group deadline is at or before ``now`` (server clock), at most ``limit``."""
        found: list[str] = []
        for part in self.partitions:
            left = limit - len(found)
            if left <= 0:
                break
            found += [
                _text(s) for s in self.client.zrangebyscore(part.session_deadlines, "-inf", now, start=0, num=left)
            ]
        return found

    def open_count(self) -> int:
        """Sessions open with a deadline, in every partition."""
        return sum(int(self.client.zcard(part.session_deadlines)) for part in self.partitions)

    @staticmethod
    def _call(function: scripts.ServerFunction, keys: list[str], args: Sequence[object]) -> object:
        try:
            return function(keys=keys, args=args)
        except redis.ResponseError as exc:
            raise SessionStore._refusal(exc) from None

    @staticmethod
    def _refusal(exc: redis.ResponseError) -> Exception:
        """A function's refusal as `SessionRefused` with its code; any other error as it is."""
        code = scripts.error_code(exc)
        if code in (
            "UNKNOWN",
            "ENDED",
            "EXPIRED",
            "TURN",
            "TAKEN",
            "EXISTS",
            "EARLY",
            "PAYLOAD",
            "STAGED",
            "BAD_INPUT",
        ):
            return SessionRefused(code, str(exc).split(None, 1)[-1])
        return exc


def _text(value: object) -> str:
    return entry_id_str(value) if isinstance(value, (bytes, str)) else str(value)
