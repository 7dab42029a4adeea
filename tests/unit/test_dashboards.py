"""The checked-in Grafana dashboard is the generator's output, and every panel queries something."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "grafana" / "build_dashboards.py"
DASHBOARD = ROOT / "grafana" / "dashboards" / "streamgrp.json"
PROVISIONING = ROOT / "grafana" / "provisioning"
SPEC_METRICS = {
    "streamgrp_slots_total",
    "streamgrp_groups_total",
    "streamgrp_groups_dropped_total",
    "streamgrp_target_slots_total",
    "streamgrp_usable_slots_total",
    "streamgrp_trainable_slots_total",
    "streamgrp_steps_total",
    "streamgrp_step_failures_total",
    "streamgrp_dead_letters_total",
    "streamgrp_stall_seconds",
    "streamgrp_empty_rounds",
    "streamgrp_open_groups",
    "streamgrp_consumer_lag_entries",
    "streamgrp_pending_entries",
    "streamgrp_policy_version",
    "streamgrp_batch_imbalance_ratio",
    "streamgrp_group_assembly_seconds",
    "streamgrp_batch_wait_seconds",
    "streamgrp_staleness_versions",
}


def _generator():
    spec = importlib.util.spec_from_file_location("build_dashboards", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_checked_in_dashboard_equals_the_generator_output():
    assert DASHBOARD.read_text() == _generator().render(), (
        "grafana/dashboards/streamgrp.json is stale: run python grafana/build_dashboards.py"
    )


def test_every_panel_has_a_target_with_an_expression():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = _panels(dashboard)
    assert len(panels) >= 12
    for panel in panels:
        exprs = [t.get("expr", "").strip() for t in panel.get("targets", [])]
        assert any(exprs), f"panel {panel['title']!r} has no query"
        assert all(exprs), f"panel {panel['title']!r} has a target without an expression"


def test_dashboard_is_portable_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] == 39 and dashboard["uid"] == "streamgrp" and dashboard["id"] is None
    assert "DS_PROMETHEUS" not in DASHBOARD.read_text() and "__inputs" not in dashboard
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    used = set()
    for panel in _panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            used.update(re.findall(r"\$(\w+)", target["expr"]))
            if "rate(" in target["expr"] or "increase(" in target["expr"]:
                assert re.search(r"\[\$__(rate_interval|range)\]", target["expr"]), target["expr"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    # every variable a query uses is defined (or a Grafana built-in)
    assert used - {"__rate_interval", "__range", "__interval"} <= set(variables)


def test_dashboard_covers_every_spec_metric():
    text = " ".join(t["expr"] for p in _panels(json.loads(DASHBOARD.read_text())) for t in p["targets"])
    missing = {m for m in SPEC_METRICS if m not in text}
    assert not missing, f"no panel shows {sorted(missing)}"


def test_provisioning_files_point_at_the_dashboard_and_a_prometheus_datasource():
    datasource = (PROVISIONING / "datasources" / "prometheus.yml").read_text()
    assert "apiVersion: 1" in datasource and "type: prometheus" in datasource
    provider = (PROVISIONING / "dashboards" / "streamgrp.yml").read_text()
    assert "apiVersion: 1" in provider and "type: file" in provider and "path: " in provider
