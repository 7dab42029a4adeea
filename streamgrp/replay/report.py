"""A run's timeline as one self-contained HTML page (`streamgrp report`), for people without Grafana.

Owns reading what the page needs from the run's streams and its trainer-metrics hash
(`build_report`; it changes nothing) and the page itself: layout, tables, and each chart drawn or,
when the run recorded nothing for it, a note saying so. The per-step series and their definitions
are `streamgrp.replay.report_series`; which charts there are and what each says,
`streamgrp.replay.report_charts`; the run totals come from `streamgrp.replay.summary.run_summary`
unchanged, so the page and the demo's summary never disagree. Drawing is `streamgrp.replay.charts`
(inline SVG, no JavaScript, no external files); the optional PNG is `streamgrp.replay.report_png`.
"""

from __future__ import annotations

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
    TaskIssued,
    TrainingResumed,
)
from streamgrp.errors import DecodeError
from streamgrp.replay.charts import format_number, line_chart, stacked_bar_chart
from streamgrp.replay.report_charts import CHART_IDS, ChartSpec, chart_specs
from streamgrp.replay.report_png import png_available, render_png, require_png
from streamgrp.replay.report_prompts import prompt_rows, share_counts
from streamgrp.replay.report_series import ReportData, run_status, step_rows, trainer_metrics
from streamgrp.store.keys import RunKeys

# The PNG and the chart list live in their own modules; the command imports them from here.
__all__ = ["CHART_IDS", "build_report", "png_available", "render_html", "render_png", "require_png"]

if TYPE_CHECKING:
    import redis


# -- reading (the only part that talks to the server) ---------------------------------------------------


def build_report(client: redis.Redis | None, keys: RunKeys, *, source=None) -> ReportData:
    """Read a run's streams and compute its per-step series and totals; ``source`` (default: the
    server) may be an archive-backed entry source (`streamgrp.store.sources`) for a run retention trimmed."""
    from streamgrp.replay.summary import run_summary
    from streamgrp.store.sources import partition_streams, server_source
    from streamgrp.store.streams import entry_time

    source = source or server_source(client, keys)

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
    decisions = [
        (t, e)
        for _, name in partition_streams(source, "decisions")
        for t, e in events(name)
        if isinstance(e, GroupDecided)
    ]
    discards = [(t, e) for t, e in events("discarded") if isinstance(e, GroupDiscarded)]
    commits = [e for _, e in events("commits")]
    failures = tuple(e for e in commits if isinstance(e, StepFailed))
    resumes = tuple(e for e in commits if isinstance(e, TrainingResumed) and e.reason != "start")
    rows, tail = step_rows(
        started_at=started,
        manifests=manifests,
        decisions=decisions,
        discards=discards,
        metrics=trainer_metrics(source.hash("trainer_metrics")),
    )
    prompts = {
        e.task_id: e.prompt
        for _, name in partition_streams(source, "tasks")
        for _, e in events(name)
        if isinstance(e, TaskIssued)
    }
    by_prompt = prompt_rows(
        prompts=prompts, decisions=[e for _, e in decisions], discards=[e for _, e in discards], manifests=manifests
    )
    return ReportData(
        run=keys.run,
        started_at=started,
        steps=tuple(rows),
        after_last_step=tail,
        totals=run_summary(client, keys, source=source),
        status=run_status(control, len(rows)),
        failures=failures,
        resumes=resumes,
        prompts=tuple(by_prompt),
    )


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


def render_html(data: ReportData) -> str:
    """The whole report as one HTML page: inline CSS and SVG, no scripts, no external references."""
    status_class = "meta failed" if data.status.startswith("failed") else "meta"
    parts = [
        "<!DOCTYPE html>",
        # An empty data: icon, so a browser asks the server for nothing but the page (no /favicon.ico).
        '<html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">',
        f"<title>streamgrp report: {escape(data.run)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f'<h1 id="title">streamgrp report: run {escape(data.run)}</h1>',
        f'<p class="{status_class}" id="status">Status: {escape(data.status)}</p>',
        f'<p class="meta">{escape(_time_span(data))}</p>',
        '<section id="totals"><h2>Run totals</h2>',
        _totals_table(data.totals),
        f'<p class="definition">{escape(_tail_note(data))}</p></section>',
    ]
    steps = [row.step for row in data.steps]
    for spec in chart_specs(data):
        if spec.omitted:
            parts.append(
                f'<section class="chart-section omitted" id="section-{spec.id}"><h2>{escape(spec.title)}</h2>'
                f'<p class="definition" id="omitted-{spec.id}">{escape(spec.omitted)}</p></section>'
            )
        else:
            parts.append(
                f'<section class="chart-section" id="section-{spec.id}">{_chart(spec, steps)}'
                f'<p class="definition">{escape(spec.definition)}</p></section>'
            )
    if data.failures:
        parts.append(
            '<section id="failures"><h2>Step failures</h2><table><tr><th>step</th><th>rank</th><th>error</th></tr>'
        )
        parts += [
            f"<tr><td>{f.step}</td><td>{f.rank}</td><td style='text-align: left'>{escape(f.error)}</td></tr>"
            for f in data.failures
        ]
        parts.append("</table></section>")
    if data.resumes:
        parts.append(
            f'<section id="resumes"><h2>Trainer restarts</h2><p class="definition">{len(data.resumes)} '
            f"restarts of the trainer group; {data.steps_trained_again} steps trained again with their "
            "recorded data after a rollback to a checkpoint.</p><table><tr><th>attempt</th>"
            "<th>resumed at step</th><th>from</th><th>trained again</th><th>versions from</th></tr>"
        )
        parts += [
            f"<tr><td>{r.attempt}</td><td>{r.step}</td><td>{escape(r.reason)}</td>"
            f"<td>{f'{r.step}..{r.retrain_through}' if r.retrain_through >= r.step else '-'}</td>"
            f"<td>{r.base_version + 1}</td></tr>"
            for r in data.resumes
        ]
        parts.append("</table></section>")
    parts.append(_prompts_section(data))
    parts.append(_steps_table(data))
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _chart(spec: ChartSpec, steps: list[int]) -> str:
    if spec.kind == "bars":
        return stacked_bar_chart(
            chart_id=spec.id, title=spec.title, steps=steps, y_label=spec.y_label, series=spec.series
        )
    return line_chart(
        chart_id=spec.id,
        title=spec.title,
        steps=steps,
        y_label=spec.y_label,
        series=spec.series,
        y_min=spec.y_min,
        y_max=spec.y_max,
    )


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
    head = (
        "step",
        "version",
        "groups",
        "tokens",
        "decided",
        "dropped",
        "usable yield",
        "trainable yield",
        "seconds",
        "longest gap s",
        "imbalance",
        "reward",
        "loss",
        "logprob mismatch",
    )
    rows = [
        '<details id="steps"><summary>Per-step numbers</summary><table id="steps-table"><tr>'
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr>"
    ]
    for r in data.steps:
        cells = (
            r.step,
            r.version,
            r.groups,
            r.tokens,
            r.tally.groups_decided,
            sum(r.tally.drop_reasons.values()),
            r.usable_yield,
            r.trainable_yield,
            r.step_seconds,
            r.longest_gap_s,
            r.imbalance,
            r.reward,
            r.loss,
            r.logprob_mismatch,
        )
        rows.append(f'<tr data-step="{r.step}">' + "".join(f"<td>{escape(_cell(c))}</td>" for c in cells) + "</tr>")
    rows.append("</table></details>")
    return "".join(rows)


#: Prompts the page lists (the ones trained least); the share counts cover every prompt.
PROMPTS_SHOWN = 20


def _prompts_section(data: ReportData) -> str:
    """The bias monitor by prompt (`streamgrp.replay.report_prompts`): the prompts trained least, and how many
    prompts trained each share of their generations."""
    head = '<section id="prompts"><h2>Prompts trained least</h2>'
    if not data.prompts:
        return head + '<p class="definition" id="no-prompts">No group was decided: no prompt to show.</p></section>'
    counts = ", ".join(f"{label} {count}" for label, count in share_counts(data.prompts).items())
    rows = [
        (
            '<table id="prompts-table"><tr><th>prompt</th><th>text</th><th>tasks</th><th>generated</th>'
            "<th>trained</th><th>stale</th><th>timed out</th><th>trained share</th><th>mean tokens</th></tr>"
        )
    ]
    for row in data.prompts[:PROMPTS_SHOWN]:
        cells = (row.tasks, row.generated, row.trained, row.stale, row.timed_out, row.trained_share, row.mean_tokens)
        rows.append(
            f'<tr data-prompt="{escape(row.key)}"><th>{escape(row.key)}</th>'
            f'<td style="text-align: left">{escape(row.preview)}</td>'
            + "".join(f"<td>{escape(_cell(c))}</td>" for c in cells)
            + "</tr>"
        )
    rows.append("</table>")
    return (
        head + f'<p class="definition" id="prompt-shares">{len(data.prompts)} prompts by the share of their '
        f"generations trained: {escape(counts)}.</p>"
        + "".join(rows)
        + '<p class="definition">Per prompt (its id, else the digest of its JSON), over the whole run: the '
        "generations decided for it (members of complete and partial groups), those trained, those in groups "
        "dropped as stale, its slots that timed out, and the mean loss tokens of its generations; the "
        f"{min(PROMPTS_SHOWN, len(data.prompts))} trained least first. Hard prompts (long generations that go "
        "stale or time out) at the top with shares far below the rest: the run learns from the easy ones "
        "(--staleness wait or mask keep them).</p></section>"
    )


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
    return (
        f"After the last step (in no step's window, so in no chart): decisions {kinds}; drop reasons {reasons}. "
        "Per-step counts plus these equal the totals."
    )
