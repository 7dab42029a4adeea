"""The report's charts as one PNG image (`streamgrp report --format png`), with matplotlib if installed.

Owns only the matplotlib drawing of `streamgrp.replay.report_charts.chart_specs`, the same charts
with the same series and styles as the HTML page (omitted charts are left out). matplotlib is the
``report`` extra, not a dependency: `require_png` says what to install.
"""

from __future__ import annotations

import io

from streamgrp.errors import ConfigError
from streamgrp.replay.charts import line_style
from streamgrp.replay.report_charts import chart_specs
from streamgrp.replay.report_series import ReportData

#: The SVG marker shapes as matplotlib markers.
_MARKERS = {"circle": "o", "square": "s", "triangle": "^", "diamond": "D", "triangle-down": "v"}


def png_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require_png() -> None:
    if not png_available():
        raise ConfigError(
            "--format png needs matplotlib, which is not installed: pip install 'streamgrp[report]', "
            "or use --format html (the default; it needs nothing)"
        )


def render_png(data: ReportData) -> bytes:
    """The page's charts as one PNG image (matplotlib required; see `require_png`)."""
    require_png()
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = [row.step for row in data.steps]
    specs = [spec for spec in chart_specs(data) if not spec.omitted]
    figure = Figure(figsize=(9, 3.2 * len(specs)), layout="constrained")
    figure.suptitle(f"streamgrp report: run {data.run} ({data.status})"[:120])
    for ax, spec in zip(figure.subplots(len(specs), 1, squeeze=False)[:, 0], specs):
        bottom = [0.0] * len(steps)
        for index, one in enumerate(spec.series):
            color, dash, marker = line_style(index, one)
            if spec.kind == "bars":
                values = [v or 0 for v in one.values]
                ax.bar(steps, values, bottom=bottom, label=one.name, color=color)
                bottom = [b + v for b, v in zip(bottom, values)]
                continue
            # The SVG's styles: a dash pattern and a marker shape per series, later ones hollow,
            # so coinciding series both show.
            ax.plot(
                steps,
                [float("nan") if v is None else v for v in one.values],
                label=one.name,
                color=color,
                linewidth=one.width,
                linestyle=(0, tuple(float(d) for d in dash.split())) if dash else "-",
                marker=_MARKERS[marker],
                markersize=4,
                markerfacecolor=color if index == 0 else "none",
            )
        if spec.y_min is not None or spec.y_max is not None:
            ax.set_ylim(spec.y_min, spec.y_max)
        if steps:  # every chart spans every step, as on the page, even where a series has no value
            ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(spec.title)
        ax.set_xlabel("step")
        ax.set_ylabel(spec.y_label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=100)
    return out.getvalue()
