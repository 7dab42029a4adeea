"""Which commands need an optional dependency, and the extra that installs it.

Owns `EXTRAS` (each extra and the modules a command needs from it) and `require`, which a handler
calls first, before it connects or starts a process, so a missing dependency is one line naming the
extra to install (exit 2), not a traceback from a child process. A plain ``pip install streamgrp``
runs the server, worker, assembler, batcher, archiver, weight-sync and the commands that read a run
(runs, steps, verify, inspect, report): none of them imports torch. torch is the ``trainer`` extra,
unpinned above, so installing streamgrp never replaces a torch already there.

It looks modules up without importing them (the demo itself runs no torch; its children do). It
deliberately ignores versions, which pip checks when the extra is installed, and the extras whose
modules are checked where they are used: ``export`` (`streamgrp.replay.export.require_pyarrow`) and
``report`` (`streamgrp.replay.report_png.require_png`).
"""

from __future__ import annotations

import importlib.util

from streamgrp.errors import ConfigError

__all__ = ["EXTRAS", "TORCH_CPU_HINT", "missing", "require"]

#: extra -> the top-level modules a command that needs it imports.
EXTRAS: dict[str, tuple[str, ...]] = {
    "trainer": ("torch",),
    "llm": ("transformers", "gguf"),
    # `streamgrp gateway` serves over aiohttp; `streamgrp agent` hands each agent an openai client.
    "gateway": ("aiohttp", "openai"),
}
TORCH_CPU_HINT = (
    "for the CPU-only build (no CUDA libraries), install torch from PyTorch's CPU wheel index first: "
    "pip install torch --index-url <that index's URL, from PyTorch's install page>"
)


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [name for name in EXTRAS[extra] if not _importable(name)]


def require(what: str, extra: str) -> None:
    """`ConfigError` naming the extra to install when ``what`` (e.g. "a trainer rank") cannot import what
    ``extra`` brings."""
    absent = missing(extra)
    if not absent:
        return
    names = " and ".join(absent)
    verb = "is" if len(absent) == 1 else "are"
    hint = f"; {TORCH_CPU_HINT}" if "torch" in absent else ""
    raise ConfigError(f"{what} needs {names}, which {verb} not installed: pip install 'streamgrp[{extra}]'{hint}")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module left half-imported
        return False
