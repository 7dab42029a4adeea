"""TRL's asynchronous GRPO trainer (``trl.experimental.async_grpo``) training from a streamgrp run.

    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from streamgrp.train.trl_async import StreamgrpRollouts, StreamgrpWeights

    trainer = TrainerClient(client, run)            # a run with dp_size 1 (TRL splits micro-batches itself)
    AsyncGRPOTrainer(model=path, args=AsyncGRPOConfig(max_steps=..., ...), train_dataset=placeholder,
                     processing_class=tokenizer, rollout_worker=(rollouts := StreamgrpRollouts(trainer)),
                     weight_transfer=StreamgrpWeights(client, run.keys), callbacks=[rollouts.callback]).train()

`StreamgrpRollouts` implements TRL's ``RolloutWorkerProtocol`` (read in
``trl/experimental/async_grpo/async_grpo_trainer.py``): ``rollout_buffer`` (TRL's dataset drains it
with ``get``/``qsize``; we fill it), ``metrics_queue`` (dicts TRL merges into its logs), ``start``,
``stop``, ``update_model_version`` and ``check_health``. So generation, grouping, staleness and
replay stay streamgrp's: workers sample, the assembler decides groups, the batcher drops stale
groups and forms steps, and every step can be replayed. TRL only trains.

Owns, on one background thread started by ``start``: reading the run's steps in order as rank 0
of 1, turning each row into TRL's ``RolloutSample`` (whole row as ``input_ids``, ``loss_mask`` as
``completion_mask``, ``logprobs`` as ``old_log_probs``, one advantage per row by
`streamgrp.normalize` over the actual group sizes, ``group_id`` unique per group of the run;
`streamgrp.train.trl_samples`). At most ``ahead_steps`` steps sit in the buffer not fully taken.

Commits only what was trained. `StreamgrpProgress` (``callbacks=[rollouts.callback]``) watches TRL's
collator, which packs each micro-batch just before its forward pass, and TRL's optimizer steps: a
step commits once every row of it was in a completed optimizer step (on TRL's ``on_step_end``,
before TRL's weight sync, so that sync publishes under the version the commit reached). The rows of
the next step already trained are recorded on the server (`StepRowsTrained`); rows TRL took but did
not train (``max_steps`` reached mid-step, a stop, a crash) are handed again on the next start, and
rows recorded as trained are not. One TRL optimizer step needs ``(gradient_accumulation_steps + 1) x
per_device_train_batch_size`` rows in hand (accelerate packs one micro-batch ahead), and the batcher
forms at most ``max_staleness + 1`` steps past the last commit: a run whose window holds fewer rows
cannot train, and ``check_health`` says so instead of waiting.

Resuming: a plain start resumes at the run's next uncommitted step, past its recorded rows. Each TRL
checkpoint (``checkpoint-N``) carries the streamgrp position of its weights in ``trainer_state.json``
(first step not fully trained, its trained rows); ``train(resume_from_checkpoint=...)`` begins a
trainer attempt after it (``resume_after``), so the rows and steps trained after that checkpoint are
trained again from the same recorded data, as retrained steps (``retrained_rows``).

TRL's own staleness check sees each sample stamped with the live TRL version as TRL takes it, so
it never drops one (a dropped row would never be trained): streamgrp already dropped groups older
than the run's ``max_staleness`` when it formed the step (``streamgrp/staleness_max`` in
TRL's logs shows what was trained). Set TRL's ``max_steps``: the prompts live in the run, so an
epoch over ``train_dataset`` means nothing, and when the run finishes with TRL wanting more,
``check_health`` raises `RunEnded`.

`StreamgrpWeights` (`streamgrp.train.trl_weights`) implements TRL's ``WeightTransferProtocol`` by
publishing the weights to the run for workers using ``WeightCache`` (small models). TRL syncs after
every optimizer step; a version names one weight state, so only the first sync after a commit is
published: version ``v`` holds the weights of the optimizer step that completed the run's step
``v - 1``. For large models keep TRL's own transfer (NCCL to vLLM) and point the workers' rollout
function at that vLLM server instead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from streamgrp.core.events import StepRowsTrained
from streamgrp.core.policy import NormSpec
from streamgrp.errors import ConfigError, RunEnded, StreamgrpError
from streamgrp.train.agreement import GroupVote
from streamgrp.train.batch import Batch
from streamgrp.train.trainer import TrainerClient
from streamgrp.train.trl_progress import Position, record_rows, recorded_rows
from streamgrp.train.trl_samples import GRPO_NORM, TakenCounter, rollout_sample_type, rollout_samples, step_logs
from streamgrp.train.trl_weights import StreamgrpWeights

__all__ = ["StreamgrpRollouts", "StreamgrpWeights", "TakenCounter"]

log = logging.getLogger(__name__)


@dataclass
class _Pushed:
    """A step whose samples are in the buffer: fully taken once ``taken`` reaches ``end``."""

    step: int
    end: int


@dataclass
class _Open:
    """A step handed to TRL and not yet committed: committed once ``trained`` holds every row."""

    batch: Batch
    trained: set[int]
    recorded: frozenset[int] = frozenset()


class StreamgrpRollouts:
    """TRL's rollout worker, fed by a streamgrp run's steps (see the module docstring)."""

    def __init__(
        self,
        trainer: TrainerClient,
        *,
        advantages: NormSpec | None = None,
        ahead_steps: int = 2,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        if trainer.joined_run.config.dp_size != 1:
            raise ConfigError(
                f"run {trainer.keys.run!r} batches for dp_size={trainer.joined_run.config.dp_size}, but TRL's "
                "async GRPO trainer reads every sample on its main process and splits micro-batches "
                "over its own ranks: start the run with --dp-size 1"
            )
        if ahead_steps < 1:
            raise ConfigError(f"ahead_steps={ahead_steps}: at least one step must be in the buffer")
        config = trainer.joined_run.config
        self.trainer = trainer
        self.spec = advantages or config.adv_norm or config.reward_norm or GRPO_NORM
        self.ahead_steps = ahead_steps
        self.decode = decode
        self.rollout_buffer = TakenCounter()
        self.metrics_queue: queue.Queue = queue.Queue(maxsize=4096)
        self._group_stride = config.max_batch_size  # group ids step * stride + index never collide
        self._pushed_rows = 0
        self._pending: deque[_Pushed] = deque()  # steps with samples still in the buffer
        self._open: dict[int, _Open] = {}  # steps handed to TRL, not committed; guarded by _lock
        self._rows: dict[int, tuple[int, int, dict]] = {}  # id(sample.metrics) -> (step, row, metrics)
        self._collated: deque[list[int]] = deque()  # the keys of each micro-batch TRL packed, not yet trained
        self._lock = threading.Lock()
        self._commit_lock = threading.Lock()  # commits and records, from TRL's thread or (all rows skipped) the feed's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._ended_at: int | None = None  # the run's step count once it finished
        self._beat = time.time()
        self._starved_since: float | None = None
        self._begun = False  # StreamgrpProgress saw TRL's train begin
        self._checkpoint: Position | None = None
        self._first: Position | None = None  # where this start resumed: its first step, the rows trained already
        self.token_budget = 0
        self.committed_steps = 0
        #: Rows trained in an earlier start whose weights this one lost (resumed from an older checkpoint).
        self.retrained_rows = 0
        self._callback: Any = None

    @property
    def callback(self) -> Any:
        """The TRL callback this feed needs: ``AsyncGRPOTrainer(..., callbacks=[rollouts.callback])``."""
        if self._callback is None:
            rollout_sample_type()  # a clear error when TRL is missing
            from streamgrp.train.trl_progress import StreamgrpProgress

            self._callback = StreamgrpProgress(self)
        return self._callback

    # -- TRL's RolloutWorkerProtocol ------------------------------------------------------------------

    def start(self) -> None:
        """Begin the trainer group's attempt and start feeding the buffer (TRL calls this once, after its
        first weight sync)."""
        if self._thread is not None:
            return
        if not self._begun:
            raise ConfigError(
                "StreamgrpRollouts needs its TRL callback: AsyncGRPOTrainer(..., callbacks=["
                "rollouts.callback]) (and TrainingArguments.restore_callback_states_from_checkpoint "
                "left False, which replaces callbacks with new, unconnected ones)"
            )
        self._sample_type = rollout_sample_type()
        self._first = first = self._begin()
        self._beat = time.time()
        self._thread = threading.Thread(target=self._run, args=(first,), name="streamgrp-rollouts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop feeding. TRL calls this at train end; rows it took but did not train are handed again next start."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def update_model_version(self, model_version: int) -> None:
        """TRL's live policy version, stamped on samples as TRL takes them."""
        self.rollout_buffer.version = int(model_version)

    def check_health(self, stale_after_s: float) -> None:
        """Raise when feeding failed (the run failed, the server is gone), ended, or stopped moving."""
        if self._error is not None:
            if isinstance(self._error, StreamgrpError):
                raise self._error
            raise RuntimeError(f"streamgrp rollout feed failed: {self._error!r}") from self._error
        if self._ended_at is not None and not self._pending and self.rollout_buffer.qsize() == 0:
            raise RunEnded(
                f"streamgrp run {self.trainer.keys.run!r} finished after {self._ended_at} steps and TRL "
                "has taken every sample, but it asks for more: lower AsyncGRPOConfig.max_steps, or let the "
                "batcher write more steps (--max-steps)"
            )
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the streamgrp rollout feed is not running: call start() (TRL does on train begin)")
        age = time.time() - self._beat
        if age > stale_after_s:
            raise RuntimeError(
                f"the streamgrp rollout feed has not moved for {age:.0f}s > {stale_after_s:.0f}s; "
                "is the server reachable?"
            )
        window = self.trainer.joined_run.config.max_staleness + 1
        if self._pending or self.rollout_buffer.qsize() or len(self._open) < window:
            self._starved_since = None
            return
        # Steps commit once trained, and the batcher forms about this many steps past the last commit (more
        # only as issued groups are dropped): TRL waits for rows that may not come before it trains the
        # ones it holds. Only a wait as long as TRL's own heartbeat limit is taken for that.
        self._starved_since = self._starved_since or time.time()
        if time.time() - self._starved_since > stale_after_s:
            raise ConfigError(
                f"TRL took every row of the {len(self._open)} uncommitted steps the run's staleness "
                f"window allows (max_staleness + 1 = {window}) and has waited {stale_after_s:.0f}s for "
                "more before an optimizer step: one optimizer step needs more rows than the window "
                "holds. Raise the run's --max-staleness, or lower per_device_train_batch_size x "
                "gradient_accumulation_steps"
            )

    # -- TRL's training loop, through StreamgrpProgress ----------------------------------------------------

    def train_begins(self, dataloader: Any, *, token_budget: int = 0, checkpoint: dict | None = None) -> None:
        """TRL's train begins: watch what its collator packs, and where a TRL checkpoint left the run."""
        if checkpoint is not None:
            if checkpoint.get("run") != self.trainer.keys.run:
                raise ConfigError(
                    f"the TRL checkpoint holds run {checkpoint.get('run')!r}'s steps, not run "
                    f"{self.trainer.keys.run!r}'s"
                )
            self._checkpoint = Position(int(checkpoint["step"]), frozenset(int(r) for r in checkpoint["rows"]))
        self.token_budget = int(token_budget)
        loader = getattr(dataloader, "base_dataloader", dataloader)
        if loader is None or not hasattr(loader, "collate_fn"):
            raise ConfigError("TRL's train dataloader has no collate_fn to watch; this TRL version is not supported")
        collate = loader.collate_fn

        def watched(examples: list) -> Any:
            out = collate(examples)
            self.collated([sample for rows in examples for row in rows for sample in row.samples])
            return out

        loader.collate_fn = watched
        self._begun = True

    def collated(self, samples: list[dict]) -> None:
        """TRL packed one micro-batch of these samples (the dicts its dataset yields); in training order."""
        keys = [id(sample["metrics"]) for sample in samples]
        with self._lock:
            if any(key not in self._rows for key in keys):
                raise ConfigError("TRL packed a sample this feed did not hand out")
            self._collated.append(keys)

    def optimizer_step(self, microbatches: int) -> None:
        """The first ``microbatches`` packed micro-batches were in this completed optimizer step: commit the
        steps now fully trained, in order, and record the trained rows of the next one."""
        with self._commit_lock:
            with self._lock:
                for _ in range(min(microbatches, len(self._collated))):
                    for key in self._collated.popleft():
                        step, row, _ = self._rows.pop(key)
                        self._open[step].trained.add(row)
                first = self._open[min(self._open)] if self._open else None
            while first is not None and len(first.trained) >= first.batch.rows:
                first.batch.commit()  # every row of it was in a completed optimizer step
                self.committed_steps += 1
                with self._lock:
                    del self._open[first.batch.step]
                    first = self._open[min(self._open)] if self._open else None
            if first is not None and first.trained and frozenset(first.trained) != first.recorded:
                self._record(first)

    def position(self) -> dict[str, Any] | None:
        """The first step not fully trained and its trained rows (saved with each TRL checkpoint)."""
        with self._lock:
            if self._first is None:
                return None
            if not self._open:
                return self._next_position().to_json(self.trainer.keys.run)
            first = self._open[min(self._open)]
            return Position(first.batch.step, frozenset(first.trained)).to_json(self.trainer.keys.run)

    # -- the feeding thread -----------------------------------------------------------------------------

    def _begin(self) -> Position:
        """Begin this start's attempt: after the TRL checkpoint's position, else at the run's next step."""
        trainer = self.trainer
        vote = GroupVote(list, 0)  # one rank: its own values are the group's maximum
        recorded = recorded_rows(trainer.client, trainer.keys, 0)
        if self._checkpoint is not None:
            first = self._checkpoint
            trainer.begin(0, 1, vote, first.step - 1)
            if recorded is not None and recorded.step >= first.step:  # trained after the checkpoint: lost with it
                self.retrained_rows += len(recorded.rows - (first.rows if recorded.step == first.step else set()))
        else:
            step = trainer.next_step(0)
            first = Position(step, recorded.rows if recorded is not None and recorded.step == step else frozenset())
            trainer.begin(0, 1, vote, None)
        if first.rows:
            self._record_position(first)  # in this attempt: a later start finds them
        return first

    def _next_position(self) -> Position:
        return Position(self.trainer.next_step(0))

    def _run(self, first: Position) -> None:
        try:
            step = first.step
            while not self._stop.is_set():
                self._drop_taken()
                if self._ended_at is not None and not self._pending:
                    return
                if self._ended_at is not None or len(self._pending) >= self.ahead_steps:
                    self._stop.wait(self.trainer.poll_ms / 1000)  # until TRL takes more
                    self._beat = time.time()
                    continue
                manifest = self.trainer.wait_for_step(step, stop_check=self._interrupted)
                self._beat = time.time()
                if manifest is None:
                    if not self._interrupted():
                        self._ended_at = step  # the run finished: feed nothing more
                    continue
                batch = self.trainer.load(manifest, 0, 1)
                skip = first.rows if step == first.step else frozenset()
                if batch.retrained:
                    self.retrained_rows += batch.rows - len(skip)
                self._push(batch, skip)
                step += 1
        except BaseException as exc:  # surfaced to TRL by check_health, on its own thread
            log.error("streamgrp rollout feed stopped: %s", exc)
            self._error = exc

    def _interrupted(self) -> bool:
        self._beat = time.time()
        return self._stop.is_set() or self._taken_due()

    def _taken_due(self) -> bool:
        with self.rollout_buffer.mutex:
            taken = self.rollout_buffer.taken
        return bool(self._pending) and self._pending[0].end <= taken

    def _drop_taken(self) -> None:
        while self._taken_due():
            self._pending.popleft()

    def _push(self, batch: Batch, trained: frozenset[int]) -> None:
        lengths = batch.attention_mask.sum(dim=1).tolist()
        if self.token_budget and max(lengths, default=0) > self.token_budget:
            raise ConfigError(
                f"step {batch.step} has a row of {max(lengths)} tokens, longer than TRL's token_budget="
                f"{self.token_budget}: TRL would drop it untrained. Raise token_budget to the run's "
                "longest row (prompt and completion)"
            )
        samples = [(row, sample) for row, sample in enumerate(self._samples(batch)) if row not in trained]
        with self._lock:
            self._open[batch.step] = _Open(batch, set(trained), trained)
            for row, sample in samples:
                self._rows[id(sample.metrics)] = (batch.step, row, sample.metrics)
        self._pushed_rows += len(samples)
        self._pending.append(_Pushed(batch.step, self._pushed_rows))
        if not samples:  # every row trained in an earlier start, only the commit was missing
            self.optimizer_step(0)
        for _, sample in samples:
            sample.enqueued_at = time.time()
            self.rollout_buffer.put(sample)
        try:
            self.metrics_queue.put_nowait(step_logs(batch))
        except queue.Full:
            pass  # TRL stopped logging; never block the feed for a metric

    def _record(self, step: _Open) -> None:
        rows = frozenset(step.trained)
        self._record_position(Position(step.batch.step, rows), step.batch.rows)
        step.recorded = rows

    def _record_position(self, position: Position, total: int | None = None) -> None:
        attempt = self.trainer.begun_attempt().number
        if total is None:
            manifest = self.trainer.manifest(position.step)
            total = self.trainer.load(manifest, 0, 1).rows if manifest is not None else max(position.rows) + 1
        record_rows(
            self.trainer.client,
            self.trainer.keys,
            StepRowsTrained(
                step=position.step,
                rank=0,
                attempt=attempt,
                rows=tuple(sorted(position.rows)),
                total=total,
                producer=self.trainer.name,
            ),
        )

    def _samples(self, batch: Batch) -> Iterator[Any]:
        """One TRL ``RolloutSample`` per row, unpadded, in group order (`streamgrp.train.trl_samples`)."""
        return rollout_samples(
            batch,
            self._sample_type,
            spec=self.spec,
            group_stride=self._group_stride,
            buffer=self.rollout_buffer,
            decode=self.decode,
        )
