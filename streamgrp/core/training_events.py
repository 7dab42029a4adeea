"""Events of training progress: trainer ranks' commits, failures and partial rows, the versions they publish,
trainer groups' attempts and checkpoints, the run's end, and the weights inference servers were told to
serve. Re-exported by `streamgrp.core.events`, which registers them; msgspec Structs (`streamgrp.core.wire`);
pure, no I/O.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from streamgrp.core import wire
from streamgrp.core.wire import WireEvent, as_tuples


class StepCommitted(WireEvent, frozen=True, kw_only=True):
    """A trainer rank finished a step, in ``attempt`` of its trainer group (0: written before attempts)."""

    kind: Literal["step_committed"] = "step_committed"

    step: wire.Int
    rank: wire.Int
    world_size: wire.Int
    attempt: wire.NonNegInt = 0


class StepFailed(WireEvent, frozen=True, kw_only=True):
    """A trainer rank's step raised; ``error`` is the exception text."""

    kind: Literal["step_failed"] = "step_failed"

    step: wire.Int
    rank: wire.Int
    error: str


class StepRowsTrained(WireEvent, frozen=True, kw_only=True):
    """Part of a rank's next step is trained: ``rows`` (indices into its shard of ``step``) were in a completed
    optimizer step of ``attempt``, the rest not yet. Written by trainers whose optimizer steps do not line up
    with streamgrp's steps (`streamgrp.train.trl_async`), which commit a step only once all of its rows were
    trained; a restart hands the other rows. Each record lists every trained row of the step so far."""

    kind: Literal["step_rows_trained"] = "step_rows_trained"

    step: wire.NonNegInt
    rank: wire.NonNegInt
    attempt: wire.NonNegInt
    rows: tuple[wire.NonNegInt, ...]
    #: The rows of the rank's shard of the step.
    total: wire.NonNegInt

    def __post_init__(self) -> None:
        as_tuples(self, "rows")
        if list(self.rows) != sorted(set(self.rows)) or (self.rows and self.rows[-1] >= self.total):
            raise ValueError(f"rows must be distinct, ascending and below total={self.total}")


class VersionAdvanced(WireEvent, frozen=True, kw_only=True):
    """Every rank committed ``step``: the policy is now at ``version``. Versions only grow: ``step + 1``
    until a trainer group rolls back, and after that beyond every version the lost weights may have used."""

    kind: Literal["version"] = "version"

    version: wire.Int
    step: wire.Int


class TrainingResumed(WireEvent, frozen=True, kw_only=True):
    """A trainer group started attempt ``attempt`` at ``step``, every rank's position set to ``step - 1``.

    ``reason`` says where ``step`` came from: ``checkpoint`` (the weights hold every step before it, a
    ``CheckpointSaved`` or the trainer's own ``resume_after``), ``lowest_rank`` (the lowest rank's next
    step, without a checkpoint) or ``start`` (nothing committed yet). Steps ``step..retrain_through``
    had been committed by some rank before and are trained again (the restarted weights lost them).
    The steps of this attempt publish versions from ``base_version + 1`` on, above any version a lost
    attempt may have handed out."""

    kind: Literal["training_resumed"] = "training_resumed"

    attempt: wire.NonNegInt
    step: wire.NonNegInt
    world_size: wire.Int
    base_version: wire.NonNegInt
    reason: Literal["checkpoint", "lowest_rank", "start"]
    retrain_through: wire.Int = -1
    #: The rank whose start created the attempt.
    rank: wire.NonNegInt = 0


class CheckpointSaved(WireEvent, frozen=True, kw_only=True):
    """A trainer group's checkpoint of the weights after ``step`` (and the optimizer's state) is durable
    at ``path``: written by ``ranks`` (each rank that wrote a part), recorded only once every part is
    on disk, so a checkpoint killed mid-write is never recorded. ``version`` is the policy version
    those weights were published as; ``files`` maps each file (relative to ``path``) to its size in
    bytes, checked before loading."""

    kind: Literal["checkpoint_saved"] = "checkpoint_saved"

    step: wire.NonNegInt
    version: wire.NonNegInt
    path: str
    ranks: tuple[wire.NonNegInt, ...]
    world_size: wire.Int
    attempt: wire.NonNegInt = 0
    files: dict[str, wire.NonNegInt] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        as_tuples(self, "ranks")


class RunFinished(WireEvent, frozen=True, kw_only=True):
    """The dataset is exhausted and every accepted group was batched: ``steps`` is the last step + 1."""

    kind: Literal["run_finished"] = "run_finished"

    steps: wire.Int


class WeightsServed(WireEvent, frozen=True, kw_only=True):
    """An inference server was told to serve policy ``version`` (written by `streamgrp weight-sync` to the
    control stream): ``ok`` says whether it answered that it does, ``detail`` what it said or why not."""

    kind: Literal["weights_served"] = "weights_served"

    server: str
    version: wire.NonNegInt
    dialect: str
    ok: bool
    detail: str = ""
    seconds: wire.Float = 0.0
    at: wire.Float = 0.0
