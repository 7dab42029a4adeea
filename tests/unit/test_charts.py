"""The inline-SVG chart code on hand-made data: the invariants in `streamgrp.replay.charts`' docstring."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from streamgrp.replay.charts import (
    LINE_STYLES,
    MARGIN_LEFT,
    MARGIN_RIGHT,
    WIDTH,
    Series,
    coincidences,
    format_number,
    line_chart,
    nice_ticks,
    stacked_bar_chart,
)


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)  # well-formed XML, or this raises
    assert root.tag == "svg"
    return root


def points(root: ET.Element, series: str | None = None, *, missing: bool | None = None) -> list[ET.Element]:
    found = [e for e in root.iter() if "point" in e.get("class", "").split()]
    if series is not None:
        found = [e for e in found if e.get("data-series") == series]
    if missing is not None:
        found = [e for e in found if ("missing" in e.get("class", "").split()) == missing]
    return found


def bars(root: ET.Element) -> list[ET.Element]:
    return [e for e in root.iter("g") if e.get("class") == "bar"]


def texts(root: ET.Element) -> list[str]:
    return ["".join(e.itertext()) for e in root.iter("text")]


def assert_chart_invariants(root: ET.Element, chart_id: str, title: str, x_label: str, y_label: str) -> None:
    """What every chart carries: id, title, both axes with their labels, a legend, no external reference."""
    assert root.get("id") == f"chart-{chart_id}" and root.get("data-chart") == chart_id
    assert root.find("title").text == title
    classes = {e.get("class") for e in root.iter()}
    assert {"x-axis", "y-axis", "legend", "x-label", "y-label", "chart-title"} <= classes
    assert x_label in texts(root) and y_label in texts(root)
    serialized = ET.tostring(root, encoding="unicode")
    assert "http" not in serialized and "href" not in serialized and "<script" not in serialized


# -- ticks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lo, hi", [(0, 1), (0, 12), (1, 1.0346), (-3, 7), (0, 0.003), (5, 5), (0, 1e6)])
def test_nice_ticks_cover_the_range_with_even_round_steps(lo, hi):
    ticks = nice_ticks(lo, hi)
    assert ticks[0] <= lo and ticks[-1] >= hi
    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
    assert len(steps) == 1 and 2 <= len(ticks) <= 12


def test_integer_ticks_are_whole_numbers_even_for_a_small_range():
    assert nice_ticks(0, 1, integer=True) == [0, 1]
    assert all(t == int(t) for t in nice_ticks(0, 13, integer=True))
    assert nice_ticks(0, 12) != nice_ticks(0, 12, integer=True)  # 2.5 steps are fine for seconds, not groups


def test_nice_ticks_refuse_a_non_finite_range():
    with pytest.raises(ValueError, match="finite"):
        nice_ticks(0, float("nan"))


def test_format_number():
    assert [format_number(v) for v in (3.0, 0.71234, 12, -0.5)] == ["3", "0.7123", "12", "-0.5"]


# -- line charts ------------------------------------------------------------------------------------------


def test_a_line_chart_has_one_point_per_step_and_series_and_breaks_at_missing_values():
    svg = line_chart(
        chart_id="yields",
        title="Yields",
        steps=[0, 1, 2, 3, 4],
        y_label="fraction",
        series=[Series("usable", [0.5, 0.75, None, 1.0, 0.25]), Series("trainable", [0.5, 0.5, 0.5, 0.5, 0.5])],
    )
    root = parse(svg)
    assert_chart_invariants(root, "yields", "Yields", "step", "fraction")
    for name in ("usable", "trainable"):
        assert sorted(int(p.get("data-step")) for p in points(root, name)) == [0, 1, 2, 3, 4]
    [gap] = points(root, "usable", missing=True)
    assert gap.get("data-step") == "2" and gap.get("data-value") is None
    assert [float(p.get("data-value")) for p in points(root, "usable", missing=False)] == [0.5, 0.75, 1.0, 0.25]
    lines = [e for e in root.iter("polyline") if e.get("data-series") == "usable"]
    assert [len(line.get("points").split()) for line in lines] == [2, 2]  # the missing value splits the line
    legend = [e.get("data-series") for e in root.iter("g") if e.get("class") == "legend-item"]
    assert legend == ["usable", "trainable"]


def test_higher_values_are_drawn_higher_and_the_missing_marker_sits_on_the_x_axis():
    root = parse(
        line_chart(chart_id="c", title="t", steps=[0, 1, 2], y_label="y", series=[Series("s", [1.0, 3.0, None])])
    )
    low, high, missing = sorted(points(root, "s"), key=lambda p: int(p.get("data-step")))
    assert float(high.get("data-y")) < float(low.get("data-y"))  # SVG y grows downwards
    x_axis = next(e for e in root.iter("line") if e.get("class") == "x-axis")
    assert float(missing.get("data-y")) == pytest.approx(float(x_axis.get("y1")))
    assert float(low.get("data-x")) < float(high.get("data-x")) < float(missing.get("data-x"))


def test_a_single_point_is_centred_and_draws_no_line():
    root = parse(line_chart(chart_id="one", title="One", steps=[7], y_label="s", series=[Series("s", [2.5])]))
    [point] = points(root, "s")
    assert point.get("data-step") == "7"
    assert float(point.get("data-x")) == pytest.approx((MARGIN_LEFT + WIDTH - MARGIN_RIGHT) / 2)
    assert list(root.iter("polyline")) == []
    assert "7" in texts(root)  # the x tick of the one step


def test_an_empty_chart_is_a_frame_that_says_so():
    root = parse(line_chart(chart_id="empty", title="Nothing", steps=[], y_label="s", series=[Series("s", [])]))
    assert_chart_invariants(root, "empty", "Nothing", "step", "s")
    assert points(root) == [] and "no steps yet" in texts(root)


def test_all_missing_values_draw_only_hollow_markers():
    root = parse(line_chart(chart_id="c", title="t", steps=[0, 1], y_label="y", series=[Series("s", [None, None])]))
    assert len(points(root, "s", missing=True)) == 2 and points(root, "s", missing=False) == []


def test_values_outside_a_fixed_range_are_clamped_to_the_plot():
    root = parse(
        line_chart(
            chart_id="c", title="t", steps=[0, 1], y_label="y", y_min=0.0, y_max=1.0, series=[Series("s", [-1.0, 5.0])]
        )
    )
    ys = [float(p.get("data-y")) for p in points(root, "s")]
    axis = next(e for e in root.iter("line") if e.get("class") == "y-axis")
    assert all(float(axis.get("y1")) <= y <= float(axis.get("y2")) for y in ys)


def test_mismatched_lengths_and_unordered_steps_are_refused():
    with pytest.raises(ValueError, match="2 values for 3 steps"):
        line_chart(chart_id="c", title="t", steps=[0, 1, 2], y_label="y", series=[Series("s", [1, 2])])
    with pytest.raises(ValueError, match="increasing"):
        line_chart(chart_id="c", title="t", steps=[1, 0], y_label="y", series=[Series("s", [1, 2])])


def style(root: ET.Element, series: str) -> tuple[str, set[str]]:
    """A series' dash pattern (of its lines) and the shapes of its markers."""
    [dash] = {e.get("stroke-dasharray", "") for e in root.iter("polyline") if e.get("data-series") == series}
    return dash, {p.get("data-marker") for p in points(root, series)}


def legend_labels(root: ET.Element) -> dict[str, str]:
    return {
        e.get("data-series"): "".join(e.find("text").itertext())
        for e in root.iter("g")
        if e.get("class") == "legend-item"
    }


def test_series_that_coincide_stay_distinguishable_and_the_legend_says_they_coincide():
    # the report's usual case: trainable yield equal to usable at every step, so one line lies on the other
    values = [0.5, 0.75, 0.25, 1.0]
    root = parse(
        line_chart(
            chart_id="yields",
            title="Yields",
            steps=[0, 1, 2, 3],
            y_label="fraction",
            series=[Series("usable", values, width=3.6), Series("trainable", list(values))],
        )
    )
    usable, trainable = style(root, "usable"), style(root, "trainable")
    assert usable[0] != trainable[0]  # distinct dash patterns
    assert len(usable[1]) == len(trainable[1]) == 1 and usable[1] != trainable[1]  # one marker shape each, distinct
    for step in range(4):  # both markers at the true position: nothing is offset
        [a] = [p for p in points(root, "usable") if p.get("data-step") == str(step)]
        [b] = [p for p in points(root, "trainable") if p.get("data-step") == str(step)]
        assert a.get("d") != b.get("d")
        assert (a.get("data-x"), a.get("data-y")) == (b.get("data-x"), b.get("data-y"))
        assert b.get("fill") == "none"  # the later marker is hollow: the one under it shows
        assert b.find("title").text.endswith("(same as usable)")
    labels = legend_labels(root)
    assert labels == {"usable": "usable", "trainable": "trainable (= usable at every step)"}


def test_a_partial_coincidence_is_counted_and_distinct_series_get_no_note():
    series = [
        Series("a", [1.0, 2.0, 3.0, None]),
        Series("b", [1.0, 5.0, 3.0, 4.0]),
        Series("c", [9.0, 9.0, 9.0, 9.0]),
        Series("d", [None, 5.0, None, None]),
        Series("e", [1.0, 7.0, 8.0, 6.0]),
    ]
    # e equals a and b at one step of four only: a lone shared point gets no note (its tooltip says so)
    assert coincidences(series) == [None, "= a at 2 of 4 steps", None, "= b", None]
    root = parse(line_chart(chart_id="c", title="t", steps=[0, 1, 2, 3], y_label="y", series=series))
    assert legend_labels(root)["b"] == "b (= a at 2 of 4 steps)" and legend_labels(root)["c"] == "c"


def test_series_styled_by_position_differ_in_dash_and_marker():
    series = [Series(f"s{i}", [float(i), float(i) + 1]) for i in range(len(LINE_STYLES))]
    root = parse(line_chart(chart_id="c", title="t", steps=[0, 1], y_label="y", series=series))
    styles = [style(root, one.name) for one in series]
    assert len({dash for dash, _ in styles}) == len(series)
    assert len({shape for _, shapes in styles for shape in shapes}) == len(series)
    paths = {p.get("d").replace(p.get("data-x"), "X") for p in points(root) if p.get("data-step") == "0"}
    assert len(paths) == len(series)  # the shapes are drawn differently, not only named differently
    with pytest.raises(ValueError, match="marker 'star'"):
        Series("s", [1.0], marker="star")


def test_text_is_escaped():
    svg = line_chart(chart_id="c", title='a <b> & "c"', steps=[0], y_label="<y>", series=[Series('s<&">', [1.0])])
    root = parse(svg)
    assert root.find("title").text == 'a <b> & "c"'
    assert points(root)[0].get("data-series") == 's<&">'


# -- stacked bars ------------------------------------------------------------------------------------------


def test_stacked_bars_have_one_bar_per_step_stacked_in_series_order():
    series = [Series("complete", [2, 0, 1]), Series("partial", [3, 0, None]), Series("dropped", [1, 0, 4])]
    root = parse(
        stacked_bar_chart(chart_id="decisions", title="Decisions", steps=[0, 1, 2], y_label="groups", series=series)
    )
    assert_chart_invariants(root, "decisions", "Decisions", "step", "groups")
    by_step = {int(b.get("data-step")): b for b in bars(root)}
    assert sorted(by_step) == [0, 1, 2]
    assert [float(by_step[s].get("data-total")) for s in (0, 1, 2)] == [6, 0, 5]
    assert list(by_step[1]) == []  # nothing to stack, but the step still has its bar group
    segments = list(by_step[0])
    assert [s.get("data-series") for s in segments] == ["complete", "partial", "dropped"]
    heights = [float(s.get("height")) for s in segments]
    assert heights[1] == pytest.approx(1.5 * heights[0], abs=0.2) and heights[2] == pytest.approx(
        heights[0] / 2, abs=0.2
    )
    tops = [float(s.get("y")) for s in segments]
    assert tops[0] > tops[1] > tops[2]  # each segment sits on the one before it
    assert [s.get("data-series") for s in by_step[2]] == ["complete", "dropped"]  # None counts as 0
    assert all(t == str(int(float(t))) for t in texts(root) if t.replace(".", "").isdigit())  # whole-number ticks


def test_a_bar_chart_with_no_series_still_has_a_bar_group_per_step_and_says_so():
    root = parse(stacked_bar_chart(chart_id="drops", title="Drops", steps=[0, 1], y_label="groups", series=[]))
    assert len(bars(root)) == 2 and list(root.iter("rect")) == []
    assert "(no series)" in texts(root)


def test_an_empty_bar_chart_and_a_single_bar():
    empty = parse(stacked_bar_chart(chart_id="e", title="E", steps=[], y_label="g", series=[Series("a", [])]))
    assert bars(empty) == [] and "no steps yet" in texts(empty)
    single = parse(stacked_bar_chart(chart_id="s", title="S", steps=[3], y_label="g", series=[Series("a", [2])]))
    [bar] = bars(single)
    [rect] = list(bar)
    centre = float(rect.get("x")) + float(rect.get("width")) / 2
    assert centre == pytest.approx((MARGIN_LEFT + WIDTH - MARGIN_RIGHT) / 2, abs=0.2)


def test_negative_values_cannot_be_stacked():
    with pytest.raises(ValueError, match="negative"):
        stacked_bar_chart(chart_id="c", title="t", steps=[0], y_label="g", series=[Series("a", [-1])])


def test_a_long_legend_wraps_and_pushes_the_plot_down_instead_of_covering_it():
    names = [f"a fairly long series name {i}" for i in range(8)]
    root = parse(
        stacked_bar_chart(chart_id="c", title="t", steps=[0], y_label="g", series=[Series(name, [1]) for name in names])
    )
    items = [e for e in root.iter("g") if e.get("class") == "legend-item"]
    lowest_legend = max(float(item.find("text").get("y")) for item in items)
    y_axis = next(e for e in root.iter("line") if e.get("class") == "y-axis")
    assert len({item.find("text").get("y") for item in items}) > 1  # more than one row
    assert float(y_axis.get("y1")) > lowest_legend
    assert float(root.get("height")) > 300


def test_the_chart_module_imports_nothing_heavy():
    code = (
        "import sys, streamgrp.replay.charts\n"
        "print(','.join(m for m in ('redis', 'torch', 'prometheus_client', 'matplotlib') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
