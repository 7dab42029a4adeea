"""`streamgrp report` on a real server: a run built in-process (workers, assembler, batcher), its page
checked for self-containment, one point per step in every chart, and totals equal to `run_summary`."""

from __future__ import annotations

import subprocess
import sys
from html.parser import HTMLParser

import orjson
import pytest

from streamgrp.config import BatcherConfig
from streamgrp.replay.report import CHART_IDS, build_report, png_available, render_html
from streamgrp.replay.summary import run_summary
from streamgrp.services.batcher import Batcher
from streamgrp.services.synthetic import make_sample

ROUND = BatcherConfig(round_s=0.05, lease_ttl_s=5)


def rollout(request):
    """Rejects the slots a prompt lists in ``reject``; else a sample sized by the slot."""
    if request.slot in request.prompt.get("reject", ()):
        return None
    return make_sample(
        tokens=4 + 3 * request.slot,
        version=request.version,
        reward=float(request.slot),
        seed=hash((request.task_id, request.slot)) % 10_000,
    )


#: One round of tasks: two complete, one partial, one dropped below the minimum, one dropped
#: all-unusable, and one complete group the batcher's filter discards.
ROUND_PROMPTS = [{}, {}, {"reject": [0]}, {"reject": [0, 1]}, {"reject": [0, 1, 2]}, {}]
ROUND_NAMES = ["ok", "ok", "partial", "below", "unusable", "filtered"]


# The report reads streams with plain XRANGE: what it draws does not depend on the server kind.
pytestmark = pytest.mark.one_server_kind


@pytest.fixture
def built_run(client, make_run, issuer, drain):
    """Four rounds of decisions, six steps (two rounds cut two steps at once), then two stale groups."""
    run = make_run(n_samples=3, min_usable_group_size=2, dp_size=2, batch_size=2, max_staleness=1)
    batcher = Batcher(client, run, ROUND, group_filter=lambda d: not d.task_id.startswith("filtered"))
    assert batcher.lease.acquire()
    batcher._activate()
    for round_index in range(4):
        ids = [f"{name}-{round_index}-{i}" for i, name in enumerate(ROUND_NAMES)]
        issuer(run).issue(ROUND_PROMPTS, task_ids=ids)
        drain(client, run, rollout)
        batcher.round()
    client.set(run.keys.version, 5)  # the next groups are version 0: more than max_staleness behind
    issuer(run).issue([{}, {}], task_ids=["late-0", "late-1"])
    drain(client, run, rollout)
    batcher.round()
    return run


class Page(HTMLParser):
    """Every start tag with its attributes, and the text of each totals cell by its key."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.totals: dict[str, str] = {}
        self._key: str | None = None

    def handle_starttag(self, tag, attrs):
        attributes = {k: v or "" for k, v in attrs}
        self.elements.append((tag, attributes))
        self._key = attributes.get("data-key") if tag == "td" else None

    def handle_data(self, data):
        if self._key is not None:
            self.totals[self._key] = self.totals.get(self._key, "") + data

    def handle_endtag(self, tag):
        self._key = None

    def points(self, series: str) -> list[int]:
        return sorted(
            int(a["data-step"])
            for tag, a in self.elements
            if "point" in a.get("class", "").split() and a.get("data-series") == series
        )

    def bars(self, chart: str) -> list[int]:
        steps, current = [], None
        for tag, a in self.elements:
            if tag == "svg":
                current = a.get("data-chart")
            elif tag == "g" and a.get("class") == "bar" and current == chart:
                steps.append(int(a["data-step"]))
        return steps


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    page.close()
    return page


def assert_self_contained(page: Page, html: str) -> None:
    for tag, attributes in page.elements:
        assert tag not in ("script", "img", "iframe", "object", "embed"), tag
        if tag == "link":  # only the empty icon, which keeps browsers from asking for /favicon.ico
            assert attributes == {"rel": "icon", "href": "data:,"}, attributes
        for name in ("src", "href", "xlink:href"):
            assert not attributes.get(name, "").startswith(("http://", "https://", "//")), (tag, attributes)
    assert "http://" not in html and "https://" not in html
    assert "url(" not in html and "@import" not in html


def expected_cells(summary: dict, prefix: str = "") -> dict[str, str]:
    """run_summary as the totals table shows it: nested keys joined by dots, floats to 4 decimals."""
    cells: dict[str, str] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            cells.update(expected_cells(value, name + ".") if value else {name: "none"})
        elif value is None:
            cells[name] = "n/a"
        elif isinstance(value, float):
            cells[name] = f"{value:.4f}"
        else:
            cells[name] = str(value)
    return cells


def test_the_report_draws_every_series_per_step_and_its_totals_match_the_summary(client, built_run):
    data = build_report(client, built_run.keys)
    summary = run_summary(client, built_run.keys)
    assert data.totals == summary
    steps = [row.step for row in data.steps]
    assert steps == list(range(6)) and summary["steps"] == 6

    html = render_html(data)
    page = parse(html)
    assert_self_contained(page, html)
    # no trainer ran: no loss or logprob mismatch, and the page says so instead of drawing empty charts
    assert [a["data-chart"] for tag, a in page.elements if tag == "svg"] == [
        chart for chart in CHART_IDS if chart not in ("loss", "logprob-mismatch")
    ]
    assert [a["id"] for tag, a in page.elements if a.get("id", "").startswith("omitted-")] == [
        "omitted-loss",
        "omitted-logprob-mismatch",
    ]
    for series in (
        "usable",
        "trainable",
        "usable (cumulative)",
        "trainable (cumulative)",
        "since previous step",
        "longest gap without a trainable decision",
        "imbalance",
        "mean reward",
    ):
        assert page.points(series) == steps, series
    for chart in ("decisions", "drop-reasons"):
        assert page.bars(chart) == steps, chart
    legends = {a["data-series"] for tag, a in page.elements if tag == "g" and a.get("class") == "legend-item"}
    assert {"complete", "partial", "dropped", "below_minimum", "all_unusable", "filtered"} <= legends

    assert page.totals == expected_cells(summary)
    assert page.totals["groups.complete"] == str(summary["groups"]["complete"]) == "14"  # 3 per round + 2 late
    assert page.totals["dropped_reasons.stale"] == "2"


def test_per_step_numbers_follow_the_rounds_and_add_up_to_the_totals(client, built_run):
    data = build_report(client, built_run.keys)
    summary = data.totals
    rows = data.steps
    # rounds 0-3 cut steps (0), (1, 2), (3), (4, 5): the second step of a pair has an empty window
    decided_in = [row.tally.groups_decided for row in rows]
    assert decided_in == [6, 6, 0, 6, 6, 0]
    assert rows[2].usable_yield is None and rows[5].trainable_yield is None
    assert rows[0].tally.decisions == {"complete": 3, "partial": 1, "dropped": 2}
    assert rows[0].tally.drop_reasons == {"all_unusable": 1, "below_minimum": 1, "filtered": 1}
    assert rows[0].usable_yield == pytest.approx(12 / 18) and rows[0].trainable_yield == pytest.approx(11 / 18)
    assert all(0 <= row.longest_gap_s <= row.step_seconds for row in rows)
    assert all(row.step_seconds >= 0 and row.imbalance >= 1.0 for row in rows)
    # the stale groups were decided and discarded after the last step
    assert data.after_last_step.decisions == {"complete": 2, "partial": 0, "dropped": 0}
    assert data.after_last_step.drop_reasons == {"stale": 2}
    for kind, total in summary["groups"].items():
        assert sum(row.tally.decisions[kind] for row in rows) + data.after_last_step.decisions[kind] == total
    for reason, total in summary["dropped_reasons"].items():
        per_step = sum(row.tally.drop_reasons.get(reason, 0) for row in rows)
        assert per_step + data.after_last_step.drop_reasons.get(reason, 0) == total
    assert data.status == "running (6 steps so far)"
    assert "After the last step" in render_html(data)


def test_reward_comes_from_the_decisions_and_loss_and_mismatch_from_the_trainer_metrics_hash(client, built_run):
    # the rollout's reward is the slot index: a step's mean is over the slots its groups kept
    data = build_report(client, built_run.keys)
    assert [row.reward for row in data.steps][:1] == [data.totals["reward_first"]]
    assert data.steps[-1].reward == data.totals["reward_last"]
    assert all(row.reward is not None and 0.0 <= row.reward <= 2.0 for row in data.steps)
    assert all(row.loss is None and row.logprob_mismatch is None for row in data.steps)

    # what a trainer records for a step (here by hand, as a trainer of one's own would) is charted at that step
    client.hset(
        built_run.keys.trainer_metrics,
        mapping={
            1: orjson.dumps({"loss": -0.5, "logprob_abs_diff_mean": 0.25}),
            4: orjson.dumps({"loss": 1.5}),
            "junk": b"{",
            5: b"not json",
        },
    )
    data = build_report(client, built_run.keys)
    assert [row.loss for row in data.steps] == [None, -0.5, None, None, 1.5, None]
    assert [row.logprob_mismatch for row in data.steps] == [None, 0.25, None, None, None, None]
    page = parse(render_html(data))
    assert [a["data-chart"] for tag, a in page.elements if tag == "svg"] == list(CHART_IDS)
    assert page.points("loss") == list(range(6))  # one marker per step; steps without a loss are hollow
    missing = sorted(
        int(a["data-step"])
        for tag, a in page.elements
        if a.get("data-series") == "loss" and "missing" in a.get("class", "").split()
    )
    assert missing == [0, 2, 3, 5]


# -- the command -----------------------------------------------------------------------------------------------


def streamgrp(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamgrp", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout
    )


def test_the_command_writes_report_run_html_by_default(client, redis_url, built_run, tmp_path):
    result = streamgrp("report", "--redis-url", redis_url, "--run", built_run.name, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    written = tmp_path / f"report-{built_run.name}.html"
    assert f"report written to report-{built_run.name}.html" in result.stdout
    page = parse(written.read_text())
    assert page.points("imbalance") == list(range(6))

    out = tmp_path / "elsewhere.html"
    assert streamgrp("report", "--redis-url", redis_url, "--run", built_run.name, "--out", str(out)).returncode == 0
    assert out.read_text() == written.read_text()  # deterministic: no wall-clock stamps in the page
    assert oct(written.stat().st_mode & 0o777) == oct(out.stat().st_mode & 0o777) == "0o600"  # only its owner reads


def test_the_command_names_what_to_fix(redis_url, run_name, tmp_path):
    missing = streamgrp("report", "--redis-url", redis_url, "--run", run_name, cwd=tmp_path)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "streamgrp runs" in missing.stderr
    if not png_available():
        png = streamgrp("report", "--redis-url", redis_url, "--run", run_name, "--format", "png", cwd=tmp_path)
        assert png.returncode == 2
        assert "pip install 'streamgrp[report]'" in png.stderr and "--format html" in png.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_demo_run_renders_one_point_per_step(redis_url, tmp_path):
    name = "report-" + tmp_path.name[-20:].strip("_-").replace("_", "-")
    demo = streamgrp(
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
        timeout=240,
    )
    assert demo.returncode == 0, demo.stderr
    out = tmp_path / "report.html"
    result = streamgrp("report", "--redis-url", redis_url, "--run", name, "--out", str(out))
    assert result.returncode == 0, result.stderr
    html = out.read_text()
    page = parse(html)
    assert_self_contained(page, html)
    for series in ("usable", "trainable", "since previous step", "imbalance"):
        assert page.points(series) == [0, 1, 2, 3]
    assert page.bars("decisions") == [0, 1, 2, 3]
    assert page.totals["steps"] == "4" and page.totals["committed_steps.0"] == "4"
    assert "Status: finished after 4 steps" in html


def test_the_bias_monitor_by_prompt_counts_each_prompts_tasks_together(client, built_run):
    from streamgrp.replay.report_prompts import prompt_key

    data = build_report(client, built_run.keys)
    rows = {row.key: row for row in data.prompts}
    plain = rows[prompt_key({})]  # "ok" and "filtered" tasks of every round, and the two late ones
    assert (plain.tasks, plain.generated, plain.trained, plain.stale) == (14, 42, 24, 6)
    partial = rows[prompt_key({"reject": [0]})]
    assert (partial.tasks, partial.generated, partial.trained, partial.trained_share) == (4, 8, 8, 1.0)
    assert [row.key for row in data.prompts][:2] == [plain.key, partial.key]  # trained least first
    assert rows[prompt_key({"reject": [0, 1, 2]})].trained_share is None  # nothing generated: dropped
    html = render_html(data)
    assert f'data-prompt="{plain.key}"' in html and 'id="prompt-shares"' in html
