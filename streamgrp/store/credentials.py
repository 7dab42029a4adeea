"""Credentials in URLs and connection options: masking a password wherever a URL is shown, dropping it
where a URL is handed on, and the redis-py options for a password and for TLS.

Owns the one rule for showing a server URL (the user name stays, the password never does, in the
user part or a ``password=`` query) and which client options carry secrets. It deliberately
ignores connecting and riding out outages: that is `streamgrp.store.connection`.
"""

from __future__ import annotations

import inspect
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis

from streamgrp.config import TlsFiles
from streamgrp.errors import ConfigError

__all__ = ["auth_options", "safe_url", "url_without_password"]


#: No ``CLIENT SETINFO`` on connect: Redis 7.0 has no such command, so a role's ACL rules cannot name it
#: (they would not load there), and without a rule newer servers log a denied command for every connection.
_NO_CLIENT_INFO: dict[str, Any] = (
    {"driver_info": None} if "driver_info" in inspect.signature(redis.connection.AbstractConnection.__init__).parameters
    else {"lib_name": None, "lib_version": None})


def auth_options(url: str, password: str | None, tls: TlsFiles | None) -> dict[str, Any]:
    """redis-py options for the password (the URL's wins) and, for ``rediss://``, the TLS files."""
    options: dict[str, Any] = dict(_NO_CLIENT_INFO)
    if password is not None:
        options["password"] = password
    scheme = urlsplit(url).scheme
    if tls is not None:
        if scheme != "rediss":
            raise ConfigError(f"TLS files are set but {safe_url(url)} is not a rediss:// URL; use rediss://HOST:PORT/0 "
                              "(or unset --tls-cert-file, --tls-key-file and --tls-ca-cert-file)")
        options.update(ssl_ca_certs=str(tls.ca_cert_file), ssl_certfile=str(tls.cert_file),
                       ssl_keyfile=str(tls.key_file))
    return options


def safe_url(url: str) -> str:
    """The URL without its password (in the user part or a ``password=`` query), for messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<an unparsable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        name, has_password, _ = user.partition(":")
        netloc = f"{name}:***@{host}" if has_password else f"{name}@{host}" if name else f"***@{host}"
    query = parts.query
    if "password" in query.lower():
        query = urlencode([(k, "***" if k.lower() == "password" else v) for k, v in parse_qsl(query)], safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def url_without_password(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` query) removed, the user name kept."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        name = user.partition(":")[0]
        netloc = f"{name}@{host}" if name else host
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k.lower() != "password"])
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
