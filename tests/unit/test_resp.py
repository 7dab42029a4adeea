"""`RespPacker` writes redis-py's own bytes for every kind of argument, and refuses what redis-py refuses."""

from __future__ import annotations

import pytest
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer
from redis.exceptions import DataError

from streamgrp.store.resp import Pieces, RespPacker

REDIS_PY = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)

COMMANDS = [
    ("PING",),
    ("XADD", "sg:{r}:slots", "*", b"h", b'{"kind":"x"}'),
    ("CONFIG GET", "appendonly"),
    (b"CLIENT SETNAME", b"streamgrp"),
    ("EVALSHA", "a" * 40, 2, "k1", "k2", 1.5, -3, 0, 2**70, -(2**63), "é", "", b"\x00\r\n" * 5000, b""),
    ("SET", "k", memoryview(b"view")),
    ("SET", "k", bytearray(b"array")),
    ("XADD", "s", "*", b"b", bytes(range(256)) * 100),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: str(command[0]))
def test_the_bytes_are_redis_pys(command):
    assert RespPacker().pack(*command) == [b"".join(REDIS_PY.pack(*command))]


@pytest.mark.parametrize("bad", [True, None, object(), [1]])
def test_what_redis_py_refuses_is_refused(bad):
    with pytest.raises(DataError):
        REDIS_PY.pack("SET", "k", bad)
    with pytest.raises(DataError):
        RespPacker().pack("SET", "k", bad)


def test_pieces_are_sent_as_the_one_argument_they_join_into_a_long_piece_unjoined():
    long = bytes(range(256)) * 1000
    for pieces in ((b"\x05\x00\x00\x00", b"hello", bytes(range(256)) * 100), (b"\x05\x00\x00\x00", b"hello", long)):
        packed = RespPacker().pack("SET", "k", Pieces(pieces), "NX")
        assert b"".join(packed) == b"".join(REDIS_PY.pack("SET", "k", b"".join(pieces), "NX"))
    assert len(packed) == 3 and packed[1] is long  # the long piece is sent as it is, never copied
