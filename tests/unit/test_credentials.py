"""Passwords never shown in a URL, and never handed on in one."""

from __future__ import annotations

import pytest

from streamgrp.config import ConnectionConfig, TlsFiles, load
from streamgrp.errors import ConfigError
from streamgrp.store.credentials import auth_options, safe_url, url_without_password


@pytest.mark.parametrize(
    ("url", "shown", "handed_on"),
    [
        ("redis://h:1/0", "redis://h:1/0", "redis://h:1/0"),
        ("redis://:p%40ss@h:1/0", "redis://:***@h:1/0", "redis://h:1/0"),
        ("rediss://alice:secret@h:1/0", "rediss://alice:***@h:1/0", "rediss://alice@h:1/0"),
        ("redis://alice@h:1/0", "redis://alice@h:1/0", "redis://alice@h:1/0"),
        ("redis://h:1/0?password=secret&db=1", "redis://h:1/0?password=***&db=1", "redis://h:1/0?db=1"),
    ],
)
def test_urls_are_shown_and_handed_on_without_their_password(url, shown, handed_on):
    assert safe_url(url) == shown
    assert url_without_password(url) == handed_on
    assert "secret" not in safe_url(url) + url_without_password(url)


def test_tls_files_need_a_rediss_url_and_the_password_is_never_a_flag(tmp_path):
    files = TlsFiles(tmp_path / "c.crt", tmp_path / "c.key", tmp_path / "ca.crt")
    options = auth_options("rediss://h:1/0", "pw", files)
    assert options["ssl_certfile"] == str(files.cert_file) and options["password"] == "pw"
    with pytest.raises(ConfigError, match="rediss://"):
        auth_options("redis://h:1/0", None, files)
    with pytest.raises(ConfigError, match="all three"):
        load(ConnectionConfig, env={"STREAMGRP_TLS_CERT_FILE": "c.crt"})
    (tmp_path / "pw").write_text("from a file\n")
    assert load(ConnectionConfig, env={"STREAMGRP_PASSWORD_FILE": str(tmp_path / "pw")}).secret() == "from a file"
    config = load(ConnectionConfig, env={"STREAMGRP_PASSWORD": " none "})
    assert config.secret() == " none " and "none" not in repr(config)  # taken as it is, shown masked
    with pytest.raises(ConfigError, match="empty"):
        load(ConnectionConfig, env={"STREAMGRP_PASSWORD": ""})


def test_the_password_has_no_flag():
    from streamgrp.cli.parser import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--password", "x"])
    assert build_parser().parse_args(["worker", "--password-file", "f"]).password_file is not None
