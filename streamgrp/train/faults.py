"""Fault injection for the reference trainers' crash tests (``--crash-at``): where to die, and dying
the way a SIGKILL kills, with nothing flushed or cleaned up."""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)


def crash_point(text: str | None) -> tuple[str, int] | None:
    """``'train:S'`` or ``'checkpoint:S'`` (`streamgrp.config.TrainerConfig.crash_at`) as (where, step)."""
    if text is None:
        return None
    where, step = text.split(":")
    return where, int(step)


def crash(where: str) -> None:
    """Die now by SIGKILL."""
    log.warning("crash injected %s: SIGKILL", where)
    os.kill(os.getpid(), signal.SIGKILL)
