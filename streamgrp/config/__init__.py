"""Settings for every role: one pydantic model per concern, filled from a TOML file, `STREAMGRP_`
environment variables and command-line flags (later sources win).

The TOML file has one table per model (``[connection]``, ``[run]``, ``[worker]``, ``[assembler]``);
a field ``name`` of any model is the flag ``--name`` (dashes for underscores) and the environment
variable ``STREAMGRP_NAME``. A field name means the same thing in every model it appears in
(``burst``: exit when idle), so one flat namespace of flags and variables serves every command. Settings objects are
passed explicitly; there is no global.

`RunConfig` is the part recorded as the run's first event; a process whose group policy differs
from the recorded one refuses to start (`streamgrp.store.runs`).
"""

from __future__ import annotations

# The settings live in one module per concern; every name is importable from here, as before the split.
from streamgrp.config.base import CONFIG_ENV, ENV_PREFIX, TlsFiles, is_loopback, read_secret
from streamgrp.config.commands import (
    DEMO_RUN_DEFAULTS,
    MODEL_RUN_DEFAULTS,
    DeleteConfig,
    DemoConfig,
    ExportConfig,
    RunsConfig,
)
from streamgrp.config.connection import ConnectionConfig
from streamgrp.config.loading import (
    SECTIONS,
    env_name,
    flag_name,
    load,
    load_callable,
    load_object,
    parse_env_value,
    parse_norm,
    read_toml,
)
from streamgrp.config.roles import (
    ArchiverConfig,
    AssemblerConfig,
    BatcherConfig,
    FollowConfig,
    RewarderConfig,
    TrainerConfig,
    WeightSyncConfig,
    WorkerConfig,
)
from streamgrp.config.run import RunConfig
from streamgrp.config.sessions import AgentConfig, GatewayConfig, InferenceConfig

__all__ = [
    "CONFIG_ENV",
    "DEMO_RUN_DEFAULTS",
    "ENV_PREFIX",
    "MODEL_RUN_DEFAULTS",
    "SECTIONS",
    "AgentConfig",
    "ArchiverConfig",
    "AssemblerConfig",
    "BatcherConfig",
    "ConnectionConfig",
    "DeleteConfig",
    "DemoConfig",
    "ExportConfig",
    "FollowConfig",
    "GatewayConfig",
    "InferenceConfig",
    "RewarderConfig",
    "RunConfig",
    "RunsConfig",
    "TlsFiles",
    "TrainerConfig",
    "WeightSyncConfig",
    "WorkerConfig",
    "env_name",
    "flag_name",
    "is_loopback",
    "load",
    "load_callable",
    "load_object",
    "parse_env_value",
    "parse_norm",
    "read_secret",
    "read_toml",
]
