"""`ConnectionConfig`: where the server is, how to authenticate and encrypt, and which run to use."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator

from streamgrp.config.base import TlsFiles, _Settings
from streamgrp.errors import ConfigError


class ConnectionConfig(_Settings):
    """Where the server is, how to authenticate and encrypt, and which run to use.

    The password is never a flag (a process's arguments are readable by every user of the machine):
    it comes from ``--password-file`` or the ``STREAMGRP_PASSWORD`` environment variable.
    """

    redis_url: str | None = Field(
        None,
        description="Redis/Valkey URL (redis://, rediss://, unix://); "
        "unset starts or reuses the embedded server in --data-dir",
    )
    cluster: bool = Field(
        False,
        description="--redis-url is a node of a Redis Cluster: use the cluster client, "
        "which finds the other nodes from it",
    )
    data_dir: Path = Field(Path(".streamgrp"), description="embedded server data directory (AOF files, logs)")
    maxmemory: str = Field(
        "50%",
        description="memory cap of the embedded server this command starts: bytes, "
        "512mb, 4gb, or a share of this machine's memory such as 50%; 0 for none. A full server "
        "refuses writes (noeviction), which roles wait out; ignored with --redis-url",
    )
    run: str | None = Field(None, description="run name; inspection commands default to the latest run")
    outage_budget_s: float = Field(
        300.0,
        gt=0,
        description="ride out a server outage (down, paused, restarting, loading, full) for this long before giving up",
    )
    command_budget_s: float = Field(
        10.0,
        gt=0,
        description="one-shot commands (runs, steps, verify, inspect, "
        "replay, report, export, delete, acl) give up on an unreachable server after "
        "this long; services ride outages for --outage-budget-s",
    )
    wait_replicas: int = Field(
        0,
        ge=0,
        description="after each commit wait until this many replicas have it "
        "(WAITAOF, or WAIT on Redis 7.0); 0: do not wait",
    )
    wait_timeout_ms: int = Field(1000, ge=1, description="how long one replica wait may take before a warning")
    password_file: Path | None = Field(
        None,
        description="file holding the password: `server` gives it to the "
        "default user; every other command authenticates with it (as the URL's "
        "user) unless the URL carries one",
    )
    password: SecretStr | None = Field(
        None, description="the password itself; environment only, never a flag", json_schema_extra={"flag": None}
    )
    tls_cert_file: Path | None = Field(
        None, description="TLS certificate (PEM): the server's for `server`, this client's otherwise"
    )
    tls_key_file: Path | None = Field(None, description="private key (PEM) of --tls-cert-file")
    tls_ca_cert_file: Path | None = Field(
        None,
        description="CA certificate (PEM): the one that signs client "
        "certificates for `server`, the one that signed the server's otherwise",
    )

    @model_validator(mode="after")
    def _check_secrets(self) -> ConnectionConfig:
        if self.password is not None and self.password_file is not None:
            raise ValueError("both STREAMGRP_PASSWORD and --password-file are set; give one of them")
        if self.password is not None and not self.password.get_secret_value():
            raise ValueError(
                "STREAMGRP_PASSWORD is empty, which would turn authentication off; unset it or set a password"
            )
        tls = (self.tls_cert_file, self.tls_key_file, self.tls_ca_cert_file)
        if any(tls) and not all(tls):
            raise ValueError("TLS needs all three of --tls-cert-file, --tls-key-file and --tls-ca-cert-file")
        return self

    @field_validator("redis_url")
    @classmethod
    def _a_redis_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"{url.split('@')[-1][:120]!r} is not a Redis URL: give redis://HOST:PORT/DB, "
                "rediss://HOST:PORT/DB (TLS) or unix:///PATH"
            )
        return url

    def secret(self) -> str | None:
        """The password, from STREAMGRP_PASSWORD or the first line of --password-file; None when neither is set."""
        if self.password is not None:
            return self.password.get_secret_value()
        if self.password_file is None:
            return None
        try:
            text = self.password_file.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(
                f"cannot read --password-file {self.password_file}: {exc.strerror}; fix the path or its permissions"
            ) from None
        if not text or not text[0].strip():
            raise ConfigError(f"--password-file {self.password_file} is empty; write the password on its first line")
        return text[0].strip()

    def tls(self) -> TlsFiles | None:
        if self.tls_cert_file is None or self.tls_key_file is None or self.tls_ca_cert_file is None:
            return None
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_ca_cert_file)
