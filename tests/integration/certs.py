"""Throwaway TLS certificates for tests, made with the ``openssl`` command into a tmp dir (never committed).

One CA signs a server certificate (for 127.0.0.1 and localhost) and a client certificate; keys are
EC P-256 so that making them takes milliseconds.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamgrp.config import TlsFiles


@dataclass(frozen=True)
class Certs:
    ca: Path
    server: TlsFiles  # the server's certificate and key, and the CA that signs clients
    client: TlsFiles  # a client's certificate and key, and the CA that signed the server


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {done.stderr}")


def _key(name: str, cwd: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", f"{name}.key", cwd=cwd)


def _signed(name: str, subject: str, extensions: str, cwd: Path) -> None:
    _key(name, cwd)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=cwd)
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-sha256",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.crt",
        cwd=cwd,
    )


def make_certs(directory: Path) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed; it makes the test certificates")
    directory.mkdir(parents=True, exist_ok=True)
    _key("ca", directory)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        "ca.key",
        "-subj",
        "/CN=streamgrp test CA",
        "-days",
        "2",
        "-sha256",
        "-out",
        "ca.crt",
        cwd=directory,
    )
    # The server's certificate also serves as a client one: the embedded server's owner presents it to check
    # that the server answers.
    _signed(
        "server",
        "/CN=localhost",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
        directory,
    )
    _signed("client", "/CN=streamgrp test client", "extendedKeyUsage=clientAuth\n", directory)
    for key in directory.glob("*.key"):
        key.chmod(0o600)
    ca = directory / "ca.crt"
    return Certs(
        ca,
        TlsFiles(directory / "server.crt", directory / "server.key", ca),
        TlsFiles(directory / "client.crt", directory / "client.key", ca),
    )
