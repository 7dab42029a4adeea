"""The settings of each long-running role: worker, rewarder, follower, weight-sync, batcher, trainer,
assembler and archiver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from streamgrp.config.base import _RoleSettings, _Settings
from streamgrp.errors import ConfigError


class WorkerConfig(_RoleSettings):
    """A rollout worker process."""

    rollout: str = Field(
        "streamgrp.services.synthetic:synthetic_rollout", description="module:function called per slot"
    )
    concurrency: int = Field(4, ge=1, description="slots run at once (async functions) or threads (sync ones)")
    claim_idle_s: float = Field(
        30.0,
        gt=0,
        description="reclaim a stopped worker's task after it sat this long unacknowledged "
        "(a worker claims the tasks it runs again every third of this)",
    )
    max_tasks: int | None = Field(None, ge=1, description="exit after this many tasks (default: run until stopped)")
    max_entry_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="a sample larger than this once encoded is "
        "published as a failed slot saying so (the assembler would dead-letter it)",
    )
    burst: bool = Field(False, description="exit when no task is waiting instead of blocking")
    take_partitions: str | None = Field(
        None,
        description="comma-separated run partitions to take tasks from (default "
        "all); results always go to their task's partition",
    )

    def partition_numbers(self) -> tuple[int, ...] | None:
        """``take_partitions`` as numbers (None: all), or `ConfigError` naming the setting."""
        if self.take_partitions is None or not self.take_partitions.strip():
            return None
        try:
            return tuple(int(part) for part in self.take_partitions.split(","))
        except ValueError:
            raise ConfigError(
                f"take_partitions={self.take_partitions!r}: give partition numbers separated by commas, like 0,2"
            ) from None


class RewarderConfig(_RoleSettings):
    """A reward stage process (`streamgrp rewarder`): scores results published with their reward pending."""

    reward: str | None = Field(
        None,
        description="module:function called per result with a ScoreRequest; returns a "
        "number, one number per row, or None (rejected); sync or async (required)",
    )
    concurrency: int = Field(16, ge=1, description="results scored at once")
    reward_timeout_s: float = Field(60.0, gt=0, description="one scoring's deadline; a timeout is retried")
    retries: int = Field(
        2,
        ge=0,
        description="retries of a scoring that timed out or lost its connection (any "
        "other exception fails the slot at once)",
    )
    claim_idle_s: float = Field(
        30.0, gt=0, description="take over a stopped rewarder's results after they sat this long unscored"
    )
    burst: bool = Field(False, description="exit once nothing has waited for a reward for 2 seconds")


class FollowConfig(_RoleSettings):
    """A follower (`streamgrp follow NAME`, `streamgrp.store.follower`): a named consumer of one run's stream."""

    follow_stream: Literal["decisions", "slots", "steps"] = Field("decisions", description="the stream to follow")
    follow_start: Literal["first", "now"] = Field(
        "first",
        description="where a new follower begins: the first entry "
        "the server holds, or what is written from now on (a known one "
        "resumes where it stopped)",
    )
    follow_handler: str | None = Field(
        None,
        description="module:function called with each Followed or Skipped item (default: print each as a JSON line)",
    )
    until_finished: bool = Field(False, description="exit once the run has ended and nothing new came for 2 seconds")
    forget: bool = Field(False, description="remove the follower's position (retention stops keeping for it) and exit")
    list_followers: bool = Field(False, description="print every follower of the run (position, lag, skips) and exit")


class WeightSyncConfig(_RoleSettings):
    """`streamgrp weight-sync`: after each committed step, tell every inference server to load the new weights."""

    dialect: Literal["vllm", "sglang", "llamacpp"] = Field("sglang", description="the servers' kind")
    weights_dir: Path = Field(
        Path("weights"), description="where the trainer writes one directory per version (vNNNNNN/, safetensors)"
    )
    poll_s: float = Field(0.5, gt=0, description="how often the run's version is checked")
    load_timeout_s: float = Field(600.0, gt=0, description="how long one server may take to load a version")
    llama_server_cmd: str | None = Field(
        None,
        description="llamacpp only: command line that starts llama-server "
        "on --server-url's port (--reuse-port, model and alias are appended); "
        "weight-sync then owns the server and hands over to a new one on each "
        "version's model.gguf",
    )
    llama_server_log: Path | None = Field(
        None,
        description="llamacpp only: append llama-server's output here "
        "(unset: a temporary file; its tail is shown when it fails to start)",
    )
    burst: bool = Field(False, description="serve until the run ends (finished or failed), then stop and exit")


class BatcherConfig(_RoleSettings):
    """The batcher process, which also feeds tasks within the staleness window."""

    round_s: float = Field(1.0, gt=0, description="length of one collection round")
    lease_ttl_s: float = Field(5.0, gt=0, description="a standby takes over this long after the active one died")
    dataset: str | None = Field(
        None, description="prompts to issue: a JSONL file or module:iterable (unset: no feeding)"
    )
    group_filter: str | None = Field(
        None, description="module:function predicate over a GroupDecided; False drops it as filtered"
    )
    max_steps: int | None = Field(None, ge=1, description="stop after writing this many steps")
    burst: bool = Field(False, description="exit after the first read that brings nothing new")


class TrainerConfig(_RoleSettings):
    """A reference trainer rank (`streamgrp.consumers.grpo_trainer`).

    ``rank``, ``world_size``, ``local_rank`` and ``dist_url`` left unset come from torchrun's variables
    (`streamgrp.train.distributed.resolve`), so ``torchrun --nproc-per-node N`` needs none of them.
    """

    rank: int | None = Field(
        None, ge=0, description="this process's DP rank (unset: $RANK as torchrun sets it, else 0)"
    )
    world_size: int | None = Field(
        None,
        ge=1,
        description="DP ranks in all; must equal the run's dp_size (unset: $WORLD_SIZE as torchrun sets it, else 1)",
    )
    local_rank: int | None = Field(
        None,
        ge=0,
        description="this process's index on its machine, for picking a device "
        "(unset: $LOCAL_RANK as torchrun sets it, else the rank)",
    )
    dist_url: str | None = Field(
        None,
        description="torch.distributed rendezvous (gloo) for world_size > 1 (unset: "
        "env:// when torchrun set MASTER_ADDR and MASTER_PORT, else tcp://127.0.0.1:29511)",
    )
    lr: float = Field(0.05, gt=0, description="Adam learning rate")
    fail_at_step: int | None = Field(None, ge=0, description="inject an exception at this step (replay demos, tests)")
    crash_at: str | None = Field(
        None,
        pattern=r"^(train|checkpoint):\d+$",
        description="tests: SIGKILL this rank at "
        "a point of a step, 'train:S' after training step S and before committing it, "
        "'checkpoint:S' halfway through writing step S's checkpoint; not again when the step is trained again",
    )
    checkpoint_dir: Path | None = Field(
        None,
        description="reference trainers (grpo, lm): write a checkpoint (weights "
        "and optimizer state, safetensors) here every --checkpoint-every steps, and on "
        "start resume from the newest recorded one, training the steps after it again",
    )
    checkpoint_every: int = Field(
        10, ge=1, description="reference trainer: steps between checkpoints (with --checkpoint-dir)"
    )
    keep_checkpoints: int = Field(
        2,
        ge=1,
        description="reference trainer: checkpoints kept on disk (with "
        "--checkpoint-dir); older ones are removed once a newer one is recorded",
    )
    peer_wait_s: float = Field(
        300.0,
        gt=0,
        description="how long a rank waits for the other ranks of its "
        "group to join (and in any one collective) before it fails naming them",
    )
    train_fn: str = Field(
        "streamgrp.consumers.grpo_trainer:train",
        description="module:function(client, run, config, metrics=) "
        "the trainer process runs (streamgrp.consumers.lm_trainer:train: a real language model)",
    )
    model_gguf: Path | None = Field(
        None,
        description="lm trainer: the GGUF file of the policy the inference servers "
        "serve, loaded in torch (transformers) to recompute log-probabilities",
    )
    lm_lr: float = Field(
        0.0,
        ge=0,
        description="lm trainer: learning rate; 0 only recomputes the log-probabilities "
        "and reports the mismatch with the server's per step",
    )
    weights_dir: Path | None = Field(
        None,
        description="write each version's weights here for `streamgrp "
        "weight-sync` (vNNNNNN/: model.safetensors; the lm trainer: model.gguf)",
    )
    gguf_outtype: Literal["f16", "f32"] = Field(
        "f16",
        description="lm trainer: the float type of the GGUF it "
        "writes per version (f16: half the file, llama-server generates "
        "about twice as fast on a CPU; f32: what it trained, exactly)",
    )


class AssemblerConfig(_RoleSettings):
    """The group assembler process."""

    tick_interval_s: float = Field(0.25, gt=0, description="how often deadlines are checked")
    read_count: int = Field(512, ge=1, description="entries read and committed per round")
    lease_ttl_s: float = Field(5.0, gt=0, description="a standby takes over this long after the active assembler died")
    max_entry_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="larger slot entries are dead-lettered (as a stub: sizes and a digest, not the payload)",
    )
    read_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="about how many bytes one read round may bring in (fewer entries per read once entries are large)",
    )
    max_open_groups: int = Field(
        100_000,
        ge=1,
        description="refuse (dead-letter) a task issued while this many "
        "groups are open: a flood of fake tasks cannot exhaust memory",
    )
    burst: bool = Field(False, description="exit after the first read that brings nothing new")
    partition: int = Field(
        0,
        ge=0,
        description="the run partition this assembler folds: a partitioned run has one "
        "assembler per partition (0 to partitions - 1)",
    )


class ArchiverConfig(_Settings):
    """The archiver process (`streamgrp.services.archiver`), and retention (`streamgrp.services.retention`)."""

    archive_dir: Path | None = Field(None, description="where the run's archive goes (default DATA_DIR/archive/RUN)")
    segment_bytes: int = Field(64 * 1024 * 1024, ge=4096, description="start a new segment file past this size")
    archive_read_count: int = Field(1000, ge=1, description="entries read per stream per pass")
    poll_s: float = Field(0.5, gt=0, description="pause between passes once caught up")
    snapshot_interval_s: float = Field(5.0, ge=0, description="snapshot the run's hashes at most this often")
    retention: bool = Field(
        False,
        description="trim the run's streams behind the archive and every reader "
        "(off by default: the archive then holds the only copy of old entries)",
    )
    retention_interval_s: float = Field(10.0, ge=0, description="seconds between retention passes")
    max_follow_lag_s: float = Field(
        0.0,
        ge=0,
        description="trim past a follower (streamgrp follow) whose oldest "
        "unread entry is older than this, recording the skip it then sees (0: never)",
    )
    burst: bool = Field(False, description="archive what is there, snapshot, trim (with --retention) and exit")
