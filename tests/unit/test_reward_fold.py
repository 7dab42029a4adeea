"""Rewards that come after their results: the fold's rules (issue: rewards as events).

A result published with ``reward_pending`` is not usable until its `SlotRewarded` arrives; the first
reward wins, a second is a duplicate, one for a slot not waiting is late; a slot still waiting at the
deadline times out; the reward's values reach the decision's member (and so every step and replay).
"""

import pytest

from streamgrp import GroupPolicy, NormSpec
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, ShardGroup, SlotRewarded, TaskIssued, Tick
from streamgrp.core.group_fold import REWARD_DUPLICATE, REWARD_LATE, REWARD_ROWS, Closed, Ignored, fold, run_fold
from streamgrp.core.manifest import make_manifest
from streamgrp.services.synthetic import make_sample

POLICY = GroupPolicy(n_samples=2, reward_norm=NormSpec("group", "group"))


def issued(task="t1", at=100.0):
    return TaskIssued(task_id=task, issued_at=at)


def pending(task="t1", slot=0, rows=1):
    return codec.sample_result(task, slot, make_sample(tokens=4, rows=rows, version=0), reward_pending=True)[0]


def plain(task="t1", slot=0):
    return codec.sample_result(task, slot, make_sample(tokens=4, rows=1, version=0))[0]


def reward(task="t1", slot=0, *values, reason=None, error=None):
    return SlotRewarded(task_id=task, slot=slot, rewards=values or None, reason=reason, error=error, scorer="r1")


def test_a_pending_result_waits_for_its_reward_and_the_reward_reaches_the_decision():
    state, outputs = run_fold(POLICY, [("1-0", issued()), ("2-0", pending(slot=0)), ("3-0", plain(slot=1))])
    assert outputs == []  # slot 0 has a result but no reward yet: the group stays open
    state, outputs = fold(state, reward("t1", 0, 0.75), "4-0")
    [closed] = outputs
    assert isinstance(closed, Closed)
    decision = closed.decision
    assert decision.decision == "complete" and decision.slot_outcomes == {"0": "sample", "1": "sample"}
    rewarded = decision.members[0]
    assert rewarded.rewards == (0.75,) and rewarded.reward == 0.75 and decision.members[1].rewards is None
    assert set(closed.entries) == {"1-0", "2-0", "3-0", "4-0"}  # the reward entry is accounted for too


def test_the_rewards_survive_the_wire_into_a_steps_manifest():
    _, [closed] = run_fold(
        POLICY,
        [
            ("1-0", issued()),
            ("2-0", pending(slot=0, rows=2)),
            ("3-0", plain(slot=1)),
            ("4-0", reward("t1", 0, 1.0, 0.5)),
        ],
    )
    decision = codec.decode(codec.encode(closed.decision))
    assert isinstance(decision, GroupDecided) and decision.members[0].rewards == (1.0, 0.5)
    manifest = codec.decode(codec.encode(make_manifest(0, 0, [("5-0", decision)], 1, 0.0)))
    [group] = manifest.shards[0].groups
    assert isinstance(group, ShardGroup) and [m.rewards for m in group.members] == [(1.0, 0.5), None]


def test_a_decision_without_late_rewards_is_written_as_before():
    _, [closed] = run_fold(POLICY, [("1-0", issued()), ("2-0", plain(slot=0)), ("3-0", plain(slot=1))])
    header = codec.encode(closed.decision)[codec.HEADER]
    assert b"member_row_rewards" not in header and b"reward_pending" not in codec.encode(plain())[codec.HEADER]


def test_first_reward_wins_and_a_second_is_a_duplicate():
    state, _ = run_fold(
        POLICY, [("1-0", issued()), ("2-0", pending(slot=0)), ("3-0", pending(slot=1)), ("4-0", reward("t1", 0, 1.0))]
    )
    state, outputs = fold(state, reward("t1", 0, 0.0), "5-0")
    [ignored] = outputs
    assert isinstance(ignored, Ignored) and ignored.reason == REWARD_DUPLICATE and "4-0" in ignored.detail
    state, [closed] = fold(state, reward("t1", 1, 0.5), "6-0")
    assert [m.reward for m in closed.decision.members] == [1.0, 0.5]


@pytest.mark.parametrize(
    "events, why",
    [
        ([("1-0", issued()), ("2-0", plain(slot=0))], "its result carried its reward"),
        ([("1-0", issued())], "no result of it waits"),
        ([], "no task with this id"),
        ([("1-0", issued()), ("2-0", plain(slot=0)), ("3-0", plain(slot=1))], "already decided"),
    ],
)
def test_a_reward_for_a_slot_that_is_not_waiting_is_late(events, why):
    state, _ = run_fold(POLICY, events)
    _, [ignored] = fold(state, reward("t1", 0, 1.0), "9-0")
    assert isinstance(ignored, Ignored) and ignored.reason == REWARD_LATE and why in ignored.detail


def test_a_reward_with_the_wrong_number_of_rows_is_refused_and_the_slot_keeps_waiting():
    state, _ = run_fold(POLICY, [("1-0", issued()), ("2-0", pending(slot=0, rows=3)), ("3-0", plain(slot=1))])
    state, [ignored] = fold(state, reward("t1", 0, 1.0, 0.5), "4-0")
    assert ignored.reason == REWARD_ROWS and "2 rewards for a sample of 3 rows" in ignored.detail
    _, [closed] = fold(state, reward("t1", 0, 1.0, 0.0, 0.5), "5-0")
    assert closed.decision.members[0].rewards == (1.0, 0.0, 0.5)


def test_one_reward_is_every_rows_reward():
    state, _ = run_fold(POLICY, [("1-0", issued()), ("2-0", pending(slot=0, rows=2)), ("3-0", plain(slot=1))])
    _, [closed] = fold(state, reward("t1", 0, 0.25), "4-0")
    assert closed.decision.members[0].rewards == (0.25, 0.25)


def test_a_slot_still_waiting_at_the_deadline_times_out():
    state, _ = run_fold(
        POLICY, [("1-0", issued(at=100.0)), ("2-0", pending(slot=0)), ("3-0", plain(slot=1))], group_timeout_s=30.0
    )
    _, [closed] = fold(state, Tick(now=130.0))
    decision = closed.decision
    assert decision.slot_outcomes == {"0": "timeout", "1": "sample"} and decision.slots == (1,)
    assert "2-0" in closed.entries  # the waiting result is accounted for with the decision


def test_a_scorer_can_reject_or_fail_a_slot():
    state, _ = run_fold(POLICY, [("1-0", issued()), ("2-0", pending(slot=0)), ("3-0", pending(slot=1))])
    state, _ = fold(state, reward("t1", 0, reason="the answer is not a number"), "4-0")
    _, [closed] = fold(state, reward("t1", 1, error="sandbox timed out"), "5-0")
    assert closed.decision.slot_outcomes == {"0": "rejected", "1": "failed"}
    assert closed.decision.decision == "dropped"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "exactly one of"),
        ({"rewards": (1.0,), "reason": "no"}, "exactly one of"),
        ({"rewards": (float("nan"),)}, r"\$\.rewards\[0\]"),
        ({"rewards": ()}, "length >= 1"),
    ],
)
def test_a_reward_event_carries_exactly_one_finite_outcome(fields, message):
    # the rule between fields holds as the event is built, its values' bounds as it is encoded
    with pytest.raises(ValueError, match=message):
        codec.encode(SlotRewarded(task_id="t1", slot=0, **fields))


def test_only_a_sample_can_wait_for_its_reward():
    from streamgrp.core.events import SlotResult

    with pytest.raises(ValueError, match="only a sample can wait"):
        SlotResult(task_id="t1", slot=0, outcome="rejected", reward_pending=True)
