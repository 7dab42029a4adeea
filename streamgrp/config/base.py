"""What every settings model shares (frozen, no unknown fields; a role's metrics endpoint), the TLS files
a process presents, and reading a secret from its file or environment variable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from streamgrp.errors import ConfigError

ENV_PREFIX = "STREAMGRP_"
CONFIG_ENV = "STREAMGRP_CONFIG"


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _RoleSettings(_Settings):
    """What every long-running role has: its metrics endpoint (loopback only unless told otherwise)."""

    metrics_port: int = Field(0, ge=0, le=65535, description="serve Prometheus /metrics on this port (0: off)")
    metrics_address: str = Field(
        "127.0.0.1",
        min_length=1,
        description="address the metrics endpoint listens on "
        "(0.0.0.0 or :: for every interface, so another machine's Prometheus can scrape it)",
    )


@dataclass(frozen=True)
class TlsFiles:
    """This process's certificate and key, and the CA it trusts for the other end (PEM files).

    For ``streamgrp server``: the server's certificate and key, and the CA that signs client
    certificates (clients must present one). For every other process: its client certificate and
    key, and the CA that signed the server's certificate."""

    cert_file: Path
    key_file: Path
    ca_cert_file: Path


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is reachable from this machine only."""
    import ipaddress

    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def read_secret(value: SecretStr | None, path: Path | None, flag: str) -> str | None:
    """A secret from its file (first line) or its environment variable's value; None when neither is set."""
    if path is not None:
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read {flag} {path}: {exc.strerror}; fix the path or its permissions") from None
        if not lines or not lines[0].strip():
            raise ConfigError(f"{flag} {path} is empty; write the secret on its first line")
        return lines[0].strip()
    if value is not None:
        if not value.get_secret_value():
            raise ConfigError("an empty secret would turn authentication off; unset it or set one")
        return value.get_secret_value()
    return None
