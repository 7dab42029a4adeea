"""The sessions a gateway serves, in memory: each one's recorded turns and how a new turn's prompt continues them.

Owns the gateway's view of a session between requests: its turns (as recorded, so a restarted gateway
rebuilds the same view from the store), one lock per session (its turns are taken one at a time, in
order), and the three rules that keep a conversation one row:

- **the assistant's own words**: an assistant message the client sends back as the gateway returned it
  (same content, same tool calls) is rendered as the raw text that was generated, tool-call markup
  included, so the template writes the generated tokens' text again, not a re-serialization of them;
- **continuation**: when the rendered conversation begins with an earlier turn's rendered prompt and the
  text of its completion ids (special tokens included; a digest and a length are kept per turn, not the
  text), the prompt ids are that turn's prompt and completion ids, then the rest tokenized. The generated
  ids are never tokenized again from text, and the prompt extends the turn token for token;
- **a retry is not a new turn**: a request a client sends again (its SDK's retry count, or the same
  ``Idempotency-Key``) whose prompt is the last turn's prompt gets the last turn's answer again: the gateway
  recorded it, then died or lost the connection before the client read it.

Deliberately ignores HTTP and the store's functions (`streamgrp.services.gateway.gateway`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamgrp.core.events import TurnRecorded
from streamgrp.errors import SessionRefused
from streamgrp.services.gateway.openai_api import assistant_signature
from streamgrp.services.gateway.tool_calls import parse_tool_calls
from streamgrp.store.sessions import StoredSession, key_matches, key_session

#: How many of the latest turns a new prompt is checked against for a continuation.
LOOKBACK_TURNS = 8


def text_digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


@dataclass
class LiveTurn:
    """One recorded turn as the gateway uses it."""

    number: int
    # Tuples: a tuple of numbers is untracked by the garbage collector, whose passes over every turn held in
    # memory (lists of thousands of ids each) were the gateway's longest pauses.
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int
    finish: str
    text: str
    endpoint: str
    model: str
    #: Characters of the rendered prompt plus the completion's text, and their digest (None: a prompt of ids).
    prefix_chars: int | None = None
    prefix_digest: str = ""
    tools: bool = False
    idempotency: str = ""
    #: What the reply said: content and tool calls, as the tool parser makes them from ``text``.
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    signature: tuple[str, tuple[tuple[str, str, str], ...]] = ("", ())

    @classmethod
    def of(cls, event: TurnRecorded, tool_parser: str) -> LiveTurn:
        meta = event.meta
        turn = cls(
            number=event.turn,
            prompt_ids=tuple(event.prompt_ids.to_list()),
            completion_ids=tuple(event.completion_ids.to_list()),
            logprobs=tuple(event.logprobs.to_list()),
            version=event.version,
            finish=event.finish,
            text=str(meta.get("text", "")),
            endpoint=str(meta.get("endpoint", "chat")),
            model=str(meta.get("model", "")),
            prefix_chars=meta.get("prefix_chars") if isinstance(meta.get("prefix_chars"), int) else None,
            prefix_digest=str(meta.get("prefix_digest", "")),
            tools=bool(meta.get("tools")),
            idempotency=str(meta.get("idempotency", "")),
        )
        turn.answer_from_text(event.session, tool_parser)
        return turn

    def answer_from_text(self, session_id: str, tool_parser: str) -> None:
        """What the reply says, from the generated text: content and tool calls, and their `signature`."""
        parser = tool_parser if self.tools and self.endpoint == "chat" else "none"
        self.content, self.tool_calls = parse_tool_calls(
            self.text, parser, call_prefix=f"call_{session_id[-8:]}_{self.number}"
        )
        self.signature = assistant_signature({"content": self.content, "tool_calls": self.tool_calls})

    def continued_by(self, text: str) -> bool:
        chars = self.prefix_chars
        return chars is not None and len(text) >= chars and text_digest(text[:chars]) == self.prefix_digest


@dataclass
class LiveSession:
    """A session as one gateway serves it."""

    session_id: str
    task_id: str
    slot: int
    task_entry: str
    deadline: float | None
    version: int
    status: str
    key_digest: str
    turns: list[LiveTurn] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _answers: dict[tuple[str, tuple[tuple[str, str, str], ...]], str] = field(default_factory=dict, repr=False)
    _answers_seen: int = field(default=0, repr=False)

    @classmethod
    def of(cls, stored: StoredSession, tool_parser: str) -> LiveSession:
        return cls(
            session_id=stored.session_id,
            task_id=stored.task_id,
            slot=stored.slot,
            task_entry=stored.task_entry,
            deadline=stored.deadline,
            version=stored.version,
            status=stored.status,
            key_digest=stored.key_digest,
            turns=[LiveTurn.of(turn, tool_parser) for turn in stored.turns],
        )

    @property
    def stored(self) -> StoredSession:
        """What the store's `end` needs to know of the session."""
        return StoredSession(
            session_id=self.session_id,
            task_id=self.task_id,
            slot=self.slot,
            task_entry=self.task_entry,
            deadline=self.deadline,
            version=self.version,
            status=self.status,
            key_digest=self.key_digest,
            turn_count=len(self.turns),
        )

    def check_open(self, now: float) -> None:
        """`SessionRefused` unless a turn may still be taken: the session is open and its deadline ahead."""
        if self.status != "open":
            raise SessionRefused("ENDED", f"session {self.session_id} ended ({self.status}); open another one")
        if self.deadline is not None and now >= self.deadline:
            raise SessionRefused("EXPIRED", f"session {self.session_id}'s group deadline passed; its slot is timed out")

    def with_own_words(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with each assistant message the gateway returned replaced by the text it generated."""
        returned = self._returned()
        out = []
        for message in messages:
            if message.get("role") == "assistant" and returned:
                raw = returned.get(assistant_signature(message))
                if raw is not None:
                    message = {"role": "assistant", "content": raw}
            out.append(message)
        return out

    def _returned(self) -> dict[tuple[str, tuple[tuple[str, str, str], ...]], str]:
        """Each chat answer's signature -> the text generated for it (kept up to date as turns are added)."""
        if self._answers_seen != len(self.turns):
            for turn in self.turns[self._answers_seen :]:
                if turn.endpoint == "chat":
                    self._answers.setdefault(turn.signature, turn.text)
            self._answers_seen = len(self.turns)
        return self._answers

    def continued(self, text: str) -> LiveTurn | None:
        """The newest of the latest turns whose rendered prompt and completion ``text`` begins with."""
        return next((turn for turn in reversed(self.turns[-LOOKBACK_TURNS:]) if turn.continued_by(text)), None)

    def replayable(self, prompt_ids: Sequence[int], *, retried: bool, idempotency: str) -> LiveTurn | None:
        """The last turn, when this request is a client's retry of it (see the module docstring)."""
        if not self.turns:
            return None
        last = self.turns[-1]
        if tuple(last.prompt_ids) != tuple(prompt_ids):
            return None
        if (idempotency and last.idempotency == idempotency) or retried:
            return last
        return None


class SessionTable:
    """The gateway's open sessions in memory, each loaded from the store on its first request."""

    def __init__(self, load: Callable[[str], Awaitable[StoredSession | None]], tool_parser: str) -> None:
        self._load = load
        self.tool_parser = tool_parser
        self._sessions: dict[str, LiveSession] = {}
        self._loading: dict[str, asyncio.Future[LiveSession | None]] = {}

    def add(self, session: LiveSession) -> None:
        self._sessions[session.session_id] = session

    def drop(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def cached(self, session_id: str) -> LiveSession | None:
        return self._sessions.get(session_id)

    def __len__(self) -> int:
        return len(self._sessions)

    async def get(self, session_id: str) -> LiveSession:
        """The session, loaded from the store unless held; `SessionRefused` ``UNKNOWN`` when there is none."""
        session = self._sessions.get(session_id)
        if session is None:
            session = await self._loaded(session_id)
        if session is None:
            raise SessionRefused("UNKNOWN", f"no session {session_id} in this run")
        return session

    async def authenticate(self, key: str) -> LiveSession:
        """The session ``key`` belongs to; `SessionRefused` ``UNKNOWN`` for any key that is not one's."""
        session_id = key_session(key)
        if session_id is None:
            raise SessionRefused("UNKNOWN", "the API key is not a session key of this gateway (sgk_...)")
        try:
            session = await self.get(session_id)
        except SessionRefused:
            raise SessionRefused("UNKNOWN", "the API key is not a session key of this gateway's run") from None
        if not key_matches(key, session.key_digest):
            raise SessionRefused("UNKNOWN", "the API key is not a session key of this gateway's run")
        return session

    async def reload(self, session_id: str) -> LiveSession:
        """Read the session again from the store (another writer recorded a turn, or ended it)."""
        self._sessions.pop(session_id, None)
        return await self.get(session_id)

    async def _loaded(self, session_id: str) -> LiveSession | None:
        waiting = self._loading.get(session_id)
        if waiting is not None:
            return await asyncio.shield(waiting)
        future: asyncio.Future[LiveSession | None] = asyncio.get_running_loop().create_future()
        self._loading[session_id] = future
        try:
            stored = await self._load(session_id)
            session = None if stored is None else LiveSession.of(stored, self.tool_parser)
            if session is not None and session.status == "open":
                current = self._sessions.setdefault(session_id, session)
                session = current
            future.set_result(session)
            return session
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved here: the waiters (if any) get it too
            raise
        finally:
            del self._loading[session_id]
