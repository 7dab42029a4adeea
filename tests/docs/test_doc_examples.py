"""Every code block of README.md and docs/ runs, in page order, or is marked with why it cannot.

One test per page (`doc_blocks` says what each block language does). A page runs in a directory of
its own, against the session's bundled Valkey (``redis_url``), with ``streamgrp``, ``python`` and
``python3`` on PATH being this checkout run by this interpreter, and no ``STREAMGRP_`` variable from
outside but the server's URL. Pages name their own runs, each distinct, since they share the server.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from unittest import SkipTest

import pytest

if os.environ.get("STREAMGRP_TEST_REQUIRE_DOCS") != "1":  # .ci/run sets it: there a missing sybil fails
    pytest.importorskip("sybil", reason="the doc tests need the docs extra: pip install -e '.[docs]'")

from doc_blocks import ROOT, SESSION_KEY, Session, is_skipper, parsers  # noqa: E402
from sybil import Sybil  # noqa: E402


def _readme_trained(client) -> None:
    """The README's own rollout and trainer trained the run's 5 steps on rank 0, each once."""
    from streamgrp.store.keys import RunKeys

    keys = RunKeys("my-first-run")
    assert client.hget(keys.committed, "0") == b"4"
    assert client.xlen(keys.steps) == 5


def _own_producer_published(client) -> None:
    """The own-rollout page's own producer published the task its batcher issued last, which was decided."""
    from streamgrp.store.keys import RunKeys

    assert client.hexists(RunKeys("own-rollout").decided, "t00000004")


def _both_ranks_trained(client) -> None:
    """The own-trainer page's two torchrun ranks each committed both steps of the run."""
    from streamgrp.store.keys import RunKeys

    assert client.hgetall(RunKeys("own-trainer").committed) == {b"0": b"1", b"1": b"1"}


#: What a page's run must have left on the server, beyond its blocks exiting 0.
AFTERWARDS = {
    "README.md": _readme_trained,
    "docs/guides/own-rollout.md": _own_producer_published,
    "docs/guides/own-trainer.md": _both_ranks_trained,
}

PAGES = ["README.md", *sorted(str(path.relative_to(ROOT)) for path in (ROOT / "docs").rglob("*.md"))]
SYBIL = Sybil(parsers=parsers(), path=str(ROOT))


def _shims(directory: Path) -> Path:
    """``streamgrp``, ``python`` and ``python3`` that run this checkout with this interpreter."""
    directory.mkdir()
    # The checkout goes last on PYTHONPATH, so a page's own "PYTHONPATH=. streamgrp ..." still finds it.
    path = f'export PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{ROOT}"'
    for name, line in (
        ("python", f'{path}; exec "{sys.executable}" "$@"'),
        ("python3", f'{path}; exec "{sys.executable}" "$@"'),
        ("streamgrp", f'{path}; exec "{sys.executable}" -m streamgrp "$@"'),
    ):
        shim = directory / name
        shim.write_text(f"#!/bin/sh\n{line}\n")
        shim.chmod(0o755)
    return directory


def _environment(redis_url: str, bin_dir: Path, home: Path) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("STREAMGRP_") or name.startswith("STREAMGRP_TEST_")
    }
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["STREAMGRP_REDIS_URL"] = redis_url
    env["PWD"] = str(home)
    env.pop("OLDPWD", None)
    return env


@pytest.mark.one_server_kind
@pytest.mark.parametrize("page", PAGES)
def test_page_examples(page: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "work"
    home.mkdir()
    session = Session(directory=home, env=_environment(redis_url, _shims(tmp_path / "bin"), home), page=page)
    monkeypatch.syspath_prepend(str(home))  # a page's python blocks import the files it wrote

    def follow(current: Session) -> None:
        for name in set(os.environ) - set(current.env):
            monkeypatch.delenv(name)
        for name, value in current.env.items():
            if os.environ.get(name) != value:
                monkeypatch.setenv(name, value)
        monkeypatch.chdir(current.env["PWD"])

    session.follow = follow
    session.changed = True
    modules_before = set(sys.modules)
    document = SYBIL.parse(ROOT / page)
    document.namespace[SESSION_KEY] = session
    try:
        for example in document.examples():
            if is_skipper(example.region):
                example.evaluate()
                continue
            try:
                example.evaluate()
            except SkipTest as skipped:
                session.skipped.append((example.line, str(skipped)))
    finally:
        document.namespace.clear()
        for name in set(sys.modules) - modules_before:  # a page's own modules (my_rl, ...) go with it
            module = sys.modules.get(name)
            if module is not None and str(getattr(module, "__file__", "") or "").startswith(str(tmp_path)):
                del sys.modules[name]
        gc.collect()
    check = AFTERWARDS.get(page)
    if check is not None:
        import redis

        with redis.Redis.from_url(redis_url) as client:
            check(client)
    slow = sorted(session.ran, key=lambda ran: -ran[2])[:3]
    print(
        f"{page}: ran {len(session.ran)} blocks in {sum(ran[2] for ran in session.ran):.1f}s (slowest: "
        + ", ".join(f"line {line} {seconds:.1f}s" for line, _, seconds in slow)
        + "); not runnable: "
        + ("; ".join(f"line {line}: {reason}" for line, reason in session.skipped) or "none")
    )
