"""A run's timeline as one self-contained HTML page (`streamgrp report`), for people without Grafana.

Owns the per-step series and their definitions; reads the run's streams and changes nothing. The
run totals come from `streamgrp.replay.summary.run_summary` unchanged, so the page and the demo's summary
never disagree. Drawing is `streamgrp.replay.charts` (inline SVG, no JavaScript, no external files).

**Step windows.** Step ``k``'s window is ``(end of k-1, created_at of manifest k]``; step 0's
starts when the run started (its `RunStarted` record). Every time is the server's clock: manifests
carry ``created_at`` (server TIME), and a decision or discard is placed by its stream entry id
(the server's clock when it was written; millisecond resolution). An event after the last manifest
falls in no step; it is reported as "after the last step", so per-step counts plus that remainder
equal the run totals.

Per step, over its window:

- *yields*: the groups the assembler decided in the window: usable slots / target slots and
  trainable slots / target slots (the run-level definitions of `run_summary`, restricted to the
  window). None when no group was decided in the window, e.g. a step cut at once from groups already
  buffered; the cumulative yields (all windows up to and including the step) are always defined.
- *decisions by kind*: complete / partial / dropped decisions written in the window.
- *drop reasons*: the reasons of dropped decisions written in the window, plus the batcher's
  discards (stale / filtered / leftover) written in it. A group the batcher discards as stale while
  cutting step ``k`` is written in the same commit as manifest ``k``, just after its ``created_at``,
  so it usually counts in step ``k+1``'s window.
- *stall seconds*: the window's length (time since the previous manifest), and the longest
  stretch of the window without a trainable (complete or partial) decision.
- *imbalance*: the manifest's largest shard tokens over the mean (1.0 is perfect).

Deliberately ignored: slot-level timing (when workers published), trainer-side timing, and anything
the counters know but the streams do not (slot outcomes per step).
"""

from __future__ import annotations

import io
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from typing import TYPE_CHECKING, Any

from streamgrp.core import codec
from streamgrp.core.events import (
    GroupDecided,
    GroupDiscarded,
    RunFinished,
    RunStarted,
    RunTerminated,
    StepFailed,
    StepManifest,
)
from streamgrp.errors import ConfigError, DecodeError
from streamgrp.replay.charts import Series, format_number, line_chart, stacked_bar_chart
from streamgrp.store.keys import RunKeys

if TYPE_CHECKING:
    import redis

DECISION_KINDS = ("complete", "partial", "dropped")
#: Stable chart ids, in page order; each chart is ``<svg id="chart-{id}">``.
CHART_IDS = ("yields", "decisions", "drop-reasons", "stall", "imbalance")
_KIND_COLORS = {"complete": "#009E73", "partial": "#56B4E9", "dropped": "#D55E00"}


@dataclass(frozen=True)
class Tally:
    """What the assembler and batcher recorded in one window."""

    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DECISION_KINDS, 0))
    drop_reasons: dict[str, int] = field(default_factory=dict)
    target_slots: int = 0
    usable_slots: int = 0
    trainable_slots: int = 0

    @property
    def groups_decided(self) -> int:
        return sum(self.decisions.values())


@dataclass(frozen=True)
class StepRow:
    """One step's numbers; see the module docstring for each definition."""

    step: int
    version: int
    groups: int  # groups the step trains
    tokens: int  # valid loss tokens over all shards
    window_start: float
    created_at: float
    tally: Tally
    usable_yield: float | None
    trainable_yield: float | None
    cumulative_usable_yield: float | None
    cumulative_trainable_yield: float | None
    step_seconds: float
    longest_gap_s: float
    imbalance: float


@dataclass(frozen=True)
class ReportData:
    run: str
    started_at: float | None
    steps: tuple[StepRow, ...]
    after_last_step: Tally
    totals: dict[str, Any]
    status: str
    failures: tuple[StepFailed, ...] = ()

    def series(self) -> dict[str, list[Any]]:
        """Every per-step series by name, one value per step (what the charts draw)."""
        reasons = sorted({reason for row in self.steps for reason in row.tally.drop_reasons})
        out: dict[str, list[Any]] = {
            "step": [r.step for r in self.steps],
            "usable_yield": [r.usable_yield for r in self.steps],
            "trainable_yield": [r.trainable_yield for r in self.steps],
            "cumulative_usable_yield": [r.cumulative_usable_yield for r in self.steps],
            "cumulative_trainable_yield": [r.cumulative_trainable_yield for r in self.steps],
            "step_seconds": [r.step_seconds for r in self.steps],
            "longest_gap_s": [r.longest_gap_s for r in self.steps],
            "imbalance": [r.imbalance for r in self.steps],
        }
        for kind in DECISION_KINDS:
            out[f"decisions:{kind}"] = [r.tally.decisions.get(kind, 0) for r in self.steps]
        for reason in reasons:
            out[f"dropped:{reason}"] = [r.tally.drop_reasons.get(reason, 0) for r in self.steps]
        return out


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


# -- the series (pure) ------------------------------------------------------------------------------------

def step_rows(*, started_at: float | None, manifests: Sequence[StepManifest],
              decisions: Sequence[tuple[float, GroupDecided]],
              discards: Sequence[tuple[float, GroupDiscarded]]) -> tuple[list[StepRow], Tally]:
    """Per-step rows from timestamped events, and the tally of what came after the last step.

    Every decision and discard is counted exactly once: in the first window whose end is at or after
    its time (an event before the run's start counts in step 0), or else in the returned remainder.
    """
    manifests = sorted(manifests, key=lambda m: m.step)
    ends: list[float] = []
    for manifest in manifests:  # a clock stepping back must not make windows overlap
        ends.append(max(manifest.created_at, ends[-1]) if ends else manifest.created_at)
    buckets: list[list[tuple[float, Any]]] = [[] for _ in range(len(manifests) + 1)]
    for when, event in sorted([*decisions, *discards], key=lambda item: item[0]):
        buckets[_window_of(ends, when)].append((when, event))
    first_event = min([when for when, _ in [*decisions, *discards]], default=None)
    start = started_at if started_at is not None else first_event
    rows: list[StepRow] = []
    running = Counter()
    for index, manifest in enumerate(manifests):
        end = ends[index]
        window_start = min(start, end) if start is not None else end
        tally = _tally(buckets[index])
        running.update(target=tally.target_slots, usable=tally.usable_slots, trainable=tally.trainable_slots)
        trainable_times = [when for when, event in buckets[index]
                           if isinstance(event, GroupDecided) and event.decision != "dropped"]
        rows.append(StepRow(
            step=manifest.step,
            version=manifest.version,
            groups=sum(len(shard.groups) for shard in manifest.shards),
            tokens=sum(shard.tokens for shard in manifest.shards),
            window_start=window_start,
            created_at=manifest.created_at,
            tally=tally,
            usable_yield=_ratio(tally.usable_slots, tally.target_slots),
            trainable_yield=_ratio(tally.trainable_slots, tally.target_slots),
            cumulative_usable_yield=_ratio(running["usable"], running["target"]),
            cumulative_trainable_yield=_ratio(running["trainable"], running["target"]),
            step_seconds=end - window_start,
            longest_gap_s=longest_gap(window_start, end, trainable_times),
            imbalance=manifest.imbalance,
        ))
        start = end
    return rows, _tally(buckets[-1])


def longest_gap(start: float, end: float, times: Sequence[float]) -> float:
    """The longest stretch of [start, end] containing none of ``times`` (clipped to the interval)."""
    points = [start, *sorted(min(max(t, start), end) for t in times), end]
    return max((b - a for a, b in zip(points, points[1:])), default=0.0)


def run_status(control: Sequence[Any], steps: int) -> str:
    """One line: finished, failed (with the terminal reason and message), or still running."""
    for event in control:
        if isinstance(event, RunTerminated):
            where = f" at step {event.step}" if event.step is not None else ""
            return f"failed{where} ({event.reason}): {event.message}"
    for event in control:
        if isinstance(event, RunFinished):
            return f"finished after {event.steps} steps"
    return f"running ({steps} steps so far)"


def _window_of(ends: Sequence[float], when: float) -> int:
    low, high = 0, len(ends)
    while low < high:  # the first window whose end is >= when
        middle = (low + high) // 2
        if ends[middle] < when:
            low = middle + 1
        else:
            high = middle
    return low


def _tally(events: Sequence[tuple[float, Any]]) -> Tally:
    decisions = dict.fromkeys(DECISION_KINDS, 0)
    reasons: Counter[str] = Counter()
    target = usable = trainable = 0
    for _, event in events:
        if isinstance(event, GroupDecided):
            decisions[event.decision] += 1
            if event.decision == "dropped" and event.reason:
                reasons[event.reason] += 1
            target += event.stats.target_slot_count
            usable += event.stats.usable_slot_count
            trainable += event.stats.trainable_slot_count
        else:
            reasons[event.reason] += 1
    return Tally(decisions, dict(sorted(reasons.items())), target, usable, trainable)


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


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
              "one): usable and trainable slots over target slots. A hollow marker on the axis: no group was decided "
              "in that window. Dashed: cumulative over all windows so far.",
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
                    Series("usable (cumulative)", series["cumulative_usable_yield"], "#0072B2", dashed=True, width=3.6),
                    Series("trainable (cumulative)", series["cumulative_trainable_yield"], "#E69F00", dashed=True)]),
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
    for name, label, style, width in (("usable_yield", "usable", "o-", 3.5), ("trainable_yield", "trainable", "o-", 1.5),
                                      ("cumulative_usable_yield", "usable (cumulative)", "--", 3.5),
                                      ("cumulative_trainable_yield", "trainable (cumulative)", "--", 1.5)):
        yields.plot(steps, nan(series[name]), style, label=label, markersize=3, linewidth=width)
    yields.set_ylim(0, 1)
    for ax, prefix in ((decisions, "decisions:"), (drops, "dropped:")):
        bottom = [0] * len(steps)
        for name, values in series.items():
            if name.startswith(prefix):
                ax.bar(steps, values, bottom=bottom, label=name.split(":", 1)[1],
                       color=_KIND_COLORS.get(name.split(":", 1)[1]))
                bottom = [b + v for b, v in zip(bottom, values)]
    stall.plot(steps, series["step_seconds"], "o-", label="since previous step", markersize=3, linewidth=3.5)
    stall.plot(steps, series["longest_gap_s"], "o-", label="longest gap without a trainable decision", markersize=3)
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
