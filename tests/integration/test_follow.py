"""Followers in-process on a real server: a follower resumes where it recorded its position, its function
checks its whole input and never moves a position back, retention keeps what the slowest follower has
not read, and a follower past --max-follow-lag-s is trimmed past with a skip it sees, exactly counted.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from streamgrp.core.events import GroupDecided
from streamgrp.store.follower import Followed, Follower, Skipped
from streamgrp.services.retention import trim
from streamgrp.services.synthetic import synthetic_rollout
from streamgrp.store.follow import FollowPositions, positions
from streamgrp.store.keys import BATCHER_GROUP


def _decided(client, run, issuer, drain, count: int, first: int = 0) -> list[str]:
    issuer(run).issue(
        [{"seed": i, "tokens": 8} for i in range(first, first + count)],
        task_ids=[f"t{i:04d}" for i in range(first, first + count)],
    )
    drain(client, run, synthetic_rollout)
    return [e.decode() for e, _ in client.xrange(run.keys.decisions)]


def _everything_archived(client, run) -> dict[str, str]:
    """Archive progress as if the archiver had copied every entry (what retention then keeps is the readers')."""
    progress = {}
    for name, key in run.streams().items():
        last = client.xrevrange(key, "+", "-", count=1)
        if last:
            progress[name] = last[0][0].decode()
    return progress


def _read(follower: Follower, count: int) -> list:
    """``count`` items through `Follower.entries`, then break out (the last one is not recorded)."""
    got = []
    for item in follower.entries(threading.Event()):
        got.append(item)
        if len(got) == count:
            break
    return got


@pytest.mark.one_server_kind
def test_a_follower_resumes_after_what_it_recorded_and_gets_each_decision_in_order(client, make_run, issuer, drain):
    run = make_run(n_samples=2, batch_size=2)
    ids = _decided(client, run, issuer, drain, 10)
    assert len(ids) == 10

    first = _read(Follower(client, run, "eval", batch=3), 4)  # reads 3 (recorded), then the 4th (not)
    assert [i.entry_id for i in first] == ids[:4] and all(isinstance(i.event, GroupDecided) for i in first)
    [mine] = positions(client, run.keys)
    assert (mine.name, mine.stream, mine.position) == ("eval", "decisions", ids[2])

    again = Follower(client, run, "eval", batch=3)  # a restart: the 4th comes again, then the rest, in order
    stop = threading.Event()
    rest = []
    for item in again.entries(stop):
        rest.append(item.entry_id)
        if len(rest) == 7:
            stop.set()
    assert rest == ids[3:]
    assert positions(client, run.keys)[0].position == ids[-1]
    # Another follower has its own position; one starting "now" sees only what comes later.
    assert [i.entry_id for i in _read(Follower(client, run, "other"), 2)] == ids[:2]
    late = Follower(client, run, "late", start="now")
    assert late.poll() == []
    more = _decided(client, run, issuer, drain, 2, first=10)
    assert [i.entry_id for i in late.poll()] == more[10:]


@pytest.mark.one_server_kind
def test_the_position_function_checks_its_input_and_only_moves_forward(client, make_run, issuer, drain):
    run = make_run(n_samples=2, batch_size=2)
    ids = _decided(client, run, issuer, drain, 3)
    mine = FollowPositions(client, run.keys, "eval")
    assert mine.register("decisions") == "0-0"
    assert mine.ack("decisions", ids[2]) == ids[2]
    assert mine.ack("decisions", ids[0]) == ids[2]  # an older ack changes nothing
    assert mine.register("decisions", ids[1]) == ids[2]  # a restart keeps the recorded one
    before = client.hgetall(run.keys.follow)
    for args in (
        ["ack", "eval", "decisions", "01-0"],
        ["ack", "eval", "decisions", "1-2-3"],
        ["ack", "e|v", "decisions", "1-0"],
        ["ack", "eval", "decisions*", "1-0"],
        ["drop", "eval", "x", "1-0"],
        ["ack", "eval", "decisions"],
        ["ack", "nobody", "decisions", "5-0"],
    ):
        with pytest.raises(redis.ResponseError, match="BAD_INPUT|NOT_REGISTERED"):
            mine._call(keys=[run.keys.follow], args=args)
    assert client.hgetall(run.keys.follow) == before
    mine.forget("decisions")
    assert positions(client, run.keys) == []


@pytest.mark.one_server_kind
def test_retention_keeps_what_the_slower_follower_has_not_read_and_records_a_skip_past_the_bound(
    client, make_run, issuer, drain
):
    run = make_run(n_samples=2, batch_size=2)
    ids = _decided(client, run, issuer, drain, 12)
    client.xgroup_create(run.keys.decisions, BATCHER_GROUP, id="$")  # the batcher read everything
    fast, slow = Follower(client, run, "fast"), Follower(client, run, "slow", batch=2)
    [fast.handled(i) for i in fast.poll()]
    fast.record()
    [slow.handled(i) for i in slow.poll()]  # two decisions
    slow.record()

    report = trim(client, run.keys, _everything_archived(client, run))
    assert report.streams["decisions"].bound == "follower slow" and report.streams["decisions"].removed == 2
    assert [e.decode() for e, _ in client.xrange(run.keys.decisions)] == ids[2:]
    assert not report.skips

    # Past the bound: the slow follower's unread decisions go, recorded first as its skip...
    time.sleep(1.1)
    report = trim(client, run.keys, _everything_archived(client, run), max_follow_lag_s=1.0)
    assert report.streams["decisions"].bound != "follower slow" and client.xlen(run.keys.decisions) == 0
    [(who, skip)] = report.skips
    assert (who.name, skip.after, skip.count) == ("slow", ids[1], 10)
    [slow_position] = [p for p in positions(client, run.keys) if p.name == "slow"]
    assert slow_position.skipped == 10 and slow_position.position == ids[1]  # its position is its own to move

    # ...which it sees before what comes next, each once.
    more = _decided(client, run, issuer, drain, 3, first=12)
    slow.batch = 100
    items = slow.poll()
    assert isinstance(items[0], Skipped) and (items[0].after, items[0].count) == (ids[1], 10)
    assert [i.entry_id for i in items[1:] if isinstance(i, Followed)] == more
    [slow.handled(i) for i in items]
    slow.record()
    assert Follower(client, run, "slow").poll() == []  # a restart: nothing again, not the skip either
