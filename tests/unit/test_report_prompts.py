"""The bias monitor by prompt: what each prompt trained of what it generated, trained least first, and on the page."""

from __future__ import annotations

from test_report_series import decided, discarded, manifest

from streamgrp.replay.report import render_html
from streamgrp.replay.report_prompts import PromptRow, prompt_key, prompt_rows, share_counts
from streamgrp.replay.report_series import ReportData, Tally

PROMPTS = {
    "easy1": {"id": "easy", "text": "2 + 2"},
    "easy2": {"id": "easy", "text": "2 + 2"},
    "hard1": {"text": "prove   the\nRiemann hypothesis"},
    "hard2": {"text": "prove   the\nRiemann hypothesis"},
    "mid": {"prompt_ids": [5, 6, 7]},
}


def _timed_out(task: str):
    group = decided(task, usable=2, target=3)
    return group.replace(slot_outcomes={"0": "sample", "1": "sample", "2": "timeout"})


def test_each_prompt_counts_its_tasks_generations_trained_stale_and_timed_out_trained_least_first():
    decisions = [
        decided("easy1"),
        decided("easy2"),
        _timed_out("hard1"),
        decided("hard2"),
        decided("mid"),
        decided("gone", "dropped", usable=0, reason="all_unusable"),
    ]
    rows = prompt_rows(
        prompts=PROMPTS,
        decisions=decisions,
        discards=[discarded("hard1", "stale"), discarded("mid", "filtered")],
        manifests=[manifest(0, 1.0, tasks=("easy1", "easy2")), manifest(1, 2.0, tasks=("hard2",))],
    )
    by_key = {row.key: row for row in rows}
    hard = by_key[prompt_key(PROMPTS["hard1"])]
    assert (hard.tasks, hard.generated, hard.trained, hard.stale, hard.timed_out) == (2, 5, 3, 2, 1)
    assert hard.trained_share == 3 / 5 and hard.preview == "prove the Riemann hypothesis"
    easy = by_key["id easy"]  # two tasks of one prompt count together
    assert (easy.tasks, easy.generated, easy.trained, easy.trained_share) == (2, 6, 6, 1.0)
    mid = by_key[prompt_key(PROMPTS["mid"])]
    assert (mid.trained, mid.stale, mid.trained_share, mid.preview) == (0, 0, 0.0, "ids [5, 6, 7]")
    assert by_key["task gone"].trained_share is None  # its task not recorded, nothing generated: last
    assert [row.key for row in rows] == [mid.key, hard.key, "id easy", "task gone"]
    assert share_counts(rows) == {"none": 1, "up to 25%": 0, "up to 50%": 0, "up to 75%": 1, "below all": 0, "all": 1}


def test_a_prompts_key_is_its_id_else_the_digest_of_its_json_whatever_the_key_order():
    assert prompt_key({"id": 7, "text": "x"}) == "id 7"
    assert prompt_key({"text": "x", "n": 1}) == prompt_key({"n": 1, "text": "x"}) != prompt_key({"text": "y", "n": 1})
    assert prompt_key({"id": True, "text": "x"}).startswith("sha ")


def test_the_page_lists_the_prompts_trained_least_with_the_share_counts():
    row = PromptRow(
        key="id hard", preview="prove <it>", tasks=2, generated=4, trained=1, stale=3, timed_out=0, mean_tokens=900.0
    )
    html = render_html(ReportData("r", 0.0, (), Tally(), {}, "running", prompts=(row,)))
    assert 'data-prompt="id hard"' in html and "prove &lt;it&gt;" in html and "0.2500" in html
    assert "1 prompts by the share of their generations trained: none 0, up to 25% 1, up to 50% 0" in html
    empty = render_html(ReportData("r", 0.0, (), Tally(), {}, "running"))
    assert 'id="no-prompts"' in empty
