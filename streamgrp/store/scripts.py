"""Loading the server-side Lua scripts that ship with the package.

Scripts share preludes, prepended here, so that code exists once: `counters.lua` (counter
changes the caller mirrors in metrics) and `acks.lua` (bounded-chunk acknowledgements and input
checks). Redis sees one self-contained script per role.
"""

from __future__ import annotations

from importlib import resources

import redis
from redis.commands.core import Script

_SHARED = {"commit.lua": ("counters.lua", "acks.lua"), "batch_commit.lua": ("counters.lua", "acks.lua"),
           "deadletter.lua": ("acks.lua",)}


def source(name: str) -> str:
    package = resources.files("streamgrp.store").joinpath("lua")
    body = package.joinpath(name).read_text()
    preludes = [package.joinpath(prelude).read_text() for prelude in _SHARED.get(name, ())]
    return "\n".join([*preludes, body])


def register(client: redis.Redis, name: str) -> Script:
    return client.register_script(source(name))
