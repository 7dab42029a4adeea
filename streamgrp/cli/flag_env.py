"""Every flag's environment variable, and the `STREAMGRP_*` variables that name no flag.

Settings flags (the fields of `streamgrp.config`'s models) are read from the environment by the
settings layer (`streamgrp.config.load`, under the TOML file's values and over the flags' absence).
This module owns the rest of SPEC section 7's promise: a flag that is not a setting (``server
--port``, ``report --out``, ``replay --rank``, ``steps --failed``, ...) takes ``STREAMGRP_<FLAG>``
as its default, named in ``--help``; and a ``STREAMGRP_`` variable that no flag, setting or
documented tool reads is reported, with the closest known name, instead of silently doing nothing.
Positional arguments (``replay STEP``) are not flags and have no variable.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Iterable, Mapping

from streamgrp.config import ENV_PREFIX, SECTIONS, env_name

__all__ = ["add_flag_environment", "apply_flag_environment", "flag_env_name", "unknown_environment"]

#: Read outside the flags: the server binary (`streamgrp.cli.server_binary`) and ops/llama-server.sh's cache.
OTHER_KNOWN = frozenset({"STREAMGRP_SERVER_BINARY", "STREAMGRP_LLAMA_CACHE"})
#: The test suite's own switches (tests/conftest.py, tests/integration/llama.py, .ci/run).
IGNORED_PREFIXES = ("STREAMGRP_TEST_",)
_NO_ENVIRONMENT = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def flag_env_name(action: argparse.Action) -> str:
    """``STREAMGRP_`` and the action's longest flag: ``--metrics-port`` is ``STREAMGRP_METRICS_PORT``."""
    longest = max(action.option_strings, key=len)
    return ENV_PREFIX + longest.lstrip("-").replace("-", "_").upper()


def add_flag_environment(parser: argparse.ArgumentParser) -> None:
    """Name a variable for each flag of ``parser`` that has none, in its help. Settings flags (marked
    ``env_name`` by the parser) are left to the settings layer."""
    for action in parser._actions:
        if not action.option_strings or isinstance(action, _NO_ENVIRONMENT) or hasattr(action, "env_name"):
            continue
        action.env_name = flag_env_name(action)  # type: ignore[attr-defined]
        if action.dest in ("config", "log_level"):
            action.read_elsewhere = True  # type: ignore[attr-defined]  # read_toml and main read them
        if action.help is not argparse.SUPPRESS and "[env " not in (action.help or ""):
            action.help = f"{action.help or ''} [env {action.env_name}]".strip()  # type: ignore[attr-defined]


def apply_flag_environment(
    parser: argparse.ArgumentParser,
    namespace: argparse.Namespace,
    argv: list[str],
    environ: Mapping[str, str] | None = None,
) -> None:
    """For each flag of ``parser`` (the subcommand that runs) not on the command line, take its variable's
    value when set. Done after parsing, so a bad variable of another subcommand never gets in the way."""
    environ = os.environ if environ is None else environ
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    for action in parser._actions:
        name = getattr(action, "env_name", None)
        if (
            name is None
            or getattr(action, "read_elsewhere", False)
            or name not in environ
            or getattr(action, "is_setting", False)
            or given.intersection(action.option_strings)
        ):
            continue
        setattr(namespace, action.dest, _from_environment(parser, action, name, environ[name]))


def _from_environment(parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str) -> object:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        text = raw.strip().lower()
        if text not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            parser.error(f"{name}={raw!r}: expected true or false")
        flag = text in ("1", "true", "yes", "on")
        return flag if isinstance(action, argparse._StoreTrueAction) else not flag
    try:
        value = action.type(raw) if callable(action.type) else raw
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{name}={raw!r}: {exc or 'not a valid value'} (it sets {action.option_strings[-1]})")
    if action.choices is not None and value not in action.choices:
        parser.error(f"{name}={raw!r}: choose from {', '.join(map(str, action.choices))}")
    return value


def known_names(parsers: Iterable[argparse.ArgumentParser]) -> set[str]:
    """Every variable streamgrp reads: each flag's, each setting's (secrets too), and `OTHER_KNOWN`."""
    names = set(OTHER_KNOWN)
    for model in SECTIONS.values():
        names.update(env_name(field, model) for field in model.model_fields)
    for parser in parsers:
        names.update(getattr(action, "env_name", "") for action in parser._actions)
    names.discard("")
    return names


def unknown_environment(parsers: Iterable[argparse.ArgumentParser], environ: Mapping[str, str]) -> list[str]:
    """One message per ``STREAMGRP_`` variable in ``environ`` that nothing reads, with the closest known name."""
    known = known_names(parsers)
    messages = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or name.startswith(IGNORED_PREFIXES):
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else "; `streamgrp COMMAND --help` lists each flag's variable"
        messages.append(f"environment variable {name} is not a streamgrp setting and is ignored{hint}")
    return messages
