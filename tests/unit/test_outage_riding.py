"""Unit tests of streamgrp.store.connection.Outage: backoff through an outage, one warning each way, the
budget, a stop while waiting, and which errors count as an outage. The retried function is a plain
callable here; riding out a real server's outage is in tests/integration/test_connection.py."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from streamgrp.errors import OutageBudgetExceeded, StopRequested
from streamgrp.store.connection import Outage, is_outage


class Flaky:
    """Fails with ``error`` ``failures`` times, then answers ``"ok"``."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_outage_is_ridden_out_with_one_warning_when_it_starts_and_one_when_it_ends(caplog):
    outage = Outage(budget_s=10, base_s=0.001, cap_s=0.002, name="the server at redis://h:1/0")
    flaky = Flaky(25, redis.ConnectionError("Connection refused"))
    with caplog.at_level(logging.WARNING):
        assert outage.call(flaky) == "ok"
    assert flaky.calls == 26 and outage.count == 1 and outage.down_for == 0.0
    [down, up] = _warnings(caplog)
    assert down.startswith("the server at redis://h:1/0 is unavailable (ConnectionError: Connection refused)")
    assert "--outage-budget-s" in down
    assert up.startswith("the server at redis://h:1/0 answers again after")
    assert outage.call(Flaky(1, redis.TimeoutError("Timeout reading from socket"))) == "ok"
    assert outage.count == 2  # a second outage is counted (and warned about) on its own


def test_an_outage_longer_than_the_budget_raises_with_the_setting_named():
    outage = Outage(budget_s=0.2, base_s=0.01, cap_s=0.05)
    started = time.monotonic()
    with pytest.raises(OutageBudgetExceeded, match=r"over the outage budget of 0.2s .*raise --outage-budget-s"):
        outage.call(Flaky(10**9, redis.ConnectionError("reset")))
    assert 0.2 <= time.monotonic() - started < 2.0


def test_a_stop_while_the_server_is_away_ends_the_wait_quietly():
    stop = threading.Event()
    outage = Outage(budget_s=60, base_s=0.5, cap_s=0.5, stop=stop)
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(StopRequested):
        outage.call(Flaky(10**9, redis.ConnectionError("refused")))
    assert time.monotonic() - started < 5


def test_errors_that_are_not_outages_are_raised_at_once():
    outage = Outage(budget_s=60)
    flaky = Flaky(1, redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        outage.call(flaky)
    assert flaky.calls == 1 and outage.count == 0


@pytest.mark.parametrize(
    "error",
    [
        redis.ConnectionError("refused"),
        redis.exceptions.BusyLoadingError("LOADING Redis is loading the dataset in memory"),
        redis.TimeoutError("Timeout reading from socket"),
        redis.exceptions.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'."),
        redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'. script: abc, on @user_script:12."),
        redis.exceptions.ReadOnlyError("READONLY You can't write against a read only replica."),
        redis.exceptions.TryAgainError("TRYAGAIN"),
    ],
)
def test_what_counts_as_an_outage(error):
    assert is_outage(error)


@pytest.mark.parametrize(
    "error", [redis.ResponseError("ERR syntax error"), redis.AuthenticationError("WRONGPASS"), ValueError("x")]
)
def test_what_does_not(error):
    assert not is_outage(error)
