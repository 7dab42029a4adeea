import pytest

from streamgrp import GroupPolicy, NormSpec
from streamgrp.core import codec
from streamgrp.core.events import SlotResult, TaskIssued, Tick
from streamgrp.core.group_fold import Closed, FoldState, Ignored, fold, run_fold
from streamgrp.services.synthetic import make_sample

POLICY = GroupPolicy(n_samples=3, reward_norm=NormSpec("group", "group"))


def issued(task="t1", at=100.0):
    return TaskIssued(task_id=task, issued_at=at)


def sample(task="t1", slot=0, rows=1, tokens=4, version=0):
    return codec.sample_result(task, slot, make_sample(tokens=tokens, rows=rows, version=version))[0]


def rejected(task="t1", slot=0):
    return SlotResult(task_id=task, slot=slot, outcome="rejected")


def failed(task="t1", slot=0):
    return SlotResult(task_id=task, slot=slot, outcome="failed", error="boom")


def test_group_closes_when_every_slot_has_a_result():
    _, outputs = run_fold(
        POLICY,
        [
            ("1-0", issued()),
            ("2-0", sample(slot=0, tokens=5, version=2)),
            ("3-0", rejected(slot=1)),
            ("4-0", sample(slot=2, tokens=7, version=1)),
        ],
    )
    [closed] = outputs
    assert isinstance(closed, Closed)
    d = closed.decision
    assert (d.decision, d.slots, d.closed_by) == ("partial", (0, 2), "all_slots")
    assert [m.entry for m in d.members] == ["2-0", "4-0"]
    assert [m.tokens for m in d.members] == [5, 7] and [m.version for m in d.members] == [2, 1] and d.version == 1
    assert d.slot_outcomes == {"0": "sample", "1": "rejected", "2": "sample"}
    assert closed.entries == ("1-0", "2-0", "3-0", "4-0")


def test_deadline_closes_a_group_with_missing_slots_as_timeout():
    events = [("1-0", issued(at=100.0)), ("2-0", sample(slot=1)), ("3-0", Tick(now=129.9))]
    state, outputs = run_fold(POLICY, events, group_timeout_s=30.0)
    assert outputs == []
    state, outputs = fold(state, Tick(now=130.0))
    [closed] = outputs
    d = closed.decision
    assert (d.decision, d.reason, d.closed_by, d.decided_at) == ("dropped", "below_minimum", "deadline", 130.0)
    assert d.slot_outcomes == {"0": "timeout", "1": "sample", "2": "timeout"}
    assert closed.entries == ("1-0", "2-0")


def test_no_deadline_means_ticks_never_close():
    _, outputs = run_fold(POLICY, [("1", issued(at=0.0)), ("2", Tick(now=1e12))], group_timeout_s=None)
    assert outputs == []


def test_deadlines_close_in_deadline_then_task_order():
    events = [
        ("1", issued("b", at=10.0)),
        ("2", issued("a", at=10.0)),
        ("3", issued("c", at=5.0)),
        ("4", Tick(now=100.0)),
    ]
    _, outputs = run_fold(POLICY, events, group_timeout_s=1.0)
    assert [o.decision.task_id for o in outputs] == ["c", "a", "b"]


def test_duplicates_and_late_results_are_ignored_never_folded():
    events = [
        ("1", issued()),
        ("2", sample(slot=0)),
        ("3", rejected(slot=0)),
        ("4", sample(slot=1)),
        ("5", sample(slot=2)),
        ("6", sample(slot=1)),
    ]
    state, outputs = run_fold(POLICY, events)
    ignored = [o for o in outputs if isinstance(o, Ignored)]
    closed = [o for o in outputs if isinstance(o, Closed)]
    assert [(o.entry_id, o.reason) for o in ignored] == [("3", "duplicate"), ("6", "late")]
    assert closed[0].decision.decision == "complete"
    assert closed[0].entries == ("1", "2", "4", "5")


def test_unknown_task_out_of_range_slot_and_reissued_task():
    events = [("1", sample(task="ghost")), ("2", issued()), ("3", sample(slot=7)), ("4", issued())]
    _, outputs = run_fold(POLICY, events)
    assert [o.reason for o in outputs] == ["unknown_task", "slot_out_of_range", "duplicate_task"]


def test_contract_violation_is_a_dropped_decision_with_error():
    _, outputs = run_fold(
        POLICY, [("1", issued()), ("2", sample(slot=0, rows=2)), ("3", sample(slot=1)), ("4", failed(slot=2))]
    )
    d = outputs[0].decision
    assert (d.decision, d.reason) == ("dropped", "contract_violation")
    assert "slot sizes [2, 1]" in d.error


def test_time_never_runs_backwards():
    state = FoldState(POLICY, group_timeout_s=5.0)
    state, _ = fold(state, Tick(now=50.0))
    state, _ = fold(state, issued(at=40.0))
    state, outputs = fold(state, Tick(now=10.0))  # a clock stepped back: still at 50
    assert [o.decision.closed_by for o in outputs] == ["deadline"]


def test_fold_rejects_other_events():
    with pytest.raises(TypeError, match="TaskIssued, SlotResult, SlotRewarded or Tick"):
        fold(FoldState(POLICY), "nope")  # type: ignore[arg-type]


def test_a_tick_is_never_later_than_its_entry_was_written():
    """A tick entry written by anyone who may write the group log, with a time in the future, would close
    every open group as timed out; folded as the drivers fold stored ticks, it says its entry's time."""
    from streamgrp.core.group_fold import written_tick

    forged = Tick(now=4_000_000_000.0, producer="worker-x", seq=1)
    assert written_tick(forged, "1700000000123-0").now == pytest.approx(1_700_000_000.124)
    genuine = Tick(now=1_700_000_000.1225)
    assert written_tick(genuine, "1700000000123-0") is genuine
    state, _ = run_fold(POLICY, [("1700000000000-0", issued(at=1_700_000_000.0))], group_timeout_s=30.0)
    _, outputs = fold(state, written_tick(forged, "1700000000500-0"), "1700000000500-0")
    assert outputs == []  # the group stays open: nothing timed out
