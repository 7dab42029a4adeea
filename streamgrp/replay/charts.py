"""Small inline-SVG charts over steps: line charts and stacked bar charts. Pure, standard library only.

Owns the drawing: the series' styles, the lines and bars, and one marker per step and series that carries
``data-step`` / ``data-series`` attributes (and a ``<title>`` tooltip), so a page stays readable and checkable
without any JavaScript; in a frame (scales, "nice" axis ticks, axes with labels, a legend) that
`streamgrp.replay.chart_frame` draws. Ignores where the numbers come from (`streamgrp.replay.report_series`
computes them) and page layout.

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

from streamgrp.replay.chart_frame import (  # noqa: F401 - the frame's names, importable from here as before
    HEIGHT,
    MARGIN_BOTTOM,
    MARGIN_LEFT,
    MARGIN_RIGHT,
    MARGIN_TOP,
    WIDTH,
    Frame,
    LegendItem,
    format_number,
    marker_path,
    nice_ticks,
)

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
    legend: list[LegendItem] = [
        (one, color, dash, marker, f"{one.name} ({note})" if note else one.name)
        for one, (color, dash, marker), note in zip(series, styles, notes)
    ]
    frame = Frame(
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
                    f'd="{marker_path(marker, x, frame.bottom, radius)}" '
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
                f'd="{marker_path(marker, x, y, radius)}" {fill}>'
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
    frame = Frame(
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
