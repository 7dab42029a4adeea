"""Issue 31's smaller connection items, without a server: which replies are an outage (BUSY, not
BUSYKEY), which TLS errors are refusals, the warnings for a weakened URL and for a password on the
command line, and the embedded server's --maxmemory (flag, environment, parsing)."""

from __future__ import annotations

import logging
import ssl

import pytest
import redis

from streamgrp.cli.main import main
from streamgrp.cli.parser import build_parser
from streamgrp.cli.server import EmbeddedServer
from streamgrp.cli.server_config import ServerLimits, parse_maxmemory
from streamgrp.config import ConnectionConfig, load
from streamgrp.errors import ConfigError
from streamgrp.store.connection import is_outage
from streamgrp.store.credentials import command_line_url_warning, tls_refusal, url_warnings

GiB = 1024**3


@pytest.mark.parametrize(
    "reply",
    [
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
        "BUSY Valkey is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
        "BUSY Redis is busy running a script. You can only call FUNCTION KILL or SHUTDOWN NOSAVE.",
        "Command # 1 (MULTI) of pipeline caused error: BUSY Redis is busy running a script.",
    ],
)
def test_busy_is_an_outage(reply):
    assert is_outage(redis.ResponseError(reply))


@pytest.mark.parametrize(
    "reply",
    [
        "BUSYKEY Target key name already exists.",
        "BUSYGROUP Consumer Group name already exists",
        "ERR Error running script: the word BUSY in a message",
    ],
)
def test_replies_about_keys_that_start_like_busy_are_not(reply):
    assert not is_outage(redis.ResponseError(reply))


def _wrapped(cause: BaseException) -> redis.ConnectionError:
    try:
        raise redis.ConnectionError("Error 1 connecting to 127.0.0.1:6380.") from cause
    except redis.ConnectionError as exc:
        return exc


def test_certificate_refusals_are_not_outages_and_say_what_to_set():
    verify = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    assert not is_outage(_wrapped(verify))
    assert "--tls-ca-cert-file" in str(tls_refusal(_wrapped(verify), "the server at rediss://h:1/0"))
    unknown_ca = ssl.SSLError(1, "[SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca")
    unknown_ca.reason = "TLSV1_ALERT_UNKNOWN_CA"
    assert not is_outage(_wrapped(unknown_ca))
    assert "--tls-cert-file" in str(tls_refusal(_wrapped(unknown_ca), "x"))
    cut = ssl.SSLEOFError(8, "EOF occurred in violation of protocol")  # a server restarting mid-handshake
    assert is_outage(_wrapped(cut)) and tls_refusal(_wrapped(cut), "x") is None


def test_a_url_that_weakens_tls_is_warned_about_without_its_password():
    [off] = url_warnings("rediss://:s3cret@h:1/0?ssl_cert_reqs=none")
    assert "verification off" in off and "s3cret" not in off and "--tls-ca-cert-file" in off
    assert len(url_warnings("rediss://h:1/0?ssl_cert_reqs=optional&ssl_check_hostname=false")) == 2
    assert url_warnings("rediss://h:1/0?ssl_cert_reqs=required") == []


@pytest.mark.parametrize("url", ["redis://:s3cret@h:1/0", "redis://user:s3cret@h:1/0", "redis://h:1/0?password=s3cret"])
def test_a_password_in_a_command_line_url_is_warned_about(url):
    warning = command_line_url_warning(url)
    assert warning is not None and "s3cret" not in warning
    assert "--password-file" in warning and "STREAMGRP_PASSWORD_FILE" in warning and "STREAMGRP_PASSWORD" in warning


def test_no_warning_without_a_password():
    assert command_line_url_warning("redis://user@h:1/0") is None
    assert command_line_url_warning(None) is None


def test_the_cli_warns_for_the_flag_but_not_for_the_environment(caplog, monkeypatch):
    url = "redis://:s3cret@127.0.0.1:1/0"
    with caplog.at_level(logging.WARNING):
        assert main(["runs", "--redis-url", url, "--command-budget-s", "0.2"]) == 2  # nothing listens there
    [warning] = [r.getMessage() for r in caplog.records if "carries a password" in r.getMessage()]
    assert "on the command line" in warning and "s3cret" not in warning
    caplog.clear()
    monkeypatch.setenv("STREAMGRP_REDIS_URL", url)
    with caplog.at_level(logging.WARNING):
        assert main(["runs", "--command-budget-s", "0.2"]) == 2
    assert not [r for r in caplog.records if "carries a password" in r.getMessage()]


def test_maxmemory_sizes_and_shares():
    assert parse_maxmemory("512mb") == 512 * 1024**2
    assert parse_maxmemory("4GB") == 4 * GiB
    assert parse_maxmemory("1073741824") == GiB
    assert parse_maxmemory("25%", total=8 * GiB) == 2 * GiB
    assert parse_maxmemory("0") == 0  # no cap, asked for explicitly
    assert parse_maxmemory("50%") > 0  # of this machine
    for bad in ("64", "lots", "150%", "-1gb"):
        with pytest.raises(ConfigError, match="--maxmemory"):
            parse_maxmemory(bad)
    args = ServerLimits(maxmemory=GiB).args()
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"


def test_maxmemory_is_a_flag_and_an_environment_variable_and_refused_before_a_server_starts(monkeypatch, tmp_path):
    parser = build_parser()
    args = parser.parse_args(["server", "--maxmemory", "2gb"])
    assert load(ConnectionConfig, overrides=vars(args)).maxmemory == "2gb"
    monkeypatch.setenv("STREAMGRP_MAXMEMORY", "3gb")
    assert load(ConnectionConfig, overrides=vars(parser.parse_args(["server"]))).maxmemory == "3gb"
    assert "STREAMGRP_MAXMEMORY" in parser.subcommands["server"].format_help()
    with pytest.raises(ConfigError, match="too little for a run"):
        EmbeddedServer(tmp_path / "data", maxmemory="64")
    assert not (tmp_path / "data").exists()
