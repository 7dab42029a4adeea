"""The server-side functions streamgrp ships: one Redis function library, and reading their error replies.

Every write a role makes that needs more than one command runs in a function of the library
``streamgrp_<digest>`` (Redis 7 / Valkey ``FUNCTION LOAD``), one function per file in ``lua/``. Roles
call them with ``FCALL`` and are never granted ``EVAL``, ``EVALSHA`` or ``SCRIPT LOAD``: a role's
credential cannot run Lua of its own (one ``while true do end`` would make the server answer BUSY to
every client of every run). Whoever creates the server or the run loads the library (`load_library`:
the embedded server at start, a client whose user may, on first use, or an administrator with
``streamgrp functions``); on a cluster every primary holds it. The library and its functions are named
by a digest of their source, so processes of two streamgrp versions can share a server, each calling
its own functions.

Functions share preludes, prepended here, so that code exists once: `counters.lua` (counter changes
the caller mirrors in metrics) and `acks.lua` (bounded-chunk acknowledgements and input checks). The
bounds a function enforces come from `streamgrp.store.limits`, declared as locals ahead of its code.

A function refuses with an error reply whose first word is a code. The fencing codes (``LEASE``: the
caller no longer holds its role's lease; ``STEP``: the step was written already; ``CURSOR``: the
feeder's cursor moved) mean another process owns the role now, so `FencedScript` raises them as
`LeaseLost` and callers never match text.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import weakref
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

import redis

from streamgrp.errors import ConfigError, LeaseLost
from streamgrp.store.limits import LUA_BOUNDS

log = logging.getLogger(__name__)

_SHARED = {
    "commit.lua": ("counters.lua", "acks.lua"),
    "batch_commit.lua": ("counters.lua", "acks.lua"),
    "deadletter.lua": ("acks.lua",),
}
#: Files that are preludes of others, not functions of their own.
_PRELUDES = frozenset(name for preludes in _SHARED.values() for name in preludes)

#: Error-reply codes that mean "another process holds this role now".
FENCING_CODES = frozenset({"LEASE", "STEP", "CURSOR"})

#: Connection pools (cluster node managers) whose server was seen holding the library.
_loaded: weakref.WeakSet[Any] = weakref.WeakSet()
_loaded_lock = threading.Lock()


def source(name: str) -> str:
    """The Lua of one function: the bounds it names (`streamgrp.store.limits`), its preludes, then its own file."""
    package = resources.files("streamgrp.store").joinpath("lua")
    body = package.joinpath(name).read_text()
    preludes = [package.joinpath(prelude).read_text() for prelude in _SHARED.get(name, ())]
    code = "\n".join([*preludes, body])
    bounds = [f"local {bound} = {value}" for bound, value in LUA_BOUNDS.items() if re.search(rf"\b{bound}\b", code)]
    return "\n".join([*bounds, code])


def _function_names() -> list[str]:
    package = resources.files("streamgrp.store").joinpath("lua")
    return sorted(p.name for p in package.iterdir() if p.name.endswith(".lua") and p.name not in _PRELUDES)


@cache
def library() -> tuple[str, str]:
    """The library's name and its code (``#!lua`` header, one registered function per file)."""
    bodies = {name: source(name) for name in _function_names()}
    digest = hashlib.sha256("\n".join(f"{n}\n{b}" for n, b in bodies.items()).encode()).hexdigest()[:12]
    parts = [
        f"#!lua name=streamgrp_{digest}",
        (
            f"redis.register_function{{function_name='{version_function(digest)}', "
            f"callback=function() return '{digest}' end, flags={{'no-writes'}}}}"
        ),
    ]
    for name, body in bodies.items():
        parts.append(f"redis.register_function('{function_name(name, digest)}', function(KEYS, ARGV)\n{body}\nend)")
    return f"streamgrp_{digest}", "\n".join(parts) + "\n"


def function_name(script: str, digest: str | None = None) -> str:
    """The server-side name of ``lua/<script>``'s function in this version's library."""
    digest = digest or library()[0].removeprefix("streamgrp_")
    return f"sg_{script.removesuffix('.lua')}_{digest}"


def version_function(digest: str) -> str:
    return f"sg_version_{digest}"


def load_library(client: redis.Redis) -> str:
    """Load this version's library (``FUNCTION LOAD REPLACE``: the same code under the same name, so
    loading again changes nothing; on a cluster on every primary). Needs a user allowed ``FUNCTION``."""
    name, code = library()
    client.function_load(code, replace=True)
    log.info("loaded the function library %s", name)
    return name


def ensure_library(client: redis.Redis) -> None:
    """Make sure the server holds this version's library: a cheap ``FCALL_RO`` of its version function,
    loading the library when it is missing. A user that may not load it gets a `ConfigError` saying
    who must (roles under ACL users are never granted ``FUNCTION``)."""
    key = _pool_of(client)
    if key in _loaded:
        return
    with _loaded_lock:
        if key in _loaded:
            return
        name, _ = library()
        try:
            client.fcall_ro(version_function(name.removeprefix("streamgrp_")), 0)
        except redis.ResponseError as exc:
            if "function not found" not in str(exc).lower():
                raise
            try:
                load_library(client)
            except redis.exceptions.NoPermissionError:
                raise ConfigError(
                    f"the server does not hold streamgrp's function library {name}, and this user may not load "
                    "it: load it once as an administrator (`streamgrp functions --redis-url ADMIN_URL`, or start "
                    "the run's first process as a user allowed FUNCTION LOAD)"
                ) from None
        _loaded.add(key)


def forget_loaded() -> None:
    """Check the server again on next use (after a server was replaced by an empty one)."""
    with _loaded_lock:
        _loaded.clear()


def _pool_of(client: Any) -> Any:
    return getattr(client, "connection_pool", None) or getattr(client, "nodes_manager", None) or client


def register(client: redis.Redis, name: str) -> ServerFunction:
    """The function of ``lua/<name>``, callable as ``fn(keys=[...], args=[...], client=pipe_or_None)``."""
    return ServerFunction(client, name)


class ServerFunction:
    """One function of the library, called with ``FCALL``; reloads the library once when the server lost it."""

    def __init__(self, client: redis.Redis, name: str) -> None:
        self.client = client
        self.name = function_name(name)
        ensure_library(client)

    def __call__(self, keys: Sequence[Any], args: Sequence[Any], client: Any = None) -> Any:
        target = client if client is not None else self.client
        try:
            return target.fcall(self.name, len(keys), *keys, *args)
        except redis.ResponseError as exc:
            # A server restarted empty (or replaced) lost the library: load it again once, call again.
            if client is not None or "function not found" not in str(exc).lower():
                raise
            forget_loaded()
            ensure_library(self.client)
            return self.client.fcall(self.name, len(keys), *keys, *args)


def error_code(exc: redis.ResponseError) -> str:
    """The first word of a function's error reply (``LEASE``, ``STEP``, ``BAD_INPUT``, ...)."""
    text = str(exc)
    return text.split(None, 1)[0] if text else ""


class FencedScript:
    """A function whose fencing error replies are raised as `LeaseLost`."""

    def __init__(self, client: redis.Redis, name: str) -> None:
        self._function = register(client, name)

    def __call__(self, keys: Sequence[Any], args: Sequence[Any], client: Any = None) -> Any:
        try:
            return self._function(keys=keys, args=args, client=client)
        except redis.ResponseError as exc:
            if error_code(exc) in FENCING_CODES:
                raise LeaseLost(str(exc)) from None
            raise


def register_fenced(client: redis.Redis, name: str) -> FencedScript:
    return FencedScript(client, name)
