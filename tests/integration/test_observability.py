"""Prometheus, alerts and dashboards against real processes: what operators will actually load.

- promtool checks the ops/ configuration and rules and runs the alert unit tests (ops/alerts_test.yml);
- every role's ``/metrics`` passes ``promtool check metrics`` with no problem reported;
- a ``streamgrp demo --prometheus`` run is scraped, and EVERY query of the Grafana dashboard returns
  data through Prometheus's HTTP API (Grafana variables substituted);
- a run whose workers reject everything shows the stall gauges rising in Prometheus, and the stall
  alert (with the run's bounds rendered into the rules) fires before the batcher fails the run.

These tests exercise Prometheus, not the server, so the ones that need a server run on the bundled
Valkey only (``server_kind`` parametrized indirectly). They skip when ``prometheus`` or ``promtool``
is missing; CI installs both (Debian's ``prometheus`` package).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from processes import wait_until

from streamgrp.cli import prom
from streamgrp.cli.children import free_port
from streamgrp.config import RunConfig
from streamgrp.errors import ConfigError
from streamgrp.store.keys import RunKeys
from streamgrp.store.runs import join_run

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"
DASHBOARD = ROOT / "grafana" / "dashboards" / "streamgrp.json"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
INSTALL = "apt-get install prometheus (Debian's package brings prometheus and promtool)"

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=f"promtool is not on PATH; {INSTALL}")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason=f"prometheus is not on PATH; {INSTALL}")
on_valkey = pytest.mark.parametrize("server_kind", ["valkey"], indirect=True)

# Grafana's built-in interval variables, as a 1 s scrape interval and a short time range give them.
GRAFANA_BUILTINS = {"__rate_interval": "30s", "__interval": "15s", "__range": "5m"}
ROLES = ("worker", "assembler", "batcher", "trainer")
DEMO_STEPS = 20


# -- helpers ------------------------------------------------------------------------------------------


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, timeout=60)


def api(base: str, path: str, **params) -> dict:
    """GET a Prometheus HTTP API endpoint; returns ``data`` (asserting status success)."""
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def query(base: str, expr: str, at: float | None = None) -> list:
    params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    return api(base, "/api/v1/query", **params)["result"]


def query_range(base: str, expr: str, start: float, end: float, step: float = 1.0) -> list:
    return api(base, "/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")[
        "result"
    ]


def fetch(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read()
    except OSError:
        return None


class Role:
    """A `python -m streamgrp ROLE` child with its output in a file; always reaped and closed."""

    def __init__(self, role: str, args: list[str], log_dir: Path, tag: str = "") -> None:
        self.role = role
        self.log_path = log_dir / f"{role}{tag}.log"
        with open(self.log_path, "wb") as output:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "streamgrp", "--log-level", "INFO", role, *args],
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


#: What each role's /metrics must show once work flows: the figures it owns (SPEC section 7 names), and
#: no other role's (assembler: slot and group accounting; batcher: steps written, the stall, staleness;
#: trainers: steps committed, failures, batch wait; workers: what they published).
EXPORTS = {
    "worker": {
        "streamgrp_slots_published_total",
        "streamgrp_policy_version",
        "streamgrp_rollouts_in_flight",
        "streamgrp_rollout_seconds_count",
    },
    "assembler": {
        "streamgrp_slots_total",
        "streamgrp_groups_total",
        "streamgrp_target_slots_total",
        "streamgrp_usable_slots_total",
        "streamgrp_trainable_slots_total",
        "streamgrp_open_groups",
        "streamgrp_group_assembly_seconds_count",
        "streamgrp_consumer_lag_entries",
        "streamgrp_pending_entries",
    },
    "batcher": {
        "streamgrp_steps_written_total",
        "streamgrp_stall_seconds",
        "streamgrp_empty_rounds",
        "streamgrp_batch_imbalance_ratio",
        "streamgrp_staleness_versions_count",
        "streamgrp_policy_version",
        "streamgrp_consumer_lag_entries",
        "streamgrp_pending_entries",
    },
    "trainer": {
        "streamgrp_steps_total",
        "streamgrp_trainer_step",
        "streamgrp_batch_wait_seconds_count",
        "streamgrp_step_failures_total",
        "streamgrp_policy_version",
        "streamgrp_steps_retrained_total",
    },
}


def exported_series(body: bytes) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets of its series, from a /metrics body."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample.labels)
    return found


#: What only a run with a rewarder or a follower exports (the reward and follower panels).
NOT_IN_DEMO = ("streamgrp_reward", 'group="rewarders"', "streamgrp_follow")


def dashboard_queries() -> list[tuple[str, str, bool]]:
    """(panel title, expr, instant) of every dashboard query, with Grafana's variables substituted."""
    dashboard = json.loads(DASHBOARD.read_text())
    values = dict(GRAFANA_BUILTINS)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            values[variable["name"]] = variable.get("allValue") or ".+"
        elif variable["type"] in ("textbox", "constant", "custom"):
            values[variable["name"]] = variable["query"]
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], target["expr"])
            out.append((panel["title"], expr, bool(target.get("instant"))))
    return out


@pytest.fixture
def observer(tmp_path):
    """Start a Prometheus (via streamgrp.cli.prom) on a targets file; stopped at teardown."""
    started: list[prom.Prometheus] = []

    def start(targets_file: Path, rules_file: Path | None = None, scrape_interval_s: float = 1.0) -> str:
        directory = tmp_path / f"observer-{len(started)}"
        config = prom.write_config(
            directory, targets_file=targets_file, rules_file=rules_file, scrape_interval_s=scrape_interval_s
        )
        server = prom.Prometheus(config, directory)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


# -- static checks ------------------------------------------------------------------------------------


@needs_promtool
def test_ops_prometheus_config_is_valid():
    result = promtool("check", "config", str(OPS / "prometheus.yml"))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


@needs_promtool
def test_ops_alert_rules_are_valid():
    result = promtool("check", "rules", str(OPS / "alerts.yml"))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


@needs_promtool
def test_alert_rule_unit_tests_pass():
    text = (OPS / "alerts_test.yml").read_text()
    for alert in re.findall(r"- alert: (\w+)", (OPS / "alerts.yml").read_text()):
        assert text.count(f"alertname: {alert}") >= 2, f"{alert} needs a firing and a quiet case"
    result = promtool("test", "rules", str(OPS / "alerts_test.yml"))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


@needs_promtool
def test_the_demo_configuration_with_a_runs_bounds_is_valid(tmp_path):
    targets = [prom.Target("batcher", 0, 9401), prom.Target("trainer", 1, 9411)]
    config = prom.prepare(tmp_path, targets, max_empty_rounds=4, stall_timeout_s=12.5)
    rules = (tmp_path / "alerts.yml").read_text()
    assert "vector(4)" in rules and "vector(12.5)" in rules and "vector(1800)" not in rules
    for args in (("check", "config", str(config)), ("check", "rules", str(tmp_path / "alerts.yml"))):
        result = promtool(*args)
        assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    listed = json.loads((tmp_path / "targets.json").read_text())
    assert listed[1] == {"targets": ["127.0.0.1:9411"], "labels": {"role": "trainer", "index": "1"}}


def test_every_dashboard_query_and_alert_keeps_runs_apart():
    """Every series of a run's process carries ``run``: each dashboard selector of a streamgrp metric picks
    the chosen run, and each alert aggregation keeps ``run`` (two runs in one Prometheus never add up)."""
    selectors = [
        (expr, m.group(1), m.group(2))
        for _, expr, _ in dashboard_queries()
        for m in re.finditer(r"(streamgrp_\w+)\{([^}]*)\}", expr)
    ]
    assert len(selectors) >= 30
    assert [(expr, metric) for expr, metric, labels in selectors if 'run=~".+"' not in labels] == []
    dashboard = json.loads(DASHBOARD.read_text())
    [run] = [v for v in dashboard["templating"]["list"] if v["name"] == "run"]
    assert "streamgrp_run_info" in run["query"]["query"] and run["multi"] is False
    lines = (OPS / "alerts.yml").read_text().splitlines()
    rules = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    clauses = re.findall(r"\b(?:by|on) \(([^)]*)\)", rules)
    assert len(clauses) >= 10
    assert [c for c in clauses if c and "run" not in c.split(", ")] == []
    assert "up{" not in rules  # up has no run label; a rank is up for its run while its run_info is scraped


def test_a_missing_prometheus_binary_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="apt-get install prometheus"):
        prom.prometheus_binary()
    # `streamgrp demo --prometheus` refuses before it starts anything
    result = subprocess.run(
        [sys.executable, "-m", "streamgrp", "demo", "--prometheus", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(tmp_path)},
    )
    assert result.returncode == 2 and "apt-get install prometheus" in result.stderr, result.stderr
    assert not (tmp_path / "server.json").exists()


# -- live processes ------------------------------------------------------------------------------------


@needs_promtool
@on_valkey
def test_every_role_serves_metrics_that_promtool_accepts(client, redis_url, run_name, tmp_path):
    join_run(client, run_name, RunConfig(n_samples=2))
    common = ["--redis-url", redis_url, "--run", run_name]
    dataset = tmp_path / "prompts.jsonl"
    prompt = {"reject_rate": 0.5, "fail_rate": 0.2}
    dataset.write_text("".join(json.dumps({"p": i % 8, **prompt}) + "\n" for i in range(5000)))
    extra = {
        "worker": ["--rollout", "streamgrp.consumers.toy_task:rollout", "--concurrency", "2"],
        "assembler": ["--tick-interval-s", "0.2"],
        "batcher": ["--dataset", str(dataset), "--round-s", "0.5"],
        "trainer": [],
    }
    ports = {role: free_port("127.0.0.1") for role in ROLES}
    roles = [Role(role, [*common, *extra[role], "--metrics-port", str(ports[role])], tmp_path) for role in ROLES]
    try:
        for role in roles:
            url = f"http://127.0.0.1:{ports[role.role]}/metrics"
            served = wait_until(
                lambda r=role, u=url: fetch(u) or r.proc.poll() is not None,
                timeout=90,
                message=f"{role.role} {url}",
                interval=0.25,
            )
            assert isinstance(served, bytes), f"{role.role} exited:\n{role.output()}"
        time.sleep(2.0)  # let work flow, so labelled series and histogram samples appear
        for role in roles:
            body = fetch(f"http://127.0.0.1:{ports[role.role]}/metrics")
            assert body is not None, f"{role.role} stopped serving:\n{role.output()}"
            exported = exported_series(body)
            names = {name for name in exported if name.startswith("streamgrp_")}
            assert EXPORTS[role.role] <= names, f"{role.role} lacks {sorted(EXPORTS[role.role] - names)}"
            others = set().union(*EXPORTS.values()) - EXPORTS[role.role]
            assert not names & others, f"{role.role} exports another role's {sorted(names & others)}"
            assert "process_cpu_seconds_total" in exported and "process_open_fds" in exported
            assert [labels["run"] for labels in exported["streamgrp_run_info"]] == [run_name]
            stray = sorted(name for name, series in exported.items() if any(s.get("run") != run_name for s in series))
            assert stray == [], f"{role.role}: series without run={run_name!r}: {stray}"
            if role.role in ("assembler", "batcher"):  # read from the server at scrape time
                assert any(s["group"] == "assembler" for s in exported["streamgrp_pending_entries"])
            result = promtool("check", "metrics", stdin=body)
            problems = (result.stdout + result.stderr).decode().strip()
            assert result.returncode == 0 and not problems, f"{role.role}: {problems}"
    finally:
        for role in roles:
            role.stop()


@pytest.mark.slow
@needs_prometheus
@on_valkey
def test_demo_with_prometheus_gives_every_dashboard_query_data(client, redis_url, run_name, tmp_path, observer):
    # A Prometheus of our own on the demo's targets file keeps the data after the demo stops its own. It
    # starts first and scrapes four times a second: Prometheus hands discovered targets to its scrapers
    # only every 5 s, and an unloaded machine runs the whole demo in about ten.
    targets_dir = tmp_path / "logs" / run_name / "prometheus"
    targets_dir.mkdir(parents=True)
    base = observer(targets_dir / "*.json", scrape_interval_s=0.25)
    started = time.time()
    out, err = tmp_path / "demo.out", tmp_path / "demo.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        demo = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streamgrp",
                "--log-level",
                "WARNING",
                "demo",
                "--redis-url",
                redis_url,
                "--data-dir",
                str(tmp_path),
                "--run",
                run_name,
                "--steps",
                str(DEMO_STEPS),
                "--workers",
                "2",
                "--ranks",
                "2",
                "--reject-rate",
                "0.5",
                "--prometheus",
                "--timeout-s",
                "240",
            ],
            stdout=stdout,
            stderr=stderr,
        )
    try:
        targets_file = targets_dir / "targets.json"
        wait_until(targets_file.exists, timeout=60, message="the demo's targets file", interval=0.25)
        listed = json.loads(targets_file.read_text())
        assert sorted(e["labels"]["role"] for e in listed) == [
            "assembler",
            "batcher",
            "trainer",
            "trainer",
            "worker",
            "worker",
        ]
        # An entry that does not decode: the assembler dead-letters it, so the dead-letter panels have data.
        client.xadd(RunKeys(run_name).slots, {"garbage": "1"})
        # The demo's own Prometheus is up and scrapes every process.
        url = wait_until(
            lambda: re.search(r"Prometheus at (http://\S+)", err.read_text()),
            timeout=60,
            message="the demo to print its Prometheus URL",
            interval=0.25,
        ).group(1)
        wait_until(
            lambda: demo.poll() is not None or len(api(url, "/api/v1/targets")["activeTargets"]) == len(listed),
            timeout=30,
            message="the demo's Prometheus to discover every process",
            interval=0.25,
        )
        assert demo.poll() is None, "the demo ended before its Prometheus could be checked"
        assert demo.wait(timeout=240) == 0, err.read_text()
    finally:
        if demo.poll() is None:
            demo.terminate()
            demo.wait(timeout=30)
    assert "Prometheus at http://127.0.0.1:" in err.read_text()
    assert f"run {run_name}: {DEMO_STEPS} steps" in out.read_text()  # its accounting is test_demo's business
    # Every panel query as Grafana sends it: a range query over the run with the scrape interval as its
    # smallest step (an instant query for stat panels, at the last moment a process was scraped).
    end = time.time()
    scraped = query_range(base, "count(up == 1)", started, end, step=0.25)
    assert scraped, "Prometheus never scraped a process of the demo"
    last = max(float(t) for t, _ in scraped[0]["values"])
    # The demo runs no rewarder and no follower: their panels stay empty for it.
    demo_queries = [
        (title, expr, instant)
        for title, expr, instant in dashboard_queries()
        if not any(name in expr for name in NOT_IN_DEMO)
    ]
    empty = [
        f"{title}: {expr}"
        for title, expr, instant in demo_queries
        if not (query(base, expr, last) if instant else query_range(base, expr, started, end, step=0.25))
    ]
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    dead = query_range(base, 'sum(streamgrp_dead_letters_total{role="assembler"})', started, end)
    assert max(float(v) for _, v in dead[0]["values"]) == 1
    # Every process said which run it works for, and labelled its process metrics with it.
    for expr in ("count by (run) (streamgrp_run_info)", "count by (run) (process_cpu_seconds_total)"):
        runs = query_range(base, expr, started, end, step=0.25)
        assert [r["metric"] for r in runs] == [{"run": run_name}], expr
        assert max(float(v) for _, v in runs[0]["values"]) == len(listed), expr


@pytest.mark.slow
@needs_prometheus
@on_valkey
def test_a_run_that_rejects_everything_shows_the_stall_and_fires_the_stall_alert(client, redis_url, run_name, tmp_path):
    bounds = {"max_empty_rounds": 4, "stall_timeout_s": 6.0}  # alert at >= 3 rounds and > 4.5 s; failure at 6 s
    join_run(client, run_name, RunConfig(n_samples=2, group_timeout_s=5.0, **bounds))
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"p": i % 8, "reject_rate": 1.0}) + "\n" for i in range(20000)))
    common = ["--redis-url", redis_url, "--run", run_name]
    specs = {
        "worker": ["--rollout", "streamgrp.consumers.toy_task:rollout", "--concurrency", "2"],
        "assembler": ["--tick-interval-s", "0.2"],
        "batcher": ["--dataset", str(dataset), "--round-s", "0.5"],
    }
    ports = {role: free_port("127.0.0.1") for role in specs}
    config = prom.prepare(
        tmp_path / "prometheus",
        [prom.Target(role, 0, port) for role, port in ports.items()],
        scrape_interval_s=0.5,  # as many scrapes and rule evaluations between alert and failure as 1 s at 12 s
        **bounds,
    )
    server = prom.Prometheus(config, tmp_path / "prometheus")
    base = server.start()
    start = time.time()
    roles: dict[str, Role] = {}
    try:
        # The batcher's stall clock starts with its first round: start it once rollouts can be taken.
        for role in ("worker", "assembler", "batcher"):
            roles[role] = Role(role, [*common, *specs[role], "--metrics-port", str(ports[role])], tmp_path)
            if role != "batcher":
                url = f"http://127.0.0.1:{ports[role]}/metrics"
                wait_until(
                    lambda r=role, u=url: fetch(u) or roles[r].proc.poll() is not None,
                    timeout=90,
                    message=f"the {role} to serve metrics",
                    interval=0.25,
                )
                assert roles[role].proc.poll() is None, roles[role].output()
        batcher = roles["batcher"]
        assert batcher.proc.wait(timeout=120) == 1, batcher.output()
        assert "run stalled" in batcher.output()
        time.sleep(1.0)  # the last rule evaluations (two intervals)
        end = time.time()

        def series(expr: str) -> list[float]:
            result = query_range(base, expr, start, end)
            return [float(v) for _, v in result[0]["values"]] if result else []

        stall = series('max(streamgrp_stall_seconds{role="batcher"})')
        rounds = series('max(streamgrp_empty_rounds{role="batcher"})')
        assert stall and max(stall) > 0.75 * bounds["stall_timeout_s"], stall
        assert stall == sorted(stall) and len(set(stall)) >= 3, f"stall seconds did not rise: {stall}"
        assert rounds and max(rounds) >= 0.75 * bounds["max_empty_rounds"] and rounds == sorted(rounds), rounds
        dropped = series('sum(streamgrp_groups_dropped_total{role="assembler", reason="all_unusable"})')
        assert dropped and dropped[-1] > 0, "the workers' rejections never reached a group decision"
        # The stall alert's own expression, as Prometheus loaded it (the run's bounds rendered in), became
        # true, and Prometheus fired the alert, before the run failed.
        rules = [
            r
            for g in api(base, "/api/v1/rules")["groups"]
            for r in g["rules"]
            if r.get("name") == "StreamgrpStallApproaching"
        ]
        assert len(rules) == 1
        assert query_range(base, rules[0]["query"], start, end), "the stall alert's expression never held"
        assert query_range(base, 'ALERTS{alertname="StreamgrpStallApproaching", alertstate="firing"}', start, end)
    finally:
        for role in roles.values():
            role.stop()
        server.stop()
