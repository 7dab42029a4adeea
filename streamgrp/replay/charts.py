"""Small inline-SVG charts over steps: line charts and stacked bar charts. Pure, standard library only.

Owns the drawing: scales, "nice" axis ticks, axes with labels, a legend, and one marker per step
and series that carries ``data-step`` / ``data-series`` attributes (and a ``<title>`` tooltip), so
a page stays readable and checkable without any JavaScript. Ignores where the numbers come from
(`streamgrp.replay.report_series` computes them) and page layout.

Invariants every chart keeps, whatever the data (tests check them):
- the x axis is a band per step from the first to the last step given; a chart of no steps is
  an empty frame that says so;
- a line chart has exactly one ``circle.point`` per (series, step); a missing value (None) is a
  hollow marker on the x axis and breaks the line, it is never drawn as a zero;
- a stacked bar chart has exactly one ``g.bar`` per step, holding one ``rect`` per series whose
  value is positive, stacked in series order;
- every text is escaped; the output is well-formed XML with no external references.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

#: Colour-blind-safe palette (Okabe-Ito), assigned to series in order unless a series names its own.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")

WIDTH, HEIGHT = 760, 300
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 64, 16, 58, 46
_FONT = "font-family=\"system-ui, sans-serif\""


@dataclass(frozen=True)
class Series:
    """One named sequence of values, one per step (None: no value at that step)."""

    name: str
    values: Sequence[float | None]
    color: str | None = None
    dashed: bool = False
    width: float = 1.8  # line width; draw a series that others may cover wider, so it still shows


def nice_ticks(lo: float, hi: float, count: int = 5, *, integer: bool = False) -> list[float]:
    """Round tick values covering [lo, hi], about ``count`` of them (1, 2, 2.5 or 5 times a power of ten;
    with ``integer``, whole numbers only: counts have no half groups)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"tick range must be finite, got [{lo}, {hi}]")
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(count, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    multiples = (1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10)
    step = next(m * power for m in multiples if m * power >= raw)
    if integer:
        step = max(1.0, float(round(step)))
    first = math.floor(lo / step + 1e-9) * step
    ticks, value = [], first
    while value < hi + step * 1e-9:
        ticks.append(round(value, 12) + 0.0)  # + 0.0 turns -0.0 into 0.0
        value += step
    if ticks[-1] < hi - step * 1e-9:
        ticks.append(round(value, 12))
    return ticks


def format_number(value: float) -> str:
    """Tick and tooltip text: integers without decimals, others with up to four significant digits."""
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def line_chart(*, chart_id: str, title: str, steps: Sequence[int], series: Sequence[Series], y_label: str,
               x_label: str = "step", y_min: float | None = None, y_max: float | None = None,
               width: int = WIDTH, height: int = HEIGHT) -> str:
    """An SVG line chart: one line and one marker per step for each series."""
    _check_lengths(steps, series)
    frame = _Frame(chart_id, title, steps, series, x_label, y_label, _y_range(series, y_min, y_max, stacked=False),
                   width, height)
    body: list[str] = []
    for index, one in enumerate(series):
        color = one.color or PALETTE[index % len(PALETTE)]
        dash = ' stroke-dasharray="6 4"' if one.dashed else ""
        radius = frame.radius * max(1.0, one.width / 1.8)
        run: list[str] = []
        segments: list[list[str]] = [run]
        points: list[str] = []
        for step, value in zip(steps, one.values):
            x = frame.x(step)
            if value is None:
                run = []
                segments.append(run)
                points.append(f'<circle class="point missing" data-series="{escape(one.name)}" data-step="{step}" '
                              f'cx="{x:.1f}" cy="{frame.bottom:.1f}" r="{radius:.1f}" fill="white" '
                              f'stroke="#999"><title>step {step}: {escape(one.name)} n/a</title></circle>')
                continue
            y = frame.y(value)
            run.append(f"{x:.1f},{y:.1f}")
            points.append(f'<circle class="point" data-series="{escape(one.name)}" data-step="{step}" '
                          f'data-value="{value!r}" cx="{x:.1f}" cy="{y:.1f}" r="{radius:.1f}" fill="{color}">'
                          f'<title>step {step}: {escape(one.name)} {format_number(value)}</title></circle>')
        for segment in segments:
            if len(segment) > 1:
                body.append(f'<polyline class="line" data-series="{escape(one.name)}" points="{" ".join(segment)}" '
                            f'fill="none" stroke="{color}" stroke-width="{one.width:g}"{dash}/>')
        body.extend(points)
    return frame.render(body, [(one, one.color or PALETTE[i % len(PALETTE)]) for i, one in enumerate(series)])


def stacked_bar_chart(*, chart_id: str, title: str, steps: Sequence[int], series: Sequence[Series], y_label: str,
                      x_label: str = "step", integer: bool = True, width: int = WIDTH, height: int = HEIGHT) -> str:
    """An SVG stacked bar chart: one bar per step, one segment per series (None counts as 0).

    ``integer`` (the default: bars here are counts) keeps y ticks on whole numbers."""
    _check_lengths(steps, series)
    for one in series:
        if any(v is not None and v < 0 for v in one.values):
            raise ValueError(f"stacked series {one.name!r} has a negative value; stacked bars need values >= 0")
    frame = _Frame(chart_id, title, steps, series, x_label, y_label,
                   _y_range(series, 0.0, None, stacked=True, integer=integer), width, height)
    colors = [one.color or PALETTE[i % len(PALETTE)] for i, one in enumerate(series)]
    body: list[str] = []
    bar = frame.band * 0.72
    for position, step in enumerate(steps):
        x = frame.x(step) - bar / 2
        total = sum(one.values[position] or 0 for one in series)
        parts = [f'<g class="bar" data-step="{step}" data-total="{total!r}">']
        base = 0.0
        for one, color in zip(series, colors):
            value = one.values[position] or 0
            if value <= 0:
                continue
            top, bottom = frame.y(base + value), frame.y(base)
            parts.append(f'<rect class="segment" data-series="{escape(one.name)}" data-value="{value!r}" '
                         f'x="{x:.1f}" y="{top:.1f}" width="{bar:.1f}" height="{max(bottom - top, 0.0):.1f}" '
                         f'fill="{color}"><title>step {step}: {escape(one.name)} {format_number(value)}</title></rect>')
            base += value
        parts.append("</g>")
        body.append("".join(parts))
    return frame.render(body, list(zip(series, colors)))


def _check_lengths(steps: Sequence[int], series: Sequence[Series]) -> None:
    for one in series:
        if len(one.values) != len(steps):
            raise ValueError(f"series {one.name!r} has {len(one.values)} values for {len(steps)} steps; give one per step")
    if list(steps) != sorted(set(steps)):
        raise ValueError("steps must be distinct and increasing")


def _legend_layout(names: Sequence[str], left: float, right: float) -> list[tuple[float, int]]:
    """Where each legend item starts (x) and on which row, wrapping at the right edge."""
    placed, x, row = [], float(left), 0
    for name in names:
        item_width = 26 + 7.0 * len(name)  # a rough text width: no font metrics without a browser
        if x + item_width > right and x > left:
            x, row = float(left), row + 1
        placed.append((x, row))
        x += item_width
    return placed


def _y_range(series: Sequence[Series], y_min: float | None, y_max: float | None, *, stacked: bool,
             integer: bool = False) -> list[float]:
    """The y ticks: from ``y_min`` (default: 0, or the smallest value if negative) to the data's top."""
    if stacked:
        totals = [sum(v or 0 for v in column) for column in zip(*(one.values for one in series))]
        values = totals
    else:
        values = [v for one in series for v in one.values if v is not None and math.isfinite(v)]
    lo = y_min if y_min is not None else min([0.0, *values])
    hi = y_max if y_max is not None else max([lo, *values])
    if hi <= lo:
        hi = lo + 1.0
    return nice_ticks(lo, hi, integer=integer)


class _Frame:
    """Scales and the fixed parts of a chart: title, legend, axes, ticks and labels."""

    def __init__(self, chart_id: str, title: str, steps: Sequence[int], series: Sequence[Series], x_label: str,
                 y_label: str, y_ticks: list[float], width: int, height: int) -> None:
        self.chart_id, self.title, self.steps = chart_id, title, list(steps)
        self.x_label, self.y_label, self.y_ticks = x_label, y_label, y_ticks
        self.width, self.height = width, height
        self.left, self.right = MARGIN_LEFT, width - MARGIN_RIGHT
        self.legend_rows = _legend_layout([one.name for one in series], self.left, self.right)
        extra = 15 * (max((row for _, row in self.legend_rows), default=0))
        self.top, self.bottom = MARGIN_TOP + extra, height + extra - MARGIN_BOTTOM
        self.height = height + extra  # a long legend adds rows above the plot instead of covering it
        self.first = self.steps[0] if self.steps else 0
        self.band = (self.right - self.left) / max(len(self.steps) and self.steps[-1] - self.first + 1, 1)
        self.radius = max(1.2, min(3.5, self.band / 3))
        self.y_lo, self.y_hi = y_ticks[0], y_ticks[-1]

    def x(self, step: int) -> float:
        return self.left + (step - self.first + 0.5) * self.band

    def y(self, value: float) -> float:
        value = min(max(value, self.y_lo), self.y_hi)
        return self.bottom - (value - self.y_lo) / (self.y_hi - self.y_lo) * (self.bottom - self.top)

    def render(self, body: list[str], legend: list[tuple[Series, str]]) -> str:
        cid = escape(self.chart_id)
        out = [f'<svg class="chart" id="chart-{cid}" data-chart="{cid}" viewBox="0 0 {self.width} {self.height}" '
               f'width="{self.width}" height="{self.height}" role="img" aria-labelledby="chart-{cid}-title">',
               f'<title id="chart-{cid}-title">{escape(self.title)}</title>',
               f'<text class="chart-title" x="{self.left}" y="20" {_FONT} font-size="15" font-weight="600">'
               f'{escape(self.title)}</text>']
        out += self._legend(legend)
        out += self._axes()
        if not self.steps:
            out.append(f'<text class="empty" x="{(self.left + self.right) / 2:.1f}" y="{(self.top + self.bottom) / 2:.1f}" '
                       f'text-anchor="middle" {_FONT} font-size="13" fill="#666">no steps yet</text>')
        out += body
        out.append("</svg>")
        return "\n".join(out)

    def _legend(self, legend: list[tuple[Series, str]]) -> list[str]:
        out = ['<g class="legend">']
        if not legend:
            out.append(f'<text x="{self.left}" y="44" {_FONT} font-size="12" fill="#666">(no series)</text>')
        for (one, color), (x, row) in zip(legend, self.legend_rows):
            label, y = escape(one.name), 40.0 + 15 * row
            dash = ' stroke-dasharray="5 3"' if one.dashed else ""
            out.append(f'<g class="legend-item" data-series="{label}"><line x1="{x:.1f}" y1="{y:.1f}" x2="{x + 16:.1f}" '
                       f'y2="{y:.1f}" stroke="{color}" stroke-width="6"{dash}/><text x="{x + 20:.1f}" y="{y + 4:.1f}" '
                       f'{_FONT} font-size="12">{label}</text></g>')
        out.append("</g>")
        return out

    def _axes(self) -> list[str]:
        left, right, top, bottom = self.left, self.right, self.top, self.bottom
        out = ['<g class="axes" stroke="#333" stroke-width="1">',
               f'<line class="x-axis" x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}"/>',
               f'<line class="y-axis" x1="{left}" y1="{top}" x2="{left}" y2="{bottom}"/>', "</g>",
               f'<g class="y-ticks" {_FONT} font-size="11" fill="#333">']
        for tick in self.y_ticks:
            y = self.y(tick)
            out.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#ddd"/>'
                       f'<text x="{left - 7}" y="{y + 4:.1f}" text-anchor="end">{format_number(tick)}</text>')
        out.append("</g>")
        out.append(f'<g class="x-ticks" {_FONT} font-size="11" fill="#333">')
        for step in self._x_ticks():
            x = self.x(step)
            out.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#333"/>'
                       f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{step}</text>')
        out.append("</g>")
        out.append(f'<text class="x-label" x="{(left + right) / 2:.1f}" y="{self.height - 8}" text-anchor="middle" '
                   f'{_FONT} font-size="12">{escape(self.x_label)}</text>')
        middle = (top + bottom) / 2
        out.append(f'<text class="y-label" x="16" y="{middle:.1f}" transform="rotate(-90 16 {middle:.1f})" '
                   f'text-anchor="middle" {_FONT} font-size="12">{escape(self.y_label)}</text>')
        return out

    def _x_ticks(self) -> list[int]:
        """Whole steps only, at most about ten labels."""
        if not self.steps:
            return []
        first, last = self.steps[0], self.steps[-1]
        every = int(nice_ticks(0, max(last - first, 1), 10, integer=True)[1])
        start = math.ceil(first / every) * every
        return list(range(start, last + 1, every)) or [first]
