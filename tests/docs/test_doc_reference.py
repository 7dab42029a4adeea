"""The manual's structure: the generated reference covers everything its source holds, every page is in
the navigation, README.md stays a front door whose links resolve. No server, no mkdocs build (.ci/run
builds the site with --strict, which checks links and anchors inside docs/)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hook():
    return _hook()


def test_every_command_and_flag_is_in_the_cli_reference(hook):
    from streamgrp.cli.parser import build_parser

    text = hook.render("cli")
    parser = build_parser()
    for name, sub in parser.subcommands.items():
        assert f"### streamgrp {name} " in text, name
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in text or f", {option}" in text, (name, option)


def test_every_setting_is_in_the_settings_reference(hook):
    from streamgrp.config import SECTIONS, env_name

    text = hook.render("settings")
    for section, model in SECTIONS.items():
        assert f"`[{section}]`" in text
        for field in model.model_fields:
            assert f"| `{field}` |" in text and env_name(field, model) in text, (section, field)


def test_every_metric_and_event_is_in_the_reference(hook):
    from streamgrp.cli.metrics import DEFINITIONS
    from streamgrp.core.codec import DECODE_REASONS
    from streamgrp.core.events import EVENT_TYPES

    from prometheus_client import CollectorRegistry

    metrics = hook.render("metrics")
    for key, make in DEFINITIONS.items():
        assert f"| `{make(CollectorRegistry())._name}" in metrics, key
    events = hook.render("events")
    for kind, model in EVENT_TYPES.items():
        assert f"`{kind}`" in events and f"### {model.__name__} " in events
    reasons = hook.render("decode-reasons")
    assert all(f"`{reason}`" in reasons for reason in DECODE_REASONS)


def test_each_generated_marker_names_a_renderer(hook):
    markers = [match.group(1) for page in DOCS.rglob("*.md") for match in hook.MARKER.finditer(page.read_text())]
    assert sorted(set(markers)) == sorted(hook.RENDERERS)


def test_every_page_is_in_the_navigation():
    nav = re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    pages = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    assert sorted(nav) == pages, "add each page of docs/ to the nav of mkdocs.yml (and only those)"


def test_readme_is_a_front_door_whose_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "README.md is the front door; the manual lives in docs/"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
