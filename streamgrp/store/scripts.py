"""Loading the server-side Lua scripts that ship with the package, and reading their error replies.

Scripts share preludes, prepended here, so that code exists once: `counters.lua` (counter
changes the caller mirrors in metrics) and `acks.lua` (bounded-chunk acknowledgements and input
checks). Redis sees one self-contained script per role.

A script refuses with an error reply whose first word is a code. The fencing codes (``LEASE``: the
caller no longer holds its role's lease; ``STEP``: the step was written already; ``CURSOR``: the
feeder's cursor moved) mean another process owns the role now, so `FencedScript` raises them as
`LeaseLost` and callers never match text.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script

from streamgrp.errors import LeaseLost

_SHARED = {"commit.lua": ("counters.lua", "acks.lua"), "batch_commit.lua": ("counters.lua", "acks.lua"),
           "deadletter.lua": ("acks.lua",)}

#: Error-reply codes that mean "another process holds this role now".
FENCING_CODES = frozenset({"LEASE", "STEP", "CURSOR"})


def source(name: str) -> str:
    package = resources.files("streamgrp.store").joinpath("lua")
    body = package.joinpath(name).read_text()
    preludes = [package.joinpath(prelude).read_text() for prelude in _SHARED.get(name, ())]
    return "\n".join([*preludes, body])


def register(client: redis.Redis, name: str) -> Script:
    return client.register_script(source(name))


def error_code(exc: redis.ResponseError) -> str:
    """The first word of a script's error reply (``LEASE``, ``STEP``, ``BAD_INPUT``, ...)."""
    text = str(exc)
    return text.split(None, 1)[0] if text else ""


class FencedScript:
    """A registered script whose fencing error replies are raised as `LeaseLost`."""

    def __init__(self, client: redis.Redis, name: str) -> None:
        self._script = register(client, name)

    def __call__(self, keys: list[Any], args: list[Any], client: Any = None) -> Any:
        try:
            return self._script(keys=keys, args=args, client=client)
        except redis.ResponseError as exc:
            if error_code(exc) in FENCING_CODES:
                raise LeaseLost(str(exc)) from None
            raise


def register_fenced(client: redis.Redis, name: str) -> FencedScript:
    return FencedScript(client, name)


class ReadOnlyScript:
    """A script flagged ``no-writes``, run with ``EVALSHA_RO``.

    Why not `register`: the keys of an ``EVALSHA`` need read *and* write permission in an ACL,
    whatever the script does, so a read-only user (an inspector replaying a step, a trainer rank
    loading payloads) could not run it; an ``EVALSHA_RO``'s keys need read permission only.
    """

    def __init__(self, client: redis.Redis, name: str) -> None:
        self.client = client
        self.script = source(name)
        self.sha = hashlib.sha1(self.script.encode()).hexdigest()

    def __call__(self, keys: list[Any], args: list[Any], client: Any = None) -> Any:
        client = client if client is not None else self.client
        try:
            return client.evalsha_ro(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            client.script_load(self.script)  # a restarted or flushed server: load it once, then run it
            return client.evalsha_ro(self.sha, len(keys), *keys, *args)


def register_read_only(client: redis.Redis, name: str) -> ReadOnlyScript:
    return ReadOnlyScript(client, name)
