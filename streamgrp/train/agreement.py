"""The ranks of a trainer group agree, once per step, on what they train: one small collective.

Owns the vote a `streamgrp.train.batch_stream.BatchStream` casts before each step: one element-wise MAX
all-reduce of seven int64 ``[leaving, attempt, -attempt, step, -step, digest, -digest]``. The maximum of
``x`` and of ``-x`` over the ranks are equal exactly when every rank holds the same ``x``, so one
reduction both tells every rank whether any is leaving and proves that all train the same step of the
same attempt from the same manifest. Every rank sees the same reduced values, so all continue together
or all raise the same `TrainerGroupError`. Before the first step one more vote (``plan``) agrees on the
group's token (the maximum of each rank's random number) and its first step.

Deliberately ignores the transport: ``reduce_max`` is any element-wise maximum over the group's ranks
(`streamgrp.train.distributed.Collectives.max_over_ranks`, or a test's threads).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from streamgrp.core.events import StepManifest
from streamgrp.errors import TrainerGroupError

log = logging.getLogger(__name__)

ReduceMax = Callable[[Sequence[int]], Sequence[int]]

#: The manifest digest rides the vote in 48 bits, so ``-digest`` fits an int64 with room to spare.
DIGEST_BITS = 48


def manifest_digest(manifest: StepManifest | None) -> int:
    """A 48-bit digest of the step's manifest (0 without one): its step, version and each shard's rank,
    tokens and digest, which hashes the bytes of every member the shard trains. Cheap (no re-encoding)."""
    if manifest is None:
        return 0
    text = ";".join(
        [
            str(manifest.step),
            str(manifest.version),
            *(f"{shard.rank}:{shard.tokens}:{shard.digest}" for shard in manifest.shards),
        ]
    )
    raw = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "big") >> (64 - DIGEST_BITS)


def resolve_reduce(agree: Any, world_size: int) -> ReduceMax | None:
    """The element-wise maximum the group votes with: from ``agree`` (a `Collectives`, its ``any_rank``,
    or a callable taking and returning a list of ints), else from an initialised ``torch.distributed``
    of ``world_size`` ranks, else the identity for one rank; None when more than one rank cannot vote."""
    from streamgrp.train.distributed import Collectives

    if agree is not None:
        owner = getattr(agree, "__self__", None)
        if isinstance(owner, Collectives):
            return owner.max_over_ranks
        if isinstance(agree, Collectives):
            return agree.max_over_ranks
        return agree
    if world_size == 1:
        return lambda values: list(values)
    collectives = Collectives.from_default_group(world_size)
    return collectives.max_over_ranks if collectives is not None else None


class GroupVote:
    """One rank's votes in its trainer group."""

    def __init__(self, reduce_max: ReduceMax, rank: int) -> None:
        self.reduce_max = reduce_max
        self.rank = rank
        #: Whether the last `step` vote had a rank that cannot train the step.
        self.peer_failed = False

    def plan(self, *, token: int, first: int, explicit: bool) -> tuple[int, int]:
        """The group's token and first step. Ranks given their first step (``explicit``: ``resume_after``)
        must all give the same one; otherwise the lowest of theirs is taken (each read the server)."""
        reduced = self._reduce([token, first, -first, int(explicit)])
        group_token, highest, lowest = reduced[0], reduced[1], -reduced[2]
        if reduced[3] and highest != lowest:
            raise TrainerGroupError(
                f"the ranks of the trainer group resume at different steps ({lowest} to {highest}): "
                "give every rank the same resume_after (the step its weights hold)"
            )
        return group_token, lowest

    def step(self, *, leaving: bool, attempt: int, step: int, digest: int, failed: bool = False) -> bool:
        """Whether any rank is leaving at ``step``; raises `TrainerGroupError` on every rank when they
        differ in attempt, step or (when none is leaving) manifest. ``failed``: this rank leaves because it
        cannot train the step (its shard cannot be loaded); `peer_failed` then tells every rank."""
        reduced = self._reduce([2 if failed else int(leaving), attempt, -attempt, step, -step, digest, -digest])
        any_leaving = bool(reduced[0])
        self.peer_failed = reduced[0] >= 2
        differs = []
        if reduced[1] != -reduced[2]:
            differs.append(f"attempts {-reduced[2]} to {reduced[1]}")
        if reduced[3] != -reduced[4]:
            differs.append(f"steps {-reduced[4]} to {reduced[3]}")
        if not differs and not any_leaving and reduced[5] != -reduced[6]:
            differs.append(f"the manifest of step {step} (digests differ)")
        if differs:
            raise TrainerGroupError(
                f"the ranks of the trainer group are not training together: {', '.join(differs)}; no rank trains "
                "this step. Restart every rank of the group together (torchrun does), so all begin one attempt"
            )
        return any_leaving

    def _reduce(self, values: list[int]) -> list[int]:
        try:
            reduced = [int(v) for v in self.reduce_max(values)]
        except TrainerGroupError:
            raise
        except RuntimeError as exc:  # gloo/NCCL: a peer's process died or left the group
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TrainerGroupError(
                f"rank {self.rank} lost its trainer group in the per-step vote ({first_line}): a "
                "peer died or left; restart every rank of the group together"
            ) from exc
        if len(reduced) != len(values):
            raise TrainerGroupError(
                f"agree returned {len(reduced)} values for {len(values)}: it must be an "
                "element-wise maximum over the ranks, such as Collectives.max_over_ranks"
            )
        return reduced
