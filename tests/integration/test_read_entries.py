"""Reading entries by id, whole or streamed part by part: order kept, gone entries None, every field kept."""

from __future__ import annotations

from functools import partial

import pytest
import redis

from streamgrp.cli.children import free_port
from streamgrp.core.entry_fields import EntryFields
from streamgrp.store import streams
from streamgrp.store.connection import connect, ride
from streamgrp.store.streams import read_entries


def test_entries_come_back_in_the_order_asked_across_chunks_with_gone_ones_none(client, run_name, monkeypatch):
    monkeypatch.setattr(streams, "READ_CHUNK", 7)
    key = f"{run_name}:s"
    ids = [client.xadd(key, {"h": str(i).encode(), "b": bytes([i % 256]) * i}).decode() for i in range(30)]
    client.xdel(key, ids[3], ids[20])
    asked = [ids[29], ids[3], *ids[:10], "1-1", ids[20], ids[15]]
    got = read_entries(client, key, asked)
    assert len(got) == len(asked)
    for entry, fields in zip(asked, got):
        if entry in (ids[3], ids[20], "1-1"):
            assert fields is None
        else:
            i = ids.index(entry)
            assert fields == {b"h": str(i).encode(), b"b": bytes([i % 256]) * i}
    assert read_entries(client, key, []) == []


def test_an_entry_that_repeats_a_field_name_keeps_every_pair(client, run_name):
    key = f"{run_name}:s"
    entry = client.execute_command("XADD", key, "*", "h", "1", "h", "2").decode()
    [fields] = read_entries(client, key, [entry])
    assert isinstance(fields, EntryFields) and fields.pairs == [(b"h", b"1"), (b"h", b"2")]


def test_only_certainly_adjacent_ids_share_a_range():
    assert streams._adjacent_runs(["5-2", "5-1", "6-0", "5-3", "5-5", "5-2", "7-1", "7-2"]) == [
        ("5-1", "5-3"),
        ("5-5", "5-5"),
        ("6-0", "6-0"),
        ("7-1", "7-2"),
    ]


def test_entries_between_asked_ids_are_never_returned_in_their_place(client, run_name):
    key = f"{run_name}:s"
    ids = [client.xadd(key, {"h": str(i).encode()}, id=f"9-{i}").decode() for i in range(6)]
    asked = [ids[0], ids[2], ids[3], ids[5], "9", "10-0"]  # "9" is 9-0 spelled short
    got = read_entries(client, key, asked)
    assert [fields and fields[b"h"] for fields in got] == [b"0", b"2", b"3", b"5", b"0", None]


# -- streaming: each part's reply made while the caller reads the last ----------------------------------------


def _written(client, key: str, count: int) -> list[str]:
    return [client.xadd(key, {"h": str(i).encode(), "b": bytes([i % 256]) * i}).decode() for i in range(count)]


def test_streamed_entries_are_the_read_ones_across_parts(client, run_name, monkeypatch):
    monkeypatch.setattr(streams, "STREAM_PART", 4)
    key = f"{run_name}:s"
    ids = _written(client, key, 30)
    client.xdel(key, ids[3], ids[20])
    asked = [ids[29], ids[3], *ids[:10], "1-1", ids[20], ids[15], ids[16], ids[17]]
    assert list(streams.stream_entries(client, key, asked)) == read_entries(client, key, asked)
    assert list(streams.stream_entries(client, key, [])) == []


@pytest.fixture
def streamed(redis_url, run_name, monkeypatch, redis_server):
    """A riding client on one server and a stream key, with parts of 4 ids (so a few entries span parts)."""
    if redis_server.kind == "cluster":
        pytest.skip("a cluster client reads whole (read_entries): nothing is sent ahead")
    monkeypatch.setattr(streams, "STREAM_PART", 4)
    client = connect(redis_url)
    yield client, f"{run_name}:s"
    client.close()


def test_a_reader_that_stops_early_leaves_no_reply_on_the_connection(streamed):
    client, key = streamed
    ids = _written(client, key, 12)
    reader = streams.stream_entries(client, key, ids)
    assert next(reader)[b"h"] == b"0"  # the second part's request is on the wire now
    reader.close()
    # The pool hands out the same connection next: it must not carry the unread reply. (redis-py drops a
    # connection with bytes already waiting, but not one whose reply is still on its way.)
    released = client.connection_pool._available_connections[-1]
    assert released._sock is None
    assert client.ping() is True
    assert client.xrange(key, ids[5], ids[5])[0][1][b"h"] == b"5"


def test_a_connection_killed_between_parts_is_read_again_and_nothing_is_handed_over_twice(streamed, redis_url):
    client, key = streamed
    ids = _written(client, key, 14)
    got = []
    for fields in streams.stream_entries(client, key, ids, retry=partial(ride, client)):  # as the trainer reads
        got.append(fields[b"h"])
        if len(got) in (2, 9):  # mid-part: the next part's request (or reply) is in flight
            # Only this client's connections: the server may be shared with other tests running meanwhile.
            pool = client.connection_pool
            ours = [
                conn._sock.getsockname()
                for conn in [*pool._available_connections, *pool._in_use_connections]
                if conn._sock is not None
            ]
            killer = redis.Redis.from_url(redis_url)
            assert sum(killer.client_kill_filter(addr=f"{host}:{port}") for host, port in ours) >= 1
            killer.close()
    assert got == [str(i).encode() for i in range(14)]


def test_a_server_down_when_a_streamed_read_begins_is_waited_for_under_the_retry(server_factory, run_name, server_kind):
    """The connection a streamed read takes is connected (or checked) as it is taken: that too runs under
    ``retry``, as the trainer's outage policy would (here: the first failure restarts the server)."""
    if server_kind == "cluster":
        pytest.skip("a cluster client reads whole (read_entries)")
    server = server_factory(port=free_port("127.0.0.1"))
    client = connect(server.url)
    key = f"{run_name}:s"
    ids = _written(client, key, 6)
    server.stop()  # the pooled connection is dead, and nothing listens
    restarts = []

    def restart_once(attempt):
        try:
            return attempt()
        except redis.ConnectionError:
            restarts.append(server.start())
            return attempt()

    got = [fields[b"h"] for fields in streams.stream_entries(client, key, ids, retry=restart_once)]
    assert len(restarts) == 1 and got == [str(i).encode() for i in range(6)]
    client.close()
