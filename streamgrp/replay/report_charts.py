"""Which charts `streamgrp report` draws, and what each says: pure, no drawing.

Owns, per chart: its stable id (``<svg id="chart-{id}">``), title, y axis, series (taken from
`ReportData.series`, defined in `streamgrp.replay.report_series`), the definition printed under it,
and whether it is drawn at all. The HTML page (`streamgrp.replay.report`) and the PNG
(`streamgrp.replay.report_png`) both draw this list, so they never disagree.

A chart of figures the run may not have recorded (`RECORDED_CHARTS`: reward, loss, logprob
mismatch) is omitted when no step has a value, and its section says why and who records it; a
chart of what every run has (yields, decisions, ...) is always drawn, as an empty frame at first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from streamgrp.replay.charts import Series
from streamgrp.replay.report_series import DECISION_KINDS, ReportData

__all__ = ["CHART_IDS", "RECORDED_CHARTS", "ChartSpec", "chart_specs"]

#: Stable chart ids, in page order; each chart is ``<svg id="chart-{id}">``.
CHART_IDS = ("yields", "reward", "loss", "logprob-mismatch", "decisions", "drop-reasons", "bias", "stall", "imbalance")
#: Charts drawn only when some step has a value: chart id -> its `ReportData.series` name.
RECORDED_CHARTS = {"reward": "reward", "loss": "loss", "logprob-mismatch": "logprob_mismatch"}

_KIND_COLORS = {"complete": "#009E73", "partial": "#56B4E9", "dropped": "#D55E00"}
_LENGTH_COLORS = {"256": "#56B4E9", "1k": "#009E73", "4k": "#E69F00", "16k": "#D55E00", "more": "#CC79A7"}
_TRAINER_HASH = "the run's trainer-metrics hash (RunKeys.trainer_metrics: step number -> JSON object)"
_WHO_LOSS = (
    "the reference trainers record it: streamgrp.consumers.grpo_trainer every step, "
    "streamgrp.consumers.lm_trainer with --lm-lr above 0"
)
_WHO_MISMATCH = (
    "the reference trainers, streamgrp.consumers.grpo_trainer and streamgrp.consumers.lm_trainer, record it every step"
)

_DEFINITIONS = {
    "yields": "Over the groups the assembler decided in each step's window (after the previous manifest, up to this "
    "one): usable and trainable slots over target slots. Dotted and dash-dotted: the same, cumulative over "
    "all windows so far. A grey hollow marker on the axis: no group was decided in that window. Where "
    "lines coincide each keeps its own dash pattern and marker, and the legend says which series equal "
    "which.",
    "reward": "The mean reward of the samples the step trains, over every shard: each sample counts once, with the "
    "reward its group's decision recorded (the mean over the sample's rows, as the worker published it). "
    "The first and last values are the totals' reward_first and reward_last. A grey hollow marker on the "
    "axis: none of the step's samples carries a reward.",
    "loss": "The policy loss the trainer recorded for the step: the reference trainers' globally token-weighted "
    'clipped loss of the whole step, all ranks together, before the step\'s update. Read from key "loss" in '
    + _TRAINER_HASH
    + "; "
    + _WHO_LOSS
    + ". A grey hollow marker on the axis: no loss recorded for that step.",
    "logprob-mismatch": "The mean absolute difference per loss token, in nats, between the log-probabilities the "
    "rollout recorded and the trainer's own for the same tokens before the step's update. It grows "
    "with staleness (the policy moved since the samples were drawn) and with any difference "
    "between the inference and training numerics; a large value means the trainer is not training "
    'the policy that sampled. Read from key "logprob_abs_diff_mean" in '
    + _TRAINER_HASH
    + "; "
    + _WHO_MISMATCH
    + ". A grey hollow marker on the axis: nothing recorded for that step.",
    "decisions": "Group decisions written in each step's window, by kind.",
    "drop-reasons": "Why groups were not trained: the assembler's drop reasons and the batcher's discards (stale, "
    "filtered, leftover) written in each step's window.",
    "bias": "The bias monitor, by length bucket of a generation's loss tokens (at most 256, 1k, 4k, 16k tokens, or "
    "more): solid, the share of the generations decided so far (members of trainable groups) that the steps "
    "so far trained; dashed, the share their groups' stale discards took. Long buckets below short ones: "
    "the run trains the easy prompts and drops the hard ones as stale (--staleness wait or mask keep them). "
    "Groups still buffered for a later step count as decided, not yet trained.",
    "stall": "Seconds from the previous manifest (step 0: from the run's start) to this one, and the longest stretch "
    "of that window without a trainable (complete or partial) decision.",
    "imbalance": "The step's largest shard (valid loss tokens) over the mean shard: 1.0 is a perfect split over ranks.",
}

_OMITTED = {
    "reward": "No reward chart: none of the steps' samples carries a reward (no step yet, or decisions written "
    "before members recorded their rewards).",
    "loss": 'No loss chart: no step has a "loss" in ' + _TRAINER_HASH + "; " + _WHO_LOSS + ". A trainer of your "
    'own shows here when it writes {"loss": ...} under the step\'s number.',
    "logprob-mismatch": 'No logprob mismatch chart: no step has a "logprob_abs_diff_mean" in '
    + _TRAINER_HASH
    + "; "
    + _WHO_MISMATCH
    + ". A trainer of your own shows here when it writes it under the step's number.",
}


@dataclass(frozen=True)
class ChartSpec:
    """One chart of the page: drawn from ``series`` unless ``omitted`` says why it is not."""

    id: str
    title: str
    kind: Literal["line", "bars"]
    y_label: str
    series: tuple[Series, ...]
    definition: str
    y_min: float | None = None
    y_max: float | None = None
    omitted: str | None = None


#: A chart before its definition: title, kind, y label, series, and its `ChartSpec` y_min and y_max if set.
_Spec = tuple[str, Literal["line", "bars"], str, list[Series], dict[str, float]]


def chart_specs(data: ReportData) -> list[ChartSpec]:
    """Every chart in `CHART_IDS` order, each with its series for ``data``."""
    series = data.series()
    specs: dict[str, _Spec] = {
        "yields": (
            "Slot yields per step",
            "line",
            "slots / target slots",
            [
                Series("usable", series["usable_yield"], "#0072B2", width=3.6),
                Series("trainable", series["trainable_yield"], "#E69F00"),
                Series("usable (cumulative)", series["cumulative_usable_yield"], "#0072B2", width=3.6),
                Series("trainable (cumulative)", series["cumulative_trainable_yield"], "#E69F00"),
            ],
            {"y_min": 0.0, "y_max": 1.0},
        ),
        "reward": ("Mean reward per step", "line", "reward", [Series("mean reward", series["reward"], "#009E73")], {}),
        "loss": ("Policy loss per step", "line", "loss", [Series("loss", series["loss"], "#D55E00")], {}),
        "logprob-mismatch": (
            "Logprob mismatch per step",
            "line",
            "nats per token",
            [Series("mean |rollout - trainer|", series["logprob_mismatch"], "#CC79A7")],
            {"y_min": 0.0},
        ),
        "decisions": (
            "Group decisions per step, by kind",
            "bars",
            "groups",
            [Series(kind, series[f"decisions:{kind}"], _KIND_COLORS[kind]) for kind in DECISION_KINDS],
            {},
        ),
        "drop-reasons": (
            "Drop reasons per step",
            "bars",
            "groups",
            [Series(name.split(":", 1)[1], values) for name, values in series.items() if name.startswith("dropped:")],
            {},
        ),
        "bias": (
            "Generations trained and stale-dropped, by length (cumulative)",
            "line",
            "share of decided",
            [
                item
                for name in series
                if name.startswith("trained_share:")
                for item in (
                    Series(
                        f"trained, {name.split(':', 1)[1]} tokens",
                        series[name],
                        _LENGTH_COLORS.get(name.split(":", 1)[1]),
                        dash="",
                        width=3.6,
                    ),
                    Series(
                        f"stale, {name.split(':', 1)[1]} tokens",
                        series["stale_share:" + name.split(":", 1)[1]],
                        _LENGTH_COLORS.get(name.split(":", 1)[1]),
                        dash="6 3",
                    ),
                )
            ],
            {"y_min": 0.0, "y_max": 1.0},
        ),
        "stall": (
            "Stall seconds per step",
            "line",
            "seconds",
            [
                Series("since previous step", series["step_seconds"], "#0072B2", width=3.6),
                Series("longest gap without a trainable decision", series["longest_gap_s"], "#D55E00"),
            ],
            {},
        ),
        "imbalance": (
            "Shard imbalance per step",
            "line",
            "largest / mean shard",
            [Series("imbalance", series["imbalance"], "#CC79A7")],
            {"y_min": 1.0},
        ),
    }
    out = []
    for chart_id in CHART_IDS:
        title, kind, y_label, chart_series, scale = specs[chart_id]
        recorded = RECORDED_CHARTS.get(chart_id)
        omitted = _OMITTED[chart_id] if recorded and all(v is None for v in series[recorded]) else None
        out.append(
            ChartSpec(
                chart_id, title, kind, y_label, tuple(chart_series), _DEFINITIONS[chart_id], omitted=omitted, **scale
            )
        )
    return out
