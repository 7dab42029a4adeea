"""Reading entries by id in one script reply per chunk: order kept, gone entries None, every field kept."""

from __future__ import annotations

from streamgrp.core.entry_fields import EntryFields
from streamgrp.store import streams
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
        ("5-1", "5-3"), ("5-5", "5-5"), ("6-0", "6-0"), ("7-1", "7-2")]


def test_entries_between_asked_ids_are_never_returned_in_their_place(client, run_name):
    key = f"{run_name}:s"
    ids = [client.xadd(key, {"h": str(i).encode()}, id=f"9-{i}").decode() for i in range(6)]
    asked = [ids[0], ids[2], ids[3], ids[5], "9", "10-0"]  # "9" is 9-0 spelled short
    got = read_entries(client, key, asked)
    assert [fields and fields[b"h"] for fields in got] == [b"0", b"2", b"3", b"5", b"0", None]
