"""`streamgrp report`'s page in headless Chromium, from a real run (`streamgrp demo`, whose reference
trainer records loss and logprob mismatch): every chart renders, the new reward, loss and logprob
mismatch charts included, the screenshot is not blank, and the page requests nothing but itself.

How requests are recorded, and why the NetLog too: `tests/integration/browser.py`. The second test
loads a deliberately leaky page, so the request check is shown to catch what it is meant to.
"""

from __future__ import annotations

import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from browser import PAGE_PATH, png_size_and_ink, visit

from streamgrp.replay.report import CHART_IDS

pytestmark = pytest.mark.slow  # a whole demo run, then Chromium


class Dom(HTMLParser):
    """Each chart's id and, per chart, the steps of its markers (by series)."""

    def __init__(self) -> None:
        super().__init__()
        self.svgs: list[str] = []
        self.points: dict[str, dict[str, list[int]]] = {}
        self.omitted: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag == "svg" and a.get("id", "").startswith("chart-"):
            self.svgs.append(a["id"])
        elif "point" in a.get("class", "").split() and self.svgs:
            self.points.setdefault(self.svgs[-1], {}).setdefault(a["data-series"], []).append(int(a["data-step"]))
        elif a.get("id", "").startswith("omitted-"):
            self.omitted.append(a["id"])


def parse_dom(dom: str) -> Dom:
    parsed = Dom()
    parsed.feed(dom)
    parsed.close()
    return parsed


@pytest.fixture
def demo_report(redis_url, server_kind, tmp_path) -> bytes:
    """The report page of a 4-step demo run on the test server."""
    if server_kind != "valkey":
        pytest.skip("the page does not depend on the server kind; the report's reading is tested on both")
    name = "browser-" + tmp_path.name[-20:].strip("_-").replace("_", "-")
    run = [sys.executable, "-m", "streamgrp"]
    demo = subprocess.run(
        [
            *run,
            "demo",
            "--redis-url",
            redis_url,
            "--data-dir",
            str(tmp_path / "data"),
            "--steps",
            "4",
            "--ranks",
            "1",
            "--workers",
            "1",
            "--run",
            name,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert demo.returncode == 0, demo.stderr
    out = tmp_path / "report.html"
    report = subprocess.run(
        [*run, "report", "--redis-url", redis_url, "--run", name, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    return out.read_bytes()


def test_every_chart_renders_in_chromium_and_the_page_requests_only_itself(demo_report, tmp_path):
    browser = visit(demo_report, tmp_path / "chromium")

    dom = parse_dom(browser.dom)
    assert dom.svgs == [f"chart-{chart}" for chart in CHART_IDS]
    assert {"chart-reward", "chart-loss", "chart-logprob-mismatch"} <= set(dom.svgs)  # named: the new ones
    assert dom.omitted == []
    steps = [0, 1, 2, 3]
    for chart in ("yields", "reward", "loss", "logprob-mismatch", "stall", "imbalance"):
        assert dom.points[f"chart-{chart}"], chart
        for series, marked in dom.points[f"chart-{chart}"].items():
            assert sorted(marked) == steps, (chart, series)
    assert "streamgrp report: run browser-" in browser.dom

    width, height, ink = png_size_and_ink(browser.screenshot)
    assert (width, height) == (1000, 4200)
    assert ink > 0.01, f"the screenshot looks blank (ink {ink:.4f})"

    # Only the page, once: no icon, stylesheet, font or image from anywhere, here or elsewhere.
    assert browser.page_requests == [browser.url]
    origin = browser.url.removesuffix(PAGE_PATH)
    here = [
        (method, target.removeprefix(origin))
        for method, target in browser.served
        if target.startswith(("/", origin + "/"))
    ]  # a proxy is asked for whole URLs, a server for paths
    assert here == [("GET", PAGE_PATH)]


LEAKY = b"""<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,">
<link rel="stylesheet" href="https://cdn.example.com/report.css"></head>
<body><svg id="chart-yields" width="10" height="10"></svg>
<img src="http://example.invalid/pixel.png" alt=""></body></html>"""


def test_the_request_check_catches_a_page_that_loads_from_elsewhere(tmp_path: Path):
    browser = visit(LEAKY, tmp_path / "chromium", height=600)
    assert parse_dom(browser.dom).svgs == ["chart-yields"]
    assert browser.page_requests[0] == browser.url
    assert set(browser.page_requests[1:]) == {"https://cdn.example.com/report.css", "http://example.invalid/pixel.png"}
    # the proxy saw the attempts, so nothing went out: the plain HTTP one whole, the HTTPS one as a CONNECT
    assert ("GET", "http://example.invalid/pixel.png") in browser.served
    assert ("CONNECT", "cdn.example.com:443") in browser.served
