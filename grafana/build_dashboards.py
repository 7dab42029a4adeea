"""Write grafana/dashboards/streamgrp.json, the streamgrp Grafana dashboard, from the panel list below.

    python grafana/build_dashboards.py            # rewrite the checked-in JSON
    python grafana/build_dashboards.py --check    # exit 1 if the checked-in JSON is out of date

The JSON is stock Grafana dashboard JSON (schemaVersion 39) that needs no plugin: every panel reads
the Prometheus data source chosen by the ``datasource`` template variable, so the file imports as
is through provisioning or Dashboards > New > Import. Metric names are SPEC section 7's. Every
query selects the chosen *Run* (every series carries ``run``; the variable lists
``streamgrp_run_info``), so runs scraped by one Prometheus never add up. A name means one thing
whichever role exports it (slots published by workers and folded by the assembler, steps written by the
batcher and committed by each trainer rank, groups dropped by the assembler and discarded by the batcher
each have their own), so a sum over every target never mixes two; queries still select the owning role
(its scrape target's ``role`` label) to read no more series than they need. A trainer rank's series
carry its ``rank``; lag and pending entries, read from the server by both the assembler and the batcher,
are combined with ``max``.

Edit the panels here, run the script, and check both files in; ``tests/unit/test_dashboards.py``
fails when they disagree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "streamgrp.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
JOB = 'job=~"$job"'
#: The chosen jobs and run: what every query of a streamgrp metric selects.
RUN = JOB + ', run=~"$run"'


def sel(role: str | None = None, where: str = "") -> str:
    """The label selector of a query: the chosen jobs and run, the role that owns the metric, and ``where``
    (more matchers, e.g. ``outcome="stale"``)."""
    return "{" + RUN + (f', role="{role}"' if role else "") + (f", {where}" if where else "") + "}"


def rate(metric: str, role: str | None = None, by: str = "", where: str = "") -> str:
    total = f"sum by ({by}) " if by else "sum"
    return f"{total}(rate({metric}{sel(role, where)}[$__rate_interval]))"


def share(metric: str, role: str, by: str, where: str) -> str:
    """The rate of ``metric``'s series matching ``where`` over the rate of all of them, by ``by``."""
    return f"{rate(metric, role, by, where)} / {rate(metric, role, by)}"


def quantiles(metric: str, role: str, qs=(0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    bucket = f"sum by (le) (rate({metric}_bucket{sel(role)}[$__rate_interval]))"
    return [(f"histogram_quantile({q}, {bucket})", f"p{round(q * 100):d}") for q in qs]


# -- panels: (title, description, queries [(expr, legend)], options) ----------------------------------
# Layout: rows of panels; each row's panels share its width equally.

ROWS: list[tuple[str, list[dict[str, Any]]]] = [
    (
        "Yield",
        [
            dict(
                title="Slot yields",
                description="Usable slots / target slots and trainable slots (usable slots of kept groups) / target "
                "slots, as ratios of counter rates over the window. A falling trainable yield means "
                "samples are produced but groups are dropped; a falling usable yield means rollouts "
                "reject, fail or time out.",
                queries=[
                    (
                        f"{rate('streamgrp_usable_slots_total', 'assembler')} / "
                        f"{rate('streamgrp_target_slots_total', 'assembler')}",
                        "usable",
                    ),
                    (
                        f"{rate('streamgrp_trainable_slots_total', 'assembler')} / "
                        f"{rate('streamgrp_target_slots_total', 'assembler')}",
                        "trainable",
                    ),
                ],
                unit="percentunit",
                min=0,
                max=1,
            ),
            dict(
                title="Slot outcomes",
                description="Slot results per second by outcome as the assembler folded them (sample, rejected, "
                "failed, timeout, duplicate, late, invalid), beside what the workers published.",
                queries=[
                    (rate("streamgrp_slots_total", "assembler", by="outcome"), "{{outcome}}"),
                    (
                        rate("streamgrp_slots_published_total", "worker", by="outcome"),
                        "{{outcome}} published by workers",
                    ),
                ],
                unit="cps",
            ),
        ],
    ),
    (
        "Groups",
        [
            dict(
                title="Group decisions",
                description="Groups decided per second: complete (every slot usable), partial (enough usable slots "
                "to train on) and dropped.",
                queries=[(rate("streamgrp_groups_total", "assembler", by="decision"), "{{decision}}")],
                unit="cps",
                stack=True,
            ),
            dict(
                title="Dropped groups by reason",
                description="Drops per second: the assembler's (all_unusable, incomplete, below_minimum, "
                "contract_violation) and the batcher's (stale, filtered, leftover).",
                queries=[
                    (rate("streamgrp_groups_dropped_total", "assembler", by="reason"), "{{reason}} (assembler)"),
                    (rate("streamgrp_groups_discarded_total", "batcher", by="reason"), "{{reason}} (batcher)"),
                ],
                unit="cps",
                stack=True,
            ),
            dict(
                title="Open groups",
                description="Groups the assembler holds open, waiting for slot results or their deadline.",
                queries=[(f"sum(streamgrp_open_groups{sel('assembler')})", "open groups")],
                unit="short",
                min=0,
            ),
        ],
    ),
    (
        "Stall",
        [
            dict(
                title="Stall seconds against the bound",
                description="Seconds since the batcher's last round that added a trainable group. The run fails "
                "when this reaches stall_timeout_s AND the empty rounds reach max_empty_rounds; the "
                "StreamgrpStallApproaching alert fires at 75% of both. Set the stall_timeout_s variable "
                "to the run's bound.",
                queries=[
                    (f"max(streamgrp_stall_seconds{sel('batcher')})", "stall seconds"),
                    ("vector($stall_timeout_s)", "bound"),
                    ("0.75 * vector($stall_timeout_s)", "alert (75%)"),
                ],
                unit="s",
                min=0,
                bounds=("bound", "alert (75%)"),
            ),
            dict(
                title="Empty rounds against the bound",
                description="Consecutive batcher rounds without a trainable group, against max_empty_rounds (the "
                "max_empty_rounds variable).",
                queries=[
                    (f"max(streamgrp_empty_rounds{sel('batcher')})", "empty rounds"),
                    ("vector($max_empty_rounds)", "bound"),
                ],
                unit="short",
                min=0,
                bounds=("bound",),
            ),
        ],
    ),
    (
        "Streams",
        [
            dict(
                title="Consumer lag",
                description="Entries of each stream not yet delivered to each consumer group (read from the "
                "server at scrape time). Growing lag means that group's consumers are slower than "
                "its producers, or down.",
                queries=[
                    ("max by (stream, group) (streamgrp_consumer_lag_entries{" + RUN + "})", "{{stream}} / {{group}}")
                ],
                unit="short",
                min=0,
            ),
            dict(
                title="Pending entries",
                description="Entries delivered to a consumer group but not yet acknowledged: work in progress, or "
                "work held by a consumer that died (another one claims it after claim_idle_s).",
                queries=[("max by (stream, group) (streamgrp_pending_entries{" + RUN + "})", "{{stream}} / {{group}}")],
                unit="short",
                min=0,
            ),
        ],
    ),
    (
        "Latency and staleness",
        [
            dict(
                title="Group assembly latency",
                description="Seconds from a task's issue to its group decision (quantiles over the window).",
                queries=quantiles("streamgrp_group_assembly_seconds", "assembler"),
                unit="s",
                min=0,
            ),
            dict(
                title="Batch wait",
                description="Seconds a trainer rank waited for its next batch (quantiles over the window, all ranks). "
                "High waits mean the trainers are starved by rollouts or group drops.",
                queries=quantiles("streamgrp_batch_wait_seconds", "trainer"),
                unit="s",
                min=0,
            ),
            dict(
                title="Staleness",
                description="Policy versions a group was behind when the batcher put it in a step (quantiles and "
                "mean); groups beyond max_staleness are dropped as stale.",
                queries=[
                    *quantiles("streamgrp_staleness_versions", "batcher", qs=(0.5, 0.99)),
                    (
                        f"{rate('streamgrp_staleness_versions_sum', 'batcher')} / "
                        f"{rate('streamgrp_staleness_versions_count', 'batcher')}",
                        "mean",
                    ),
                ],
                unit="short",
                min=0,
            ),
        ],
    ),
    (
        "Versions and bias",
        [
            dict(
                title="Long generations: trained, stale, timed out",
                description="The bias monitor: of the generations decided per length bucket (loss tokens: 256, 1k, "
                "4k, 16k, more), the share trained and the share dropped as stale (--staleness drop "
                "discards the long ones first: a run whose long buckets train less than its short ones "
                "learns from the easy prompts). Timed-out slots have no length (bucket none): their "
                "share is of every generation.",
                queries=[
                    (
                        share("streamgrp_generations_total", "batcher", "length", 'outcome="trained"'),
                        "trained {{length}}",
                    ),
                    (share("streamgrp_generations_total", "batcher", "length", 'outcome="stale"'), "stale {{length}}"),
                    (share("streamgrp_generations_total", "batcher", "", 'outcome="timeout"'), "timed out (of all)"),
                ],
                unit="percentunit",
                min=0,
            ),
            dict(
                title="Version span and token staleness",
                description="Per trained row, its newest minus its oldest token version (generations that spanned "
                "weight updates); per trained loss token, the versions it was behind its step; and the "
                "loss tokens --staleness mask cleared per second.",
                queries=[
                    *[
                        (expr, f"span {legend}")
                        for expr, legend in quantiles("streamgrp_sample_version_span", "trainer", qs=(0.5, 0.99))
                    ],
                    *[
                        (expr, f"token staleness {legend}")
                        for expr, legend in quantiles("streamgrp_token_staleness_versions", "trainer", qs=(0.5, 0.99))
                    ],
                    (rate("streamgrp_stale_masked_tokens_total", "trainer"), "masked tokens /s"),
                ],
                unit="short",
                min=0,
            ),
        ],
    ),
    (
        "Rollouts",
        [
            dict(
                title="Rollouts in flight",
                description="Slots whose rollout function is running in the workers now (at most each worker's "
                "--concurrency).",
                queries=[(f"sum(streamgrp_rollouts_in_flight{sel('worker')})", "in flight")],
                unit="short",
                min=0,
            ),
            dict(
                title="Rollout time",
                description="A slot's rollout function, from its call to its return or exception.",
                queries=quantiles("streamgrp_rollout_seconds", "worker"),
                unit="s",
                min=0,
            ),
            dict(
                title="Rollout exceptions by type",
                description="Rollouts that raised, per second, by the exception's type (its slot is published as "
                "failed with the text; the worker logs them, rate-limited).",
                queries=[(rate("streamgrp_rollout_exceptions_total", "worker", by="type"), "{{type}}")],
                unit="cps",
                min=0,
            ),
        ],
    ),
    (
        "Steps",
        [
            dict(
                title="Steps per second",
                description="Steps the batcher wrote and each trainer rank committed, per second.",
                queries=[
                    (rate("streamgrp_steps_written_total", "batcher"), "written (batcher)"),
                    (rate("streamgrp_steps_total", "trainer", by="rank"), "committed (rank {{rank}})"),
                ],
                unit="short",
                min=0,
            ),
            dict(
                title="Step failures and steps trained again",
                description="Trainer steps that raised, per rank (each is a StepFailed event; see `streamgrp steps "
                "--failed`), and steps trained again after the trainer group rolled back to a checkpoint "
                "(a restart; `streamgrp steps` shows them).",
                queries=[
                    (
                        "sum by (rank) (increase(streamgrp_step_failures_total"
                        + sel("trainer")
                        + "[$__rate_interval]))",
                        "failed (rank {{rank}})",
                    ),
                    (
                        "sum by (rank) (increase(streamgrp_steps_retrained_total"
                        + sel("trainer")
                        + "[$__rate_interval]))",
                        "trained again (rank {{rank}})",
                    ),
                ],
                unit="short",
                min=0,
                bars=True,
            ),
            dict(
                title="Current step per rank",
                description="The step each trainer rank committed last: ranks of one group move together; one that "
                "stays behind is waiting for its peers or stuck.",
                queries=[("max by (rank) (streamgrp_trainer_step" + sel("trainer") + ")", "rank {{rank}}")],
                unit="short",
                min=0,
            ),
            dict(
                title="Shard imbalance",
                description="The last step's largest shard in tokens over the mean shard (1 is perfectly balanced).",
                queries=[(f"max(streamgrp_batch_imbalance_ratio{sel('batcher')})", "largest / mean")],
                unit="short",
                min=0,
            ),
        ],
    ),
    (
        "Rewards (a run with streamgrp rewarder)",
        [
            dict(
                title="Reward latency",
                description="Seconds from a result published with its reward pending to its reward posted by a "
                "rewarder (quantiles over the window): the time a slot waits for its score.",
                queries=quantiles("streamgrp_reward_latency_seconds", "rewarder"),
                unit="s",
                min=0,
            ),
            dict(
                title="Pending rewards",
                description="Results waiting for their reward: being scored by a rewarder now, taken by the "
                "rewarders' group and not posted yet (a killed rewarder's are taken over after "
                "claim_idle_s), and not taken yet.",
                queries=[
                    (f"sum(streamgrp_rewards_in_flight{sel('rewarder')})", "scoring now"),
                    ("max(streamgrp_pending_entries{" + RUN + ', group="rewarders"})', "taken, not posted"),
                    ("max(streamgrp_consumer_lag_entries{" + RUN + ', group="rewarders"})', "not taken yet"),
                ],
                unit="short",
                min=0,
            ),
            dict(
                title="Rewards and rewarder failures",
                description="Rewards posted per second by what they made of their slot (sample, rejected, failed), "
                "and scorings that failed per second by kind: transient (timed out or lost its "
                "connection; retried) or error (the slot failed with its reason).",
                queries=[
                    (rate("streamgrp_rewards_total", "rewarder", by="outcome"), "{{outcome}}"),
                    (rate("streamgrp_reward_failures_total", "rewarder", by="kind"), "failed: {{kind}}"),
                ],
                unit="cps",
                min=0,
            ),
        ],
    ),
    (
        "Followers (streamgrp follow, export --follow)",
        [
            dict(
                title="Follower lag",
                description="Per follower and stream: how old the newest entry it read was while more waited (0: "
                "caught up). Retention keeps what a follower has not read, so a growing lag holds "
                "entries on the server, up to the archiver's --max-follow-lag-s.",
                queries=[
                    (
                        "max by (consumer, stream) (streamgrp_follow_lag_seconds{" + RUN + "})",
                        "{{consumer}} / {{stream}}",
                    )
                ],
                unit="s",
                min=0,
            ),
            dict(
                title="Follower reads and skips",
                description="Entries each follower read per second, and entries retention trimmed before a "
                "follower read them (it fell past --max-follow-lag-s; it sees the skip). Normally no "
                "skips.",
                queries=[
                    (
                        "sum by (consumer) (rate(streamgrp_follow_entries_total{" + RUN + "}[$__rate_interval]))",
                        "{{consumer}} read",
                    ),
                    (
                        "sum by (consumer) (increase(streamgrp_follow_skipped_total{" + RUN + "}[$__rate_interval]))",
                        "{{consumer}} skipped",
                    ),
                ],
                unit="short",
                min=0,
            ),
        ],
    ),
    (
        "Dead letters and processes",
        [
            dict(
                title="Dead letters",
                description="Entries moved to the dead-letter stream, per second by reason (an entry that does not "
                "decode or validate) and by the role that moved it (the assembler: slot-log entries; "
                "workers: tasks; the batcher: decisions; any of them: control entries). Normally empty.",
                queries=[(rate("streamgrp_dead_letters_total", by="role, reason"), "{{reason}} ({{role}})")],
                unit="cps",
                min=0,
                bars=True,
            ),
            dict(
                title="Dead letters in range",
                kind="stat",
                description="Dead-lettered entries in the dashboard's time range; StreamgrpDeadLetters fires on any.",
                queries=[("sum(increase(streamgrp_dead_letters_total" + sel() + "[$__range]))", "dead letters")],
                unit="short",
            ),
            dict(
                title="Processes up",
                description="Scrape targets up, by role (from the targets file), of the targets that served the run "
                "in the time range (up has no run label of its own: Prometheus writes it).",
                queries=[
                    (
                        "sum by (role) (up{"
                        + JOB
                        + "} and on (job, instance) max_over_time(streamgrp_run_info{"
                        + RUN
                        + "}[$__range]))",
                        "{{role}}",
                    )
                ],
                unit="short",
                min=0,
            ),
            dict(
                title="Policy version",
                description="The newest policy version each role has seen (trainers: the weights they committed; "
                "workers: the version they sampled with), and the newest version among the samples of "
                "the groups the batcher saw decided: what the inference servers serve. Served more than "
                "max_staleness behind the batcher's line, every group is dropped as stale.",
                queries=[
                    ("max by (role) (streamgrp_policy_version{" + RUN + "})", "{{role}}"),
                    ("max(streamgrp_served_version{" + RUN + "})", "served"),
                ],
                unit="short",
                min=0,
            ),
        ],
    ),
]

PANEL_HEIGHT = 8


def _targets(queries: list[tuple[str, str]], *, instant: bool) -> list[dict[str, Any]]:
    return [
        {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": expr,
            "instant": instant,
            "legendFormat": legend,
            "range": not instant,
            "refId": chr(ord("A") + i),
        }
        for i, (expr, legend) in enumerate(queries)
    ]


def _bound_override(name: str) -> dict[str, Any]:
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [
            {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
            {"id": "custom.fillOpacity", "value": 0},
            {"id": "color", "value": {"fixedColor": "red" if name == "bound" else "orange", "mode": "fixed"}},
        ],
    }


def _panel(spec: dict[str, Any], panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": spec.get("unit", "short")}
    for key in ("min", "max"):
        if key in spec:
            defaults[key] = spec[key]
    if spec.get("kind") == "stat":
        defaults.update(
            color={"mode": "thresholds"},
            noValue="0",
            thresholds={"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}]},
        )
        return {
            "datasource": DATASOURCE,
            "description": spec["description"],
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "gridPos": grid,
            "id": panel_id,
            "options": {
                "colorMode": "value",
                "graphMode": "none",
                "justifyMode": "auto",
                "orientation": "auto",
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "textMode": "auto",
            },
            "targets": _targets(spec["queries"], instant=True),
            "title": spec["title"],
            "type": "stat",
        }
    defaults.update(
        color={"mode": "palette-classic"},
        custom={
            "drawStyle": "bars" if spec.get("bars") else "line",
            "fillOpacity": 10,
            "lineWidth": 1,
            "pointSize": 4,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"group": "A", "mode": "normal" if spec.get("stack") else "none"},
        },
        thresholds={"mode": "absolute", "steps": [{"color": "green", "value": None}]},
    )
    return {
        "datasource": DATASOURCE,
        "description": spec["description"],
        "fieldConfig": {"defaults": defaults, "overrides": [_bound_override(name) for name in spec.get("bounds", ())]},
        "gridPos": grid,
        "id": panel_id,
        "options": {
            "legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": _targets(spec["queries"], instant=False),
        "title": spec["title"],
        "type": "timeseries",
    }


def _templating() -> list[dict[str, Any]]:
    return [
        {
            "current": {},
            "hide": 0,
            "includeAll": False,
            "label": "Data source",
            "multi": False,
            "name": "datasource",
            "options": [],
            "query": "prometheus",
            "refresh": 1,
            "regex": "",
            "type": "datasource",
        },
        # No "definition" (the query's text in Grafana's variable list): Grafana's dashboard schema has no
        # such field (tests/unit/test_dashboard_schema.py checks against it) and it shows the query without.
        {
            "allValue": ".+",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "datasource": DATASOURCE,
            "hide": 0,
            "includeAll": True,
            "label": "Job",
            "multi": True,
            "name": "job",
            "options": [],
            "query": {
                "qryType": 1,
                "query": "label_values(streamgrp_build_info, job)",
                "refId": "PrometheusVariableQueryEditor-VariableQuery",
            },
            "refresh": 2,
            "regex": "",
            "sort": 1,
            "type": "query",
        },
        # One run at a time (newest demo run first, by name): sums over two runs would mean nothing.
        {
            "current": {},
            "datasource": DATASOURCE,
            "hide": 0,
            "includeAll": False,
            "label": "Run",
            "multi": False,
            "name": "run",
            "options": [],
            "query": {
                "qryType": 1,
                "query": 'label_values(streamgrp_run_info{job=~"$job"}, run)',
                "refId": "PrometheusVariableQueryEditor-VariableQuery",
            },
            "refresh": 2,
            "regex": "",
            "sort": 2,
            "type": "query",
        },
        # The stall bounds are run settings, not metrics: enter the run's values (RunConfig defaults shown).
        {
            "current": {"text": "1800", "value": "1800"},
            "hide": 0,
            "label": "stall_timeout_s",
            "name": "stall_timeout_s",
            "options": [{"selected": True, "text": "1800", "value": "1800"}],
            "query": "1800",
            "type": "textbox",
        },
        {
            "current": {"text": "8", "value": "8"},
            "hide": 0,
            "label": "max_empty_rounds",
            "name": "max_empty_rounds",
            "options": [{"selected": True, "text": "8", "value": "8"}],
            "query": "8",
            "type": "textbox",
        },
    ]


def build() -> dict[str, Any]:
    """The dashboard as a dict."""
    panels: list[dict[str, Any]] = []
    y = 0
    for title, specs in ROWS:
        panels.append(
            {
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "id": len(panels) + 1,
                "panels": [],
                "title": title,
                "type": "row",
            }
        )
        y += 1
        width = 24 // len(specs)
        for index, spec in enumerate(specs):
            grid = {"h": PANEL_HEIGHT, "w": width, "x": index * width, "y": y}
            panels.append(_panel(spec, len(panels) + 1, grid))
        y += PANEL_HEIGHT
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "streamgrp: yields, group decisions, the stall bound, stream lag, latency, staleness, "
        "steps, rewards, followers and dead letters (built by grafana/build_dashboards.py)",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": panels,
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["streamgrp"],
        "templating": {"list": _templating()},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "streamgrp",
        "uid": "streamgrp",
        "version": 1,
        "weekStart": "",
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in JSON differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is out of date: run python grafana/build_dashboards.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
