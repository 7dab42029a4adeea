"""Unit tests of streamgrp.core.stall: the stall bound (SPEC section 4) on fake times, and its message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from streamgrp.core.stall import WARNING_INTERVAL_S, StallTracker, stall_message


def _empty_rounds(tracker: StallTracker, times) -> list[bool]:
    return [tracker.round(0, now) for now in times]


@pytest.mark.parametrize("max_empty_rounds", [1, 3, 8])
def test_zero_timeout_fails_after_exactly_max_empty_rounds(max_empty_rounds):
    tracker = StallTracker(max_empty_rounds=max_empty_rounds, stall_timeout_s=0)
    verdicts = _empty_rounds(tracker, [100.0 + 0.01 * i for i in range(max_empty_rounds)])
    assert verdicts == [False] * (max_empty_rounds - 1) + [True]
    assert tracker.empty_rounds == max_empty_rounds


def test_a_round_with_a_trainable_group_resets_the_streak():
    tracker = StallTracker(max_empty_rounds=3, stall_timeout_s=0)
    assert _empty_rounds(tracker, [1.0, 2.0]) == [False, False]
    assert tracker.round(1, 3.0) is False
    assert tracker.empty_rounds == 0
    assert tracker.last_progress == 3.0
    assert tracker.stall_seconds(3.5) == 0.0  # no empty round since the progress
    # the streak starts over: two more empty rounds are not enough, the third is
    assert _empty_rounds(tracker, [4.0, 5.0, 6.0]) == [False, False, True]
    assert tracker.stall_seconds(6.0) == pytest.approx(3.0)


def test_fast_empty_rounds_with_the_default_timeout_do_not_fail():
    tracker = StallTracker()  # 8 rounds and 1800 s
    assert (tracker.max_empty_rounds, tracker.stall_timeout_s) == (8, 1800.0)
    assert not any(_empty_rounds(tracker, [50.0 + 0.05 * i for i in range(20)]))
    assert tracker.empty_rounds == 20


def test_many_rounds_in_little_time_do_not_fail():
    tracker = StallTracker(max_empty_rounds=3, stall_timeout_s=60)
    assert not any(_empty_rounds(tracker, [float(i) for i in range(50)]))  # 50 rounds, 49 s
    assert tracker.round(0, 60.0) is True  # 51 rounds and 60 s: both hold now


def test_long_time_but_few_rounds_do_not_fail():
    tracker = StallTracker(max_empty_rounds=5, stall_timeout_s=60)
    assert _empty_rounds(tracker, [0.0, 1000.0, 2000.0, 3000.0]) == [False] * 4  # 3000 s, 4 rounds
    assert tracker.round(0, 3001.0) is True


def test_stall_time_counts_from_the_last_progress_not_from_the_first_round():
    tracker = StallTracker(max_empty_rounds=2, stall_timeout_s=100)
    assert tracker.round(0, 0.0) is False
    assert tracker.round(2, 90.0) is False
    assert _empty_rounds(tracker, [150.0, 180.0]) == [False, False]  # 90 s since progress
    assert tracker.round(0, 190.0) is True


def test_warnings_at_most_once_a_minute():
    tracker = StallTracker(max_empty_rounds=1000, stall_timeout_s=1e9)
    assert tracker.should_warn(0.0) is False  # nothing to warn about before an empty round
    warned = []
    for i in range(200):  # a round every second for 200 s
        now = 1000.0 + i
        tracker.round(0, now)
        if tracker.should_warn(now):
            warned.append(now)
    assert warned == [
        1000.0,
        1000.0 + WARNING_INTERVAL_S,
        1000.0 + 2 * WARNING_INTERVAL_S,
        1000.0 + 3 * WARNING_INTERVAL_S,
    ]
    assert WARNING_INTERVAL_S == 60.0


def test_no_warning_after_progress():
    tracker = StallTracker(max_empty_rounds=10, stall_timeout_s=1e9)
    tracker.round(0, 0.0)
    assert tracker.should_warn(0.0) is True
    tracker.round(1, 1000.0)
    assert tracker.should_warn(1000.0) is False


def test_message_names_causes_yields_and_drop_reasons():
    tracker = StallTracker(max_empty_rounds=3, stall_timeout_s=0)
    _empty_rounds(tracker, [10.0, 20.0, 30.0])
    counts = {
        "target_slots": 40,
        "usable_slots": 10,
        "trainable_slots": 4,
        "dropped:below_minimum": 6,
        "dropped:all_unusable": 4,
        "dropped:stale": 0,
        "slots:rejected": 25,
        "slots:failed": 5,
        "slots:sample": 10,
        "decisions:dropped": 10,
        "steps": 2,
    }
    message = stall_message(tracker, 30.0, counts)
    assert message.startswith("run stalled: 3 consecutive batcher rounds added no trainable group")
    assert "20s passed without progress" in message
    assert "max_empty_rounds=3" in message and "stall_timeout_s=0" in message
    for cause in ("reward function", "rejects or fails every sample", "min_usable_group_size", "no worker is running"):
        assert cause in message
    assert "usable_slot_yield=0.250" in message
    assert "trainable_slot_yield=0.100" in message
    assert "'below_minimum': 6" in message and "'all_unusable': 4" in message
    assert "stale" not in message  # a zero counter is not a reason
    assert "'rejected': 25" in message and "'failed': 5" in message
    assert "streamgrp_groups_dropped_total" in message


def test_message_with_nothing_decided_says_so():
    tracker = StallTracker(max_empty_rounds=1, stall_timeout_s=0)
    tracker.round(0, 5.0)
    message = stall_message(tracker, 5.0, {})
    assert "usable_slot_yield=n/a (no group decided)" in message
    assert "drop reasons {}" in message


def test_stall_module_is_pure():
    code = (
        "import sys, streamgrp.core.stall, streamgrp.core.manifest\n"
        "print(','.join(sorted(m for m in ('redis', 'torch', 'prometheus_client') if m in sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


# -- rounds that wait for trainers, and time the server was away ------------------------------------


def test_rounds_waiting_for_trainers_are_not_empty_and_restart_the_timer():
    tracker = StallTracker(max_empty_rounds=3, stall_timeout_s=2)
    assert tracker.round(1, 0.0) is False
    # a trainer at 4 s a step: 40 rounds of 0.1 s with the window full, none of them empty
    assert not any(tracker.round(0, 0.1 * i, waiting_for_trainers=True) for i in range(1, 41))
    assert (tracker.empty_rounds, tracker.trainer_wait_rounds) == (0, 40)
    assert tracker.last_progress == pytest.approx(4.0)
    # once rollouts really produce nothing, the bound counts from the last wait
    assert _empty_rounds(tracker, [4.5, 5.0, 5.9]) == [False, False, False]
    assert tracker.round(0, 6.1) is True


def test_a_waiting_round_that_brings_a_group_counts_as_progress_not_as_a_wait():
    tracker = StallTracker(max_empty_rounds=1, stall_timeout_s=0)
    assert tracker.round(2, 1.0, waiting_for_trainers=True) is False
    assert tracker.trainer_wait_rounds == 0 and tracker.empty_rounds == 0


def test_time_without_the_server_is_left_out_of_the_stall_timer():
    tracker = StallTracker(max_empty_rounds=2, stall_timeout_s=10)
    assert _empty_rounds(tracker, [0.0, 5.0]) == [False, False]
    tracker.shift(30.0)  # 30 s of outage between these rounds
    assert tracker.round(0, 38.0) is False  # 38 s of wall time, 8 s of stall time
    assert tracker.stall_seconds(38.0) == pytest.approx(8.0)
    assert tracker.round(0, 40.0) is True
    StallTracker().shift(5.0)  # before any round there is nothing to shift


def test_the_stall_message_names_a_full_server():
    tracker = StallTracker(max_empty_rounds=1, stall_timeout_s=0)
    tracker.round(0, 1.0)
    note = "The server is full (100 of maxmemory 100 bytes)"
    assert stall_message(tracker, 1.0, {}, server_note=note).endswith(note)
    assert "server is full" not in stall_message(tracker, 1.0, {})
