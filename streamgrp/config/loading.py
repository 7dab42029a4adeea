"""Building settings: one model from its TOML table, `STREAMGRP_` environment variables and flags (`load`),
the names of flags and variables, and settings that name Python objects ("module:attribute").
"""

from __future__ import annotations

import importlib
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from streamgrp.config.base import CONFIG_ENV, ENV_PREFIX, _Settings
from streamgrp.config.commands import DeleteConfig, DemoConfig, ExportConfig, RunsConfig
from streamgrp.config.connection import ConnectionConfig
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
from streamgrp.core.policy import NormSpec
from streamgrp.errors import ConfigError

T = TypeVar("T", bound=_Settings)


SECTIONS: dict[str, type[_Settings]] = {
    "connection": ConnectionConfig,
    "run": RunConfig,
    "worker": WorkerConfig,
    "rewarder": RewarderConfig,
    "assembler": AssemblerConfig,
    "batcher": BatcherConfig,
    "trainer": TrainerConfig,
    "demo": DemoConfig,
    "archiver": ArchiverConfig,
    "inference": InferenceConfig,
    "weight_sync": WeightSyncConfig,
    "gateway": GatewayConfig,
    "agent": AgentConfig,
    "runs": RunsConfig,
    "delete": DeleteConfig,
    "export": ExportConfig,
    "follow": FollowConfig,
}


def read_toml(path: str | Path | None) -> dict[str, Any]:
    """The TOML file's tables; None reads ``$STREAMGRP_CONFIG`` if set, else nothing."""
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        return {}
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; fix --config / {CONFIG_ENV}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config file {path} has unknown tables {unknown}; known tables are {sorted(SECTIONS)}")
    return data


def load(
    model: type[T],
    *,
    toml: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> T:
    """Build one settings model: the model's defaults < ``defaults`` (a command's own, such as the demo's
    run settings) < TOML table < environment < explicit overrides (flags)."""
    section = _section_name(model)
    values: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k in model.model_fields}
    values.update((toml or {}).get(section, {}))
    env = os.environ if env is None else env
    for name in model.model_fields:
        raw = env.get(env_name(name, model))
        if raw is not None:
            values[name] = parse_env_value(model, name, raw)
    for name, value in (overrides or {}).items():
        if name in model.model_fields and value is not None:
            values[name] = value
    try:
        return model(**values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or section}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid [{section}] settings: {problems}") from None


def env_name(field: str, model: type[BaseModel] | None = None) -> str:
    """``STREAMGRP_`` and the flag's name: ``--json`` (field ``as_json``) is ``STREAMGRP_JSON``; a field
    with no flag (a secret) goes by its own name."""
    extra = model.model_fields[field].json_schema_extra if model is not None else None
    if isinstance(extra, dict) and extra.get("flag", field) is None:
        return ENV_PREFIX + field.upper()
    return ENV_PREFIX + flag_name(field, model)[2:].replace("-", "_").upper()


def flag_name(field: str, model: type[BaseModel] | None = None) -> str:
    """``--field-name``, or the field's own short flag (``as_json`` is ``--json``)."""
    extra = model.model_fields[field].json_schema_extra if model is not None else None
    name = extra.get("flag", field) if isinstance(extra, dict) else field
    return "--" + str(name).replace("_", "-")


def parse_env_value(model: type[_Settings], name: str, raw: str) -> Any:
    """Text from an environment variable or flag, turned into what the field expects."""
    annotation = str(model.model_fields[name].annotation)
    if "SecretStr" in annotation:
        return raw  # a password is taken as it is: "none" or surrounding spaces may be part of it
    text = raw.strip()
    if text.lower() in ("none", "null") and "None" in annotation:
        return None
    if "NormSpec" in annotation:
        return parse_norm(text)
    if "bool" in annotation:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{env_name(name, model)}={raw!r}: expected true or false")
    return text


def parse_norm(text: str) -> NormSpec | None:
    """``group,group`` / ``batch,none`` shorthand, a JSON object, or ``none``."""
    if text.lower() in ("none", "null", ""):
        return None
    if text.startswith("{"):
        try:
            return NormSpec(**orjson.loads(text))
        except (orjson.JSONDecodeError, ValidationError, TypeError) as exc:
            raise ConfigError(f"normalization {text!r} is not a valid NormSpec: {exc}") from None
    parts = [p.strip().lower() for p in text.split(",")]
    if len(parts) != 2:
        raise ConfigError(f"normalization {text!r}: write 'MEAN,STD' with each of group, batch or none")
    levels = [None if p in ("none", "null") else p for p in parts]
    try:
        return NormSpec(levels[0], levels[1])
    except ValidationError:
        raise ConfigError(f"normalization {text!r}: each level must be group, batch or none") from None


def _section_name(model: type[_Settings]) -> str:
    for name, candidate in SECTIONS.items():
        if candidate is model:
            return name
    raise KeyError(model)


def load_object(spec: str) -> Any:
    """Import ``module:attribute`` (attribute paths allowed after the colon)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{spec!r} is not 'module:name'; for example streamgrp.services.synthetic:synthetic_rollout")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name == "consumers":  # the examples' name before they installed inside the package
            raise ConfigError(
                f"cannot import {module_name!r} for {spec!r}: the examples are 'streamgrp.{module_name}' now"
            ) from None
        raise ConfigError(f"cannot import {module_name!r} for {spec!r}: {exc}; is it on PYTHONPATH?") from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"{module_name!r} has no attribute {attr!r} (from {spec!r})") from None
    return target


def load_callable(spec: str) -> Callable[..., Any]:
    """Import ``module:function`` and check it can be called."""
    target = load_object(spec)
    if not callable(target):
        raise ConfigError(f"{spec!r} is not callable")
    return target
