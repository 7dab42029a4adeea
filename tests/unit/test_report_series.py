"""`streamgrp.replay.report`'s per-step series and page on hand-made events: windows, yields, gaps, the remainder."""

from __future__ import annotations

import sys
from html.parser import HTMLParser

import pytest

import orjson

from streamgrp.core.events import (
    GroupDecided,
    GroupDiscarded,
    GroupStats,
    RunFinished,
    RunTerminated,
    Shard,
    ShardGroup,
    StepFailed,
    StepManifest,
)
from streamgrp.errors import ConfigError
from streamgrp.replay.report import CHART_IDS, png_available, render_html, render_png
from streamgrp.replay.report_charts import RECORDED_CHARTS
from streamgrp.replay.report_series import (
    ReportData,
    Tally,
    longest_gap,
    run_status,
    step_rows,
    trainer_metrics,
)

ALWAYS_DRAWN = [chart for chart in CHART_IDS if chart not in RECORDED_CHARTS]


def decided(
    task: str,
    kind: str = "complete",
    usable: int = 3,
    target: int = 3,
    reason: str | None = None,
    rewards: tuple[float, ...] = (),
) -> GroupDecided:
    trainable = 0 if kind == "dropped" else usable
    return GroupDecided(
        task_id=task,
        decision=kind,
        reason=reason,
        slots=tuple(range(usable)),
        member_entries=("1-0",) * usable,
        member_rows=(1,) * usable,
        member_tokens=(4,) * usable,
        member_versions=(0,) * usable,
        member_rewards=rewards,
        slot_outcomes={str(i): "sample" for i in range(target)},
        stats=GroupStats.of(target, usable, trainable),
        closed_by="all_slots",
    )


def discarded(task: str, reason: str = "stale") -> GroupDiscarded:
    return GroupDiscarded(task_id=task, reason=reason, decision_entry="1-0")


def manifest(
    step: int, created_at: float, tokens: tuple[int, ...] = (10, 10), tasks: tuple[str, ...] = ()
) -> StepManifest:
    """A manifest whose first shard trains ``tasks`` (members are not looked at: rewards come from decisions)."""
    groups = tuple(ShardGroup.of(task_id=task, decision_entry="1-0", members=(), digest="") for task in tasks)
    shards = tuple(Shard(rank=r, groups=groups if r == 0 else (), tokens=t, digest="") for r, t in enumerate(tokens))
    return StepManifest(
        step=step, version=step, shards=shards, imbalance=max(tokens) * len(tokens) / sum(tokens), created_at=created_at
    )


MANIFESTS = [manifest(0, 10.0), manifest(1, 14.0, (30, 10)), manifest(2, 14.5)]
DECISIONS = [
    (2.0, decided("a")),  # before the run's recorded start: still step 0
    (5.0, decided("b", "partial", usable=2)),
    (10.0, decided("c", "dropped", usable=0, reason="all_unusable")),  # exactly at step 0's manifest: step 0
    (11.0, decided("d", "partial", usable=1)),
    (13.0, decided("e", "dropped", usable=1, reason="below_minimum")),
    (20.0, decided("f")),  # after the last step
]
DISCARDS = [(10.004, discarded("a", "stale")), (12.0, discarded("b", "filtered")), (30.0, discarded("d", "leftover"))]


def rows_and_tail():
    return step_rows(started_at=3.0, manifests=MANIFESTS, decisions=DECISIONS, discards=DISCARDS)


def test_each_event_counts_in_the_first_window_ending_at_or_after_it():
    rows, tail = rows_and_tail()
    assert [r.step for r in rows] == [0, 1, 2]
    assert [r.tally.decisions for r in rows] == [
        {"complete": 1, "partial": 1, "dropped": 1},
        {"complete": 0, "partial": 1, "dropped": 1},
        {"complete": 0, "partial": 0, "dropped": 0},
    ]
    assert [r.tally.drop_reasons for r in rows] == [
        {"all_unusable": 1},
        {"below_minimum": 1, "filtered": 1, "stale": 1},
        {},
    ]
    assert tail.decisions == {"complete": 1, "partial": 0, "dropped": 0}
    assert tail.drop_reasons == {"leftover": 1}


def test_per_step_counts_plus_the_remainder_are_every_event_once():
    rows, tail = rows_and_tail()
    for kind in ("complete", "partial", "dropped"):
        assert sum(r.tally.decisions[kind] for r in rows) + tail.decisions[kind] == sum(
            d.decision == kind for _, d in DECISIONS
        )
    drops = sum(sum(r.tally.drop_reasons.values()) for r in rows) + sum(tail.drop_reasons.values())
    assert drops == len(DISCARDS) + sum(d.decision == "dropped" for _, d in DECISIONS)


def test_yields_are_over_the_window_and_undefined_without_decisions():
    rows, _ = rows_and_tail()
    assert rows[0].usable_yield == pytest.approx(5 / 9) and rows[0].trainable_yield == pytest.approx(5 / 9)
    assert rows[1].usable_yield == pytest.approx(2 / 6) and rows[1].trainable_yield == pytest.approx(1 / 6)
    assert rows[2].usable_yield is None and rows[2].trainable_yield is None
    assert rows[1].cumulative_usable_yield == pytest.approx(7 / 15)
    assert rows[2].cumulative_trainable_yield == rows[1].cumulative_trainable_yield == pytest.approx(6 / 15)


def test_stall_seconds_are_the_window_and_its_longest_stretch_without_a_trainable_decision():
    rows, _ = rows_and_tail()
    assert [r.window_start for r in rows] == [3.0, 10.0, 14.0]
    assert [r.step_seconds for r in rows] == pytest.approx([7.0, 4.0, 0.5])
    # step 0: trainable at 2 (clipped to 3) and 5, dropped at 10 does not count -> 5..10
    # step 1: trainable at 11 only -> 11..14; step 2: no decision -> the whole window
    assert [r.longest_gap_s for r in rows] == pytest.approx([5.0, 3.0, 0.5])
    assert all(r.longest_gap_s <= r.step_seconds for r in rows)


def test_imbalance_groups_and_tokens_come_from_the_manifest():
    rows, _ = rows_and_tail()
    assert [r.imbalance for r in rows] == [1.0, 1.5, 1.0]
    assert [r.tokens for r in rows] == [20, 40, 20]


def test_no_steps_puts_everything_after_the_last_step():
    rows, tail = step_rows(started_at=None, manifests=[], decisions=DECISIONS, discards=DISCARDS)
    assert rows == [] and tail.groups_decided == len(DECISIONS)


def test_without_a_run_start_step_0_starts_at_the_first_event():
    rows, _ = step_rows(started_at=None, manifests=MANIFESTS[:1], decisions=DECISIONS[1:2], discards=[])
    assert rows[0].window_start == 5.0 and rows[0].step_seconds == 5.0


def test_a_clock_stepping_back_never_makes_windows_overlap():
    rows, _ = step_rows(
        started_at=0.0, manifests=[manifest(0, 10.0), manifest(1, 9.0)], decisions=[(9.5, decided("a"))], discards=[]
    )
    assert rows[1].step_seconds == 0.0 and rows[0].tally.groups_decided == 1


def test_longest_gap():
    assert longest_gap(0.0, 10.0, []) == 10.0
    assert longest_gap(0.0, 10.0, [2.0, 9.0]) == 7.0
    assert longest_gap(0.0, 10.0, [-5.0, 15.0]) == 10.0
    assert longest_gap(4.0, 4.0, []) == 0.0


def test_run_status_prefers_a_terminal_event():
    finished = RunFinished(steps=3)
    failed = RunTerminated(reason="stall", message="run stalled: ...", step=2)
    assert run_status([finished], 3) == "finished after 3 steps"
    assert run_status([finished, failed], 3) == "failed at step 2 (stall): run stalled: ..."
    assert run_status([], 1) == "running (1 steps so far)"


# -- the page ---------------------------------------------------------------------------------------------------


class Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))


def page(data: ReportData) -> list[tuple[str, dict]]:
    parser = Elements()
    parser.feed(render_html(data))
    parser.close()
    return parser.elements


def report(rows, tail, **extra) -> ReportData:
    totals = {
        "run": "r",
        "steps": len(rows),
        "groups": {"complete": 1},
        "dropped_reasons": {},
        "reward_first": None,
        "usable_slot_yield": 0.5,
    }
    return ReportData(
        run="r",
        started_at=3.0,
        steps=tuple(rows),
        after_last_step=tail,
        totals=totals,
        status=extra.pop("status", "finished after 3 steps"),
        **extra,
    )


def test_the_page_draws_every_chart_with_one_point_or_bar_per_step():
    rows, tail = rows_and_tail()
    elements = page(report(rows, tail))
    charts = [a["data-chart"] for tag, a in elements if tag == "svg"]
    assert charts == ALWAYS_DRAWN  # no reward, loss or mismatch recorded: those three are omitted
    points = [a for _, a in elements if "point" in (a.get("class") or "").split()]
    bars = [a for tag, a in elements if tag == "g" and a.get("class") == "bar"]
    for series in ("usable", "trainable", "since previous step", "imbalance"):
        assert sorted(int(p["data-step"]) for p in points if p["data-series"] == series) == [0, 1, 2]
    assert len(bars) == 2 * len(rows)  # decisions and drop reasons
    missing = [p["data-step"] for p in points if p["data-series"] == "usable" and "missing" in p["class"]]
    assert missing == ["2"]


def test_the_page_shows_the_totals_the_remainder_and_failures():
    rows, tail = rows_and_tail()
    failure = StepFailed(step=1, rank=0, error="loss is <NaN>")
    html = render_html(report(rows, tail, failures=(failure,), status="failed at step 2 (stall): stuck"))
    assert '<td data-key="groups.complete">1</td>' in html
    assert '<td data-key="dropped_reasons">none</td>' in html
    assert '<td data-key="reward_first">n/a</td>' in html and '<td data-key="usable_slot_yield">0.5000</td>' in html
    assert "decisions complete 1; drop reasons leftover 1" in html
    assert "loss is &lt;NaN&gt;" in html and 'class="meta failed"' in html


def test_an_empty_run_renders_a_complete_page():
    elements = page(report([], Tally(), status="running (0 steps so far)"))
    assert [a["data-chart"] for tag, a in elements if tag == "svg"] == ALWAYS_DRAWN
    assert [a["id"] for tag, a in elements if tag == "p" and a.get("id", "").startswith("omitted-")] == [
        f"omitted-{chart}" for chart in RECORDED_CHARTS
    ]
    assert not any(tag in ("script", "img") for tag, _ in elements)
    # the one link is an empty data: icon, so a browser asks for nothing but the page
    assert [a for tag, a in elements if tag == "link"] == [{"rel": "icon", "href": "data:,"}]


def test_png_needs_matplotlib_and_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed (the dev extra installs it)
    assert not png_available()
    with pytest.raises(ConfigError, match=r"pip install 'streamgrp\[report\]'.*--format html"):
        render_png(report([], Tally()))


@pytest.mark.parametrize("empty", [False, True])
def test_png_renders_when_matplotlib_is_installed(empty):
    pytest.importorskip("matplotlib")
    rows, tail = ([], Tally()) if empty else rows_and_tail()
    assert render_png(report(rows, tail)).startswith(b"\x89PNG\r\n\x1a\n")


# -- reward, loss and logprob mismatch -------------------------------------------------------------------------

REWARDED = [
    (1.0, decided("a", rewards=(0.0, 0.5, 1.0))),
    (2.0, decided("b", "partial", usable=2, rewards=(1.0, 1.0))),
    (3.0, decided("c", rewards=(0.25, 0.25, 0.25))),
    (3.5, decided("old")),
]  # "old": recorded no rewards
STEPS = [manifest(0, 2.5, tasks=("a", "b")), manifest(1, 4.0, tasks=("c", "old")), manifest(2, 5.0, tasks=("old",))]
METRICS = {
    0: {"loss": -0.25, "logprob_abs_diff_mean": 0.0, "reward_mean": 0.7},
    1: {"loss": 0.5, "logprob_abs_diff_mean": 0.125},
    2: {"loss": "nan?", "logprob_abs_diff_mean": float("inf")},
}


def test_reward_is_the_mean_over_the_steps_samples_and_trainer_figures_come_from_the_metrics():
    rows, _ = step_rows(started_at=0.0, manifests=STEPS, decisions=REWARDED, discards=[], metrics=METRICS)
    assert [r.reward for r in rows] == [pytest.approx(3.5 / 5), pytest.approx(0.25), None]  # each sample once
    assert [r.loss for r in rows] == [-0.25, 0.5, None]  # a value that is not a finite number is no value
    assert [r.logprob_mismatch for r in rows] == [0.0, 0.125, None]
    rows, _ = step_rows(started_at=0.0, manifests=STEPS, decisions=REWARDED, discards=[])
    assert [r.loss for r in rows] == [None, None, None]


def test_the_trainer_metrics_hash_is_read_by_step_skipping_what_does_not_parse():
    raw = {"0": orjson.dumps({"loss": 1.5}), b"1": b'{"loss": 2}', "x": b"{}", "2": b"not json", "3": b"[1]"}
    assert trainer_metrics(raw) == {0: {"loss": 1.5}, 1: {"loss": 2}}


def series_points(elements, chart: str) -> dict[str, list[tuple[int, bool]]]:
    """(step, missing) of every marker of ``chart``, by series."""
    out: dict[str, list[tuple[int, bool]]] = {}
    current = None
    for tag, attributes in elements:
        if tag == "svg":
            current = attributes["data-chart"]
        elif current == chart and "point" in (attributes.get("class") or "").split():
            out.setdefault(attributes["data-series"], []).append(
                (int(attributes["data-step"]), "missing" in attributes["class"])
            )
    return out


def test_the_page_draws_reward_loss_and_mismatch_when_recorded():
    rows, tail = step_rows(started_at=0.0, manifests=STEPS, decisions=REWARDED, discards=[], metrics=METRICS)
    elements = page(report(rows, tail))
    assert [a["data-chart"] for tag, a in elements if tag == "svg"] == list(CHART_IDS)
    assert series_points(elements, "reward") == {"mean reward": [(0, False), (1, False), (2, True)]}
    assert series_points(elements, "loss") == {"loss": [(0, False), (1, False), (2, True)]}
    assert series_points(elements, "logprob-mismatch") == {
        "mean |rollout - trainer|": [(0, False), (1, False), (2, True)]
    }
    html = render_html(report(rows, tail))
    assert 'data-value="-0.25"' in html and "omitted-" not in html
    assert "<th>reward</th><th>loss</th><th>logprob mismatch</th>" in html


def test_a_chart_is_omitted_with_a_note_only_when_no_step_has_its_value():
    rows, tail = step_rows(
        started_at=0.0, manifests=STEPS, decisions=REWARDED, discards=[], metrics={1: {"logprob_abs_diff_mean": 0.5}}
    )
    html = render_html(report(rows, tail))
    assert 'id="chart-reward"' in html and 'id="chart-logprob-mismatch"' in html
    assert 'id="chart-loss"' not in html
    assert 'id="omitted-loss"' in html and "No loss chart: no step has a &quot;loss&quot;" in html
    assert "streamgrp.consumers.grpo_trainer" in html


def test_the_bias_series_say_what_share_of_each_length_was_trained_and_dropped_as_stale():
    def sized(task: str, tokens: int) -> GroupDecided:
        return decided(task).with_members(tuple(m.replace(tokens=tokens) for m in decided(task).members))

    decisions = [
        (1.0, sized("short1", 100)),
        (2.0, sized("short2", 100)),
        (3.0, sized("long1", 5000)),
        (6.0, sized("long2", 5000)),
    ]
    manifests = [manifest(0, 5.0, tasks=("short1", "short2")), manifest(1, 9.0, tasks=("long2",))]
    rows, _ = step_rows(
        started_at=0.0, manifests=manifests, decisions=decisions, discards=[(5.001, discarded("long1", "stale"))]
    )
    series = ReportData("r", 0.0, tuple(rows), Tally(), {}, "running").series()
    assert series["trained_share:256"] == [1.0, 1.0]
    assert series["trained_share:16k"] == [0.0, 0.5] and series["stale_share:16k"] == [0.0, 0.5]
    assert "trained_share:1k" not in series  # no generation of that length: no line
