"""The connection a role lends to user code running in its own process: a worker's, to its rollout function.

Owns handing rollout code (loading weights by version, `streamgrp.train.weights.WeightCache.from_env`)
the worker's own client and run keys, so that the worker never has to put its URL, password or key
files in the environment, which every subprocess a rollout starts (a sandbox running generated
code, a tool) would inherit. It deliberately ignores isolation inside the process: code the worker
calls can read its memory; run rollouts that execute untrusted code in a sandbox of their own.
"""

from __future__ import annotations

import threading

import redis

from streamgrp.store.keys import RunKeys

__all__ = ["borrowed", "lend"]

_lock = threading.Lock()
_lent: tuple[redis.Redis, RunKeys] | None = None


def lend(client: redis.Redis | None, keys: RunKeys | None = None) -> None:
    """Lend ``client`` (and the run's ``keys``) to code in this process; ``lend(None)`` takes it back."""
    global _lent
    with _lock:
        _lent = (client, keys) if client is not None and keys is not None else None


def borrowed() -> tuple[redis.Redis, RunKeys] | None:
    """The lent client and run keys, or None when no role lent them."""
    return _lent
