"""A rank's iteration over its steps: `BatchStream`, what `TrainerClient.batches` returns.

Owns the loop a rank runs step by step: beginning the group's attempt, waiting for each manifest,
loading the rank's shard (on a background thread for the next step while the loop body trains on
this one, `PREFETCH_BODY_SHARE`), the per-step vote that proves the group's ranks hold the same attempt,
step and manifest and lets them leave together (`streamgrp.train.agreement`), committing a step when the
loop body moves on, and recording the loop's exception as the step's failure (the ``with`` form). What a
step's reads and writes do on the server is `streamgrp.train.trainer.TrainerClient`'s; the rules for
stopping and resuming are in that module's docstring.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from streamgrp.core.events import StepManifest
from streamgrp.errors import RunFailed
from streamgrp.train.agreement import GroupVote, manifest_digest, resolve_reduce
from streamgrp.train.batch import Batch

if TYPE_CHECKING:
    from streamgrp.train.trainer import TrainerClient

#: Prefetch the next step only while loop bodies last at least this share of a load.
PREFETCH_BODY_SHARE = 0.25


class BatchStream:
    """Iterable of a rank's batches; also a context manager that records the loop's exception."""

    def __init__(
        self, trainer: TrainerClient, rank: int, world_size: int, agree: Any = None, resume_after: int | None = None
    ) -> None:
        self.trainer = trainer
        self.rank = rank
        self.world_size = world_size
        self.agree = agree
        self.resume_after = resume_after
        self.current: Batch | None = None

    def __iter__(self) -> Iterator[Batch]:
        trainer = self.trainer
        reduce_max = resolve_reduce(self.agree, self.world_size)
        vote = GroupVote(reduce_max, self.rank) if reduce_max is not None else None
        step = trainer.begin(self.rank, self.world_size, vote, self.resume_after)
        attempt = trainer.begun_attempt().number
        ahead: tuple[StepManifest, Future[tuple[Batch, float]]] | None = None
        body_s = load_s = None  # the last loop body's and the last load's seconds
        # Terminal events, commits and the order of steps stay on this thread; the pool only loads.
        with ThreadPoolExecutor(1, thread_name_prefix="streamgrp-prefetch") as pool:
            while True:
                manifest, ended = self._next_manifest(step, ahead[0] if ahead else None)
                # Loaded before the vote, so a rank that cannot load its shard (a sample gone or altered)
                # leaves with every rank of the group instead of leaving them in the step's collectives.
                loaded = None
                if manifest is not None and ended is None:
                    try:
                        loaded = ahead[1].result() if ahead else self._timed_load(manifest)
                    except RunFailed as failed:
                        ended = failed
                ahead = None
                if vote is not None and vote.step(
                    leaving=manifest is None or ended is not None,
                    attempt=attempt,
                    step=step,
                    digest=manifest_digest(manifest),
                    failed=loaded is None and manifest is not None,
                ):
                    manifest = None  # a rank is leaving at this step: so does every rank
                    if ended is None and vote.peer_failed:
                        ended = RunFailed(
                            f"run {trainer.keys.run}: another rank of the trainer group cannot train "
                            f"step {step} (its shard cannot be loaded; its log says why); no rank "
                            "trains it. `streamgrp verify` lists what is missing"
                        )
                if ended is not None:
                    raise ended
                if manifest is None:
                    return
                assert loaded is not None, "a step's shard is loaded (or the load's failure ended the loop) above"
                batch, load_s = loaded
                # A loop body that returns at once (a rank with nothing else to do) would only wait for
                # the thread: the handoffs of its reads cost CPU and gain nothing, so it loads in line.
                hides = body_s is None or body_s >= PREFETCH_BODY_SHARE * load_s
                following = self._peek(step + 1) if trainer.prefetch and hides else None
                if following is not None:
                    ahead = following, pool.submit(self._timed_load, following)
                self.current = batch
                started = time.perf_counter()
                yield batch
                body_s = time.perf_counter() - started
                batch.commit()  # the loop body finished: the step is done
                self.current = None
                step += 1

    def _peek(self, step: int) -> StepManifest | None:
        """The next step's manifest for prefetching, if it is there and decodes (a damaged one fails the
        rank when it reaches that step, not this one)."""
        try:
            return self.trainer.manifest(step)
        except RunFailed:
            return None

    def _timed_load(self, manifest: StepManifest) -> tuple[Batch, float]:
        started = time.perf_counter()
        batch = self.trainer.load(manifest, self.rank, self.world_size)
        return batch, time.perf_counter() - started

    def _next_manifest(self, step: int, known: StepManifest | None) -> tuple[StepManifest | None, RunFailed | None]:
        """The manifest of ``step``, or None (with the run's failure, if it failed) when this rank leaves
        before it. The failure is returned rather than raised so the rank still votes on leaving."""
        trainer = self.trainer
        if trainer.stopping:
            return None, None
        try:
            return trainer.wait_for_step(step, lambda: trainer.stopping, known=known), None
        except RunFailed as failed:
            return None, failed

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if (
            exc is not None
            and self.current is not None
            and not self.current.settled
            and not isinstance(exc, (RunFailed, KeyboardInterrupt))
            and not self.trainer.stopping
        ):
            self.current.fail(exc)
