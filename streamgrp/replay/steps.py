"""Replay any retained step: list steps, rebuild what a rank consumed, inspect a task; the replay API.

Owns reading a run's record after the fact (SPEC section 6) and nothing that changes it:

- `list_steps`: every step with each rank's status (committed, failed with the exception text, in
  progress, pending) and its group statistics, from the ``steps`` and ``commits`` streams, the
  ``committed`` hash and the ``decisions`` stream.
- `replay_step`: the exact `Batch` a rank consumed at a step, rebuilt by `streamgrp.train.loader.build_batch`
  (the trainer's own code) from the manifest and the slot entries, digests checked. Entries come from
  an entry source (`streamgrp.store.sources`): the server by default, an archive's source when given. A
  replayed batch is read-only (`ReadOnlyBatch` on commit or fail).
- `inspect_task`: one task's timeline: issue, each slot result, its agent sessions' turns (when the
  gateway served them), the decision, the step and rank it trained in (or why it was discarded); built in
  `streamgrp.replay.task_timeline`, importable from here.

The rest of the replay API (`save_batch` / `load_batch`, batches on disk without pickle, and
`verify`) is offered by `streamgrp.replay`. Importing this module loads no torch: only rebuilding a
batch does (`replay_step`). Where entries come from is the entry source's business
(`streamgrp.store.sources`: the server, an archive, or the server backed by an archive); this module
deliberately ignores retention and archiving.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from streamgrp.core import codec
from streamgrp.core.events import (
    GroupDecided,
    StepCommitted,
    StepFailed,
    StepManifest,
)
from streamgrp.core.manifest import decision_ref
from streamgrp.core.shown import printable
from streamgrp.errors import ConfigError, DigestMismatch
from streamgrp.replay.task_timeline import (  # noqa: F401 - a task's story, importable from here as before
    TimelineEvent,
    format_timeline,
    inspect_task,
    recorded_text,
)
from streamgrp.store.keys import RunKeys, id_key, step_entry_id
from streamgrp.store.sources import (
    EntrySource,
    RedisSource,
    decode_all,
    partition_streams,
    recorded_config,
    server_source,
)
from streamgrp.store.streams import entry_time

if TYPE_CHECKING:
    from streamgrp.train.batch import Batch


# -- listing steps ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankStatus:
    """One rank at one step: ``committed``, ``failed`` (``error`` is the last exception text),
    ``in_progress`` (the rank's next uncommitted step) or ``pending`` (the rank has not reached it)."""

    rank: int
    state: str
    error: str | None = None
    failures: int = 0
    at: float | None = None  # server time of the commit or the last failure
    #: How many times the rank committed the step: more than once when a trainer group rolled back to a
    #: checkpoint before it and trained it again (`TrainingResumed`).
    commits: int = 0


@dataclass(frozen=True)
class StepStatus:
    """One recorded step: its manifest's statistics per shard (rank) and each rank's status."""

    step: int
    version: int
    created_at: float
    groups: tuple[int, ...]  # per shard
    rows: tuple[int, ...]  # per shard
    tokens: tuple[int, ...]  # valid loss tokens per shard
    imbalance: float
    decisions: dict[str, int]  # complete / partial groups, from the decisions stream
    ranks: tuple[RankStatus, ...]

    @property
    def failed(self) -> bool:
        return any(r.state == "failed" for r in self.ranks)

    @property
    def committed(self) -> bool:
        return all(r.state == "committed" for r in self.ranks)

    @property
    def trainings(self) -> int:
        """How many times the step was trained (committed by some rank): 2 and more after rollbacks."""
        return max((r.commits for r in self.ranks), default=0)


def list_steps(client: redis.Redis | None, keys: RunKeys, *, source: RedisSource | None = None) -> list[StepStatus]:
    """Every recorded step, in order, with each rank's status and the step's group statistics."""
    source = source or server_source(client, keys)
    kinds = {
        decision_ref(partition, entry_id): event.decision
        for partition, name in partition_streams(source, "decisions")
        for entry_id, event in decode_all(source, name)
        if isinstance(event, GroupDecided)
    }
    ranks = _rank_events(source)
    last_committed = {int(rank): int(step) for rank, step in source.hash("committed").items()}
    out = []
    for _, manifest in decode_all(source, "steps"):
        if not isinstance(manifest, StepManifest):
            continue
        shards = manifest.shards
        out.append(
            StepStatus(
                step=manifest.step,
                version=manifest.version,
                created_at=manifest.created_at,
                groups=tuple(len(s.groups) for s in shards),
                rows=tuple(sum(g.rows for g in s.groups) for s in shards),
                tokens=tuple(s.tokens for s in shards),
                imbalance=manifest.imbalance,
                decisions=dict(
                    Counter(
                        kinds.get(decision_ref(g.partition, g.decision_entry), "unknown")
                        for s in shards
                        for g in s.groups
                    )
                ),
                ranks=tuple(_rank_status(manifest.step, rank, ranks, last_committed) for rank in range(len(shards))),
            )
        )
    return out


def _rank_events(source: RedisSource) -> dict[tuple[int, int], list[tuple[str, StepCommitted | StepFailed]]]:
    events: dict[tuple[int, int], list[tuple[str, StepCommitted | StepFailed]]] = {}
    for entry_id, event in decode_all(source, "commits"):
        if isinstance(event, (StepCommitted, StepFailed)):
            events.setdefault((event.step, event.rank), []).append((entry_id, event))
    return events


def _rank_status(step: int, rank: int, events, last_committed: dict[int, int]) -> RankStatus:
    mine = events.get((step, rank), [])
    failures = [(entry_id, e) for entry_id, e in mine if isinstance(e, StepFailed)]
    commits = [entry_id for entry_id, e in mine if isinstance(e, StepCommitted)]
    # The committed hash decides: a rollback (`TrainingResumed`) moves it back below steps committed before.
    if last_committed.get(rank, -1) >= step:
        return RankStatus(
            rank,
            "committed",
            failures=len(failures),
            at=entry_time(commits[-1]) if commits else None,
            commits=len(commits),
        )
    if failures and (not commits or id_key(failures[-1][0]) > id_key(commits[-1])):
        entry_id, last = failures[-1]
        return RankStatus(rank, "failed", last.error, len(failures), entry_time(entry_id), commits=len(commits))
    state = "in_progress" if last_committed.get(rank, -1) + 1 == step else "pending"
    return RankStatus(rank, state, commits=len(commits))


# -- replaying a step -------------------------------------------------------------------------------


def read_manifest(source: EntrySource, step: int) -> StepManifest | None:
    (fields,) = source("steps", [step_entry_id(step)])
    return codec.decode(fields) if fields else None


def replay_step(
    client: redis.Redis | None, keys: RunKeys, step: int, rank: int, *, source: EntrySource | None = None
) -> Batch:
    """The `Batch` rank ``rank`` consumed at ``step``, rebuilt bit for bit; raises `DigestMismatch`.

    ``source`` defaults to the server (`RedisSource`); pass an archive's source to replay trimmed steps.
    """
    from streamgrp.train.loader import (
        build_batch,  # torch: only when a batch is rebuilt
    )

    source = source or server_source(client, keys)
    manifest = read_manifest(source, step)
    if manifest is None:
        raise ConfigError(
            f"step {step} is not recorded in run {keys.run!r} (or no longer retained: pass the run's "
            "archive with --archive DIR); list the steps with `streamgrp steps`"
        )
    world = len(manifest.shards)
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside 0..{world - 1}: step {step} of run {keys.run!r} has {world} shards")
    shard = manifest.shards[rank]
    if codec.combine_digests(g.digest for g in shard.groups) != shard.digest:
        raise DigestMismatch(
            f"step {step} rank {rank}: the manifest's group digests do not combine to its shard "
            "digest; the manifest entry was altered"
        )
    # The run's settings say whether its staleness policy masked old tokens: replay masks the same ones.
    config = recorded_config(source) if hasattr(source, "scan") else None  # type: ignore[arg-type]
    return build_batch(
        manifest,
        rank,
        world,
        source,
        run=keys.run,
        check_digests=True,
        missing_hint="replay it from an archive that still holds it",
        run_config=config,
    )


# -- text for the CLI -------------------------------------------------------------------------------


def format_steps(steps: Sequence[StepStatus]) -> str:
    lines = [
        (
            f"{'step':>5} {'version':>7} {'groups':>6} {'complete+partial':>16} {'rows':>6} {'tokens/shard':>14} "
            f"{'imbal':>6}  ranks"
        )
    ]
    for status in steps:
        ranks = " ".join(f"{r.rank}:{r.state}" for r in status.ranks)
        kinds = f"{status.decisions.get('complete', 0)}+{status.decisions.get('partial', 0)}"
        lines.append(
            f"{status.step:>5} {status.version:>7} {sum(status.groups):>6} {kinds:>16} {sum(status.rows):>6} "
            f"{','.join(map(str, status.tokens)):>14} {status.imbalance:>6.3f}  {ranks}"
        )
        if status.trainings > 1:
            lines.append(
                f"      trained {status.trainings} times: a trainer group rolled back to a checkpoint "
                "before it and trained it again with the same data"
            )
        for rank in status.ranks:
            if rank.state == "failed":
                again = f" ({rank.failures} failures)" if rank.failures > 1 else ""
                lines.append(f"      rank {rank.rank} failed{again}: {printable(rank.error)}")
    return "\n".join(lines)


def format_batch(batch: Batch) -> str:
    sums = ", ".join(
        f"{name} {getattr(batch, name).double().sum().item():.6g}"
        for name in ("token_ids", "loss_mask", "logprobs", "rewards")
    )
    return "\n".join(
        [
            (
                f"step {batch.step} rank {batch.rank}/{batch.world_size} of run {batch.run}: "
                f"digest {batch.digest} matches the manifest"
            ),
            (
                f"  {batch.rows} rows x {batch.token_ids.shape[1]} tokens, policy version {batch.version}, "
                f"{len(batch.task_ids)} groups, step loss tokens {batch.step_loss_tokens}"
            ),
            f"  group sizes {batch.group_sizes.tolist()}",
            f"  tasks {', '.join(printable(task) for task in batch.task_ids)}",
            f"  sums  {sums}",
        ]
    )
