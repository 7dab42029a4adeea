"""Reaching a local server without ``redis``: its address and URL, and a PING/AUTH/INFO probe in raw RESP.

Owns the few bytes of RESP that starting and reusing a server need, so that neither they nor the
``streamgrp server`` command import the ``redis`` client, and start fast. It deliberately ignores
everything else a client does (pools, retries, outages): that is `streamgrp.store.connection`.
"""

from __future__ import annotations

import socket
import ssl
from typing import BinaryIO
from urllib.parse import quote

from streamgrp.config import TlsFiles
from streamgrp.errors import ServerError

__all__ = ["AUTH_REFUSALS", "connect_host", "probe", "server_url"]

#: Error replies that mean "this client may not in", not "the server is not ready".
AUTH_REFUSALS = ("NOAUTH", "WRONGPASS", "NOPERM", "ERR AUTH", "ERR invalid password")


def connect_host(bind: str) -> str:
    """The address a client on this machine uses to reach a server bound to ``bind``."""
    first = bind.split()[0].lstrip("-")  # "-" marks an optional address in redis.conf
    return {"0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "::": "::1", "::*": "::1"}.get(first, first)


def server_url(host: str, port: int, password: str | None, *, tls: bool = False) -> str:
    """``redis[s]://[:password@]host:port/0``, with an IPv6 host in brackets."""
    netloc = f"[{host}]" if ":" in host else host
    auth = f":{quote(password, safe='')}@" if password is not None else ""
    return f"{'rediss' if tls else 'redis'}://{auth}{netloc}:{port}/0"


def probe(
    host: str,
    port: int,
    password: str | None,
    *,
    timeout: float = 1.0,
    tls: TlsFiles | None = None,
    refusal_answers: bool = False,
) -> dict[str, str]:
    """PING the server; return its ``INFO server`` fields.

    Raises OSError if nothing answers, ServerError with the server's message if it answers with an
    error (``LOADING``, ``NOAUTH``, ``WRONGPASS``...). With ``refusal_answers`` an authentication
    refusal counts as an answer and gives ``{}``: a server whose ACL file lets no anonymous client
    in is up, though it tells nothing about itself. ``tls`` presents its certificate as the client's.
    """
    commands: list[tuple[str, ...]] = [("PING",), ("INFO", "server")]
    if password is not None:
        commands.insert(0, ("AUTH", password))
    replies = _call(host, port, commands, timeout=timeout, tls=tls)
    if refusal_answers and any(isinstance(r, ServerError) and str(r).startswith(AUTH_REFUSALS) for r in replies):
        return {}
    for reply in replies:
        if isinstance(reply, ServerError):
            raise reply
    info = replies[-1]
    if not isinstance(info, bytes):
        raise ConnectionError(f"unexpected INFO reply {info!r}")
    fields: dict[str, str] = {}
    for line in info.decode(errors="replace").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()
    return fields


def _call(
    host: str, port: int, commands: list[tuple[str, ...]], *, timeout: float = 1.0, tls: TlsFiles | None = None
) -> list:
    """Send ``commands`` pipelined, return their replies (errors returned, not raised).

    Raises OSError when nothing answers on ``host:port`` (an ``ssl.SSLError`` is one).
    """
    with socket.create_connection((host, port), timeout=timeout) as raw:
        sock = _tls_context(tls).wrap_socket(raw) if tls is not None else raw
        try:
            sock.sendall(b"".join(_encode(*command) for command in commands))
            with sock.makefile("rb") as stream:
                return [_read_reply(stream) for _ in commands]
        finally:
            if sock is not raw:
                sock.close()


def _tls_context(tls: TlsFiles) -> ssl.SSLContext:
    """Verify the server against the CA and present ``tls``'s certificate. The host name is not checked:
    the probe reaches a server this machine started (or recorded), by the address it was bound to."""
    context = ssl.create_default_context(cafile=str(tls.ca_cert_file))
    context.check_hostname = False
    context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    return context


def _encode(*args: str | bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else arg
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _read_reply(stream: BinaryIO) -> bytes | int | list | ServerError | None:
    line = stream.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed by the server")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body
    if kind == b"-":
        return ServerError(body.decode(errors="replace"))
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        if size < 0:
            return None
        data = stream.read(size + 2)
        if len(data) != size + 2:
            raise ConnectionError("connection closed by the server")
        return data[:-2]
    if kind == b"*":
        size = int(body)
        return None if size < 0 else [_read_reply(stream) for _ in range(size)]
    raise ConnectionError(f"not a RESP reply: {line[:40]!r}")
