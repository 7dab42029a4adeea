"""What verify reports: each `Difference` between the record and the recomputation, and the `VerifyReport`
that counts what was checked; `format_report` prints one line per difference and a verdict.

The kinds of difference are listed in `streamgrp.replay.verifier`, which finds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamgrp.core.shown import printable


@dataclass(frozen=True)
class Difference:
    """One way the record differs from the recomputation: ``kind``, what it is about (``subject``: a
    task or a step and rank), which ``field``, and both values."""

    kind: str
    subject: str
    field: str | None = None
    recorded: Any = None
    recomputed: Any = None

    def __str__(self) -> str:
        where = f"{self.subject} {self.field}" if self.field else self.subject
        # task ids and recorded values come from the streams: one printable line whatever they hold
        return printable(
            f"{self.kind}: {where}: recorded {_short(self.recorded)}, recomputed {_short(self.recomputed)}"
        )


@dataclass
class VerifyReport:
    run: str
    entries_folded: int = 0
    unread_entries: int = 0  # slot-log entries after the assembler's position, not folded
    decisions_checked: int = 0
    payloads_checked: int = 0
    steps_checked: int = 0
    segments_checked: int = 0  # decided samples built on segments, compared against them
    differences: list[Difference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_report(report: VerifyReport) -> str:
    lines = [str(difference) for difference in report.differences]
    unread = (
        f", {report.unread_entries} entries after the assembler's position not folded" if report.unread_entries else ""
    )
    verdict = "all match" if report.ok else f"{len(report.differences)} differences"
    lines.append(
        f"verify run {report.run}: folded {report.entries_folded} slot-log entries{unread}; checked "
        f"{report.decisions_checked} decisions, {report.payloads_checked} payloads"
        f"{f' ({report.segments_checked} built on segments)' if report.segments_checked else ''} and "
        f"{report.steps_checked} steps: {verdict}"
    )
    return "\n".join(lines)
