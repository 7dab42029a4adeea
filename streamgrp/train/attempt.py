"""A trainer group's attempts: which steps the ranks of one start train together, and which versions
those steps publish.

Owns the ``trainer:attempt`` hash. Every time a trainer group starts (a new process group, a torchrun
restart, a single rank's new process) it begins a new attempt at one first step for all its ranks:
the step after the checkpoint its weights were loaded from (``resume_after``), or else the lowest
rank's next step. Beginning rewinds every rank's position to ``first - 1``, so steps some rank had
committed since are trained again with the same recorded data (the restarted weights lost them), and
records a `TrainingResumed` event. A rank of a lost attempt that is still alive can no longer commit:
``trainer_commit.lua`` refuses a commit from any attempt but the current one (``STALE_ATTEMPT``).

Policy versions never go back and are never reused: the steps of an attempt publish versions from its
base + 1 on, the base being above every version any rank's commit may have published weights under.

The ranks of one group find the same attempt through a token they agreed on (the maximum of a random
number over the group's collective); the first rank to begin it creates it, the others join it.
Deliberately ignores how ranks communicate: the caller brings the token.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Literal

import redis

from streamgrp.core import codec
from streamgrp.core.events import TrainingResumed
from streamgrp.errors import TrainerGroupError
from streamgrp.store import scripts
from streamgrp.store.keys import RunKeys
from streamgrp.store.version import VersionReader

log = logging.getLogger(__name__)

#: How often a begin retries when other groups' attempts keep replacing the one it read.
BEGIN_TRIES = 20


@dataclass(frozen=True)
class Attempt:
    """One start of a trainer group: ``number`` (0 for runs trained before attempts existed), the
    ``first`` step its ranks train, and the version ``base`` its steps publish above."""

    number: int
    first: int
    base: int

    def version_after(self, step: int) -> int:
        """The policy version the weights have once ``step`` is trained in this attempt."""
        return self.base + step - self.first + 1


@dataclass(frozen=True)
class AttemptState:
    """What the server holds about the current attempt and the run's trainer positions."""

    attempt: Attempt
    token: str | None
    #: The highest step any rank ever committed, and the highest version any commit published.
    high: int
    reserved: int
    version: int
    committed: dict[int, int]
    #: The newest weights version published to the server (`streamgrp.train.weights.publish`), -1 if none:
    #: a trainer publishes before it commits, so a lost attempt may have published beyond what it committed.
    published: int = -1

    def next_step(self, rank: int) -> int:
        return self.committed.get(rank, -1) + 1

    def lowest_next_step(self, world_size: int) -> int:
        """The step after the lowest rank's last commit: every rank has committed the steps before it."""
        return min(self.next_step(rank) for rank in range(world_size))

    @property
    def version_base(self) -> int:
        """The base of a new attempt: above the run's version, every version a commit reserved and every
        published weights version."""
        return max(self.version, self.reserved, self.published)


def new_token() -> int:
    """A random 62-bit number; the maximum of the group's numbers is the group's token."""
    return secrets.randbits(62)


def read_state(client: redis.Redis, keys: RunKeys) -> AttemptState:
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.attempt)
    pipe.hgetall(keys.committed)
    pipe.get(keys.version)
    pipe.get(keys.weights("latest"))
    fields, committed, version, published = pipe.execute()
    fields = {_text(k): _text(v) for k, v in fields.items()}
    attempt = Attempt(int(fields.get("attempt", 0)), int(fields.get("first", 0)), int(fields.get("base", 0)))
    return AttemptState(
        attempt,
        fields.get("token"),
        int(fields.get("high", -1)),
        int(fields.get("reserved", 0)),
        VersionReader(keys).parse(version),
        {int(_text(r)): int(_text(s)) for r, s in committed.items()},
        int(published) if published is not None else -1,
    )


def begin(
    client: redis.Redis,
    keys: RunKeys,
    *,
    token: int,
    first: int,
    world_size: int,
    reason: Literal["checkpoint", "lowest_rank", "start"],
    rank: int,
    producer: str,
) -> Attempt:
    """Begin the group's attempt at ``first`` (or join it, when a peer with the same ``token`` began it)."""
    script = scripts.register(client, "trainer_attempt.lua")
    for _ in range(BEGIN_TRIES):
        state = read_state(client, keys)
        base = state.version_base
        retrain_through = state.high if state.high >= first else -1
        if not state.committed and state.high < 0:
            reason = "start"
        event = TrainingResumed(
            attempt=state.attempt.number + 1,
            step=first,
            world_size=world_size,
            base_version=base,
            reason=reason,
            retrain_through=retrain_through,
            rank=rank,
            producer=producer,
            seq=1,
        )
        reply = script(
            keys=[keys.attempt, keys.committed, keys.commits],
            args=[state.attempt.number, str(token), first, base, world_size, codec.encode(event)[codec.HEADER]],
        )
        outcome = _text(reply[0])
        if outcome == "new":
            attempt = Attempt(state.attempt.number + 1, first, base)
            _log_begun(attempt, reason, retrain_through)
            return attempt
        if outcome == "same":
            return Attempt(int(reply[1]), int(reply[2]), int(reply[3]))
    raise TrainerGroupError(
        f"rank {rank} could not begin its trainer group's attempt: other starts replaced it "
        f"{BEGIN_TRIES} times; is another trainer group training run {keys.run!r}?"
    )


def current(client: redis.Redis, keys: RunKeys) -> Attempt:
    """The attempt a rank without a group token joins (ranks that cannot agree: no collectives)."""
    return read_state(client, keys).attempt


def _log_begun(attempt: Attempt, reason: str, retrain_through: int) -> None:
    where = {
        "checkpoint": "after the checkpoint its weights were loaded from",
        "lowest_rank": "the lowest rank's next step (no checkpoint given: pass resume_after=S when the "
        "weights hold step S)",
        "start": "the run's first step",
    }[reason]
    again = (
        f"; steps {attempt.first}..{retrain_through} are trained again with their recorded data"
        if retrain_through >= attempt.first
        else ""
    )
    log.info(
        "trainer group attempt %d starts at step %d, %s%s; its versions start at %d",
        attempt.number,
        attempt.first,
        where,
        again,
        attempt.base + 1,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
