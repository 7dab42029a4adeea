"""The Grafana dashboard against Grafana's own schema, as grafana-foundation-sdk's typed models state it.

No Grafana server runs here, so `tests/grafana_schema.py` loads the dashboard into the SDK's models
and checks every field's type and that no field is unknown. The checked-in JSON and the generator's
output must load with every panel and target typed; broken copies (a wrong-typed field in a panel,
a target, the options, a variable; a misspelt key; a panel type Grafana does not have) must fail.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import grafana_schema
import pytest
from grafana_foundation_sdk.models import prometheus, stat, timeseries

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "grafana" / "dashboards" / "streamgrp.json"
GENERATOR = ROOT / "grafana" / "build_dashboards.py"


def checked_in() -> dict:
    return json.loads(DASHBOARD.read_text())


def json_panels(data: dict) -> list[dict]:
    """The JSON's panels that are not rows, rows' nested panels included (as `grafana_schema.panels`)."""
    out = []
    for panel in data["panels"]:
        out += panel.get("panels", []) if panel["type"] == "row" else [panel]
    return out


def test_the_checked_in_dashboard_loads_every_panel_and_target_into_typed_models():
    data = checked_in()
    dashboard = grafana_schema.load(data)  # raises listing every schema error
    assert dashboard.uid == "streamgrp" and dashboard.schema_version == 39
    loaded, given = grafana_schema.panels(dashboard), json_panels(data)
    assert [p.title for p in loaded] == [p["title"] for p in given] and len(loaded) >= 12
    option_models = {"timeseries": timeseries.Options, "stat": stat.Options}
    for panel, raw in zip(loaded, given):
        assert isinstance(panel.options, option_models[raw["type"]]), panel.title
        if raw["type"] == "timeseries":
            assert isinstance(panel.field_config.defaults.custom, timeseries.FieldConfig), panel.title
        assert len(panel.targets) == len(raw["targets"]) > 0, panel.title
        for target, raw_target in zip(panel.targets, raw["targets"]):
            assert isinstance(target, prometheus.Dataquery), panel.title
            assert (target.expr, target.ref_id, target.legend_format) == (
                raw_target["expr"],
                raw_target["refId"],
                raw_target.get("legendFormat"),
            ), panel.title
    assert [v.name for v in dashboard.templating.list_val] == [
        "datasource",
        "job",
        "run",
        "stall_timeout_s",
        "max_empty_rounds",
    ]


def test_the_generator_output_matches_the_schema():
    # The generator is the source of truth: its output must load, whatever is checked in.
    spec = importlib.util.spec_from_file_location("build_dashboards", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert grafana_schema.check(module.build()) == []


def first(data: dict, kind: str) -> dict:
    return next(p for p in data["panels"] if p["type"] == kind)


def _set(path: str, value):
    """A mutation setting ``value`` at ``path`` (keys and list indexes separated by dots, from a panel when
    the path starts with "timeseries." or "stat.")."""

    def mutate(data: dict) -> None:
        parts = path.split(".")
        node = first(data, parts.pop(0)) if parts[0] in ("timeseries", "stat") else data
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        last = parts[-1]
        node[int(last) if isinstance(node, list) else last] = value

    return mutate


def _misspell_legend_format(data: dict) -> None:
    target = first(data, "timeseries")["targets"][0]
    target["legendFromat"] = target.pop("legendFormat")


BROKEN = {
    "panel width as a string": (_set("timeseries.gridPos.w", "12"), "grid_pos.w: '12' is not of type int"),
    "panel title as a number": (_set("stat.title", 7), ".title: 7 is not of type str"),
    "target refId as a number": (_set("timeseries.targets.0.refId", 1), "targets[0].ref_id: 1 is not of type str"),
    "target expr as a list": (_set("timeseries.targets.0.expr", ["up"]), "targets[0].expr: ['up'] is not of type str"),
    "legend switch as a word": (
        _set("timeseries.options.legend.showLegend", "yes"),
        "options.legend.show_legend: 'yes' is not of type bool",
    ),
    "unit as a number": (
        _set("timeseries.fieldConfig.defaults.unit", 1),
        "field_config.defaults.unit: 1 is not of type str",
    ),
    "axis minimum as a string": (
        _set("timeseries.fieldConfig.defaults.min", "0"),
        "field_config.defaults.min_val: '0' is not of type float",
    ),
    "line width as a string": (_set("timeseries.fieldConfig.defaults.custom.lineWidth", "1"), "custom.line_width: '1'"),
    "draw style not one Grafana has": (
        _set("timeseries.fieldConfig.defaults.custom.drawStyle", "curvy"),
        "custom.draw_style: 'curvy' is not one of",
    ),
    "variable hide as a word": (_set("templating.list.0.hide", "no"), "templating.list_val[0].hide: 'no'"),
    "shared crosshair out of range": (_set("graphTooltip", 5), "graph_tooltip: 5 is not one of [0, 1, 2]"),
    "a misspelt target key": (_misspell_legend_format, "targets[0].legendFromat: no model has this field"),
    "a panel type Grafana does not have": (_set("timeseries.type", "timeseriez"), "no typed options model"),
    "panels not a list": (_set("panels", {"a": 1}), "from_json failed"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_copy_fails_and_the_error_says_where(name):
    mutate, expected = BROKEN[name]
    data = copy.deepcopy(checked_in())
    mutate(data)
    errors = grafana_schema.check(data)
    assert any(expected in error for error in errors), errors
    with pytest.raises(AssertionError, match="does not match grafana-foundation-sdk's models"):
        grafana_schema.load(data)
