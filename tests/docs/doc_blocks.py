"""Running the code blocks of a Markdown page as a reader would type them into one terminal (sybil).

A page is a `sybil.Document`; `PARSERS` find its fenced blocks and its skip comments; `Session` is the
terminal: one directory, one environment and one Python namespace for the whole page, each block
running in page order against the server the test gives (``STREAMGRP_REDIS_URL``).

What each block language does:

    python       executed in the page's namespace (a doctest when it starts with ``>>>``); with
                 ``title="NAME.py"`` it is a file: written to NAME.py in the page's directory and
                 compiled, not executed (a later ``bash`` block runs or imports it)
    bash         run by ``bash -e -o pipefail`` in the page's directory; the variables it exports and
                 the directory it ends in carry over to the following blocks (``python`` ones too);
                 whatever it left running in the background is stopped when it ends (SIGTERM, then
                 SIGKILL), as closing the terminal would
    toml, json   parsed (toml: each table a settings model of `streamgrp.config`, every key known);
                 with ``title="NAME"`` also written to that file
    yaml, ini    with ``title="NAME"`` written to that file; nothing else
    text,        output, pictures and trees: nothing to run (in README.md a fence without a language
    mermaid      is output too: tests/integration/test_demo.py reads the demo's sample output there)

A block that cannot run here (a GPU, several machines, an inference server, minutes of work) is
preceded by ``<!-- skip: next "why" -->``; a skip without a reason fails the page. A block with no
language, or one not listed above, fails the page too, so no example goes unrun unnoticed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sybil import Document, Example, Region
from sybil.evaluators.doctest import DocTestEvaluator
from sybil.evaluators.python import PythonEvaluator
from sybil.evaluators.skip import Skipper
from sybil.parsers.abstract.doctest import DocTestStringParser
from sybil.parsers.markdown import SkipParser
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

ROOT = Path(__file__).resolve().parents[2]
SESSION_KEY = "__doc_session__"
RUN_LANGUAGES = ("python", "bash", "toml", "json", "yaml", "ini")
TEXT_LANGUAGES = ("text", "mermaid")
#: Pages whose fences without a language are output: README.md's demo sample, which
#: tests/integration/test_demo.py reads as the block after "at the end it prints:" with a bare fence.
BARE_OUTPUT_PAGES = ("README.md",)
#: Longest one bash block may take before the page fails.
BLOCK_TIMEOUT_S = 180.0
#: How long background processes a block left behind get to stop after SIGTERM before SIGKILL.
STOP_GRACE_S = 10.0

_INFO = re.compile(r"(?P<language>[^\s`]*)(?P<attributes>[^\n]*)$\n", re.MULTILINE)
_TITLE = re.compile(r'title="(?P<title>[^"]+)"')


@dataclass
class Session:
    """One page's terminal: its directory, its environment and what ran."""

    directory: Path
    env: dict[str, str]
    page: str
    #: (line, reason) of every block the page marked not runnable
    skipped: list[tuple[int, str]] = field(default_factory=list)
    #: (line, language, seconds) of every block that ran
    ran: list[tuple[int, str, float]] = field(default_factory=list)
    #: set when a bash block changed the environment or directory, for the page's Python side to follow
    changed: bool = False
    #: makes this process's environment and directory the page's (the test sets it, with monkeypatch)
    follow: Callable[[Session], None] | None = None

    def run_bash(self, source: str, line: int) -> None:
        env_out = self.directory.parent / ".env-after"
        pwd_out = self.directory.parent / ".pwd-after"
        # The trap runs however the script ends (set -e included), so exports survive a failing block's
        # report and carry over after a passing one.
        script = f'trap \'env -0 > "{env_out}"; pwd > "{pwd_out}"\' EXIT\nset -e -o pipefail\n' + source
        log = self.directory.parent / f".block-{line}.log"
        env_out.unlink(missing_ok=True)  # what a previous block left is not this one's
        pwd_out.unlink(missing_ok=True)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", script],
                cwd=self.env.get("PWD", str(self.directory)),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=BLOCK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                _stop_group(proc.pid)
        output = log.read_text(errors="replace")
        if env_out.exists():
            self.env = dict(item.split("=", 1) for item in env_out.read_text().split("\0") if "=" in item)
            self.env["PWD"] = pwd_out.read_text().strip()
            self.changed = True
        if code != 0:
            what = f"timed out after {BLOCK_TIMEOUT_S:g}s" if code is None else f"exited {code}"
            raise AssertionError(f"{self.page} line {line}: the bash block {what}; its output:\n{_tail(output)}")

    def write(self, name: str, text: str) -> Path:
        """Write a titled block to its file, relative to the page's current directory."""
        where = Path(self.env.get("PWD", str(self.directory))) / name
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(text)
        return where


def _tail(text: str, lines: int = 60) -> str:
    kept = text.splitlines()[-lines:]
    return "\n".join(kept) if kept else "(no output)"


def _stop_group(pgid: int) -> None:
    """Stop what a block left running in its process group: SIGTERM (roles exit 0 on it), then SIGKILL."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _session(example: Example) -> Session:
    return example.namespace[SESSION_KEY]


def _check_toml(text: str, where: str) -> None:
    from streamgrp.config import SECTIONS

    data = tomllib.loads(text)
    for table, values in data.items():
        assert table in SECTIONS, f"{where}: [{table}] is no settings table; known: {sorted(SECTIONS)}"
        unknown = sorted(set(values) - set(SECTIONS[table].model_fields))
        assert not unknown, f"{where}: [{table}] has no keys {unknown}"
        SECTIONS[table](**values)  # validates the values


class BlockParser:
    """Every fenced block of a page, each with the evaluator its language asks for."""

    def __init__(self) -> None:
        self.lexer = RawFencedCodeBlockLexer(info_pattern=_INFO)
        self.python = PythonEvaluator()
        self.doctest = DocTestStringParser(DocTestEvaluator())

    def __call__(self, document: Document):
        for region in self.lexer(document):
            language = region.lexemes["language"]
            title = _TITLE.search(region.lexemes["attributes"])
            source = region.lexemes["source"]
            region.parsed = source
            if language == "python" and title is None and source.lstrip().startswith(">>>"):
                for doctest_region in self.doctest(source, document.path):
                    doctest_region.adjust(region, source)
                    doctest_region.evaluator = _counted(doctest_region.evaluator, "python")
                    yield doctest_region
                continue
            region.evaluator = self._evaluator(language, title.group("title") if title else None)
            yield region

    def _evaluator(self, language: str, title: str | None):
        def evaluate(example: Example) -> None:
            session = _session(example)
            where = f"{session.page} line {example.line}"
            source = str(example.parsed)
            if language in TEXT_LANGUAGES or (language == "" and session.page in BARE_OUTPUT_PAGES):
                return
            if language not in RUN_LANGUAGES:
                raise AssertionError(
                    f"{where}: a block in {language or 'no language'!r}; give it one of "
                    f"{RUN_LANGUAGES + TEXT_LANGUAGES} (tests/docs/doc_blocks.py)"
                )
            started = time.monotonic()
            try:
                self._run(example, session, language, title, source, where)
            finally:
                session.ran.append((example.line, language, time.monotonic() - started))

        return evaluate

    def _run(
        self, example: Example, session: Session, language: str, title: str | None, source: str, where: str
    ) -> None:
        if language == "python" and title is not None:
            compile(source, f"{where} ({title})", "exec")
            session.write(title, source)
        elif language == "python":
            _follow(session)
            self.python(example)
        elif language == "bash":
            session.run_bash(source, example.line)
        else:
            if language == "toml":
                _check_toml(source, where)
            elif language == "json":
                _check_json(source, where, lines=bool(title and title.endswith(".jsonl")))
            if title is not None:
                session.write(title, source)


def _check_json(source: str, where: str, *, lines: bool) -> None:
    """One JSON value, or one per line for a JSONL file."""
    for number, text in enumerate(source.splitlines() if lines else [source], 1):
        if text.strip():
            try:
                json.loads(text)
            except ValueError as exc:
                raise AssertionError(f"{where}: not JSON (line {number}): {exc}") from None


def _counted(evaluator, language: str):
    def evaluate(example: Example):
        session = _session(example)
        _follow(session)
        started = time.monotonic()
        try:
            return evaluator(example)
        finally:
            session.ran.append((example.line, language, time.monotonic() - started))

    return evaluate


def _follow(session: Session) -> None:
    """Bring this process's environment and directory to where the page's last bash block left them."""
    if session.changed and session.follow is not None:
        session.follow(session)
    session.changed = False


class CheckedSkipParser(SkipParser):
    """sybil's skip comments, each required to give its reason: ``<!-- skip: next "why" -->``."""

    def __call__(self, document: Document):
        for region in super().__call__(document):
            action, reason = region.parsed
            if action in ("next", "start") and not (reason and reason.strip().strip("\"'").strip()):
                line = document.text.count("\n", 0, region.start) + 1
                raise ValueError(
                    f"{document.path} line {line}: 'skip: {action}' without a reason; write "
                    f'<!-- skip: {action} "why it cannot run here" -->'
                )
            yield region


def parsers() -> list[Any]:
    return [BlockParser(), CheckedSkipParser()]


def is_skipper(region: Region) -> bool:
    return isinstance(region.evaluator, Skipper)
