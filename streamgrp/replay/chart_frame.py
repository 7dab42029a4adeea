"""The frame every chart of `streamgrp.replay.charts` is drawn in: its size and margins, the x band per step and
the y scale, "nice" tick values, the title, the legend (wrapped onto rows above the plot) and the axes with their
ticks and labels; and the marker shapes a line chart and its legend draw. Pure, standard library only.

Owns where things go and the fixed parts of the SVG; what is plotted in the frame (lines, markers, bars) and how
series are styled are `streamgrp.replay.charts`'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamgrp.replay.charts import Series

WIDTH, HEIGHT = 760, 300
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 64, 16, 58, 46
_FONT = 'font-family="system-ui, sans-serif"'


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


def marker_path(shape: str, x: float, y: float, r: float) -> str:
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


#: A legend entry: the series, its colour, dash and marker (None for a bar), and the label shown.
LegendItem = tuple["Series", str, "str | None", "str | None", str]


class Frame:
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

    def render(self, body: list[str], legend: list[LegendItem]) -> str:
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

    def _legend(self, legend: list[LegendItem]) -> list[str]:
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
                    f'<path d="{marker_path(marker, x + 13, y, 3.5)}" {fill}/>'
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
