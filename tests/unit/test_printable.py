"""Untrusted text on a terminal or in a log line: escapes, not control sequences or forged lines."""

from __future__ import annotations

import logging

from streamgrp.cli.main import EscapingFormatter
from streamgrp.core.shown import printable, printable_lines
from streamgrp.replay.steps import TimelineEvent, format_timeline
from streamgrp.replay.verifier import Difference

HOSTILE = "t1\x1b[2J\rstep 9 rank 0 committed\n\u202egnp.exe"


def test_printable_escapes_every_control_and_format_character_and_keeps_the_rest():
    shown = printable(HOSTILE)
    assert shown.isprintable() and "\n" not in shown and "\x1b" not in shown
    assert shown == "t1\\x1b[2J\\rstep 9 rank 0 committed\\n\\u202egnp.exe"
    assert printable("plain task-00042 ünïcode") == "plain task-00042 ünïcode"
    assert printable_lines("first line\nsecond \x1b[31mred") == "first line\nsecond \\x1b[31mred"


def test_inspection_output_escapes_task_ids_producers_and_errors():
    line = format_timeline([TimelineEvent(0.0, "slot", f"slot 0 failed from {HOSTILE}: {HOSTILE}", "1-0")])
    assert "\n" not in line and "\x1b" not in line and "\\x1b[2J" in line
    difference = str(Difference("decision_missing", f"task {HOSTILE}", "decision", None, "complete"))
    assert difference.isprintable() and "\\n" in difference


def test_log_lines_escape_their_arguments_not_their_format():
    record = logging.LogRecord("streamgrp", logging.WARNING, __file__, 1, "task %s: %s", (HOSTILE, 3), None)
    text = EscapingFormatter("%(message)s").format(record)
    assert text == f"task {printable(HOSTILE)}: 3"
    assert record.args == (HOSTILE, 3)  # the record other handlers see is unchanged
    mapping = logging.LogRecord("streamgrp", logging.INFO, __file__, 1, "%(task)s", ({"task": HOSTILE},), None)
    assert EscapingFormatter("%(message)s").format(mapping) == printable(HOSTILE)
