"""The command line as a user meets it: common flags anywhere, suggestions, defaults in --help, one
environment variable per flag, unknown STREAMGRP_ variables reported. No server needed."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from streamgrp.cli.flag_env import unknown_environment
from streamgrp.cli.parser import build_parser
from streamgrp.cli.roles import _ranks_from_dp_size
from streamgrp.config import DEMO_RUN_DEFAULTS, DemoConfig, RunConfig, load
from streamgrp.errors import ConfigError

ROLES = ("worker", "assembler", "batcher", "trainer", "demo", "archiver", "weight-sync")


def _help(parser: argparse.ArgumentParser, command: str) -> str:
    return parser.subcommands[command].format_help()


def _parse(argv: list[str], monkeypatch: pytest.MonkeyPatch | None = None, **environ: str) -> argparse.Namespace:
    if monkeypatch is not None:
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("command", ROLES)
def test_config_and_log_level_work_after_the_subcommand_and_are_in_its_help(command):
    args = build_parser().parse_args([command, "--config", "settings.toml", "--log-level", "debug"])
    assert (args.config, args.log_level) == ("settings.toml", "DEBUG")
    before = build_parser().parse_args(["--config", "settings.toml", command])
    assert before.config == "settings.toml"  # the subcommand's unset flag does not overwrite it
    text = _help(build_parser(), command)
    assert "--config FILE" in text and "--log-level LEVEL" in text and "STREAMGRP_CONFIG" in text


def test_a_misspelled_flag_names_the_subcommand_and_the_closest_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["demo", "--step", "3"])  # no prefix matching: --step is not --steps
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "streamgrp demo: error: unrecognized arguments: --step 3 (did you mean --steps?)" in err
    # two lines, not the command's whole usage block before the one line that helps
    assert err.splitlines() == [
        "streamgrp demo: error: unrecognized arguments: --step 3 (did you mean --steps?)",
        "(see 'streamgrp demo --help' for its flags)",
    ]


def test_a_misspelled_command_names_the_closest_command(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["workr"])
    assert "(did you mean worker?)" in capsys.readouterr().err


def test_demo_help_shows_the_demos_own_run_defaults():
    text = " ".join(_help(build_parser(), "demo").split())
    assert "[env STREAMGRP_N_SAMPLES; default 6]" in text
    assert "[env STREAMGRP_GROUP_TIMEOUT_S; default 30.0]" in text
    assert "[env STREAMGRP_REWARD_NORM; default group,group]" in text
    assert "[env STREAMGRP_STALL_TIMEOUT_S; default 120.0]" in text
    worker = " ".join(_help(build_parser(), "worker").split())
    assert "[env STREAMGRP_N_SAMPLES; default 4]" in worker  # the run's own default elsewhere


def test_help_shows_values_as_typed_never_python_reprs():
    parser = build_parser()
    for command in parser.subcommands:
        text = _help(parser, command)
        assert "PosixPath(" not in text and "[AS_JSON]" not in text and "default None" not in text, command
    assert "default .streamgrp]" in " ".join(_help(parser, "demo").split())
    assert "--json [true|false]" in _help(parser, "demo")


def test_the_demos_defaults_sit_under_the_environment_and_the_toml_file():
    env = {"STREAMGRP_N_SAMPLES": "3"}
    run = load(RunConfig, env=env, defaults=DEMO_RUN_DEFAULTS, toml={"run": {"batch_size": 4}})
    assert (run.n_samples, run.batch_size, run.group_timeout_s) == (3, 4, 30.0)
    assert load(DemoConfig, env={"STREAMGRP_JSON": "true"}).as_json is True  # the flag's name, not the field's


def test_demo_dp_size_sets_the_ranks_or_disagrees_loudly(monkeypatch):
    monkeypatch.delenv("STREAMGRP_RANKS", raising=False)
    monkeypatch.delenv("STREAMGRP_DP_SIZE", raising=False)
    alone = build_parser().parse_args(["demo", "--dp-size", "3"])
    demo = _ranks_from_dp_size(DemoConfig(), load(RunConfig, overrides=vars(alone)), {}, alone)
    assert demo.ranks == 3
    both = build_parser().parse_args(["demo", "--dp-size", "3", "--ranks", "2"])
    with pytest.raises(ConfigError, match="--dp-size 3 and --ranks 2 disagree"):
        _ranks_from_dp_size(DemoConfig(ranks=2), load(RunConfig, overrides=vars(both)), {}, both)
    neither = build_parser().parse_args(["demo"])
    assert _ranks_from_dp_size(DemoConfig(), load(RunConfig, overrides=vars(neither)), {}, neither).ranks == 2


def test_every_flag_of_every_subcommand_names_one_environment_variable():
    parser = build_parser()
    for command, sub in parser.subcommands.items():
        for action in sub._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            names = [
                word
                for word in (action.help or "").replace(";", " ").replace("]", " ").split()
                if word.startswith("STREAMGRP_")
            ]
            assert len(names) == 1, (command, action.option_strings, action.help)


def test_flags_that_are_not_settings_read_their_variable_and_a_given_flag_wins(monkeypatch):
    assert _parse(["server"], monkeypatch, STREAMGRP_PORT="7001").port == 7001
    assert _parse(["replay", "3"], monkeypatch, STREAMGRP_RANK="1").rank == 1
    assert _parse(["replay", "3", "--rank", "0"], monkeypatch, STREAMGRP_RANK="1").rank == 0
    assert _parse(["steps"], monkeypatch, STREAMGRP_FAILED="yes").failed is True
    assert _parse(["report"], monkeypatch, STREAMGRP_OUT="page.html").out == "page.html"


def test_a_bad_variable_is_an_error_naming_it_and_only_for_its_own_command(monkeypatch, capsys):
    monkeypatch.setenv("STREAMGRP_PORT", "abc")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server"])
    assert "STREAMGRP_PORT='abc'" in capsys.readouterr().err
    assert build_parser().parse_args(["acl", "run-a"]).command == "acl"  # no --port there: not in the way


def test_unknown_streamgrp_variables_are_reported_with_the_closest_name():
    parser = build_parser()
    environ = {
        "STREAMGRP_N_SAMPLE": "3",
        "STREAMGRP_PASSWORD": "x",
        "STREAMGRP_TEST_REDIS_URL": "redis://",
        "STREAMGRP_JSON": "1",
        "STREAMGRP_PORT": "1",
        "HOME": "/root",
        "STREAMGRP_ZZZ": "1",
    }
    messages = unknown_environment([parser, *parser.subcommands.values()], environ)
    assert len(messages) == 2
    assert "STREAMGRP_N_SAMPLE is not a streamgrp setting" in messages[0] and "STREAMGRP_N_SAMPLES?" in messages[0]
    assert messages[1].startswith("environment variable STREAMGRP_ZZZ")


def test_the_command_warns_about_an_unknown_variable():
    done = subprocess.run(
        [sys.executable, "-m", "streamgrp", "acl", "run-a"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "STREAMGRP_BATCH_SIZ": "8"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (
        "STREAMGRP_BATCH_SIZ is not a streamgrp setting and is ignored; did you mean STREAMGRP_BATCH_SIZE?"
        in done.stderr
    )
