"""The payloads' reads on a connection of the reader's own (`streamgrp.store.own_connection.OwnConnection.values`):
an MGET's reply read into one buffer, each value a view of it, on a real server. The values are the server's,
byte for byte (absent keys None, empty and long values, a reply larger than any buffer so far); a buffer is read
into again only when no view of it is left, so the values a reader still holds never change under it; an error
reply is raised as redis-py raises it; a dropped connection is an outage a riding client rides out, and the next
read opens another."""

from __future__ import annotations

import os
import secrets

import pytest
import redis

from streamgrp.store import payloads
from streamgrp.store.connection import connect
from streamgrp.store.own_connection import OwnConnection


def _keys(client, run_name: str, sizes: list[int | None]) -> tuple[list[str], list[bytes | None]]:
    keys = [f"{run_name}:own:{i}" for i in range(len(sizes))]
    values = [None if size is None else os.urandom(size) for size in sizes]
    for key, value in zip(keys, values):
        if value is not None:
            client.set(key, value)
    return keys, values


def test_values_are_the_servers_byte_for_byte_and_held_values_never_change(client, run_name):
    own = OwnConnection(client)
    # absent, empty, small, and past the first 64 KB buffer (it grows while the reply is read)
    keys, expected = _keys(client, run_name, [None, 0, 5, 200_000, 3, 1_000_000, None])
    first = own.values(keys)
    assert [None if v is None else bytes(v) for v in first] == expected == client.mget(keys)
    assert all(v is None or v.readonly for v in first)
    # Held views keep their buffer: the next read goes into another, and the held values stay as they were.
    others, other_expected = _keys(client, run_name + "b", [1_200_000, 7])
    second = own.values(others)
    assert [bytes(v) for v in second] == other_expected
    assert [None if v is None else bytes(v) for v in first] == expected
    buffers = list(own._buffers)
    # Once no view of a buffer is left, it is read into again (no fresh memory for every reply).
    del first, second
    third = own.values(keys)
    assert [None if v is None else bytes(v) for v in third] == expected
    assert any(buffer is third[3].obj for buffer in buffers)


def test_payloads_read_through_the_own_connection_as_through_redis_py(client, run_name):
    ids = ["1-0", "2-0", "3-0"]
    for entry_id, size in zip(ids[:2], (10, 300_000)):
        client.set(payloads.key(run_name, entry_id), payloads.frame(b'{"h":1}', os.urandom(size)))
    own = OwnConnection(client)
    mine = payloads.read(client, run_name, ids, views=True, own=own)
    theirs = payloads.read(client, run_name, ids)
    assert mine[2] is None and theirs[2] is None
    assert [(f[b"h"], bytes(f[b"b"])) for f in mine[:2]] == [(f[b"h"], f[b"b"]) for f in theirs[:2]]


def test_an_error_reply_is_raised_as_redis_py_raises_it(client, redis_server, run_name):
    if redis_server.kind == "cluster":
        pytest.skip("a cluster client reads through redis-py")
    user, password = f"nomget-{secrets.token_hex(4)}", secrets.token_hex(8)
    client.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all", "-mget"])
    try:
        limited = redis.Redis.from_url(redis_server.url, username=user, password=password)
        own = OwnConnection(limited)
        with pytest.raises(redis.exceptions.NoPermissionError):
            own.values([f"{run_name}:a", f"{run_name}:b"])
        assert limited.ping()  # the connection stayed in step with the server
        limited.close()
    finally:
        client.acl_deluser(user)


def test_a_dropped_connection_is_an_outage_a_riding_client_rides_out(client, redis_url, run_name):
    keys, expected = _keys(client, run_name, [100, 70_000])
    plain = redis.Redis.from_url(redis_url)
    own = OwnConnection(plain)
    assert [bytes(v) for v in own.values(keys)] == expected
    host, port = own.connection._sock.getsockname()[:2]
    assert client.client_kill_filter(addr=f"{host}:{port}") == 1
    with pytest.raises(redis.ConnectionError):
        own.values(keys)  # a plain client does not ride it
    assert [bytes(v) for v in own.values(keys)] == expected  # the next read opens another connection
    riding = connect(redis_url)  # a role's client: it rides out outages
    own = OwnConnection(riding)
    ids = ["1-0"]
    client.set(payloads.key(run_name, "1-0"), payloads.frame(b"{}", b"xyz"))
    assert bytes(payloads.read(riding, run_name, ids, views=True, own=own)[0][b"b"]) == b"xyz"
    host, port = own.connection._sock.getsockname()[:2]
    assert client.client_kill_filter(addr=f"{host}:{port}") == 1
    assert bytes(payloads.read(riding, run_name, ids, views=True, own=own)[0][b"b"]) == b"xyz"
    assert riding.outage is not None and riding.outage.count == 1
    for closing in (plain, riding):
        closing.close()
