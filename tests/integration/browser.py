"""Headless Chromium for tests: load a page from a local server, get its DOM, a screenshot and its requests.

`visit` serves one page on 127.0.0.1 from a threaded ``http.server`` that records every request it
receives. The same server is Chromium's proxy for every other address (``--proxy-server`` with
``<-loopback>`` so loopback goes through it too), and answers those with 404: nothing leaves the
machine whatever the page or the browser asks for, and every attempt is recorded.

Chromium also makes requests of its own whatever its flags (update checks, account and network-time
queries), so the page's requests are told apart in Chromium's NetLog (``--log-net-log``): a request
is the page's when the page's origin initiated it or it was made in the page's network isolation key
(its top frame's site). `tests/integration/test_report_browser.py` shows this check catching a
leaky page, so a Chromium whose NetLog says it differently fails that test instead of passing blind.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import struct
import subprocess
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

REQUIRE_ENV = "STREAMGRP_TEST_REQUIRE_CHROMIUM"
#: Flags that keep headless Chromium off the network and out of the user's profile (the profile is fresh).
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
PAGE_PATH = "/report.html"


def chromium() -> str:
    """The Chromium binary; skips the test without one (fails where CI requires it)."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"no chromium on PATH but {REQUIRE_ENV} is set: apt-get install chromium")
    pytest.skip("no chromium on PATH (Debian: apt-get install --no-install-recommends chromium)")


@dataclass(frozen=True)
class Visit:
    """What one page load produced."""

    url: str
    dom: str  # the DOM after loading (--dump-dom)
    screenshot: Path
    served: list[tuple[str, str]]  # (method, target) of every request the local server received, in order
    page_requests: list[str]  # URLs of the requests made for the page (NetLog), in order


class _Recorder(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, page: bytes) -> None:
        self.page = page
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Recorder

    def _answer(self) -> None:
        with self.server.lock:
            self.server.requests.append((self.command, self.path))
        host, port = self.server.server_address[:2]
        if self.command == "GET" and self.path in (PAGE_PATH, f"http://{host}:{port}{PAGE_PATH}"):
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(self.server.page)))
            self.end_headers()
            self.wfile.write(self.server.page)
        else:  # anything else, here or (as the proxy) anywhere: recorded, never fetched
            self.send_error(404)

    do_GET = do_HEAD = do_POST = do_PUT = do_CONNECT = _answer

    def log_message(self, *args) -> None:  # the recorder's list is the log
        pass


def visit(page: bytes, work: Path, *, width: int = 1000, height: int = 4200, timeout: float = 90) -> Visit:
    """Load ``page`` in headless Chromium over HTTP from 127.0.0.1; see the module docstring."""
    binary = chromium()
    server = _Recorder(page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}{PAGE_PATH}"
    netlog, screenshot = work / "netlog.json", work / "screenshot.png"
    try:
        result = subprocess.run(
            [
                binary,
                *FLAGS,
                f"--user-data-dir={work / 'profile'}",
                f"--proxy-server=http://{host}:{port}",
                "--proxy-bypass-list=<-loopback>",
                f"--log-net-log={netlog}",
                f"--window-size={width},{height}",
                f"--screenshot={screenshot}",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "HOME": str(work)},
        )
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert result.returncode == 0, result.stderr[-2000:]
    with server.lock:
        served = list(server.requests)
    return Visit(url, result.stdout, screenshot, served, page_requests(netlog, f"http://{host}:{port}"))


def page_requests(netlog: Path, origin: str) -> list[str]:
    """URLs of the requests Chromium's NetLog shows were made for the page served at ``origin``."""
    log = json.loads(netlog.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    site = origin.rsplit(":", 1)[0]  # a network isolation key names sites: scheme and host, no port
    urls = []
    for event in log["events"]:
        params = event.get("params") or {}
        if event["type"] != start or "url" not in params:
            continue
        if params.get("initiator") == origin or site in str(params.get("network_isolation_key", "")).split():
            urls.append(params["url"])
    return urls


def png_size_and_ink(path: Path) -> tuple[int, int, float]:
    """A PNG's width, height and a rough share of "ink": the bytes of its filtered image data that are
    neither 0 nor 255. Rows are stored as differences, so a blank page is all 0 (or 255) and gives
    about 0; text and charts give a few percent."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height, depth = struct.unpack(">IIB", data[16:25])
    assert depth == 8, f"expected an 8-bit PNG, got depth {depth}"
    idat, offset = b"", 8
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        if kind == b"IDAT":
            idat += data[offset + 8 : offset + 8 + length]
        offset += 12 + length
    raw = zlib.decompress(idat)
    return width, height, (len(raw) - raw.count(0) - raw.count(255)) / len(raw)
