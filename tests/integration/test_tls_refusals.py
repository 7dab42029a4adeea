"""TLS refusals fail at once, not after the outage budget, and a URL that turns verification off is
warned about; on a real TLS server (Debian's redis-server: the bundled Valkey is built without TLS)."""

from __future__ import annotations

import logging
import time

import pytest
from certs import make_certs

from streamgrp.cli.server import EmbeddedServer
from streamgrp.config import TlsFiles
from streamgrp.errors import ServerError
from streamgrp.store.connection import connect

PASSWORD = "tls-test-pass"


@pytest.fixture
def tls_server(kind_binary, server_kind, tmp_path):
    if server_kind == "valkey":
        pytest.skip("the bundled valkey-server is built without TLS; the redis7 kind runs this test")
    certs = make_certs(tmp_path / "certs")
    server = EmbeddedServer(tmp_path / "data", binary=kind_binary, tls=certs.server, password=PASSWORD)
    url = server.start()
    try:
        yield url, certs, make_certs(tmp_path / "other")
    finally:
        server.stop()


@pytest.mark.parametrize(
    "which, refusal",
    [
        ("server", r"cannot verify .*not retried.*--tls-ca-cert-file"),  # the client trusts another CA
        ("client", r"refused this client's TLS certificate .*--tls-cert-file"),  # another CA signed the client's
    ],
)
def test_a_certificate_either_side_cannot_verify_fails_at_once(tls_server, which, refusal):
    url, certs, other = tls_server
    if which == "server":
        files = TlsFiles(certs.client.cert_file, certs.client.key_file, other.ca)
    else:
        files = TlsFiles(other.client.cert_file, other.client.key_file, certs.ca)
    started = time.monotonic()
    with pytest.raises(ServerError, match=refusal):
        connect(url, tls=files, outage_budget_s=60)
    assert time.monotonic() - started < 5  # not the 60 s budget


def test_a_url_turning_verification_off_is_warned_about(tls_server, caplog):
    url, certs, _other = tls_server
    with caplog.at_level(logging.WARNING, logger="streamgrp.store.connection"):
        client = connect(url + "?ssl_cert_reqs=none", tls=certs.client)
        assert client.ping()
        client.close()
    [warning] = [r.getMessage() for r in caplog.records if "ssl_cert_reqs" in r.getMessage()]
    assert "verification off" in warning and "--tls-ca-cert-file" in warning
    assert PASSWORD not in warning
