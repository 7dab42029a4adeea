"""Code health: no module of the library is over `MAX_LINES` lines (one concern per module, a few hundred
lines each; STYLE.md), so a module that grows past it is split by responsibility when it does, not later."""

from __future__ import annotations

from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[2] / "streamgrp"
MAX_LINES = 450


def _line_counts(root: Path) -> dict[str, int]:
    # consumers/ is a link to the examples beside the package, which are not the library's modules
    return {
        path.relative_to(root).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in root.rglob("*.py")
        if path.relative_to(root).parts[0] != "consumers"
    }


def _over(root: Path) -> dict[str, int]:
    return {name: lines for name, lines in sorted(_line_counts(root).items()) if lines > MAX_LINES}


def test_no_module_is_over_the_line_limit():
    over = _over(LIBRARY)
    assert not over, (
        f"modules over {MAX_LINES} lines: {over}; split each by responsibility (one module per "
        "thing it owns, its public names still importable from where they were)"
    )


def test_the_check_reports_a_module_one_line_over_the_limit_and_skips_the_examples(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "consumers").mkdir()
    (tmp_path / "core" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "core" / "full.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "consumers" / "example.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert _over(tmp_path) == {"core/big.py": MAX_LINES + 1}
