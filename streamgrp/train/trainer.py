"""The trainer API: each DP rank iterates its shard of every step, in order, exactly once.

    client = TrainerClient(redis_client, run)
    with client.batches(rank=r, world_size=w) as batches:
        for batch in batches:
            loss = step_fn(batch.token_ids, batch.loss_mask, ...)
            batch.commit()

Owns the rank's position (the next uncommitted step, kept on the server, so a restarted rank
resumes there), loading a shard's slot entries and checking them against the manifest's digests,
turning them into padded torch tensors, committing or failing steps, and raising the run's
terminal error on every rank at the same step. Moving to the next batch without `commit` commits
the previous one (the loop body finished). With the ``with`` form an exception inside the loop
records a `StepFailed` event carrying the exception text before it propagates; a bare ``for``
loop cannot see that exception, so an uncommitted step there is simply left for the next start.

`build_batch` is the one place a shard becomes tensors; it reads slot entries through a fetch
function, so `streamgrp.replay.steps` rebuilds a step from the live log or an archive with the same code.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import redis
import torch

from streamgrp.core import codec
from streamgrp.core.events import (
    RunFinished,
    RunTerminated,
    Sample,
    Shard,
    StepCommitted,
    StepFailed,
    StepManifest,
    VersionAdvanced,
)
from streamgrp.errors import (
    ConfigError,
    DigestMismatch,
    ReadOnlyBatch,
    RunFailed,
)
from streamgrp.store import scripts
from streamgrp.store.connection import MAX_BLOCK_MS, replicate
from streamgrp.store.control import ControlCursor
from streamgrp.store.deadletter import DeadLetters
from streamgrp.store.keys import step_entry_id
from streamgrp.store.runs import Run
from streamgrp.store.streams import producer_name, read_entries
from streamgrp.train import dtypes

log = logging.getLogger(__name__)





#: Reads slot entries by id: the fields of each, in order, None where an entry is gone.
SlotFetch = Callable[[Sequence[str]], Sequence[Mapping[bytes, bytes] | None]]


@dataclass
class Batch:
    """One rank's shard of one step, as padded tensors (rows x longest row), in group order.

    ``group_sizes`` are the actual usable rows per group (use them with `streamgrp.normalize`);
    ``step_loss_tokens`` counts the valid loss tokens of the whole step across all ranks, the
    denominator of the globally token-weighted loss.
    """

    step: int
    rank: int
    world_size: int
    version: int
    task_ids: list[str]
    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    attention_mask: torch.Tensor
    rewards: torch.Tensor
    versions: torch.Tensor
    group_sizes: torch.Tensor
    step_loss_tokens: int
    digest: str
    samples: list[Sample] = field(repr=False, default_factory=list)
    run: str = ""
    _client: TrainerClient | None = field(repr=False, default=None)
    settled: bool = field(default=False, repr=False)

    @property
    def rows(self) -> int:
        return int(self.token_ids.shape[0])

    def commit(self) -> None:
        """Record this rank's step as done (idempotent)."""
        self._check_live("commit")
        if not self.settled:
            self._client._commit(self)
            self.settled = True

    def fail(self, exc: BaseException | str) -> None:
        """Record a failed-step event with the exception text; the step stays uncommitted."""
        self._check_live("fail")
        if not self.settled:
            self._client._fail(self, exc)
            self.settled = True

    def _check_live(self, action: str) -> None:
        if self._client is None:
            raise ReadOnlyBatch(
                f"cannot {action} step {self.step} rank {self.rank}: this batch is a replay (or was loaded from a "
                "file), not a trainer rank's live batch; only batches from TrainerClient.batches() record progress")


def shard_tensors(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """Padded [rows, T] tensors (and per-row rewards and versions) from samples, in order."""
    rows: list[tuple[Sample, int, int, int]] = []
    for sample in samples:
        offset = 0
        for index, length in enumerate(sample.row_lengths):
            rows.append((sample, offset, length, index))
            offset += length
    width = max((row[2] for row in rows), default=0)
    n = len(rows)
    out = {
        "token_ids": torch.zeros((n, width), dtype=torch.int64),
        "loss_mask": torch.zeros((n, width), dtype=torch.bool),
        "logprobs": torch.zeros((n, width), dtype=torch.float32),
        "attention_mask": torch.zeros((n, width), dtype=torch.bool),
    }
    rewards, versions = [], []
    flat: dict[int, dict[str, torch.Tensor]] = {}
    for row, (sample, offset, length, index) in enumerate(rows):
        tensors = flat.get(id(sample))
        if tensors is None:
            tensors = flat[id(sample)] = {name: _tensor(getattr(sample, name))
                                          for name in ("token_ids", "loss_mask", "logprobs")}
        out["token_ids"][row, :length] = tensors["token_ids"][offset:offset + length]
        out["loss_mask"][row, :length] = tensors["loss_mask"][offset:offset + length].bool()
        out["logprobs"][row, :length] = tensors["logprobs"][offset:offset + length].float()
        out["attention_mask"][row, :length] = True
        rewards.append(sample.rewards[index])
        versions.append(sample.version)
    out["rewards"] = torch.tensor(rewards, dtype=torch.float32)
    out["versions"] = torch.tensor(versions, dtype=torch.int64)
    return out


def _tensor(array) -> torch.Tensor:
    if not array.data:
        return torch.zeros(array.shape, dtype=dtypes.TORCH[array.dtype])
    return torch.frombuffer(bytearray(array.data), dtype=dtypes.TORCH[array.dtype]).reshape(array.shape)


class TrainerClient:
    """A trainer process's view of a run: manifests in, commits and failures out."""

    def __init__(self, client: redis.Redis, run: Run, *, poll_s: float = 1.0, name: str | None = None) -> None:
        self.client = client
        self.run_ = run
        self.keys = run.keys
        self.poll_ms = min(MAX_BLOCK_MS, max(1, int(poll_s * 1000)))
        self.name = name or producer_name("trainer")
        self._commit_script = scripts.register(client, "trainer_commit.lua")
        self._seq = 0
        self._dead_letters = DeadLetters(client, self.keys)
        self._control = ControlCursor(self._dead_letters)  # each entry read once, not from the start per step
        self._terminal: RunTerminated | None = None
        self._finished: RunFinished | None = None

    def next_step(self, rank: int) -> int:
        last = self.client.hget(self.keys.committed, str(rank))
        return 0 if last is None else int(last) + 1

    def batches(self, *, rank: int, world_size: int) -> BatchStream:
        dp_size = self.run_.config.dp_size
        if world_size != dp_size:
            raise ConfigError(f"world_size={world_size} but run {self.keys.run!r} batches for dp_size={dp_size}; "
                              "start as many trainer ranks as the run's dp_size")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}")
        return BatchStream(self, rank, world_size)

    # -- reading ------------------------------------------------------------------------------------

    def manifest(self, step: int) -> StepManifest | None:
        entry = step_entry_id(step)
        found = self.client.xrange(self.keys.steps, entry, entry)
        return codec.decode(found[0][1]) if found else None

    def wait_for_step(self, step: int, stop_check=None) -> StepManifest | None:
        """The manifest of ``step``; None when the run finished before it; raises `RunFailed`."""
        while True:
            self._read_control()
            terminal = self._terminal
            if terminal is not None and step >= terminal.step:
                raise RunFailed(f"run {self.keys.run} failed at step {terminal.step} ({terminal.reason}): {terminal.message}")
            manifest = self.manifest(step)
            if manifest is not None:
                return manifest
            if self._finished is not None and step >= self._finished.steps:
                return None
            if stop_check is not None and stop_check():
                return None
            previous = step_entry_id(step - 1) if step > 0 else "0-0"
            self.client.xread({self.keys.steps: previous, self.keys.control: self._control.last}, block=self.poll_ms,
                              count=1)

    def _read_control(self) -> None:
        """Take the terminal and finished events from the control stream past this client's cursor."""
        for event in self._control.read():
            if isinstance(event, RunTerminated) and event.step is not None and self._terminal is None:
                self._terminal = event
            elif isinstance(event, RunFinished):
                self._finished = event

    def load(self, manifest: StepManifest, rank: int, world_size: int) -> Batch:
        return build_batch(manifest, rank, world_size, lambda ids: read_entries(self.client, self.keys.slots, list(ids)),
                           run=self.keys.run, client=self)

    # -- writing ------------------------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _commit(self, batch: Batch) -> None:
        committed = StepCommitted(step=batch.step, rank=batch.rank, world_size=batch.world_size,
                                  producer=self.name, seq=self._next_seq())
        advanced = VersionAdvanced(version=batch.step + 1, step=batch.step, producer=self.name, seq=self._next_seq())
        self._commit_script(keys=[self.keys.committed, self.keys.commits, self.keys.version, self.keys.control],
                            args=[batch.rank, batch.step, batch.world_size, codec.encode(committed)[codec.HEADER],
                                  codec.encode(advanced)[codec.HEADER]])
        replicate(self.client)

    def _fail(self, batch: Batch, exc: BaseException | str) -> None:
        if isinstance(exc, BaseException):
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        else:
            text = str(exc)
        event = StepFailed(step=batch.step, rank=batch.rank, error=text[:8000], producer=self.name, seq=self._next_seq())
        self.client.xadd(self.keys.commits, codec.encode(event))
        log.error("step %d failed on rank %d: %s", batch.step, batch.rank, text)


def build_batch(manifest: StepManifest, rank: int, world_size: int, fetch: SlotFetch, *, run: str = "",
                client: TrainerClient | None = None,
                missing_hint: str = "replay it from the archive") -> Batch:
    """Rank ``rank``'s shard of ``manifest`` as a `Batch`, its slot entries read through ``fetch``.

    Every group's entries must hash to the digest the manifest recorded, else `DigestMismatch`.
    Without ``client`` the batch is read-only: `Batch.commit` and `Batch.fail` raise `ReadOnlyBatch`.
    """
    shard: Shard = manifest.shards[rank]
    entries = [member.entry for group in shard.groups for member in group.members]
    by_entry = {}
    for entry, fields in zip(entries, fetch(entries), strict=True):
        if not fields:
            raise DigestMismatch(f"step {manifest.step} rank {rank}: slot entry {entry} is gone from the slot log "
                                 f"(trimmed?); {missing_hint}")
        by_entry[entry] = fields
    samples, task_ids, sizes = [], [], []
    for group in shard.groups:
        digests = [codec.entry_digest(by_entry[member.entry]) for member in group.members]
        if codec.combine_digests(digests) != group.digest:
            raise DigestMismatch(f"step {manifest.step} rank {rank}: task {group.task_id}'s slot entries do not "
                                 "match the digest the manifest recorded")
        for member in group.members:
            samples.append(codec.decode(by_entry[member.entry]).sample)
        task_ids.append(group.task_id)
        sizes.append(group.rows)
    tensors = shard_tensors(samples)
    return Batch(step=manifest.step, rank=rank, world_size=world_size, version=manifest.version, task_ids=task_ids,
                 group_sizes=torch.tensor(sizes, dtype=torch.int64),
                 step_loss_tokens=sum(s.tokens for s in manifest.shards), digest=shard.digest,
                 samples=samples, run=run, _client=client, **tensors)


class BatchStream:
    """Iterable of a rank's batches; also a context manager that records the loop's exception."""

    def __init__(self, trainer: TrainerClient, rank: int, world_size: int) -> None:
        self.trainer = trainer
        self.rank = rank
        self.world_size = world_size
        self.current: Batch | None = None

    def __iter__(self) -> Iterator[Batch]:
        step = self.trainer.next_step(self.rank)
        while True:
            manifest = self.trainer.wait_for_step(step)
            if manifest is None:
                return
            batch = self.trainer.load(manifest, self.rank, self.world_size)
            self.current = batch
            yield batch
            batch.commit()  # the loop body finished: the step is done
            self.current = None
            step += 1

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and self.current is not None and not self.current.settled \
                and not isinstance(exc, (RunFailed, KeyboardInterrupt)):
            self.current.fail(exc)
