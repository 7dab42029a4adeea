"""A run's timeline as one self-contained HTML page (`streamgrp report`), for people without Grafana.

Owns reading what the page needs from the run's streams (`build_report`; it changes nothing) and
the page itself: layout, tables, each chart's definition, and the optional PNG. The per-step series
and their definitions are `streamgrp.replay.report_series`; the run totals come from
`streamgrp.replay.summary.run_summary` unchanged, so the page and the demo's summary never disagree.
Drawing is `streamgrp.replay.charts` (inline SVG, no JavaScript, no external files).
"""

from __future__ import annotations

import io
import time
from html import escape
from typing import TYPE_CHECKING, Any

from streamgrp.core import codec
from streamgrp.core.events import (
    GroupDecided,
    GroupDiscarded,
    RunStarted,
    StepFailed,
    StepManifest,
)
from streamgrp.errors import ConfigError, DecodeError
from streamgrp.replay.charts import Series, format_number, line_chart, stacked_bar_chart
from streamgrp.replay.report_series import (
    DECISION_KINDS,
    ReportData,
    run_status,
    step_rows,
)
from streamgrp.store.keys import RunKeys

if TYPE_CHECKING:
    import redis

#: Stable chart ids, in page order; each chart is ``<svg id="chart-{id}">``.
CHART_IDS = ("yields", "decisions", "drop-reasons", "stall", "imbalance")
_KIND_COLORS = {"complete": "#009E73", "partial": "#56B4E9", "dropped": "#D55E00"}


# -- reading (the only part that talks to the server) ---------------------------------------------------

def build_report(client: redis.Redis | None, keys: RunKeys, *, source=None) -> ReportData:
    """Read a run's streams and compute its per-step series and totals; ``source`` (default: the
    server) may be an archive-backed entry source (`streamgrp.store.sources`) for a run retention trimmed."""
    from streamgrp.replay.summary import run_summary
    from streamgrp.store.sources import RedisSource
    from streamgrp.store.streams import entry_time

    source = source or RedisSource(client, keys)

    def events(stream: str) -> list[tuple[float, Any]]:
        out = []
        for entry_id, fields in source.scan(stream):
            try:
                out.append((entry_time(entry_id), codec.decode(fields)))
            except DecodeError:
                continue  # the summary counts what decodes; so does the timeline
        return out

    control = [event for _, event in events("control")]
    started = next((e.started_at for e in control if isinstance(e, RunStarted)), None)
    manifests = [e for _, e in events("steps") if isinstance(e, StepManifest)]
    decisions = [(t, e) for t, e in events("decisions") if isinstance(e, GroupDecided)]
    discards = [(t, e) for t, e in events("discarded") if isinstance(e, GroupDiscarded)]
    failures = tuple(e for _, e in events("commits") if isinstance(e, StepFailed))
    rows, tail = step_rows(started_at=started, manifests=manifests, decisions=decisions, discards=discards)
    return ReportData(run=keys.run, started_at=started, steps=tuple(rows), after_last_step=tail,
                      totals=run_summary(client, keys, source=source), status=run_status(control, len(rows)),
                      failures=failures)


# -- HTML ----------------------------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 820px; color: #222; padding: 0 1rem; }
h1 { font-size: 1.4rem; margin-bottom: .2rem; } h2 { font-size: 1.1rem; margin-top: 2rem; }
.meta { color: #555; margin: .2rem 0; } .failed { color: #b00020; font-weight: 600; }
table { border-collapse: collapse; font-size: .9rem; } th, td { padding: .15rem .6rem; border-bottom: 1px solid #eee; }
th { text-align: left; font-weight: 500; color: #444; } td { text-align: right; font-variant-numeric: tabular-nums; }
.definition { color: #555; font-size: .85rem; max-width: 760px; } svg.chart { max-width: 100%; height: auto; }
details { margin-top: 2rem; }
"""

_DEFINITIONS = {
    "yields": "Over the groups the assembler decided in each step's window (after the previous manifest, up to this "
              "one): usable and trainable slots over target slots. Dotted and dash-dotted: the same, cumulative over "
              "all windows so far. A grey hollow marker on the axis: no group was decided in that window. Where "
              "lines coincide each keeps its own dash pattern and marker, and the legend says which series equal "
              "which.",
    "decisions": "Group decisions written in each step's window, by kind.",
    "drop-reasons": "Why groups were not trained: the assembler's drop reasons and the batcher's discards (stale, "
                    "filtered, leftover) written in each step's window.",
    "stall": "Seconds from the previous manifest (step 0: from the run's start) to this one, and the longest stretch "
             "of that window without a trainable (complete or partial) decision.",
    "imbalance": "The step's largest shard (valid loss tokens) over the mean shard: 1.0 is a perfect split over ranks.",
}


def render_html(data: ReportData) -> str:
    """The whole report as one HTML page: inline CSS and SVG, no scripts, no external references."""
    series = data.series()
    steps = series["step"]
    charts = {
        "yields": line_chart(
            chart_id="yields", title="Slot yields per step", steps=steps, y_label="slots / target slots",
            y_min=0.0, y_max=1.0,
            series=[Series("usable", series["usable_yield"], "#0072B2", width=3.6),
                    Series("trainable", series["trainable_yield"], "#E69F00"),
                    Series("usable (cumulative)", series["cumulative_usable_yield"], "#0072B2", width=3.6),
                    Series("trainable (cumulative)", series["cumulative_trainable_yield"], "#E69F00")]),
        "decisions": stacked_bar_chart(
            chart_id="decisions", title="Group decisions per step, by kind", steps=steps, y_label="groups",
            series=[Series(kind, series[f"decisions:{kind}"], _KIND_COLORS[kind]) for kind in DECISION_KINDS]),
        "drop-reasons": stacked_bar_chart(
            chart_id="drop-reasons", title="Drop reasons per step", steps=steps, y_label="groups",
            series=[Series(name.split(":", 1)[1], values) for name, values in series.items()
                    if name.startswith("dropped:")]),
        "stall": line_chart(
            chart_id="stall", title="Stall seconds per step", steps=steps, y_label="seconds",
            series=[Series("since previous step", series["step_seconds"], "#0072B2", width=3.6),
                    Series("longest gap without a trainable decision", series["longest_gap_s"], "#D55E00")]),
        "imbalance": line_chart(
            chart_id="imbalance", title="Shard imbalance per step", steps=steps, y_label="largest / mean shard",
            y_min=1.0, series=[Series("imbalance", series["imbalance"], "#CC79A7")]),
    }
    status_class = "meta failed" if data.status.startswith("failed") else "meta"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>streamgrp report: {escape(data.run)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f'<h1 id="title">streamgrp report: run {escape(data.run)}</h1>',
        f'<p class="{status_class}" id="status">Status: {escape(data.status)}</p>',
        f'<p class="meta">{escape(_time_span(data))}</p>',
        '<section id="totals"><h2>Run totals</h2>',
        _totals_table(data.totals),
        f'<p class="definition">{escape(_tail_note(data))}</p></section>',
    ]
    for chart_id in CHART_IDS:
        parts.append(f'<section class="chart-section" id="section-{chart_id}">{charts[chart_id]}'
                     f'<p class="definition">{escape(_DEFINITIONS[chart_id])}</p></section>')
    if data.failures:
        parts.append('<section id="failures"><h2>Step failures</h2><table><tr><th>step</th><th>rank</th>'
                     '<th>error</th></tr>')
        parts += [f"<tr><td>{f.step}</td><td>{f.rank}</td><td style='text-align: left'>{escape(f.error)}</td></tr>"
                  for f in data.failures]
        parts.append("</table></section>")
    parts.append(_steps_table(data))
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _totals_table(totals: dict[str, Any]) -> str:
    rows = []
    for key, value in _flatten(totals):
        rows.append(f'<tr><th>{escape(key)}</th><td data-key="{escape(key)}">{escape(_cell(value))}</td></tr>')
    return '<table id="totals-table">' + "".join(rows) + "</table>"


def _flatten(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested totals as ``("groups.complete", 12)`` rows; an empty mapping is one row shown as "none"."""
    out: list[tuple[str, Any]] = []
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += _flatten(value, name + ".") if value else [(name, "none")]
        else:
            out.append((name, value))
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return str(value) if isinstance(value, int) else f"{value:.4f}"


def _steps_table(data: ReportData) -> str:
    head = ("step", "version", "groups", "tokens", "decided", "dropped", "usable yield", "trainable yield",
            "seconds", "longest gap s", "imbalance")
    rows = ["<details id=\"steps\"><summary>Per-step numbers</summary><table id=\"steps-table\"><tr>"
            + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for r in data.steps:
        cells = (r.step, r.version, r.groups, r.tokens, r.tally.groups_decided, sum(r.tally.drop_reasons.values()),
                 r.usable_yield, r.trainable_yield, r.step_seconds, r.longest_gap_s, r.imbalance)
        rows.append(f'<tr data-step="{r.step}">' + "".join(f"<td>{escape(_cell(c))}</td>" for c in cells) + "</tr>")
    rows.append("</table></details>")
    return "".join(rows)


def _time_span(data: ReportData) -> str:
    def stamp(seconds: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))

    if data.started_at is None:
        return "Run start unknown (no run record)."
    text = f"Started {stamp(data.started_at)}"
    if data.steps:
        last = data.steps[-1].created_at
        elapsed = format_number(round(last - data.started_at, 1))
        text += f"; last step {data.steps[-1].step} at {stamp(last)} ({elapsed} s in)"
    return text + "."


def _tail_note(data: ReportData) -> str:
    tail = data.after_last_step
    dropped = sum(tail.drop_reasons.values())
    if not tail.groups_decided and not dropped:
        return "Every decision and discard falls in a step's window."
    kinds = ", ".join(f"{kind} {n}" for kind, n in tail.decisions.items() if n) or "none"
    reasons = ", ".join(f"{reason} {n}" for reason, n in tail.drop_reasons.items()) or "none"
    return (f"After the last step (in no step's window, so in no chart): decisions {kinds}; drop reasons {reasons}. "
            "Per-step counts plus these equal the totals.")


# -- PNG (only with matplotlib, which streamgrp does not depend on) ----------------------------------------

def png_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require_png() -> None:
    if not png_available():
        raise ConfigError("--format png needs matplotlib, which streamgrp does not install: "
                          "`pip install matplotlib`, or use --format html (the default; it needs nothing)")


def render_png(data: ReportData) -> bytes:
    """The same charts as one PNG image (matplotlib required; see `require_png`)."""
    require_png()
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    series = data.series()
    steps = series["step"]
    figure = Figure(figsize=(9, 16), layout="constrained")
    figure.suptitle(f"streamgrp report: run {data.run} ({data.status})"[:120])
    axes = figure.subplots(len(CHART_IDS), 1)

    def nan(values):
        return [float("nan") if v is None else v for v in values]

    yields, decisions, drops, stall, imbalance = axes
    # The SVG's styles: a dash pattern and a marker shape per series, so coinciding series both show.
    for name, label, style, width in (("usable_yield", "usable", "o-", 3.5), ("trainable_yield", "trainable", "s--", 1.5),
                                      ("cumulative_usable_yield", "usable (cumulative)", "^:", 3.5),
                                      ("cumulative_trainable_yield", "trainable (cumulative)", "D-.", 1.5)):
        yields.plot(steps, nan(series[name]), style, label=label, markersize=4, linewidth=width,
                    markerfacecolor=None if style == "o-" else "none")
    yields.set_ylim(0, 1)
    for ax, prefix in ((decisions, "decisions:"), (drops, "dropped:")):
        bottom = [0] * len(steps)
        for name, values in series.items():
            if name.startswith(prefix):
                ax.bar(steps, values, bottom=bottom, label=name.split(":", 1)[1],
                       color=_KIND_COLORS.get(name.split(":", 1)[1]))
                bottom = [b + v for b, v in zip(bottom, values)]
    stall.plot(steps, series["step_seconds"], "o-", label="since previous step", markersize=3, linewidth=3.5)
    stall.plot(steps, series["longest_gap_s"], "s--", label="longest gap without a trainable decision", markersize=4,
               markerfacecolor="none")
    imbalance.plot(steps, series["imbalance"], "o-", label="imbalance", markersize=3)
    titles = ("Slot yields per step", "Group decisions per step, by kind", "Drop reasons per step",
              "Stall seconds per step", "Shard imbalance per step")
    labels = ("slots / target slots", "groups", "groups", "seconds", "largest / mean shard")
    for ax, title, label in zip(axes, titles, labels):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=100)
    return out.getvalue()
