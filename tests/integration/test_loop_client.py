"""The gateway's turn records on the event loop (`streamgrp.store.loop_client`) on a real server: a function's
answer and its refusals come back as the synchronous call's would, and whatever is not the function's own
answer (a library the server lost, a server gone) is `UNANSWERED`, for the caller to send again the
synchronous way."""

from __future__ import annotations

import asyncio

import pytest
import redis

from streamgrp.store import loop_client
from streamgrp.store.scripts import ensure_library, function_name


def _loop_client(client):
    ensure_library(client)
    aclient = loop_client.loop_client(client)
    if aclient is None:
        assert isinstance(client, redis.RedisCluster)
        pytest.skip("a cluster client has no loop client (its turns are recorded on threads)")
    return aclient


def test_a_function_answers_on_the_loop_and_its_refusals_are_raised(client):
    async def main():
        aclient = _loop_client(client)
        try:
            version = await loop_client.call(aclient, function_name("version"), [], [])
            assert version not in (None, loop_client.UNANSWERED)
            with pytest.raises(redis.ResponseError, match="BAD_INPUT"):
                await loop_client.call(aclient, function_name("session_turn"), ["sg:{t-x}:s", "sg:{t-x}:e"], [])
        finally:
            await aclient.aclose()

    asyncio.run(main())


def test_what_is_not_the_functions_answer_is_unanswered(client):
    async def main():
        aclient = _loop_client(client)
        try:
            missing = await loop_client.call(aclient, "streamgrp_no_such_function", [], [])
            assert missing is loop_client.UNANSWERED
        finally:
            await aclient.aclose()
        gone = redis.asyncio.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)  # nothing listens there
        try:
            assert await loop_client.call(gone, function_name("version"), [], []) is loop_client.UNANSWERED
        finally:
            await gone.aclose()

    asyncio.run(main())


def test_a_staged_call_sends_its_staging_write_first_and_leaves_the_connection_clean(client, run_name):
    async def main():
        aclient = _loop_client(client)
        staged = f"sg:{{{run_name}}}:sessions:staged:{'0' * 32}"
        try:
            # The function refuses (no such session) after the staging write: the error is the function's.
            with pytest.raises(redis.ResponseError, match="UNKNOWN"):
                await loop_client.call(
                    aclient,
                    function_name("session_turn"),
                    [f"sg:{{{run_name}}}:session:p0-0123456789abcdef", f"sg:{{{run_name}}}:sessions", staged],
                    [1, "d", b"{}", b""],
                    staging=("SET", staged, b"value", "NX", "PX", 60_000),
                )
            assert client.get(staged) == b"value" and 0 < client.pttl(staged) <= 60_000
            # Both replies were read: the next call on the loop's connection gets its own answer.
            for _ in range(3):
                assert await loop_client.call(aclient, function_name("version"), [], []) not in (
                    None,
                    loop_client.UNANSWERED,
                )
        finally:
            await aclient.aclose()
            client.delete(staged)

    asyncio.run(main())
