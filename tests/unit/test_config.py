from pathlib import Path

import pytest

from streamgrp.config import (
    SECTIONS,
    BatcherConfig,
    ConnectionConfig,
    RunConfig,
    WorkerConfig,
    load,
    parse_norm,
    read_toml,
)
from streamgrp.core.policy import NormSpec
from streamgrp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_sources_layer_defaults_then_toml_then_environment_then_flags(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("[run]\nn_samples = 6\nbatch_size = 16\n[worker]\nconcurrency = 3\n")
    toml = read_toml(path)
    env = {"STREAMGRP_BATCH_SIZE": "32", "STREAMGRP_CONCURRENCY": "5"}
    run = load(RunConfig, toml=toml, env=env, overrides={"n_samples": 8})
    assert (run.n_samples, run.batch_size, run.max_staleness) == (8, 32, 1)
    assert load(WorkerConfig, toml=toml, env=env).concurrency == 5
    assert load(WorkerConfig, toml=toml, env={}).concurrency == 3
    assert run.model_fields_set == {"n_samples", "batch_size"}


def test_the_shipped_role_configuration_loads_for_every_role():
    toml = read_toml(ROOT / "ops" / "streamgrp.toml")
    for model in SECTIONS.values():
        load(model, toml=toml, env={})
    assert load(RunConfig, toml=toml, env={}).reward_norm == NormSpec("group", "group")
    assert load(BatcherConfig, toml=toml, env={}).dataset == "ops/prompts.jsonl"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("group,group", NormSpec("group", "group")),
        ("batch, none", NormSpec("batch", None)),
        ('{"mean_level": "group", "std_level": null, "leave_one_out": true}', NormSpec("group", None, True)),
        ("none", None),
    ],
)
def test_normalization_shorthands(text, expected):
    assert parse_norm(text) == expected


def test_errors_name_what_to_change(tmp_path):
    with pytest.raises(ConfigError, match="MEAN,STD"):
        parse_norm("group")
    with pytest.raises(ConfigError, match="each level must be group, batch or none"):
        parse_norm("token,group")
    with pytest.raises(ConfigError, match="expected true or false"):
        load(ConnectionConfig, env={}, overrides={}) and load(WorkerConfig, env={"STREAMGRP_BURST": "maybe"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[runner]\nx = 1\n")
    with pytest.raises(ConfigError, match="unknown tables"):
        read_toml(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        read_toml(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="batch_size .* is smaller than dp_size"):
        load(RunConfig, env={}, overrides={"dp_size": 4, "batch_size": 2})
    with pytest.raises(ConfigError, match=r"\[worker\].*concurrency"):
        load(WorkerConfig, env={"STREAMGRP_CONCURRENCY": "0"})
