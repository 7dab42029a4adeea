"""The reference pages' generated parts, rendered from the code at build time so they never drift.

A page asks for one with a marker line, ``<!-- generated: NAME -->``, which `on_page_markdown` (an MkDocs
hook, named in mkdocs.yml) replaces with ``render(NAME)``:

    cli            every command, its flags and their environment variables, from `streamgrp.cli.parser`
    settings       every settings model of `streamgrp.config.SECTIONS`: TOML table, field, type, default
    metrics        every Prometheus metric of `streamgrp.cli.metrics`, and which role exports it
    events         every event kind of `streamgrp.core.events.EVENT_TYPES` and the models inside them
    decode-reasons every `DecodeError` reason `streamgrp.core.codec` can give a dead letter

Owns only turning those objects into Markdown; tests/docs/test_reference.py checks that each renders
and covers everything its source holds. Imports nothing but the core install (no torch).
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # build from a checkout without installing it
    sys.path.insert(0, str(ROOT))

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)
# The "[env NAME; default VALUE]" that streamgrp.cli.parser appends to every flag's help.
_ENV_SUFFIX = re.compile(r"\s*\[env (?P<env>[A-Z0-9_]+)(?:; default (?P<default>.*))?\]\s*$", re.DOTALL)


def on_page_markdown(markdown: str, **_: object) -> str:
    """MkDocs hook: replace each marker with what it names."""
    return MARKER.sub(lambda match: render(match.group(1)), markdown)


def render(name: str) -> str:
    try:
        renderer = RENDERERS[name]
    except KeyError:
        raise ValueError(f"unknown generated section {name!r}; one of {sorted(RENDERERS)}") from None
    return renderer().rstrip() + "\n"


def _cell(text: object) -> str:
    """Text for one Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: object) -> str:
    text = str(text)
    return f"`` {text} ``" if "`" in text else f"`{text}`"


# -- the command line ----------------------------------------------------------------------------------------


def _subcommand_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    helps: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                helps[choice.dest] = choice.help or ""
    return helps


def _flag_rows(group: argparse._ArgumentGroup) -> list[tuple[str, str, str, str]]:
    """(flag, environment variable, default, meaning) per argument of ``group``."""
    rows = []
    for action in group._group_actions:
        if (
            isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction))
            or action.help == argparse.SUPPRESS
        ):
            continue
        help_text = action.help or ""
        env = getattr(action, "env_name", "")
        default = ""
        found = _ENV_SUFFIX.search(help_text)
        if found:
            env = found.group("env")
            default = found.group("default") or ""
            help_text = help_text[: found.start()]
        if not default and action.default not in (None, False, argparse.SUPPRESS):
            default = str(action.default)
        if action.option_strings:
            metavar = ""
            if action.nargs != 0:
                metavar = action.metavar or (action.dest.upper() if action.choices is None else "")
                if action.choices is not None and not action.metavar:
                    metavar = "{" + ",".join(map(str, action.choices)) + "}"
            flag = ", ".join(action.option_strings) + (f" {metavar}" if metavar else "")
        else:
            flag = action.metavar or action.dest
            env = "(positional)"
        rows.append((flag, env, default, help_text.replace("%%", "%")))
    return rows


def _flag_table(rows: list[tuple[str, str, str, str]]) -> str:
    lines = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for flag, env, default, meaning in rows:
        lines.append(
            f"| {_code(flag)} | {_code(env) if env.startswith('STREAMGRP_') else _cell(env)} | "
            f"{_code(default) if default else ''} | {_cell(meaning)} |"
        )
    return "\n".join(lines)


def _group_key(title: str, rows: list[tuple[str, str, str, str]]) -> tuple:
    return (title, tuple(rows))


def render_cli() -> str:
    from streamgrp.cli.parser import build_parser

    parser = build_parser()
    helps = _subcommand_help(parser)
    commands = parser.subcommands
    # Groups that several commands share unchanged (connection, run, ...) are shown once, then linked.
    seen: dict[tuple, list[str]] = {}
    for name, sub in commands.items():
        for group in sub._action_groups:
            rows = _flag_rows(group)
            if rows and group.title not in ("positional arguments", "options", "common"):
                seen.setdefault(_group_key(group.title, rows), []).append(name)
    shared = {
        key: f"flags-{re.sub(r'[^a-z0-9]+', '-', key[0].lower()).strip('-')}"
        for key, users in seen.items()
        if len(users) > 1
    }
    anchors_used: dict[str, int] = {}
    for key, anchor in list(shared.items()):  # two variants of one title get distinct anchors
        count = anchors_used.get(anchor, 0)
        anchors_used[anchor] = count + 1
        if count:
            shared[key] = f"{anchor}-{count + 1}"

    out = ["## Commands", "", "| command | what it does |", "|---|---|"]
    out += [f"| [`streamgrp {name}`](#streamgrp-{name}) | {_cell(helps.get(name, ''))} |" for name in commands]
    out += ["", "Every command also takes the two [common flags](#flags-common) before or after its name.", ""]
    for name, sub in commands.items():
        out += [
            f"### streamgrp {name} {{ #streamgrp-{name} }}",
            "",
            _cell(helps.get(name, "")),
            "",
            "```text",
            sub.format_usage().strip(),
            "```",
            "",
        ]
        links = []
        for group in sub._action_groups:
            rows = [row for row in _flag_rows(group)]
            if not rows or group.title == "common":
                continue
            key = _group_key(group.title, rows)
            if key in shared:
                links.append(f"[{group.title}](#{shared[key]})")
                continue
            title = {"positional arguments": "Arguments", "options": "Options"}.get(group.title, group.title)
            out += [f"**{title[0].upper() + title[1:]}**", "", _flag_table(rows), ""]
        if links:
            out += ["Also the shared flag groups: " + ", ".join(links) + ".", ""]
    out += ["## Shared flag groups", ""]
    common = next(group for group in parser._action_groups if group.title == "common")
    out += [
        "### common { #flags-common }",
        "",
        "`--config` and `--log-level` work before or after the subcommand.",
        "",
        _flag_table(_flag_rows(common)),
        "",
    ]
    for key, anchor in shared.items():
        title, rows = key
        users = ", ".join(f"`{user}`" for user in seen[key])
        out += [f"### {title} {{ #{anchor} }}", "", f"Taken by {users}.", "", _flag_table(list(rows)), ""]
    return "\n".join(out)


# -- settings ------------------------------------------------------------------------------------------------


def _type_name(annotation: object) -> str:
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    text = re.sub(
        r"\b(typing|pathlib|pydantic\.types|streamgrp\.core\.policy|streamgrp\.core\.values|"
        r"streamgrp\.core\.members|streamgrp\.core\.events|streamgrp\.core\.step_events)\.",
        "",
        text,
    )
    text = re.sub(r"Annotated\[([\w.]+), msgspec\.Meta\([^)]*\)\]", r"\1", text)  # the wire's bounds
    return text.replace("NoneType", "None").replace("<class '", "").replace("'>", "")


def _shown_default(field: object) -> str:
    from streamgrp.cli.parser import shown_default

    factory = getattr(field, "default_factory", None)
    if factory is not None:
        return repr(factory())
    return shown_default(getattr(field, "default"))


def render_settings() -> str:
    from streamgrp.config import SECTIONS, env_name, flag_name

    out = []
    for section, model in SECTIONS.items():
        doc = inspect.cleandoc(model.__doc__ or "")
        out += [
            f"### `[{section}]`: {model.__name__} {{ #{section.replace('_', '-')} }}",
            "",
            doc,
            "",
            "| key | type | default | flag | environment | meaning |",
            "|---|---|---|---|---|---|",
        ]
        for name, field in model.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            flag = "(none: a secret)" if "flag" in extra and extra["flag"] is None else _code(flag_name(name, model))
            out.append(
                f"| `{name}` | {_code(_type_name(field.annotation))} | {_code(_shown_default(field))} | {flag} | "
                f"{_code(env_name(name, model))} | {_cell(field.description or '')} |"
            )
        out.append("")
    return "\n".join(out)


# -- metrics -------------------------------------------------------------------------------------------------


def _metric_rows() -> Iterator[tuple[str, str, str, str, str]]:
    """(name as scraped, type, labels, help, buckets) of every metric definition."""
    from prometheus_client import CollectorRegistry

    from streamgrp.cli.metrics import DEFINITIONS

    for key, make in DEFINITIONS.items():
        metric = make(CollectorRegistry())
        kind = metric._type
        name = metric._name + ("_total" if kind == "counter" else "")
        labels = ", ".join(f"`{label}`" for label in metric._labelnames)
        buckets = ""
        if kind == "histogram":
            buckets = ", ".join(f"{bound:g}" for bound in metric._upper_bounds if bound != float("inf"))
        yield key, name, kind, labels, metric._documentation, buckets


def render_metrics() -> str:
    from prometheus_client import CollectorRegistry

    from streamgrp.cli.metrics import OWNED, Metrics, _StreamCollector

    exporters: dict[str, list[str]] = {}
    for role, names in OWNED.items():
        for key in names:
            exporters.setdefault(key, []).append(role)
    out = ["| metric | type | labels | exported by | meaning |", "|---|---|---|---|---|"]
    histograms = []
    for key, name, kind, labels, doc, buckets in _metric_rows():
        roles = ", ".join(exporters.get(key, [])) or "(no role)"
        out.append(f"| `{name}` | {kind} | {labels} | {roles} | {_cell(doc)} |")
        if buckets:
            histograms.append(f"- `{name}`: {buckets}")
    for family in _StreamCollector(None, {}).collect():
        labels = ", ".join(f"`{label}`" for label in ("stream", "group"))
        out.append(
            f"| `{family.name}` | {family.type} | {labels} | assembler, batcher | {_cell(family.documentation)} |"
        )
    registry = CollectorRegistry()
    Metrics(registry, role="weight-sync", run="RUN")
    everywhere = sorted({family.name + ("_info" if family.type == "info" else "") for family in registry.collect()})
    out += [
        "",
        "Every role also exports "
        + ", ".join(f"`{name}`" for name in everywhere)
        + " (`process_*`: CPU seconds, resident and virtual memory, open and maximum file descriptors, start "
        "time), and every series of a role carries the label `run`.",
        "",
    ]
    if histograms:
        out += ["Histogram buckets (upper bounds):", "", *histograms, ""]
    by_role = ["| role | exports |", "|---|---|"]
    names = {key: name for key, name, *_ in _metric_rows()}
    for role, keys in OWNED.items():
        by_role.append(f"| {role} | {', '.join(f'`{names[key]}`' for key in keys) or 'only what every role has'} |")
    return "\n".join(out + ["What each role exports (`streamgrp.cli.metrics.OWNED`):", "", *by_role])


# -- events --------------------------------------------------------------------------------------------------


def _models_in(annotation: object) -> Iterator[type]:
    import msgspec
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, (BaseModel, msgspec.Struct)):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


def _event_fields(model: type) -> list[tuple[str, object, str]]:
    """(wire name, annotation, shown default or "required") of each field of an event or a value inside one:
    a msgspec Struct (the wire schema) or a pydantic model (a group policy)."""
    import msgspec

    if issubclass(model, msgspec.Struct):
        fields = []
        for info in msgspec.structs.fields(model):
            if info.required:
                default = "required"
            else:
                shown = (
                    repr(info.default_factory())
                    if info.default_factory is not msgspec.NODEFAULT
                    else _shown_default(type("Field", (), {"default": info.default})())
                )
                default = _code(shown)
            fields.append((info.encode_name, info.type, default))
        return fields
    return [
        (name, field.annotation, "required" if field.is_required() else _code(_shown_default(field)))
        for name, field in model.model_fields.items()
        if name != "kind"
    ]


def _model_table(model: type) -> list[str]:
    rows = ["| field | type | default |", "|---|---|---|"]
    for name, annotation, default in _event_fields(model):
        rows.append(f"| `{name}` | {_code(_type_name(annotation))} | {default} |")
    return rows


def render_events() -> str:
    from streamgrp.core.events import EVENT_TYPES, SCHEMA_VERSION

    out = [
        f"Schema version {SCHEMA_VERSION}. Every event also has `schema_version`, `producer` (the writing "
        "process's name) and `seq` (its sequence number), and a `kind` that names its model:",
        "",
    ]
    out += ["| kind | model | what it records |", "|---|---|---|"]
    for kind, model in EVENT_TYPES.items():
        summary = inspect.cleandoc(model.__doc__ or "").split("\n\n")[0]
        out.append(f"| `{kind}` | [{model.__name__}](#{model.__name__.lower()}) | {_cell(summary)} |")
    out.append("")
    nested: dict[str, type] = {}
    for kind, model in EVENT_TYPES.items():
        out += [
            f"### {model.__name__} {{ #{model.__name__.lower()} }}",
            "",
            f"`kind: {kind}`. " + " ".join(inspect.cleandoc(model.__doc__ or "").split()),
            "",
            *_model_table(model),
            "",
        ]
        for _, annotation, _ in _event_fields(model):
            for inner in _models_in(annotation):
                if inner.__name__ not in {m.__name__ for m in EVENT_TYPES.values()}:
                    nested.setdefault(inner.__name__, inner)
    queue = list(nested.values())
    while queue:  # models inside the nested ones, once each
        model = queue.pop()
        for _, annotation, _ in _event_fields(model):
            for inner in _models_in(annotation):
                if inner.__name__ not in nested:
                    nested[inner.__name__] = inner
                    queue.append(inner)
    if nested:
        out += ["## Values inside events", ""]
    for name in sorted(nested):
        model = nested[name]
        out += [
            f"### {name} {{ #{name.lower()} }}",
            "",
            " ".join(inspect.cleandoc(model.__doc__ or "").split()),
            "",
            *_model_table(model),
            "",
        ]
    return "\n".join(out)


def render_decode_reasons() -> str:
    from streamgrp.core import codec

    described: dict[str, str] = {}
    current = None
    for line in (codec.__doc__ or "").splitlines():
        found = re.match(r"^    (\w+)\s{2,}(.*)$", line)
        if found and found.group(1) in codec.DECODE_REASONS:
            current = found.group(1)
            described[current] = found.group(2).strip()
        elif current and line.startswith("     ") and line.strip():
            described[current] += " " + line.strip()
        else:
            current = None
    out = ["| reason | the entry |", "|---|---|"]
    out += [f"| `{reason}` | {_cell(described.get(reason, ''))} |" for reason in sorted(codec.DECODE_REASONS)]
    return "\n".join(out)


RENDERERS: dict[str, Callable[[], str]] = {
    "cli": render_cli,
    "settings": render_settings,
    "metrics": render_metrics,
    "events": render_events,
    "decode-reasons": render_decode_reasons,
}

__all__ = ["MARKER", "RENDERERS", "on_page_markdown", "render"]
