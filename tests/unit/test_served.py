"""The served-policy warning (`streamgrp.core.served`): the batcher says "workers serve v0, the run is at
v2" within a minute of every new group coming from a policy too old to train on, and stays quiet while
the served version keeps up, while it is within the staleness bound, and while no group is decided."""

from __future__ import annotations

from streamgrp.core.served import GRACE_S, ServedTracker


def test_a_served_version_left_behind_is_reported_within_a_minute_naming_both_versions():
    tracker = ServedTracker(max_staleness=1)
    warnings = []
    for second in range(0, 121, 5):  # one round every 5 s; groups keep coming from v0; the run is at v2 from 10 s
        tracker.decided(0, float(second))
        run_version = 0 if second < 10 else 2
        warnings.append((second, tracker.warning(run_version, float(second))))
    said = [(second, message) for second, message in warnings if message]
    assert said[0][0] == 10 + GRACE_S <= 60
    assert said[0][1].startswith("workers serve v0, the run is at v2: are weights being published?")
    assert [second for second, _ in said] == [40, 100]  # then once a minute while it lasts
    assert tracker.behind_seconds(2, 120.0) == 110.0


def test_it_stays_quiet_while_the_served_version_keeps_up_or_is_within_the_bound():
    tracker = ServedTracker(max_staleness=1)
    for second in range(0, 300, 5):
        version = second // 20  # a new version every 20 s; the servers follow it with one version of delay
        tracker.decided(max(0, version - 1), float(second))
        assert tracker.warning(version, float(second)) is None
        assert tracker.behind_seconds(version, float(second)) == 0.0


def test_no_decided_group_is_the_stall_bounds_business_not_this_warning():
    tracker = ServedTracker(max_staleness=1)
    tracker.decided(0, 0.0)
    for second in range(5, 200, 5):  # nothing decided after 0 s, the run far ahead
        assert tracker.warning(5, float(second)) is None
    assert tracker.behind_seconds(5, 200.0) == 0.0


def test_the_served_version_is_the_newest_seen_and_catching_up_clears_the_count():
    tracker = ServedTracker(max_staleness=1)
    tracker.decided(0, 0.0)
    assert tracker.behind_seconds(3, 1.0) == 0.0 and tracker.behind_seconds(3, 21.0) == 20.0
    tracker.decided(None, 22.0)  # a decision without versions changes nothing
    tracker.decided(2, 23.0)
    tracker.decided(1, 24.0)  # an older straggler does not lower it
    assert tracker.served == 2 and tracker.behind_seconds(3, 25.0) == 0.0
