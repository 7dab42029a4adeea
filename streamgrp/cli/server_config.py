"""What the embedded server is told about who may connect: listening address, password, ACL file, TLS.

Owns the safety rules of starting a server: protected mode stays on; a server other machines can
reach (a non-loopback ``--bind``) needs a password or an ACL file; an ACL file must say what the
``default`` user may do (without a line for it, Redis and Valkey let anyone in with every
permission); a password-only server's one user may run every command streamgrp's roles need but
none of the ``@dangerous`` ones (``CONFIG SET appendonly no``, ``FLUSHALL``, ``DEBUG``, ``ACL``...),
so a leaked role credential cannot switch persistence off. Also the TLS options and, never on the
command line, the password: it goes in a config read from the server's stdin. It deliberately
ignores running the process: that is `streamgrp.cli.server`.

Also the limits that keep one client from taking the server down (`ServerLimits`): a memory cap
with ``maxmemory-policy noeviction`` (a full server refuses writes, which roles wait out, instead of
growing until the machine's OOM killer ends it, or evicting a run's state), and the script time
limit after which a running script makes the server answer ``BUSY`` and becomes killable with
``SCRIPT KILL``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from streamgrp.config import TlsFiles
from streamgrp.errors import ConfigError

__all__ = [
    "DEFAULT_MAXMEMORY",
    "DEFAULT_USER_RULES",
    "SCRIPT_TIME_LIMIT_MS",
    "ServerLimits",
    "ServerSecurity",
    "check_acl_file",
    "is_loopback",
    "machine_memory",
    "parse_maxmemory",
]

#: The embedded server's memory cap unless ``--maxmemory`` says otherwise: half the machine (or of the
#: container's limit), leaving the rest to the roles beside it and to the copy-on-write of an AOF rewrite.
DEFAULT_MAXMEMORY = "50%"
#: Below this a server refuses a run's first writes; a typo ("64" for 64 MB) is refused instead.
MIN_MAXMEMORY = 32 * 1024 * 1024
#: Milliseconds a script may run before the server answers BUSY to everyone else and accepts SCRIPT KILL.
#: streamgrp's own scripts validate bounded input and finish in milliseconds; the server's default
#: (5 s) would only keep a runaway script unkillable for longer.
SCRIPT_TIME_LIMIT_MS = 1000
_UNITS = {"": 1, "b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3, "tb": 1024**4}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(%|[kmgt]?b?)\s*", re.IGNORECASE)

#: The rules of a password-only server's default user: everything streamgrp uses, no @dangerous
#: command but INFO (the connection check) and CONFIG GET (reading appendfsync). Administer with an
#: ACL file that defines an administrator.
DEFAULT_USER_RULES = "~* &* +@all -@dangerous +info +config|get"


def is_loopback(address: str) -> bool:
    """Whether ``address`` (one ``--bind`` entry; ``-`` marks an optional one) is reachable from this machine only."""
    address = address.lstrip("-")
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False  # a host name or "*": could be anything


def quote_config(value: str) -> str:
    """Quote for a redis.conf line: every byte as a \\xHH escape inside double quotes."""
    return '"' + "".join(f"\\x{byte:02x}" for byte in value.encode()) + '"'


def check_acl_file(path: Path) -> None:
    """Refuse an ACL file that leaves the default user open (no line for it, or ``nopass``)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the ACL file {path}: {exc.strerror}; fix --acl-file") from None
    default = None
    for line in lines:
        words = line.split()
        if len(words) >= 2 and words[0] == "user" and words[1] == "default":
            default = words[2:]
    fix = (
        'add "user default off" (no anonymous clients; `streamgrp acl RUN` prints it) or give the default '
        'user a password (">PASSWORD" or "#SHA256") and the rules it needs'
    )
    if default is None:
        raise ConfigError(
            f"the ACL file {path} has no line for the default user, which the server would then let "
            f"in without a password and with every permission; {fix}"
        )
    if "nopass" in default and default.index("nopass") > _last(default, "resetpass"):
        raise ConfigError(f"the ACL file {path} lets the default user in without a password (nopass); {fix}")


def _last(words: list[str], word: str) -> int:
    return max((i for i, w in enumerate(words) if w == word), default=-1)


@dataclass(frozen=True)
class ServerSecurity:
    """Who may connect to one embedded server: its address, the default user's password, an ACL file, TLS."""

    bind: str = "127.0.0.1"
    password: str | None = None
    acl_file: Path | None = None
    tls: TlsFiles | None = None

    def __post_init__(self) -> None:
        if self.password == "":
            raise ConfigError("password='' would disable authentication; pass None or a non-empty password")
        if self.acl_file is not None:
            check_acl_file(self.acl_file)
        remote = [address for address in self.bind.split() if not is_loopback(address)]
        if remote and self.password is None and self.acl_file is None:
            raise ConfigError(
                f"--bind {self.bind} listens on {' '.join(remote)}, which other machines can reach, and the server "
                "has no password: anyone who reaches the port could read, rewrite or stop every run. Give a password "
                "(--password-file FILE, or the STREAMGRP_PASSWORD environment variable) or an ACL file (--acl-file; "
                "`streamgrp acl RUN` prints one user per role), or bind 127.0.0.1"
            )
        for name in ("cert_file", "key_file", "ca_cert_file"):
            path = getattr(self.tls, name, None)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"--tls-{name.replace('_', '-')} {path} is not a file; fix the path")

    @property
    def anonymous_refused(self) -> bool:
        """True when the server may refuse a client that brings no credentials (an ACL file decides)."""
        return self.acl_file is not None

    def args(self, port: int) -> list[str]:
        """The command-line options for listening on ``port`` with these settings (no secret among them)."""
        if self.tls is None:
            listen = ["--port", str(port)]
        else:  # TLS only: the plain port is closed
            listen = [
                "--port",
                "0",
                "--tls-port",
                str(port),
                "--tls-cert-file",
                str(self.tls.cert_file),
                "--tls-key-file",
                str(self.tls.key_file),
                "--tls-ca-cert-file",
                str(self.tls.ca_cert_file),
                "--tls-auth-clients",
                "yes",
            ]
        acl = ["--aclfile", str(Path(self.acl_file).resolve())] if self.acl_file is not None else []
        return [*listen, "--bind", *self.bind.split(), "--protected-mode", "yes", *acl]

    def stdin_config(self) -> str | None:
        """The config lines the server reads from stdin: the default user's password and rules, or None.

        With an ACL file the file defines every user (the server ignores ``requirepass`` then) and
        ``password`` is only what streamgrp authenticates with to check the server."""
        if self.password is None or self.acl_file is not None:
            return None
        return f"user default on resetpass {quote_config('>' + self.password)} {DEFAULT_USER_RULES}\n"

    def describe(self) -> str:
        """For logs: how clients authenticate and whether traffic is encrypted (never the password)."""
        auth = "ACL users" if self.acl_file else "a password" if self.password else "no password"
        return f"{auth}, {'TLS' if self.tls else 'plain TCP'}, bound to {shlex.join(self.bind.split())}"


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit when lower (a container)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def parse_maxmemory(text: str, total: int | None = None) -> int:
    """Bytes from ``--maxmemory``: ``1073741824``, ``512mb``, ``4gb`` (binary units), ``50%`` of ``total``
    (default `machine_memory`), or ``0`` for no cap."""
    match = _SIZE.fullmatch(str(text))
    if match is None:
        raise ConfigError(
            f"--maxmemory {text!r:.40} is not a size; give bytes, a size such as 512mb or 4gb, or a "
            "share of this machine's memory such as 50% (STREAMGRP_MAXMEMORY)"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise ConfigError(f"--maxmemory {text} is not a share between 0% and 100%")
        size = int((total if total is not None else machine_memory()) * number / 100)
    else:
        size = int(number * _UNITS[unit if unit.endswith("b") or not unit else unit + "b"])
    if 0 < size < MIN_MAXMEMORY:
        raise ConfigError(
            f"--maxmemory {text} is {size} bytes, too little for a run; give at least 32mb (or 0 for no cap)"
        )
    return size


@dataclass(frozen=True)
class ServerLimits:
    """What one client may take of an embedded server: memory (bytes, 0 for no cap) and script time."""

    maxmemory: int
    script_time_limit_ms: int = SCRIPT_TIME_LIMIT_MS

    def args(self) -> list[str]:
        # noeviction whatever the cap: an evicting server would silently delete a run's state, and
        # streamgrp refuses to use one (streamgrp.store.connection).
        return [
            "--maxmemory",
            str(self.maxmemory),
            "--maxmemory-policy",
            "noeviction",
            "--busy-reply-threshold",
            str(self.script_time_limit_ms),
        ]
