"""Packing a command into the Redis protocol: one bytes object per command, built by one join.

With hiredis installed, redis-py 8 packs every command with hiredis' ``pack_command`` behind a
Python layer that encodes each argument first. Measured here (2 cores, CPython 3.11): a publish
of 64 samples of 1024 tokens (about 630 KB of arguments) costs about 1,000 µs to pack that way,
15 µs a sample and a quarter of a worker's CPU, against 72 µs for one join; a small command
(``XREADGROUP`` with its options) costs 13 µs against 10. `RespPacker` is the ``command_packer``
of every single-server connection (`streamgrp.store.connection.connect`); the bytes it writes are
redis-py's own (a unit test holds them equal). A Redis Cluster client keeps redis-py's packer:
its node clients accept no packer.
"""

from __future__ import annotations

from typing import Any

from redis._parsers.encoders import Encoder


class Pieces(tuple):
    """An argument that is the concatenation of these byte strings, never joined: a piece of at least
    `SEPARATE_BYTES` is its own chunk of the packed command, which redis-py writes to the socket as it is,
    so a payload's bytes (`streamgrp.store.payloads`) are sent without a copy in the writer."""

    __slots__ = ()


#: A `Pieces` piece this long is sent as a chunk of its own (redis-py sends chunks over its 6000-byte
#: buffer cutoff without joining them).
SEPARATE_BYTES = 65536


class RespPacker:
    """A redis-py ``command_packer``: ``pack(*args)`` returns the command as a one-item list (several items
    when a `Pieces` argument holds a long piece, which stays a chunk of its own)."""

    def __init__(self) -> None:
        # streamgrp's clients never decode replies and send text as UTF-8: the Encoder of such a client.
        self._encode = Encoder("utf-8", "strict", False).encode

    def pack(self, *args: Any) -> list[bytes]:
        name = args[0]
        # A command name with its subcommand in one argument ("CONFIG GET") is sent as separate
        # arguments, as redis-py does.
        if name.__class__ is str:
            args = (*name.encode().split(), *args[1:])
        elif b" " in name:
            args = (*name.split(), *args[1:])
        parts = [b"*%d\r\n" % len(args)]
        chunks: list[bytes] = []
        encode = self._encode
        for arg in args:
            kind = arg.__class__
            if kind is Pieces:
                parts.append(b"$%d\r\n" % sum(map(len, arg)))
                for piece in arg:
                    if len(piece) >= SEPARATE_BYTES:  # the join before it, then the piece itself: no copy
                        chunks += (b"".join(parts), piece)
                        parts = []
                    else:
                        parts.append(piece)
                parts.append(b"\r\n")
                continue
            if kind is str:  # text and counts are most of a commit's arguments: encoded here, as redis-py would
                arg = arg.encode()
            elif kind is int:
                arg = b"%d" % arg
            elif kind is not bytes:
                arg = encode(arg)  # float and the rest; anything else raises redis-py's DataError
                if arg.__class__ is not bytes:  # a memoryview or bytearray passes encode unchanged
                    arg = bytes(arg)
            parts += (b"$%d\r\n" % len(arg), arg, b"\r\n")
        if chunks:
            return [*chunks, b"".join(parts)]
        return [b"".join(parts)]


def packs_pieces(pool: Any) -> bool:
    """Whether the connections of ``pool`` pack with `RespPacker`, so an argument may be `Pieces`: those of
    `streamgrp.store.connection.connect`'s single-server clients; a cluster's, or a client made otherwise, not."""
    return isinstance(getattr(pool, "connection_kwargs", {}).get("command_packer"), RespPacker)
