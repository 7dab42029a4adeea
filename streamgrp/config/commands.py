"""The settings of one-shot commands: the demo (and the run settings it defaults to), runs, delete, export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from streamgrp.config.base import _Settings
from streamgrp.core.policy import NormSpec


class DemoConfig(_Settings):
    """`streamgrp demo`: a whole asynchronous RL run on the embedded server."""

    steps: int = Field(60, ge=1, description="optimizer steps to train")
    workers: int = Field(3, ge=1, description="rollout worker processes")
    ranks: int = Field(2, ge=1, description="trainer ranks (DP size)")
    reject_rate: float = Field(0.2, ge=0, le=1, description="fraction of slots the toy reward function rejects")
    fail_rate: float = Field(0.1, ge=0, le=1, description="fraction of slots whose rollout raises")
    as_json: bool = Field(
        False, description="print the summary as one JSON object on the last line", json_schema_extra={"flag": "json"}
    )
    timeout_s: float = Field(600.0, gt=0, description="stop everything if the run takes longer")
    trainer_fail_at_step: int | None = Field(
        None, ge=0, description="inject a trainer fault at this step (replay demo)"
    )
    prometheus: bool = Field(
        False,
        description="serve every process's metrics and scrape them with a local "
        "Prometheus (the prometheus binary on PATH); prints its URL",
    )
    model: Path | None = Field(
        None,
        description="run on a real language model instead of the toy task: this GGUF "
        "file served by llama-server, trained by streamgrp.consumers.lm_trainer (needs the llm extra)",
    )
    llama_server: str = Field(
        "llama-server", description="with --model: the llama-server binary (ops/llama-server.sh builds one)"
    )
    lm_lr: float = Field(
        0.0,
        ge=0,
        description="lm trainer: learning rate; 0 only recomputes the log-probabilities "
        "and reports the mismatch with the server's per step",
    )


#: The demo's run settings where the user sets none (flag, environment or TOML): GRPO-style group
#: normalization, groups of 6, a short deadline and stall bound for a run of about a minute.
DEMO_RUN_DEFAULTS: dict[str, Any] = {
    "n_samples": 6,
    "batch_size": 8,
    "max_staleness": 1,
    "group_timeout_s": 30.0,
    "reward_norm": NormSpec("group", "group"),
    "stall_timeout_s": 120.0,
}


#: ``demo --model``'s: groups of 4, one rank, a deadline that fits CPU generation; the default staleness
#: bound, since llama-server serves each version the trainer writes (weight-sync hands it over).
MODEL_RUN_DEFAULTS: dict[str, Any] = {
    "n_samples": 4,
    "batch_size": 4,
    "dp_size": 1,
    "group_timeout_s": 600.0,
    "reward_norm": NormSpec("group", "group"),
    "stall_timeout_s": 600.0,
}


class RunsConfig(_Settings):
    """`streamgrp runs`: what to show of each run."""

    sizes: bool = Field(
        False,
        description="also show each run's keys, their memory on the server (MEMORY USAGE), "
        "entries per stream, and its archive's size on disk",
    )


class DeleteConfig(_Settings):
    """`streamgrp delete RUN` (`streamgrp.store.run_admin`): when a run may be deleted, and what goes with it."""

    force: bool = Field(
        False,
        description="delete even a live run (a process holds its lease, an archiver writes "
        "its archive, or it has not ended and was active within --idle-s)",
    )
    delete_archive: bool = Field(
        False,
        description="also remove the run's archive directory (kept by default: "
        "after retention it holds the only copy of the run)",
    )
    idle_s: float = Field(
        60.0,
        ge=0,
        description="a run that has not ended counts as live while an entry was "
        "appended or a consumer read within this many seconds",
    )
    yes: bool = Field(
        False,
        description="delete without asking (asked on a terminal; without a terminal, "
        "delete refuses unless this is given)",
    )


class ExportConfig(_Settings):
    """`streamgrp export` (`streamgrp.replay.export`): where the Parquet files go."""

    out: Path | None = Field(None, description="directory for the Parquet files and run.json (default export-RUN)")
    follow: bool = Field(
        False,
        description="follow the run: append a Parquet file of its new decisions every "
        "--flush-s, resuming where the follower --follow-name stopped (see docs/guides/follow.md)",
    )
    follow_name: str = Field("export", description="the follower name --follow records its position under")
    flush_s: float = Field(5.0, gt=0, description="with --follow: seconds between files")
