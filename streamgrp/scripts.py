"""Loading the server-side Lua scripts that ship with the package.

Scripts that count (`commit.lua`, `batch_commit.lua`) share `counters.lua`, prepended here, so
the counting code exists once; Redis sees one self-contained script per role.
"""

from __future__ import annotations

from importlib import resources

import redis
from redis.commands.core import Script

_SHARED = {"commit.lua": "counters.lua", "batch_commit.lua": "counters.lua"}


def source(name: str) -> str:
    package = resources.files("streamgrp")
    body = package.joinpath(name).read_text()
    prelude = _SHARED.get(name)
    return body if prelude is None else package.joinpath(prelude).read_text() + "\n" + body


def register(client: redis.Redis, name: str) -> Script:
    return client.register_script(source(name))
