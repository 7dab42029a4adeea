"""The `streamgrp` argument parser: one subcommand per role or inspection, each bound to its handler.

Every setting of `streamgrp.config` is a flag ``--name`` and an environment variable
``STREAMGRP_NAME`` (shown in `--help`); a TOML file (``--config`` / ``STREAMGRP_CONFIG``) fills
the rest. Flags that are not settings (``server --port``, ``replay --rank``, ...) get their variable
from `streamgrp.cli.flag_env`. ``--config`` and ``--log-level`` work before or after the subcommand.
Owns only the flags, how they read in ``--help``, the suggestion for a mistyped flag or command, and
which handler each subcommand runs; the handlers live in `streamgrp.cli.roles` and
`streamgrp.cli.inspection`, and import what they need only when run.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from pydantic import BaseModel

from streamgrp._version import __version__
from streamgrp.cli import housekeeping, inspection, roles
from streamgrp.cli.flag_env import add_flag_environment, apply_flag_environment
from streamgrp.cli.follow_cmd import add_follow_command
from streamgrp.cli.security import add_acl_command
from streamgrp.config import (
    DEMO_RUN_DEFAULTS,
    AgentConfig,
    ArchiverConfig,
    AssemblerConfig,
    BatcherConfig,
    ConnectionConfig,
    DeleteConfig,
    DemoConfig,
    ExportConfig,
    GatewayConfig,
    InferenceConfig,
    RewarderConfig,
    RunConfig,
    RunsConfig,
    TrainerConfig,
    WeightSyncConfig,
    WorkerConfig,
    env_name,
    flag_name,
    parse_env_value,
)
from streamgrp.core.policy import NormSpec
from streamgrp.errors import StreamgrpError

__all__ = ["Parser", "build_parser"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class Parser(argparse.ArgumentParser):
    """argparse without abbreviated flags, whose errors name the closest flag, command or choice.

    No abbreviations: "--password SECRET" would otherwise be taken for --password-file (leaving a
    password in the process's argument list), and "--step 3" for "--steps 3"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.subcommands: dict[str, Parser] = {}

    def error(self, message: str) -> NoReturn:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            known = re.findall(r"'([^']*)'", choice.group(2))
            message += _did_you_mean(choice.group(1), known)
        # One line that says what is wrong and where the flags are, not argparse's whole usage block
        # (30-40 lines on most commands) with the useful line at its end.
        self.exit(2, f"{self.prog}: error: {message}\n(see '{self.prog} --help' for its flags)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """As argparse's, but an unknown flag is reported by its subcommand, with the closest known flag."""
        argv = list(sys.argv[1:] if args is None else args)
        parsed, extras = self.parse_known_args(argv, namespace)
        where = self.subcommands.get(getattr(parsed, "command", None) or "", self)
        if extras:
            known = [option for action in where._actions for option in action.option_strings]
            hints = "".join(_did_you_mean(extra.split("=", 1)[0], known) for extra in extras if extra.startswith("-"))
            where.error(f"unrecognized arguments: {' '.join(extras)}{hints}")
        apply_flag_environment(where, parsed, argv)
        return parsed


def _did_you_mean(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def build_parser() -> Parser:
    parser = Parser(prog="streamgrp", description="Event-sourced rollout queue for asynchronous RL post-training.")
    parser.add_argument("--version", action="version", version=f"streamgrp {__version__}")
    _add_common_flags(parser, argparse_default=None)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    server = commands.add_parser("server", help="run the embedded Valkey server in the foreground")
    _add_model_flags(server, ConnectionConfig, "connection")
    server.add_argument("--port", type=int, default=6379, help="TCP port [default 6379]")
    server.add_argument("--bind", default="127.0.0.1", help="address to listen on [default 127.0.0.1]")
    server.add_argument(
        "--appendfsync",
        choices=["always", "everysec", "no"],
        default="everysec",
        help="AOF fsync policy (see README: what each mode can lose)",
    )
    server.add_argument(
        "--acl-file",
        default=None,
        metavar="FILE",
        help="the server's users (`streamgrp acl RUN` prints one per role); it must define the default "
        "user. A --bind other machines reach needs this or a password",
    )
    server.set_defaults(handler=roles.cmd_server)

    # Each role takes the connection flags, the run's settings, and its own.
    for name, help_text, model, handler in (
        ("worker", "run a rollout worker process", WorkerConfig, roles.cmd_worker),
        (
            "rewarder",
            "score results published with their reward pending, and post each reward",
            RewarderConfig,
            roles.cmd_rewarder,
        ),
        ("assembler", "run the group assembler (one active, others stand by)", AssemblerConfig, roles.cmd_assembler),
        ("batcher", "run the batcher and task feeder (one active, others stand by)", BatcherConfig, roles.cmd_batcher),
        (
            "trainer",
            "run a reference GRPO trainer rank (streamgrp.consumers.grpo_trainer)",
            TrainerConfig,
            roles.cmd_trainer,
        ),
        (
            "demo",
            "run a whole asynchronous RL loop on the embedded server and summarize it",
            DemoConfig,
            roles.cmd_demo,
        ),
    ):
        role = commands.add_parser(name, help=help_text)
        sections: list[tuple[type[BaseModel], str]] = [
            (ConnectionConfig, "connection"),
            (RunConfig, "run"),
            (model, name),
        ]
        if name == "worker":  # --rollout vllm|sglang|llamacpp reads these
            sections.append((InferenceConfig, "inference (--rollout vllm, sglang or llamacpp)"))
        for section, title in sections:
            # the demo's run settings have its own defaults (`streamgrp.config.DEMO_RUN_DEFAULTS`)
            shown = DEMO_RUN_DEFAULTS if name == "demo" and section is RunConfig else None
            _add_model_flags(role, section, title, defaults=shown)
        role.set_defaults(handler=handler)
    _add_weight_sync(commands)
    _add_agent_sessions(commands)

    runs = commands.add_parser("runs", help="list the runs on the server, newest last (--sizes: what each holds)")
    _add_model_flags(runs, ConnectionConfig, "connection")
    _add_model_flags(runs, RunsConfig, "runs")
    runs.set_defaults(handler=inspection.cmd_runs)
    _add_housekeeping(commands)

    report = commands.add_parser("report", help="render the run's timeline as one self-contained HTML page")
    _add_model_flags(report, ConnectionConfig, "connection")
    report.add_argument("--out", default=None, metavar="FILE", help="where to write [default report-RUN.FORMAT]")
    report.add_argument(
        "--format",
        choices=["html", "png"],
        default="html",
        help="html (default; needs nothing) or png (needs matplotlib)",
    )
    report.set_defaults(handler=inspection.cmd_report)

    archiver = commands.add_parser(
        "archiver",
        help="copy the run's streams to segment files on disk; with "
        "--retention, trim the server behind the archive and every reader",
    )
    for settings, title in ((ConnectionConfig, "connection"), (ArchiverConfig, "archiver")):
        _add_model_flags(archiver, settings, title)
    archiver.set_defaults(handler=roles.cmd_archiver)
    _add_replay_commands(commands)
    add_follow_command(commands, _add_model_flags, ConnectionConfig)
    add_acl_command(commands)
    parser.subcommands.update(commands.choices)
    for sub in parser.subcommands.values():
        # SUPPRESS: a subcommand not given --config keeps what was given before it
        _add_common_flags(sub, argparse_default=argparse.SUPPRESS)
    for sub in (parser, *parser.subcommands.values()):
        add_flag_environment(sub)
    return parser


def _add_common_flags(parser: argparse.ArgumentParser, *, argparse_default: Any) -> None:
    group = parser.add_argument_group("common")
    group.add_argument(
        "--config", default=argparse_default, metavar="FILE", help="TOML settings file [env STREAMGRP_CONFIG]"
    )
    group.add_argument(
        "--log-level",
        default=argparse_default,
        type=str.upper,
        choices=LOG_LEVELS,
        metavar="LEVEL",
        help=f"{', '.join(LOG_LEVELS)} [env STREAMGRP_LOG_LEVEL; default INFO]",
    )


def add_connection_flags(parser: Any) -> None:
    """The connection flags (--redis-url, --password-file, TLS, ...) of a command that talks to a server."""
    _add_model_flags(parser, ConnectionConfig, "connection")


def _add_housekeeping(commands: Any) -> None:
    delete = commands.add_parser(
        "delete",
        help="delete a run's keys and registry entry from the server; refuses a "
        "live run, keeps its archive unless --delete-archive",
    )
    delete.add_argument("target", metavar="RUN", help="the run to delete (given explicitly: never the latest run)")
    _add_model_flags(delete, ConnectionConfig, "connection")
    _add_model_flags(delete, DeleteConfig, "delete")
    _add_archive_flag(delete, "where the run's archive is, for --delete-archive and the archiver check")
    delete.set_defaults(handler=housekeeping.cmd_delete)


def _add_weight_sync(commands: Any) -> None:
    sync = commands.add_parser(
        "weight-sync",
        help="after each committed step, tell every inference server to "
        "load the new weights, and record which server serves which version",
    )
    for model, title in (
        (ConnectionConfig, "connection"),
        (InferenceConfig, "inference servers"),
        (WeightSyncConfig, "weight-sync"),
    ):
        _add_model_flags(sync, model, title)
    sync.set_defaults(handler=roles.cmd_weight_sync)


def _add_agent_sessions(commands: Any) -> None:
    """`streamgrp gateway` and `streamgrp agent` (`streamgrp.services.gateway`; the ``gateway`` extra)."""
    from streamgrp.cli import gateway_roles

    gateway = commands.add_parser(
        "gateway",
        help="serve agent sessions: an OpenAI-compatible endpoint whose every "
        "turn is recorded token-exact as training data of its slot",
    )
    for model, title in (
        (ConnectionConfig, "connection"),
        (RunConfig, "run"),
        (GatewayConfig, "gateway"),
        (InferenceConfig, "inference servers"),
    ):
        _add_model_flags(gateway, model, title)
    gateway.set_defaults(handler=gateway_roles.cmd_gateway)
    agent = commands.add_parser(
        "agent",
        help="take tasks like a worker and run an agent function once per slot, each in its own gateway session",
    )
    for agent_model, title in ((ConnectionConfig, "connection"), (RunConfig, "run"), (AgentConfig, "agent")):
        _add_model_flags(agent, agent_model, title)
    agent.set_defaults(handler=gateway_roles.cmd_agent)


# -- replay: steps, replay, verify, inspect, export (streamgrp.replay) -------------------------------------


def _add_replay_commands(commands: Any) -> None:
    steps = commands.add_parser("steps", help="list the run's steps and each rank's status (committed, failed, ...)")
    _add_model_flags(steps, ConnectionConfig, "connection")
    steps.add_argument("--failed", action="store_true", help="only steps a rank failed, with the exception text")
    _add_archive_flag(steps)
    steps.set_defaults(handler=inspection.cmd_steps)

    replay = commands.add_parser("replay", help="rebuild the exact tensors a rank consumed at a step, digests checked")
    _add_model_flags(replay, ConnectionConfig, "connection")
    replay.add_argument("step", type=int, metavar="STEP", help="the step to rebuild")
    replay.add_argument("--rank", type=int, default=None, help="the rank to rebuild [default: every rank]")
    replay.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="save the batch (safetensors layout, no pickle); for several ranks FILE gets .rankR",
    )
    replay.add_argument(
        "--run-fn",
        default=None,
        metavar="MODULE:FUNCTION",
        help="call this with the replayed streamgrp.train.batch.Batch and print what it returns "
        "(the module may sit in the current directory)",
    )
    _add_archive_flag(replay)
    replay.set_defaults(handler=inspection.cmd_replay)

    verify = commands.add_parser(
        "verify", help="re-fold the slot log and re-shard the steps; exit 1 on any difference from the record"
    )
    _add_model_flags(verify, ConnectionConfig, "connection")
    verify.add_argument(
        "--from", dest="from_step", type=int, default=None, metavar="STEP", help="first step to re-shard [default: 0]"
    )
    verify.add_argument(
        "--to", dest="to_step", type=int, default=None, metavar="STEP", help="last step to re-shard [default: the last]"
    )
    _add_archive_flag(verify)
    verify.set_defaults(handler=inspection.cmd_verify)

    inspect = commands.add_parser(
        "inspect", help="one task's timeline: issue, slot results, agent sessions' turns, decision, step and rank"
    )
    _add_model_flags(inspect, ConnectionConfig, "connection")
    inspect.add_argument("task_id", metavar="TASK_ID")
    _add_archive_flag(inspect)
    inspect.set_defaults(handler=inspection.cmd_inspect)

    export = commands.add_parser(
        "export",
        help="write the run's decisions, slot results and steps as Parquet files "
        "for pandas, polars or duckdb (needs pyarrow: pip install 'streamgrp[export]')",
    )
    export.add_argument(
        "target",
        metavar="RUN",
        nargs="?",
        default=None,
        help="the run to export [default: --run, else the latest run, else the --archive's]",
    )
    _add_model_flags(export, ConnectionConfig, "connection")
    _add_model_flags(export, ExportConfig, "export")
    _add_archive_flag(export)
    export.set_defaults(handler=inspection.cmd_export)


def _add_archive_flag(
    parser: argparse.ArgumentParser,
    what: str = "read entries the server no longer holds from "
    "this archive (the whole run, when it is not on the server)",
) -> None:
    parser.add_argument(
        "--archive", default=None, metavar="DIR", help=f"{what} (default DATA_DIR/archive/RUN when it exists)"
    )


# -- flags from the settings models ------------------------------------------------------------------------


def _add_model_flags(
    parser: argparse.ArgumentParser, model: type[BaseModel], title: str, defaults: Mapping[str, Any] | None = None
) -> None:
    """One flag per field of ``model``; unset flags stay None so TOML and environment fill them. A field whose
    ``flag`` is None (a secret) has no flag: only its environment variable and the TOML file set it.
    ``defaults`` are the command's own defaults where they differ from the model's, for the help text."""
    group = parser.add_argument_group(title)
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if "flag" in extra and extra["flag"] is None:
            continue
        default = (defaults or {}).get(name, field.default)
        help_text = f"{field.description or ''} [env {env_name(name, model)}; default {shown_default(default)}]"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %: a literal one (50%) is doubled
        options: dict[str, Any] = (
            {"nargs": "?", "const": True, "metavar": "true|false"}
            if field.annotation is bool
            else {"metavar": name.upper()}
        )
        action = group.add_argument(
            flag_name(name, model), dest=name, default=None, help=help_text, type=_flag_parser(model, name), **options
        )
        action.env_name = env_name(name, model)  # type: ignore[attr-defined]
        action.is_setting = True  # type: ignore[attr-defined]  # streamgrp.config.load reads its variable


def shown_default(value: Any) -> str:
    """A default as a user would type it: paths and text bare, ``true``/``false``, ``unset`` for None."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, NormSpec):
        return ",".join(level or "none" for level in (value.mean_level, value.std_level))
    if isinstance(value, (str, Path)):
        return str(value)
    return repr(value)


def _flag_parser(model: type, name: str) -> Callable[[str], Any]:
    """Parse a flag's text the way its environment variable is parsed, as an argparse type error."""

    def parse(text: str) -> Any:
        try:
            return parse_env_value(model, name, text)
        except StreamgrpError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse
