"""The trainer API: each DP rank iterates its shard of every step, in order, exactly once.

    client = TrainerClient(redis_client, run)
    with client.batches(rank=r, world_size=w) as batches:
        for batch in batches:
            loss = step_fn(batch.token_ids, batch.loss_mask, ...)
            batch.commit()

Owns the rank's position (the next uncommitted step, kept on the server, so a restarted rank
resumes there), loading each step's shard (`streamgrp.train.loader`), committing or failing steps, and raising the run's
terminal error on every rank at the same step. Moving to the next batch without `commit` commits
the previous one (the loop body finished). With the ``with`` form an exception inside the loop
records a `StepFailed` event carrying the exception text before it propagates; a bare ``for``
loop cannot see that exception, so an uncommitted step there is simply left for the next start.

Ranks of a data-parallel group train each step together (`streamgrp.train.agreement`): before the
first step they begin one attempt at one step (`streamgrp.train.attempt`): the step after the
checkpoint their weights hold (``resume_after``), else the lowest rank's next step; before every step
one small collective proves they hold the same attempt, step and manifest, or every rank raises the
same `TrainerGroupError`. Steps some rank had committed after that first step are trained again (the
restarted weights lost them) and publish new versions above every earlier one.

A stop (the client's stop event: the one ``connect(stop=...)`` was given, which for ``streamgrp
trainer`` SIGTERM and SIGINT set) ends the iteration between steps, after the running step is
committed, so a stopped rank exits cleanly and resumes at its next step. Data-parallel ranks must
leave at the same step, or a rank that already started the next step waits in its collectives for a
peer that left: the per-step vote carries whether a rank is leaving, and all leave when any rank is
stopping (or the run ended for it). Ranks that cannot vote (more than one rank, no ``agree`` and no
``torch.distributed`` group) each resume at their own next step, unchecked, with a warning; an
exception that ends a step after a stop was requested is not recorded as a failure either: it is the
peer's stop, not the step, and the step is left for the next start.

The loop itself (prefetch, the per-step vote, committing as the body moves on) is
`streamgrp.train.batch_stream.BatchStream`, which `TrainerClient.batches` returns.

`streamgrp.train.loader.build_batch` is the one place a shard becomes tensors; it reads entries
through a fetch function, so `streamgrp.replay.steps` rebuilds a step from the live log or an archive
with the same code.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from collections.abc import Mapping
from functools import partial
from typing import Any

import orjson
import redis

from streamgrp.core import codec
from streamgrp.core.events import (
    CheckpointSaved,
    RunFinished,
    RunTerminated,
    StepCommitted,
    StepFailed,
    StepManifest,
    VersionAdvanced,
)
from streamgrp.errors import (
    ConfigError,
    DecodeError,
    DigestMismatch,
    RunFailed,
    TrainerGroupError,
)
from streamgrp.store import payloads, scripts
from streamgrp.store.connection import MAX_BLOCK_MS, outage_of, ride, wait_for_replicas
from streamgrp.store.control import ControlCursor
from streamgrp.store.deadletter import DeadLetters
from streamgrp.store.keys import step_entry_id
from streamgrp.store.runs import Run
from streamgrp.store.streams import producer_name
from streamgrp.train import attempt as attempts
from streamgrp.train.agreement import GroupVote
from streamgrp.train.attempt import Attempt
from streamgrp.train.batch import Batch
from streamgrp.train.batch_stream import BatchStream
from streamgrp.train.loader import EntryFetch, build_batch
from streamgrp.train.step_metrics import checked_metrics

log = logging.getLogger(__name__)


class TrainerClient:
    """A trainer process's view of a run: manifests in, commits and failures out."""

    def __init__(
        self,
        client: redis.Redis,
        run: Run,
        *,
        poll_s: float = 1.0,
        name: str | None = None,
        check_digests: bool = False,
        prefetch: bool = True,
        stop: threading.Event | None = None,
    ) -> None:
        self.client = client
        #: Ends the iteration between steps; default: the stop event the client was connected with.
        self.stop = stop if stop is not None else outage_of(client).stop
        #: Load the next step's shard on a background thread while the loop body trains on this one,
        #: when its manifest is written already (one batch more in memory) and the previous loop body
        #: ran long enough to hide a load (`streamgrp.train.batch_stream.PREFETCH_BODY_SHARE`).
        self.prefetch = prefetch
        #: Hash every payload and compare with the manifest's digests before training on it. Off by
        #: default: the publisher computed each digest once, and replay and verify check them; the
        #: payload's structure (task, slot, dtypes, sizes) is checked on every load either way.
        self.check_digests = check_digests
        self.joined_run = run
        self.keys = run.keys
        self.poll_ms = min(MAX_BLOCK_MS, max(1, int(poll_s * 1000)))
        self.name = name or producer_name("trainer")
        self._commit_script = scripts.register(client, "trainer_commit.lua")
        self._fetch: EntryFetch | None = None
        self._checkpoint_script = scripts.register(client, "checkpoint_record.lua")
        self._seq = 0
        self._dead_letters = DeadLetters(client, self.keys)
        self._control = ControlCursor(self._dead_letters)  # each entry read once, not from the start per step
        self._terminal: RunTerminated | None = None
        self._finished: RunFinished | None = None
        #: The attempt this client's ranks train in, and the highest step committed before it began.
        self.attempt: Attempt | None = None
        self._retrain_through = -1

    def next_step(self, rank: int) -> int:
        last = self.client.hget(self.keys.committed, str(rank))
        return 0 if last is None else int(last) + 1

    def batches(self, *, rank: int, world_size: int, agree: Any = None, resume_after: int | None = None) -> BatchStream:
        """This rank's batches, from the first step of the attempt its group begins.

        ``agree``: how the group's ranks vote, an element-wise maximum over them
        (`streamgrp.train.distributed.Collectives`, its ``max_over_ranks`` or ``any_rank``); by default
        ``torch.distributed``'s group when it is initialised. ``resume_after``: the step the weights hold
        (the checkpoint they were loaded from; -1 for the initial weights): the group resumes after it
        and trains every later step again. Without it the group resumes at the lowest rank's next step."""
        dp_size = self.joined_run.config.dp_size
        if world_size != dp_size:
            raise ConfigError(
                f"world_size={world_size} but run {self.keys.run!r} batches for dp_size={dp_size}; "
                "start as many trainer ranks as the run's dp_size"
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}")
        if resume_after is not None and resume_after < -1:
            raise ConfigError(
                f"resume_after={resume_after}: give the last step the weights hold, or -1 for the initial weights"
            )
        return BatchStream(self, rank, world_size, agree, resume_after)

    def begin(self, rank: int, world_size: int, vote: GroupVote | None, resume_after: int | None) -> int:
        """Begin (or join) this group's attempt; returns the rank's first step."""
        state = attempts.read_state(self.client, self.keys)
        if vote is None:
            if world_size > 1:
                log.warning(
                    "rank %d of %d cannot vote with its peers (no agree and no torch.distributed group): it "
                    "resumes at its own next step and nothing checks that the ranks train the same step; "
                    "pass agree=Collectives(...) or initialise torch.distributed first",
                    rank,
                    world_size,
                )
            self.attempt = state.attempt
            self._retrain_through = -1
            return state.next_step(rank)
        lowest = state.lowest_next_step(world_size)
        first = lowest if resume_after is None else resume_after + 1
        if first > lowest:
            raise TrainerGroupError(
                f"resume_after={resume_after}, but some rank committed only the steps before {lowest}: weights that "
                f"hold step {resume_after} were trained on steps not every rank committed; resume after a step every "
                f"rank committed (at most {lowest - 1})"
            )
        token, first = vote.plan(token=attempts.new_token(), first=first, explicit=resume_after is not None)
        self.attempt = attempts.begin(
            self.client,
            self.keys,
            token=token,
            first=first,
            world_size=world_size,
            reason="checkpoint" if resume_after is not None else "lowest_rank",
            rank=rank,
            producer=self.name,
        )
        self._retrain_through = state.high
        return self.attempt.first

    def begun_attempt(self) -> Attempt:
        """The attempt `begin` began or joined (a bug to ask for before it)."""
        if self.attempt is None:
            raise RuntimeError("no attempt has begun: TrainerClient.begin() comes first")
        return self.attempt

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested."""
        return self.stop is not None and self.stop.is_set()

    # -- reading ------------------------------------------------------------------------------------

    def manifest(self, step: int) -> StepManifest | None:
        """The step's manifest, None before the batcher wrote it; `RunFailed` when the entry at the step's
        id does not decode (every rank reads the same entry, so every rank fails the same way)."""
        entry = step_entry_id(step)
        found = self.client.xrange(self.keys.steps, entry, entry)
        if not found:
            return None
        try:
            return codec.decode(found[0][1])
        except DecodeError as exc:
            raise RunFailed(
                f"run {self.keys.run}: step {step}'s manifest (steps entry {entry}) does not decode "
                f"({exc.reason}); the step cannot be trained. Only the batcher writes steps: check who "
                "else may write the steps stream; `streamgrp verify` lists the damaged entry"
            ) from None

    def wait_for_step(self, step: int, stop_check=None, *, known: StepManifest | None = None) -> StepManifest | None:
        """The manifest of ``step`` (``known``: already read); None when the run finished before it; raises
        `RunFailed`."""
        while True:
            self._read_control()
            terminal = self._terminal
            if terminal is not None and terminal.step is not None and step >= terminal.step:  # held only with a step
                raise RunFailed(
                    f"run {self.keys.run} failed at step {terminal.step} ({terminal.reason}): {terminal.message}"
                )
            manifest = known if known is not None and known.step == step else self.manifest(step)
            if manifest is not None:
                return manifest
            if self._finished is not None and step >= self._finished.steps:
                return None
            if stop_check is not None and stop_check():
                return None
            previous = step_entry_id(step - 1) if step > 0 else "0-0"
            self.client.xread(
                {self.keys.steps: previous, self.keys.control: self._control.last}, block=self.poll_ms, count=1
            )

    def _read_control(self) -> None:
        """Take the terminal and finished events from the control stream past this client's cursor."""
        for event in self._control.read():
            if isinstance(event, RunTerminated) and event.step is not None and self._terminal is None:
                self._terminal = event
            elif isinstance(event, RunFinished):
                self._finished = event

    def _payload_fetch(self) -> EntryFetch:
        """How this rank reads a step's entries: made once, so its connection's buffers are read into again."""
        if self._fetch is None:
            self._fetch = payloads.entry_fetch(
                self.client,
                self.joined_run.stream_key,
                self.joined_run.config.payload_layout,
                retry=partial(ride, self.client),
            )
        return self._fetch

    def load(self, manifest: StepManifest, rank: int, world_size: int) -> Batch:
        """Rank ``rank``'s batch of ``manifest``; `RunFailed` when a sample it names is gone or altered (every
        rank that reads it fails the same way, and a restart would meet it again: it needs a person)."""
        try:
            batch = build_batch(
                manifest,
                rank,
                world_size,
                self._payload_fetch(),
                run=self.keys.run,
                client=self,
                check_digests=self.check_digests,
                missing_hint="a step is never trimmed before every rank committed it, so it was deleted",
                run_config=self.joined_run.config,
            )
        except DigestMismatch as exc:
            raise RunFailed(
                f"run {self.keys.run}: step {manifest.step} cannot be trained as it was recorded: {exc}. "
                "Only streamgrp's functions should write or delete entries: check who else may; "
                "`streamgrp verify` lists what is missing; an archive (`streamgrp archiver`) holds a copy "
                "to restore"
            ) from None
        attempt = self.attempt if self.attempt is not None else attempts.current(self.client, self.keys)
        batch.attempt = attempt.number
        batch.next_version = attempt.version_after(manifest.step)
        batch.retrained = manifest.step <= self._retrain_through
        return batch

    # -- writing ------------------------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _commit(self, batch: Batch) -> None:
        committed = StepCommitted(
            step=batch.step,
            rank=batch.rank,
            world_size=batch.world_size,
            attempt=batch.attempt,
            producer=self.name,
            seq=self._next_seq(),
        )
        advanced = VersionAdvanced(
            version=batch.next_version, step=batch.step, producer=self.name, seq=self._next_seq()
        )
        try:
            self._commit_script(
                keys=[self.keys.committed, self.keys.commits, self.keys.version, self.keys.control, self.keys.attempt],
                args=[
                    batch.rank,
                    batch.step,
                    batch.world_size,
                    codec.encode(committed)[codec.HEADER],
                    codec.encode(advanced)[codec.HEADER],
                    batch.attempt,
                    batch.next_version,
                ],
            )
        except redis.ResponseError as exc:
            if scripts.error_code(exc) == "STALE_ATTEMPT":
                raise TrainerGroupError(str(exc).split(None, 1)[1]) from None
            raise
        wait_for_replicas(self.client)

    def record_checkpoint(
        self, batch: Batch, path: str | os.PathLike, files: dict[str, int], *, ranks: tuple[int, ...] | None = None
    ) -> CheckpointSaved:
        """Record that the checkpoint of the weights after ``batch``'s step is durable at ``path`` (every
        file written and fsynced, `streamgrp.train.checkpoint.save_training_state`), written by ``ranks``
        (default: this batch's rank). Call it once every rank committed the step (after a barrier), so
        a group that resumes from it never skips a step some rank did not commit."""
        event = CheckpointSaved(
            step=batch.step,
            version=batch.next_version,
            path=str(path),
            ranks=ranks if ranks is not None else (batch.rank,),
            world_size=batch.world_size,
            attempt=batch.attempt,
            files=files,
            producer=self.name,
            seq=self._next_seq(),
        )
        try:
            self._checkpoint_script(
                keys=[self.keys.checkpoint, self.keys.commits, self.keys.attempt],
                args=[batch.step, batch.attempt, codec.encode(event)[codec.HEADER]],
            )
        except redis.ResponseError as exc:
            if scripts.error_code(exc) == "STALE_ATTEMPT":
                raise TrainerGroupError(str(exc).split(None, 1)[1]) from None
            raise
        wait_for_replicas(self.client)
        log.info("checkpoint of step %d (version %d) recorded at %s", batch.step, batch.next_version, path)
        return event

    def latest_checkpoint(self) -> CheckpointSaved | None:
        """The newest recorded checkpoint, or None."""
        header = self.client.hget(self.keys.checkpoint, "h")
        return codec.decode({codec.HEADER: header}) if header is not None else None

    def _record_metrics(self, batch: Batch, values: Mapping[str, Any]) -> None:
        record = {**checked_metrics(values), "step": batch.step}
        self.client.hset(self.keys.trainer_metrics, str(batch.step), orjson.dumps(record))

    def _fail(self, batch: Batch, exc: BaseException | str) -> None:
        if isinstance(exc, BaseException):
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        else:
            text = str(exc)
        event = StepFailed(
            step=batch.step, rank=batch.rank, error=text[:8000], producer=self.name, seq=self._next_seq()
        )
        # redis-py types the fields as an invariant Dict of its widest key and value types, so no narrower dict fits
        self.client.xadd(self.keys.commits, codec.encode(event))  # type: ignore[arg-type]
        log.error("step %d failed on rank %d: %s", batch.step, batch.rank, text)
