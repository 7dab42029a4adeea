"""The bounds the server-side functions enforce on their input, each defined once, here.

`streamgrp.store.scripts` declares every bound a function's Lua names as a ``local`` at the top of that
function (``local MAX_RESULTS = 256``), so the Lua files use the names and never write the numbers; the
Python that builds a call imports the same names. A bound changed here changes both sides (and the
library's digest, so a server holding the old functions gets the new ones loaded beside them).
"""

from __future__ import annotations

#: Field pairs of one dead letter (`streamgrp.store.deadletter` builds them; commit.lua, deadletter.lua).
MAX_DEAD_LETTER_FIELDS = 64
#: Finished slots one publish call takes, and acknowledgements it carries (publish.lua, the worker).
MAX_RESULTS = 256
#: Sessions one session_open call opens: one task's slots (session_open.lua, the gateway).
MAX_SESSIONS = 256
#: Turns of one session (session_turn.lua).
MAX_TURNS = 4096
#: Bytes of a posted reward's header (reward_post.lua).
MAX_REWARD_HEADER = 65536
#: Ids one XACK or XCLAIM call takes inside a function, so no single command grows with its input (acks.lua).
ACK_CHUNK = 256

#: Every bound, by the name the Lua uses.
LUA_BOUNDS: dict[str, int] = {
    name: value for name, value in globals().items() if name.isupper() and isinstance(value, int)
}
