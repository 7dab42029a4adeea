"""Credentials in URLs and connection options: masking a password wherever a URL is shown, dropping it
where a URL is handed on, and the redis-py options for a password and for TLS.

Owns the one rule for showing a server URL (the user name stays, the password never does, in the
user part or a ``password=`` query), which client options carry secrets, the warnings for a URL that
weakens them (a password on the command line, TLS verification turned off), and telling a refused
certificate from an outage (`tls_refusal`: waiting cannot fix one, so it is not retried). It
deliberately ignores connecting and riding out outages: that is `streamgrp.store.connection`.
"""

from __future__ import annotations

import inspect
import ssl
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis

from streamgrp.config import TlsFiles
from streamgrp.errors import ConfigError, ServerError

__all__ = [
    "auth_options",
    "command_line_url_warning",
    "safe_url",
    "tls_refusal",
    "url_warnings",
    "url_without_password",
]

#: Alerts a TLS server sends when it refuses the client's certificate: as permanent as a server
#: certificate this client cannot verify.
_REFUSED_CERTIFICATE = frozenset(
    {
        "TLSV1_ALERT_UNKNOWN_CA",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_EXPIRED",
        "SSLV3_ALERT_CERTIFICATE_REVOKED",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
        "TLSV1_ALERT_ACCESS_DENIED",
    }
)


#: No ``CLIENT SETINFO`` on connect: Redis 7.0 has no such command, so a role's ACL rules cannot name it
#: (they would not load there), and without a rule newer servers log a denied command for every connection.
_NO_CLIENT_INFO: dict[str, Any] = (
    {"driver_info": None}
    if "driver_info" in inspect.signature(redis.connection.AbstractConnection.__init__).parameters
    else {"lib_name": None, "lib_version": None}
)


def auth_options(url: str, password: str | None, tls: TlsFiles | None) -> dict[str, Any]:
    """redis-py options for the password (the URL's wins) and, for ``rediss://``, the TLS files."""
    options: dict[str, Any] = dict(_NO_CLIENT_INFO)
    if password is not None:
        options["password"] = password
    scheme = urlsplit(url).scheme
    if tls is not None:
        if scheme != "rediss":
            raise ConfigError(
                f"TLS files are set but {safe_url(url)} is not a rediss:// URL; use rediss://HOST:PORT/0 "
                "(or unset --tls-cert-file, --tls-key-file and --tls-ca-cert-file)"
            )
        options.update(
            ssl_ca_certs=str(tls.ca_cert_file), ssl_certfile=str(tls.cert_file), ssl_keyfile=str(tls.key_file)
        )
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


def url_warnings(url: str) -> list[str]:
    """What in ``url`` weakens TLS: ``ssl_cert_reqs=none``/``optional`` or ``ssl_check_hostname=false``.

    redis-py honours both query options silently; a client that does not verify the server sends
    its password and the run's data to whoever answers on that address.
    """
    query = {key.lower(): value.lower() for key, value in parse_qsl(urlsplit(url).query)}
    shown = safe_url(url)
    out = []
    if query.get("ssl_cert_reqs") in ("none", "optional"):
        out.append(
            f"{shown} turns TLS certificate verification off (ssl_cert_reqs={query['ssl_cert_reqs']}): anyone "
            "who can answer on that address sees the password and the run. Drop ssl_cert_reqs from the URL "
            "and give the server's CA with --tls-ca-cert-file (STREAMGRP_TLS_CA_CERT_FILE)"
        )
    if query.get("ssl_check_hostname") in ("false", "0", "no"):
        out.append(
            f"{shown} does not check that the server's certificate names its host (ssl_check_hostname="
            f"{query['ssl_check_hostname']}); drop that option and connect by a name the certificate holds"
        )
    return out


def command_line_url_warning(url: str | None) -> str | None:
    """The warning for a ``--redis-url`` given on the command line with a password in it; None without one."""
    if not url:
        return None
    try:
        parts = urlsplit(url)
        in_query = any(key.lower() == "password" for key, _ in parse_qsl(parts.query))
    except ValueError:
        return None
    if parts.password is None and not in_query:
        return None
    return (
        f"--redis-url {safe_url(url)} carries a password on the command line, where every user of this machine "
        "can read it (ps, /proc/PID/cmdline, shell history). Put it in a file only you can read and pass "
        "--password-file FILE (STREAMGRP_PASSWORD_FILE), or set STREAMGRP_PASSWORD, and drop it from the URL "
        "(or set the whole URL in STREAMGRP_REDIS_URL)"
    )


def tls_refusal(exc: BaseException, where: str) -> ServerError | None:
    """The error to raise at once when ``exc`` is a TLS certificate refusal, not an outage; else None.

    A server certificate this client cannot verify (unknown CA, wrong host name, expired), or a
    client certificate the server refuses, fails the same way on every attempt: retrying it for
    the whole outage budget only hides the fix. A connection cut during the handshake (a server
    restarting) stays an outage.
    """
    cause: BaseException | None = exc
    seen = 0
    while cause is not None and seen < 8:
        if isinstance(cause, ssl.SSLCertVerificationError):
            detail = getattr(cause, "verify_message", None) or cause
            return ServerError(
                f"{where} presented a TLS certificate this client cannot verify ({detail}); "
                "this is not retried. Give --tls-ca-cert-file (STREAMGRP_TLS_CA_CERT_FILE) the CA that signed the "
                "server's certificate, and connect by a host name or address the certificate names"
            )
        if isinstance(cause, ssl.SSLError) and getattr(cause, "reason", None) in _REFUSED_CERTIFICATE:
            return ServerError(
                f"{where} refused this client's TLS certificate ({cause.reason}); this is not retried. Give "
                "--tls-cert-file and --tls-key-file (STREAMGRP_TLS_CERT_FILE, STREAMGRP_TLS_KEY_FILE) a certificate "
                "signed by the CA the server trusts (its tls-ca-cert-file)"
            )
        cause = cause.__cause__ or cause.__context__
        seen += 1
    return None
