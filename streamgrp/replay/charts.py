"""Small inline-SVG charts over steps: line charts and stacked bar charts. Pure, standard library only.

Owns the drawing: scales, "nice" axis ticks, axes with labels, a legend, and one marker per step
and series that carries ``data-step`` / ``data-series`` attributes (and a ``<title>`` tooltip), so
a page stays readable and checkable without any JavaScript. Ignores where the numbers come from
(`streamgrp.replay.report_series` computes them) and page layout.

Series that coincide (usable and trainable yields often do) stay readable without moving any point:
each series of a line chart has its own dash pattern and marker shape (`LINE_STYLES`), later series
draw narrower lines and hollow markers over earlier ones, and the legend and tooltips say where a
series equals an earlier one (`coincidences`). Points are never offset: a shifted point would show
a value the run did not have.

Invariants every chart keeps, whatever the data (tests check them):
- the x axis is a band per step from the first to the last step given; a chart of no steps is
  an empty frame that says so;
- a line chart has exactly one ``.point`` marker per (series, step), centred at its ``data-x`` /
  ``data-y``; a missing value (None) is a hollow grey marker on the x axis and breaks the line, it
  is never drawn as a zero;
- series styled by position (up to ``len(LINE_STYLES)`` of them) differ in both dash pattern and marker
  shape, and a series equal to an earlier one at some step says so in its legend label;
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

#: (dash pattern, marker shape) given to a line chart's series in order, unless a series names its own.
#: An empty dash is a solid line.
LINE_STYLES = (
    ("", "circle"),
    ("7 4", "square"),
    ("2 3", "triangle"),
    ("10 3 2 3", "diamond"),
    ("4 2", "triangle-down"),
)
MARKERS = ("circle", "square", "triangle", "diamond", "triangle-down")

WIDTH, HEIGHT = 760, 300
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 64, 16, 58, 46
_FONT = 'font-family="system-ui, sans-serif"'


@dataclass(frozen=True)
class Series:
    """One named sequence of values, one per step (None: no value at that step)."""

    name: str
    values: Sequence[float | None]
    color: str | None = None
    dash: str | None = None  # an SVG stroke-dasharray ("" solid); None: by position (LINE_STYLES)
    marker: str | None = None  # one of MARKERS; None: by position (LINE_STYLES)
    width: float = 1.8  # line width; draw a series that others may cover wider, so it still shows

    def __post_init__(self) -> None:
        if self.marker is not None and self.marker not in MARKERS:
            raise ValueError(f"marker {self.marker!r} is not one of {', '.join(MARKERS)}")


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


def line_chart(
    *,
    chart_id: str,
    title: str,
    steps: Sequence[int],
    series: Sequence[Series],
    y_label: str,
    x_label: str = "step",
    y_min: float | None = None,
    y_max: float | None = None,
    width: int = WIDTH,
    height: int = HEIGHT,
) -> str:
    """An SVG line chart: one line and one marker per step for each series.

    Lines are drawn first, then markers, each in series order: an earlier series (drawn wider, with
    a filled marker) stays visible around a later one that coincides with it (narrower, dashed,
    hollow marker)."""
    _check_lengths(steps, series)
    styles = [line_style(index, one) for index, one in enumerate(series)]
    notes = coincidences(series)
    legend: list[_LegendItem] = [
        (one, color, dash, marker, f"{one.name} ({note})" if note else one.name)
        for one, (color, dash, marker), note in zip(series, styles, notes)
    ]
    frame = _Frame(
        chart_id,
        title,
        steps,
        [label for *_, label in legend],
        x_label,
        y_label,
        _y_range(series, y_min, y_max, stacked=False),
        width,
        height,
    )
    lines: list[str] = []
    markers: list[str] = []
    for index, (one, (color, dash, marker)) in enumerate(zip(series, styles)):
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        radius = frame.radius * max(1.0, one.width / 1.8)
        name = escape(one.name)
        run: list[str] = []
        segments: list[list[str]] = [run]
        for position, (step, value) in enumerate(zip(steps, one.values)):
            x = frame.x(step)
            if value is None:
                run = []
                segments.append(run)
                markers.append(
                    f'<path class="point missing" data-series="{name}" data-step="{step}" '
                    f'data-marker="{marker}" data-x="{x:.1f}" data-y="{frame.bottom:.1f}" '
                    f'd="{_marker_path(marker, x, frame.bottom, radius)}" '
                    f'fill="none" stroke="#999" stroke-width="1.2"><title>step {step}: {name} n/a</title></path>'
                )
                continue
            y = frame.y(value)
            run.append(f"{x:.1f},{y:.1f}")
            same = [escape(other.name) for other in series[:index] if _same(other.values[position], value)]
            also = f" (same as {', '.join(same)})" if same else ""
            fill = f'fill="{color}"' if index == 0 else f'fill="none" stroke="{color}" stroke-width="1.6"'
            markers.append(
                f'<path class="point" data-series="{name}" data-step="{step}" data-value="{value!r}" '
                f'data-marker="{marker}" data-x="{x:.1f}" data-y="{y:.1f}" '
                f'd="{_marker_path(marker, x, y, radius)}" {fill}>'
                f"<title>step {step}: {name} {format_number(value)}{also}</title></path>"
            )
        for segment in segments:
            if len(segment) > 1:
                lines.append(
                    f'<polyline class="line" data-series="{name}" points="{" ".join(segment)}" '
                    f'fill="none" stroke="{color}" stroke-width="{one.width:g}"{dash_attr}/>'
                )
    return frame.render(lines + markers, legend)


def coincidences(series: Sequence[Series]) -> list[str | None]:
    """Per series, a legend note naming the earlier series it coincides with most (equal values at
    the same steps): ``= usable at every step`` (every step where it has a value) or ``= usable at 3
    of 5 steps``. None when no earlier series equals it at every step or at two steps and at least
    half of them: a lone shared point (a cumulative series equals its own first window) is not worth
    a legend note; its tooltip still says so."""
    notes: list[str | None] = []
    for index, one in enumerate(series):
        defined = sum(value is not None for value in one.values)
        best, best_count = None, 0
        for other in series[:index]:
            count = sum(_same(a, b) for a, b in zip(other.values, one.values))
            if count > best_count:
                best, best_count = other, count
        if best is not None and best_count == defined:
            notes.append(f"= {best.name} at every step" if defined > 1 else f"= {best.name}")
        elif best is not None and best_count >= 2 and 2 * best_count >= defined:
            notes.append(f"= {best.name} at {best_count} of {defined} steps")
        else:
            notes.append(None)
    return notes


def _same(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def line_style(index: int, one: Series) -> tuple[str, str, str]:
    """(colour, dash, marker) of the series at ``index``."""
    dash, marker = LINE_STYLES[index % len(LINE_STYLES)]
    color = one.color or PALETTE[index % len(PALETTE)]
    return color, dash if one.dash is None else one.dash, marker if one.marker is None else one.marker


def _marker_path(shape: str, x: float, y: float, r: float) -> str:
    """An SVG path of ``shape`` centred at (x, y), about ``2 r`` across; shapes of one size cover
    about the same area, so none hides another completely."""
    if shape == "circle":
        return f"M{x - r:.1f},{y:.1f}a{r:.1f},{r:.1f} 0 1,0 {2 * r:.1f},0a{r:.1f},{r:.1f} 0 1,0 {-2 * r:.1f},0Z"
    if shape == "square":
        s = r * 0.9
        return f"M{x - s:.1f},{y - s:.1f}h{2 * s:.1f}v{2 * s:.1f}h{-2 * s:.1f}Z"
    if shape == "diamond":
        d = r * 1.3
        return f"M{x:.1f},{y - d:.1f}L{x + d:.1f},{y:.1f}L{x:.1f},{y + d:.1f}L{x - d:.1f},{y:.1f}Z"
    sign = 1 if shape == "triangle" else -1  # triangle points up, triangle-down down
    tip, base, half = y - sign * 1.3 * r, y + sign * 0.8 * r, 1.2 * r
    return f"M{x:.1f},{tip:.1f}L{x + half:.1f},{base:.1f}L{x - half:.1f},{base:.1f}Z"


def stacked_bar_chart(
    *,
    chart_id: str,
    title: str,
    steps: Sequence[int],
    series: Sequence[Series],
    y_label: str,
    x_label: str = "step",
    integer: bool = True,
    width: int = WIDTH,
    height: int = HEIGHT,
) -> str:
    """An SVG stacked bar chart: one bar per step, one segment per series (None counts as 0).

    ``integer`` (the default: bars here are counts) keeps y ticks on whole numbers."""
    _check_lengths(steps, series)
    for one in series:
        if any(v is not None and v < 0 for v in one.values):
            raise ValueError(f"stacked series {one.name!r} has a negative value; stacked bars need values >= 0")
    frame = _Frame(
        chart_id,
        title,
        steps,
        [one.name for one in series],
        x_label,
        y_label,
        _y_range(series, 0.0, None, stacked=True, integer=integer),
        width,
        height,
    )
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
            parts.append(
                f'<rect class="segment" data-series="{escape(one.name)}" data-value="{value!r}" '
                f'x="{x:.1f}" y="{top:.1f}" width="{bar:.1f}" height="{max(bottom - top, 0.0):.1f}" '
                f'fill="{color}"><title>step {step}: {escape(one.name)} {format_number(value)}</title></rect>'
            )
            base += value
        parts.append("</g>")
        body.append("".join(parts))
    return frame.render(body, [(one, color, None, None, one.name) for one, color in zip(series, colors)])


def _check_lengths(steps: Sequence[int], series: Sequence[Series]) -> None:
    for one in series:
        if len(one.values) != len(steps):
            raise ValueError(
                f"series {one.name!r} has {len(one.values)} values for {len(steps)} steps; give one per step"
            )
    if list(steps) != sorted(set(steps)):
        raise ValueError("steps must be distinct and increasing")


def _legend_layout(names: Sequence[str], left: float, right: float) -> list[tuple[float, int]]:
    """Where each legend item starts (x) and on which row, wrapping at the right edge."""
    placed, x, row = [], float(left), 0
    for name in names:
        item_width = 40 + 7.2 * len(name)  # swatch, gap and a rough text width: no font metrics without a browser
        if x + item_width > right and x > left:
            x, row = float(left), row + 1
        placed.append((x, row))
        x += item_width
    return placed


def _y_range(
    series: Sequence[Series], y_min: float | None, y_max: float | None, *, stacked: bool, integer: bool = False
) -> list[float]:
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


#: A legend entry: the series, its colour, dash and marker (None for a bar), and the label shown.
_LegendItem = tuple[Series, str, "str | None", "str | None", str]


class _Frame:
    """Scales and the fixed parts of a chart: title, legend, axes, ticks and labels."""

    def __init__(
        self,
        chart_id: str,
        title: str,
        steps: Sequence[int],
        labels: Sequence[str],
        x_label: str,
        y_label: str,
        y_ticks: list[float],
        width: int,
        height: int,
    ) -> None:
        self.chart_id, self.title, self.steps = chart_id, title, list(steps)
        self.x_label, self.y_label, self.y_ticks = x_label, y_label, y_ticks
        self.width, self.height = width, height
        self.left, self.right = MARGIN_LEFT, width - MARGIN_RIGHT
        self.legend_rows = _legend_layout(labels, self.left, self.right)
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

    def render(self, body: list[str], legend: list[_LegendItem]) -> str:
        cid = escape(self.chart_id)
        out = [
            (
                f'<svg class="chart" id="chart-{cid}" data-chart="{cid}" viewBox="0 0 {self.width} {self.height}" '
                f'width="{self.width}" height="{self.height}" role="img" aria-labelledby="chart-{cid}-title">'
            ),
            f'<title id="chart-{cid}-title">{escape(self.title)}</title>',
            (
                f'<text class="chart-title" x="{self.left}" y="20" {_FONT} font-size="15" font-weight="600">'
                f"{escape(self.title)}</text>"
            ),
        ]
        out += self._legend(legend)
        out += self._axes()
        if not self.steps:
            out.append(
                f'<text class="empty" x="{(self.left + self.right) / 2:.1f}" y="{(self.top + self.bottom) / 2:.1f}" '
                f'text-anchor="middle" {_FONT} font-size="13" fill="#666">no steps yet</text>'
            )
        out += body
        out.append("</svg>")
        return "\n".join(out)

    def _legend(self, legend: list[_LegendItem]) -> list[str]:
        """One item per series: a swatch (a bar's colour, or a line's dash pattern and marker) and its label."""
        out = ['<g class="legend">']
        if not legend:
            out.append(f'<text x="{self.left}" y="44" {_FONT} font-size="12" fill="#666">(no series)</text>')
        for index, ((one, color, dash, marker, label), (x, row)) in enumerate(zip(legend, self.legend_rows)):
            y = 40.0 + 15 * row
            if marker is None:  # a bar chart's series: a block of its colour
                swatch = (
                    f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x + 22:.1f}" y2="{y:.1f}" '
                    f'stroke="{color}" stroke-width="6"/>'
                )
            else:
                dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
                fill = f'fill="{color}"' if index == 0 else f'fill="white" stroke="{color}" stroke-width="1.6"'
                swatch = (
                    f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x + 26:.1f}" y2="{y:.1f}" stroke="{color}" '
                    f'stroke-width="{max(one.width, 1.8):g}"{dash_attr}/>'
                    f'<path d="{_marker_path(marker, x + 13, y, 3.5)}" {fill}/>'
                )
            out.append(
                f'<g class="legend-item" data-series="{escape(one.name)}">{swatch}<text x="{x + 30:.1f}" '
                f'y="{y + 4:.1f}" {_FONT} font-size="12">{escape(label)}</text></g>'
            )
        out.append("</g>")
        return out

    def _axes(self) -> list[str]:
        left, right, top, bottom = self.left, self.right, self.top, self.bottom
        out = [
            '<g class="axes" stroke="#333" stroke-width="1">',
            f'<line class="x-axis" x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}"/>',
            f'<line class="y-axis" x1="{left}" y1="{top}" x2="{left}" y2="{bottom}"/>',
            "</g>",
            f'<g class="y-ticks" {_FONT} font-size="11" fill="#333">',
        ]
        for tick in self.y_ticks:
            y = self.y(tick)
            out.append(
                f'<line x1="{left - 4}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#ddd"/>'
                f'<text x="{left - 7}" y="{y + 4:.1f}" text-anchor="end">{format_number(tick)}</text>'
            )
        out.append("</g>")
        out.append(f'<g class="x-ticks" {_FONT} font-size="11" fill="#333">')
        for step in self._x_ticks():
            x = self.x(step)
            out.append(
                f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#333"/>'
                f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{step}</text>'
            )
        out.append("</g>")
        out.append(
            f'<text class="x-label" x="{(left + right) / 2:.1f}" y="{self.height - 8}" text-anchor="middle" '
            f'{_FONT} font-size="12">{escape(self.x_label)}</text>'
        )
        middle = (top + bottom) / 2
        out.append(
            f'<text class="y-label" x="16" y="{middle:.1f}" transform="rotate(-90 16 {middle:.1f})" '
            f'text-anchor="middle" {_FONT} font-size="12">{escape(self.y_label)}</text>'
        )
        return out

    def _x_ticks(self) -> list[int]:
        """Whole steps only, at most about ten labels."""
        if not self.steps:
            return []
        first, last = self.steps[0], self.steps[-1]
        every = int(nice_ticks(0, max(last - first, 1), 10, integer=True)[1])
        start = math.ceil(first / every) * every
        return list(range(start, last + 1, every)) or [first]
