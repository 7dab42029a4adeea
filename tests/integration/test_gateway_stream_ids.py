"""Foreign payload ids make no session's end fail, with the gateway's own ACL user (as `test_stream_ids` shows
for workers' publishes).

A session's sample is published with its payload at its slot result's id, so an entry a gateway's credential
appends to the payloads stream at a later id (an explicit id in the future, deleted or not) would make the
session's end fail: the payload and its header move after it instead. At the largest id there is no payload
can ever be written: the session ends as a failed slot saying why, and its group is decided. Only a run
recorded with ``payload_layout = "stream"`` keeps payloads in a stream, so these runs are such runs.
"""

from __future__ import annotations

import openai
import pytest
from gateway_fakes import Running
from gateway_fakes import start as start_fake
from role_users import refused, role_users  # noqa: F401  (a fixture)

from streamgrp.config import AssemblerConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, SessionEnded
from streamgrp.replay.verifier import format_report, verify
from streamgrp.services.assembler import Assembler
from streamgrp.store.streams import read_entries

LARGEST_ID = "18446744073709551615-18446744073709551615"
FUTURE_ID = "99999999999999-0"


@pytest.fixture
def fake():
    fake, server = start_fake()
    yield fake
    server.shutdown()
    server.server_close()


def _sessions_of_one_task(client, make_run, issuer, role_users, fake) -> tuple[Running, list[dict]]:
    run = make_run(n_samples=2, group_timeout_s=60.0, payload_layout="stream")
    issuer(run).issue([{"q": 1}])
    gateway = Running(role_users.client("gateway"), run, fake)
    sessions = gateway.open()["sessions"]
    for session in sessions:
        with openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"]) as chat:
            chat.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
    return gateway, sessions


def _decide(client, run) -> list[GroupDecided]:
    Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)
    return [codec.decode(fields) for _, fields in client.xrange(run.keys.decisions)]


def test_a_future_payload_id_written_and_deleted_fails_no_sessions_end(client, make_run, issuer, role_users, fake):
    gateway, sessions = _sessions_of_one_task(client, make_run, issuer, role_users, fake)
    try:
        own = gateway.client  # the gateway's own user (a second role_users.client would reset its password)
        future = own.xadd(gateway.run.keys.payloads, {"h": b"{}"}, id=FUTURE_ID)
        refused(lambda: own.xdel(gateway.run.keys.payloads, future))  # it may not delete payloads...
        client.xdel(gateway.run.keys.payloads, future)  # ...but the stream's last id stays in the future anyway
        ended = [gateway.end(session["session_id"], reward=1.0) for session in sessions]
    finally:
        gateway.close()
    assert [e["outcome"] for e in ended] == ["sample", "sample"] and all(e["entry"] > FUTURE_ID for e in ended)
    [decision] = _decide(client, gateway.run)
    assert decision.decision == "complete"
    members = [m.entry for m in decision.members]
    assert sorted(members) == sorted(e["entry"] for e in ended)
    assert all(p is not None for p in read_entries(client, gateway.run.keys.payloads, members))
    report = verify(client, gateway.run.keys)
    assert report.ok, format_report(report)


def test_at_the_largest_payload_id_a_session_ends_failed_saying_why(client, make_run, issuer, role_users, fake):
    gateway, sessions = _sessions_of_one_task(client, make_run, issuer, role_users, fake)
    try:
        gateway.client.xadd(gateway.run.keys.payloads, {"h": b"{}"}, id=LARGEST_ID)
        ended = [gateway.end(session["session_id"], reward=1.0) for session in sessions]
        events = gateway.events(SessionEnded)
    finally:
        gateway.close()
    assert [e["outcome"] for e in ended] == ["failed", "failed"]
    assert all("payloads stream holds an entry" in e["error"] for e in ended)
    assert [(e.outcome, "payloads stream holds an entry" in (e.error or "")) for e in events] == [("failed", True)] * 2
    [decision] = _decide(client, gateway.run)
    assert decision.decision == "dropped" and decision.slot_outcomes == {"0": "failed", "1": "failed"}
    report = verify(client, gateway.run.keys)
    assert report.ok, format_report(report)
