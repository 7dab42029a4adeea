"""What a TRL run has trained, in streamgrp's terms: the partly trained step on the server, and the position
a TRL checkpoint holds.

Owns two records, both written only once the rows they name were in a completed optimizer step:

- `StepRowsTrained` in the commits stream (through ``trainer_rows.lua``, which checks the attempt and that
  the step is the rank's next one before it writes): which rows of the next uncommitted step are trained.
  `recorded_rows` reads it back on the next start, unless a trainer group resumed from a checkpoint since
  (those weights lost the rows).
- `StreamgrpProgress`, the TrainerCallback that drives `StreamgrpRollouts` from TRL's training loop and,
  as a transformers ``ExportableState``, writes the position (first step not fully trained, its trained
  rows) into every TRL checkpoint's ``trainer_state.json``; ``train(resume_from_checkpoint=...)`` brings
  it back, and the feed resumes exactly there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

try:  # the callback needs transformers (TRL's extra); the records do not
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError:  # pragma: no cover - StreamgrpRollouts.callback says how to install TRL first
    TrainerCallback = ExportableState = object  # type: ignore[misc,assignment]

from streamgrp.core import codec
from streamgrp.core.events import StepRowsTrained, TrainingResumed
from streamgrp.errors import TrainerGroupError
from streamgrp.store import scripts
from streamgrp.store.keys import RunKeys

if TYPE_CHECKING:
    from streamgrp.train.trl_async import StreamgrpRollouts

__all__ = ["Position", "StreamgrpProgress", "record_rows", "recorded_rows"]


@dataclass(frozen=True)
class Position:
    """Where training stands: every step before ``step`` is trained (and committed), and ``rows`` of ``step``."""

    step: int
    rows: frozenset[int] = frozenset()

    def to_json(self, run: str) -> dict[str, Any]:
        return {"run": run, "step": self.step, "rows": sorted(self.rows)}


def record_rows(client: redis.Redis, keys: RunKeys, event: StepRowsTrained) -> None:
    """Record which rows of ``event.step`` are trained; `TrainerGroupError` when another attempt replaced this one."""
    try:
        scripts.register(client, "trainer_rows.lua")(
            keys=[keys.committed, keys.commits, keys.attempt],
            args=[event.rank, event.step, event.attempt, codec.encode(event)[codec.HEADER]],
        )
    except redis.ResponseError as exc:
        if scripts.error_code(exc) == "STALE_ATTEMPT":
            raise TrainerGroupError(str(exc).split(None, 1)[1]) from None
        raise


def recorded_rows(client: redis.Redis, keys: RunKeys, rank: int) -> Position | None:
    """The rank's newest record of a partly trained step, if it still holds: no trainer group resumed from a
    checkpoint after it (those weights lost the rows; a plain restart keeps it, its weights taken to hold them)."""
    entry = client.hget(keys.attempt, f"rows:{rank}")
    if entry is None:
        return None
    found = client.xrange(keys.commits, entry, "+", count=1000)
    if not found or found[0][0] != entry:
        return None  # trimmed away: nothing to skip, the rows are trained again
    record = codec.decode(found[0][1])
    if not isinstance(record, StepRowsTrained):
        return None
    for _, fields in found[1:]:
        later = codec.decode(fields)
        if isinstance(later, TrainingResumed) and later.reason == "checkpoint" and later.step <= record.step:
            return None
    return Position(record.step, frozenset(record.rows))


class StreamgrpProgress(TrainerCallback, ExportableState):
    """TRL's side of `StreamgrpRollouts` (pass ``callbacks=[rollouts.callback]``): which micro-batches went
    through an optimizer step, and the streamgrp position saved with each TRL checkpoint."""

    def __init__(self, feed: StreamgrpRollouts | None = None) -> None:
        self.feed = feed
        self._substeps = 0  # micro-batches trained since the last optimizer step

    def state(self) -> dict[str, Any]:
        position = self.feed.position() if self.feed is not None else None
        return {"args": {}, "attributes": {"position": position}}

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        if self.feed is None:
            return
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        saved = saved[0] if isinstance(saved, list) and saved else saved
        position = (saved or {}).get("attributes", {}).get("position") if isinstance(saved, dict) else None
        self.feed.train_begins(
            train_dataloader,
            token_budget=getattr(args, "token_budget", 0) or 0,
            checkpoint=position if state.global_step > 0 else None,
        )

    def on_substep_end(self, args, state, control, **kwargs):
        self._substeps += 1

    def on_step_end(self, args, state, control, **kwargs):
        # Runs before TRL's own on_step_end callbacks (a user's callbacks come first), so the weight sync
        # that follows publishes under the version this commit advanced to.
        trained, self._substeps = self._substeps + 1, 0
        if self.feed is not None:
            self.feed.optimizer_step(trained)
