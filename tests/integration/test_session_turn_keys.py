"""A keys-layout run's session turns (`streamgrp.store.payloads.with_turns`): the gateway stages a turn's tensors
with SET NX PX in the same pipeline as ``session_turn``, which renames them to ``<sessions>:turn:<entry id>``,
so no tensor byte is ever an argument of the function; a staged turn that is gone is refused with nothing
written; a repeat after a lost reply returns the first entry id; reload, replay, the inspector and the archive
see the turns as a stream-layout run's, which still read as before; retention deletes a turn key with its
entry."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from monitored import commands_until_fcall

from streamgrp.config import ArchiverConfig, RunConfig
from streamgrp.core import codec
from streamgrp.core.events import RawArray, TurnRecorded
from streamgrp.errors import SessionRefused
from streamgrp.replay import inspect_task
from streamgrp.replay.session_lines import session_lines
from streamgrp.services.archiver import Archiver
from streamgrp.services.retention import archive_progress, trim
from streamgrp.services.worker import WorkerClient
from streamgrp.store import loop_client, payloads
from streamgrp.store.runs import join_run
from streamgrp.store.sessions import SessionStore, new_key, new_session_id
from streamgrp.store.sources import ArchiveSource, FallbackSource, RedisSource
from streamgrp.store.streams import entry_id_str

TOKENS = 4096


def _turn(session: str, task_id: str, number: int, tokens: int = 16) -> TurnRecorded:
    return TurnRecorded(
        session=session,
        task_id=task_id,
        slot=0,
        turn=number,
        prompt_ids=RawArray.from_values([(number + i) % 1000 for i in range(tokens)], "int32"),
        completion_ids=RawArray.from_values([7, 8, number], "int32"),
        logprobs=RawArray.from_values([-0.5, -0.25, -0.125], "float32"),
        version=0,
        finish="stop",
        meta={"text": f"turn {number}"},
    )


def _opened(client, run, issuer) -> tuple[SessionStore, str, str]:
    """A session of the run's one task, opened as the gateway opens it: (store, session id, task id)."""
    [task] = issuer(run).issue([{"question": "q"}])
    [taken] = WorkerClient(client, run.keys).take(1, block_ms=None)
    store = SessionStore(client, run.partitions, producer="gw")
    session = new_session_id(0)
    assert store.open_task(0, taken.entry_id, taken.event, [(session, 0, new_key(session))], deadline=None, version=0)
    return store, session, task.task_id


def _entries(client, sessions: str) -> list[tuple[str, dict]]:
    return [(entry_id_str(i), f) for i, f in client.xrange(sessions)]


def _scan(client, pattern: str) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter(match=pattern, count=1000))


def test_a_turns_tensors_never_pass_through_the_function_and_live_in_its_turn_key(client, make_run, issuer):
    run = make_run(n_samples=1)
    store, session, task_id = _opened(client, run, issuer)
    sessions = run.keys.sessions
    turn = _turn(session, task_id, 1, TOKENS)
    fields = codec.encode(turn)
    with commands_until_fcall(client, sessions.encode()) as seen:
        entry = store.record(turn)
    [call] = [c for c in seen if c.upper().startswith(b"FCALL ")]
    assert len(call) < len(fields[codec.HEADER]) + 400  # its header and a digest, never the tensors
    # The stream entry is the header alone; the turn key holds header and tensors, without a time to live.
    [_opened_entry, (entry_id, stored)] = _entries(client, sessions)
    assert entry_id == entry and set(stored) == {codec.HEADER} and stored[codec.HEADER] == fields[codec.HEADER]
    value = client.get(payloads.turn_key(sessions, entry))
    assert value == payloads.frame(fields[codec.HEADER], fields[codec.BLOB])
    assert client.ttl(payloads.turn_key(sessions, entry)) == -1
    assert _scan(client, payloads.staged_pattern(sessions)) == []  # the staged key became the turn key
    [_, (_, read)] = payloads.with_turns(client, sessions, _entries(client, sessions))
    assert codec.decode(read) == turn
    # On the event loop: the staging write and the call in one pipeline, the call again without tensors.
    second = _turn(session, task_id, 2, TOKENS)
    call2 = store.record_call(second)
    assert call2.staged is not None and call2.args[3] == b"" and call2.keys[2] == call2.staged

    async def on_loop():
        aclient = loop_client.loop_client(client)
        if aclient is None:
            pytest.skip("a cluster client has no loop client")
        try:
            return await store.record_on_loop(aclient, call2)
        finally:
            await aclient.aclose()

    entry2 = asyncio.run(on_loop())
    assert entry2 is not None and entry2 > entry
    assert [t.turn for t in store.load(session).turns] == [1, 2] and store.load(session).turns[1] == second


def test_a_staged_turn_that_is_gone_is_refused_with_nothing_written(client, make_run, issuer):
    run = make_run(n_samples=1)
    store, session, task_id = _opened(client, run, issuer)
    sessions = run.keys.sessions
    call = store.record_call(_turn(session, task_id, 1))
    before = client.xlen(sessions)
    with pytest.raises(redis.ResponseError, match=r"STAGED the staged turn .* is gone"):  # never staged
        store._turn(keys=call.keys, args=call.args)
    client.set(call.staged, payloads.frame(*call.frame), px=20)
    time.sleep(0.1)
    with pytest.raises(redis.ResponseError, match="STAGED"):  # expired
        store._turn(keys=call.keys, args=call.args)
    header = call.args[2]
    for keys, args in (
        ([*call.keys[:2], run.keys.slots], call.args),  # not a staging key of the sessions stream
        ([*call.keys[:2], payloads.staged_key(run.keys.payloads)], call.args),  # the payloads' staging key
        (call.keys, [1, call.args[1], header, b"tensors"]),  # a staged key and the tensors
    ):
        with pytest.raises(redis.ResponseError, match="BAD_INPUT"):
            store._turn(keys=keys, args=args)
    assert client.xlen(sessions) == before and client.hget(run.keys.session(session), "turns") == b"0"
    assert _scan(client, payloads.turn_pattern(sessions)) == []
    # The refusals of a session's state are unchanged, and leave only the staged key, which expires by itself.
    with pytest.raises(SessionRefused) as refused:
        store.record(_turn(session, task_id, 2))
    assert refused.value.code == "TURN"
    [left] = _scan(client, payloads.staged_pattern(sessions))
    assert 0 < client.pttl(left) <= payloads.STAGED_TTL_MS
    assert client.xlen(sessions) == before and _scan(client, payloads.turn_pattern(sessions)) == []
    store.end(store.load(session), turns=0)  # rejected
    with pytest.raises(SessionRefused) as refused:
        store.record(_turn(session, task_id, 1))
    assert refused.value.code == "ENDED"


@pytest.mark.cluster
def test_a_repeat_after_a_lost_reply_returns_the_first_entry_id(client, make_run, issuer):
    run = make_run(n_samples=1)
    store, session, task_id = _opened(client, run, issuer)
    sessions = run.keys.sessions
    turn = _turn(session, task_id, 1)
    call = store.record_call(turn)
    pipe = client.pipeline(transaction=False)
    pipe.set(call.staged, payloads.frame(*call.frame), nx=True, px=payloads.STAGED_TTL_MS)
    store._turn(keys=call.keys, args=call.args, client=pipe)
    first = entry_id_str(pipe.execute()[-1])  # as if its reply were lost: the gateway sends it again
    # The same call (the same staged key, renamed already and staged again by the repeat's SET NX)...
    pipe = client.pipeline(transaction=False)
    pipe.set(call.staged, payloads.frame(*call.frame), nx=True, px=payloads.STAGED_TTL_MS)
    store._turn(keys=call.keys, args=call.args, client=pipe)
    assert entry_id_str(pipe.execute()[-1]) == first
    # ...or `record` again (a fresh staged key), as the loop's fallback does.
    assert store.record(turn) == first
    assert client.xlen(sessions) == 2  # opened, one turn
    assert _scan(client, payloads.turn_pattern(sessions)) == [payloads.turn_key(sessions, first)]
    assert all(0 < client.pttl(k) for k in _scan(client, payloads.staged_pattern(sessions)))  # they expire
    # A different turn 1 (another writer's) is still refused.
    with pytest.raises(SessionRefused) as refused:
        store.record(_turn(session, task_id, 1, tokens=3))
    assert refused.value.code == "TURN"


@pytest.mark.cluster
@pytest.mark.parametrize("layout", ["keys", "stream"])
def test_reload_inspect_archive_and_retention_see_the_same_turns_in_either_layout(
    client, run_name, issuer, tmp_path, layout
):
    run = join_run(client, run_name, RunConfig(n_samples=1, payload_layout=layout))
    store, session, task_id = _opened(client, run, issuer)
    sessions = run.keys.sessions
    turns = [_turn(session, task_id, n, 64) for n in (1, 2, 3)]
    ids = [store.record(t) for t in turns]
    raw = _entries(client, sessions)
    assert all((codec.BLOB in f) == (layout == "stream") for i, f in raw if i in ids)  # `b` only in a stream run
    keyed = _scan(client, payloads.turn_pattern(sessions))
    assert keyed == (sorted(payloads.turn_key(sessions, i) for i in ids) if layout == "keys" else [])
    # The gateway's reload after a restart.
    assert store.load(session).turns == turns
    # The inspector's timeline, through the server's source.
    shown = [e.data for e in inspect_task(client, run.keys, task_id) if e.what == "turn"]
    assert [(d["turn"], d["prompt_tokens"], d["text"]) for d in shown] == [(n, 64, f"turn {n}") for n in (1, 2, 3)]
    assert [codec.decode(f) for f in RedisSource(client, run.keys)("sessions", ids)] == turns
    store.end(store.load(session), turns=3)  # rejected: the session is over, retention may trim its events
    archiver = Archiver(client, run.keys, tmp_path / "archive", ArchiverConfig(retention=True))
    archiver.run(burst=True)
    assert archiver.last_trim is not None and archiver.last_trim.streams["sessions"].removed == 5  # open, 3, end
    assert client.xlen(sessions) == 0
    assert _scan(client, payloads.turn_pattern(sessions)) == []  # each turn key went with its entry
    # The archive carries every turn with its tensors; replaying the sessions from it reads them as before.
    archived = ArchiveSource(tmp_path / "archive")
    assert [codec.decode(f) for f in archived("sessions", ids)] == turns
    for source in (archived, FallbackSource(RedisSource(client, run.keys), ArchiveSource(tmp_path / "archive"))):
        lines = session_lines(source.scan("sessions"), task_id, lambda *a: a)
        assert [what for _, what, *_ in lines] == ["session", "turn", "turn", "turn", "session end"]
    with pytest.raises(SessionRefused) as gone:
        store.load(session)
    assert gone.value.code == "TRIMMED"


def test_retention_behind_a_partial_archive_deletes_the_turn_keys_of_the_entries_it_trims(
    client, make_run, issuer, tmp_path
):
    run = make_run(n_samples=1)
    store, session, task_id = _opened(client, run, issuer)
    sessions = run.keys.sessions
    ids = [store.record(_turn(session, task_id, n)) for n in (1, 2, 3)]
    store.end(store.load(session), turns=3)
    archiver = Archiver(client, run.keys, tmp_path / "archive", ArchiverConfig(archive_read_count=3))
    archiver.archive_once()  # opened, turns 1 and 2
    archiver.close()
    report = trim(client, run.keys, archive_progress(client, run.keys))
    assert report.streams["sessions"].removed == 3
    assert _scan(client, payloads.turn_pattern(sessions)) == [payloads.turn_key(sessions, ids[2])]
    assert [codec.decode(f).turn for _, f in list(ArchiveSource(tmp_path / "archive").scan("sessions"))[1:]] == [1, 2]
