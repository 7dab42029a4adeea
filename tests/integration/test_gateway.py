"""The agent gateway on a real server, in front of a predictable llama-server stand-in (`gateway_fakes`),
driven by the official ``openai`` client: sessions, their turns as recorded, what a session publishes,
keys, retries, timeouts, and `streamgrp agent` running agents per slot.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx2
import openai
import orjson
import pytest
from gateway_fakes import IM_END, TOKEN, Running, logprob
from gateway_fakes import start as start_fake
from processes import wait_until
from prometheus_client import CollectorRegistry
from stored_payloads import payload_at

from streamgrp.cli.metrics import Metrics
from streamgrp.config import AssemblerConfig, GatewayConfig, RunConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, SamplePayload, SessionEnded, SlotResult, TurnRecorded
from streamgrp.core.policy import NormSpec
from streamgrp.errors import ConfigError
from streamgrp.replay import inspect_task
from streamgrp.services.assembler import Assembler
from streamgrp.services.gateway.agent import AgentProcess
from streamgrp.services.retention import SESSION_CLOCK_MARGIN_S, floors, trim
from streamgrp.services.worker import WorkerClient
from streamgrp.store import payloads
from streamgrp.store.runs import join_run
from streamgrp.store.streams import entry_id_str
from streamgrp.store.tasks import TaskIssuer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "arithmetic",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>{"name": "calc", "arguments": {"x": "2+2"}}</tool_call>'


_CLIENTS: list[openai.OpenAI] = []


def openai_client(session: dict, **options) -> openai.OpenAI:
    """An OpenAI client of ``session``, closed when the test ends (its connections are not left to the collector)."""
    _CLIENTS.append(openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], **options))
    return _CLIENTS[-1]


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


@pytest.fixture
def fake():
    fake, server = start_fake()
    yield fake
    server.shutdown()
    server.server_close()


@pytest.fixture
def gateway_for(client, run_name, fake):
    running: list[Running] = []

    def make(tasks: int = 1, metrics=None, **run_settings) -> Running:
        run = join_run(
            client, f"{run_name}-{len(running)}", RunConfig(**{"n_samples": 2, "group_timeout_s": 60.0, **run_settings})
        )
        TaskIssuer(client, run.keys).issue([{"question": f"q{i}"} for i in range(tasks)])
        running.append(Running(client, run, fake, metrics=metrics))
        return running[-1]

    yield make
    for gateway in running:
        gateway.close()


def _decide(client, run) -> list[GroupDecided]:
    Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)
    return [codec.decode(f) for _, f in client.xrange(run.keys.decisions)]


def _payload(client, run, entry: str):
    fields = payload_at(client, run.keys, entry)
    event = codec.decode(fields)
    assert isinstance(event, SamplePayload)
    return event.sample


def test_a_two_turn_session_with_a_tool_message_is_one_row_of_the_servers_own_tokens(client, gateway_for, fake):
    metrics = Metrics(CollectorRegistry(), role="gateway")
    gw = gateway_for(metrics=metrics)
    opened = gw.open()
    assert [s["slot"] for s in opened["sessions"]] == [0, 1] and opened["prompt"] == {"question": "q0"}
    first, second = opened["sessions"]
    chat = openai_client(first)
    fake.script.extend([f"Let me compute. {CALL}", "It is 4."])
    messages = [{"role": "user", "content": "What is 2+2?"}]
    reply = chat.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    [call] = reply.choices[0].message.tool_calls
    assert (call.function.name, orjson.loads(call.function.arguments)) == ("calc", {"x": "2+2"})
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content == "Let me compute."
    messages += [
        reply.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "4"},
    ]
    again = chat.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    assert again.choices[0].message.content == "It is 4." and again.choices[0].finish_reason == "stop"
    assert again.usage.completion_tokens == len("It is 4.") + 1  # and the end-of-generation token

    ended = gw.end(first["session_id"], reward=1.0)
    assert (ended["outcome"], ended["turns"], ended["rows"]) == ("sample", 2, 1)
    assert gw.end(second["session_id"], reward=None)["outcome"] == "rejected"

    # Every recorded turn is what the server was given and generated, id for id, with its log-probabilities.
    turns = gw.events(TurnRecorded)
    assert [(t.session, t.turn) for t in turns] == [(first["session_id"], 1), (first["session_id"], 2)]
    assert [{"prompt": t.prompt_ids.to_list(), "tokens": t.completion_ids.to_list()} for t in turns] == fake.generations
    for turn in turns:
        assert turn.logprobs.to_list() == [logprob(t) for t in turn.completion_ids.to_list()]
        assert turn.completion_ids.to_list()[-1] == IM_END
    one, two = turns
    # The second prompt continues the first turn's prompt and completion exactly: only the tool message and
    # the template's markers were tokenized, without a BOS (the continuation of a prompt, not a new one).
    assert (
        two.prompt_ids.to_list()[: len(one.prompt_ids.to_list()) + len(one.completion_ids.to_list())]
        == one.prompt_ids.to_list() + one.completion_ids.to_list()
    )
    tokenized = [body for path, body in fake.requests if path == "/tokenize"]
    assert [body["add_special"] for body in tokenized] == [True, False]
    assert tokenized[1]["content"] == "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"
    assert all(body.get("tools") == TOOLS for path, body in fake.requests if path == "/apply-template")

    [decision] = _decide(client, gw.run)
    assert (decision.decision, decision.slot_outcomes) == ("partial", {"0": "sample", "1": "rejected"})
    value = metrics.registry.get_sample_value
    assert value("streamgrp_gateway_turns_total", {"endpoint": "chat"}) == 2
    assert value("streamgrp_gateway_sessions_total", {"outcome": "sample"}) == 1
    assert value("streamgrp_gateway_sessions_total", {"outcome": "rejected"}) == 1
    assert value("streamgrp_gateway_tokens_total", {"kind": "completion"}) == sum(
        len(t.completion_ids.to_list()) for t in turns
    )
    assert (
        value("streamgrp_gateway_overhead_seconds_count") == 2 and value("streamgrp_gateway_sessions_opened_total") == 2
    )
    sample = _payload(client, gw.run, decision.members[0].entry)
    ids, mask, values = sample.token_ids.to_list(), sample.loss_mask.to_list(), sample.logprobs.to_list()
    assert sample.row_lengths == (len(ids),) and sample.rewards == (1.0,) and sample.meta["row_turns"] == [[1, 2]]
    assert ids == two.prompt_ids.to_list() + two.completion_ids.to_list()
    start = len(one.prompt_ids.to_list())
    generated = set(range(start, start + len(one.completion_ids.to_list())))
    generated |= set(range(len(two.prompt_ids.to_list()), len(ids)))
    assert [i for i, m in enumerate(mask) if m] == sorted(generated)
    assert [values[i] for i in sorted(generated)] == [logprob(ids[i]) for i in sorted(generated)]
    assert all(values[i] == 0.0 for i in range(len(ids)) if i not in generated)

    # `streamgrp inspect` tells the task's sessions: opened, each turn, how each ended.
    lines = [
        (e.what, e.data)
        for e in inspect_task(client, gw.run.keys, opened["task_id"])
        if e.what in ("session", "turn", "session end")
    ]
    assert [what for what, _ in lines] == ["session", "session", "turn", "turn", "session end", "session end"]
    shown_turns = [data for what, data in lines if what == "turn"]
    assert [(d["turn"], d["completion_tokens"], d["text"]) for d in shown_turns] == [
        (1, len(one.completion_ids.to_list()), one.meta["text"]),
        (2, len(two.completion_ids.to_list()), "It is 4."),
    ]
    assert {d["outcome"] for what, d in lines if what == "session end"} == {"sample", "rejected"}


def test_retention_keeps_the_turns_of_open_sessions_and_trims_ended_ones_behind_the_archive(client, gateway_for, fake):
    gw = gateway_for(tasks=1)

    def one_turn(opened: dict) -> None:
        fake.script.append("Hello.")
        openai_client(opened["sessions"][0]).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}]
        )

    ended_task = gw.open()
    one_turn(ended_task)
    for session in ended_task["sessions"]:
        gw.end(session["session_id"], reward=1.0)
    time.sleep(SESSION_CLOCK_MARGIN_S + 0.2)  # the floor keeps a margin before the open one's task was issued
    TaskIssuer(client, gw.run.keys).issue([{"question": "later"}])
    open_task = gw.open()
    one_turn(open_task)
    keys = gw.run.keys
    everything = {
        stream: entry_id_str(client.xrevrange(key, count=1)[0][0])
        for stream, key in gw.run.streams().items()
        if client.exists(key)
    }
    assert "sessions" in everything  # archived and trimmed like every stream of the run
    floors_ = floors(client, keys, everything)
    floor, why = floors_["sessions"]
    assert why == "open agent sessions", floors_
    kept = [codec.decode(f) for _, f in _sessions(client, keys, f"{floor[0]}-{floor[1]}")]
    assert {e.task_id for e in kept} == {open_task["task_id"]}  # every event of the open one, none of the other
    assert sum(isinstance(e, TurnRecorded) for e in kept) == 1
    turn_keys = _turn_keys(client, keys)
    assert len(turn_keys) == 2  # a keys-layout run: each turn's tensors in a key of its own
    trim(client, keys, everything)
    assert [codec.decode(f).task_id for _, f in _sessions(client, keys)] == [e.task_id for e in kept]
    # The trimmed turn's key went with its entry; the open session's stays (its gateway reads it back).
    [(kept_id, _)] = [(i, f) for i, f in _sessions(client, keys) if codec.BLOB in f]
    assert _turn_keys(client, keys) == [payloads.turn_key(keys.sessions, kept_id)]
    for session in open_task["sessions"]:
        gw.end(session["session_id"], reward=None)
    assert floors(client, keys, everything)["sessions"][1] == "archive"


def _sessions(client, keys, start: str = "-") -> list:
    """The sessions stream's entries from ``start``, each turn with its tensors (`payloads.with_turns`)."""
    entries = [(entry_id_str(i), f) for i, f in client.xrange(keys.sessions, start, "+")]
    return payloads.with_turns(client, keys.sessions, entries)


def _turn_keys(client, keys) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter(match=payloads.turn_pattern(keys.sessions), count=1000))


@pytest.mark.one_server_kind
def test_streamed_chat_and_completions_answer_in_openais_shape(gateway_for, fake):
    gw = gateway_for()
    session = gw.open()["sessions"][0]
    chat = openai_client(session)
    assert [m.id for m in chat.models.list()] == ["policy"]
    fake.script.extend(["Streamed answer.", "abc", "def"])
    chunks = list(
        chat.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Streamed answer."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len("Streamed answer.") + 1
    content = [c for c in chunks if c.choices and c.choices[0].logprobs]
    assert [entry.token for c in content for entry in c.choices[0].logprobs.content][:2] == [
        f"token_id:{ord('S') + 16}",
        f"token_id:{ord('t') + 16}",
    ]
    # /v1/completions: a text prompt that continues the last turn's prompt and completion, then a prompt of ids.
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nStreamed answer.<|im_end|>\nmore"
    done = chat.completions.create(model="policy", prompt=text, max_tokens=8, extra_body={"return_token_ids": True})
    assert done.choices[0].text == "abc" and done.model_extra["prompt_token_ids"][:3] == [3, 1, ord("u") + 16]
    ids = chat.completions.create(model="policy", prompt=[5, 6, 7], max_tokens=2, logprobs=1)
    assert ids.choices[0].text == "de" and ids.choices[0].finish_reason == "length"
    assert ids.choices[0].logprobs.token_logprobs == [logprob(ord("d") + 16), logprob(ord("e") + 16)]
    turns = gw.events(TurnRecorded)
    assert [t.prompt_ids.to_list()[-len("more") :] for t in turns[1:2]] == [[ord(c) + 16 for c in "more"]]
    assert (
        turns[1].prompt_ids.to_list()[: len(turns[0].prompt_ids.to_list()) + len(turns[0].completion_ids.to_list())]
        == turns[0].prompt_ids.to_list() + turns[0].completion_ids.to_list()
    )
    assert turns[2].prompt_ids.to_list() == [5, 6, 7] and turns[2].finish == "length"


def test_a_streamed_turn_reaches_the_client_as_it_is_generated_and_ends_once_it_is_recorded(gateway_for, fake):
    """The server's tokens go to the client as they stream: the first part arrives while the generation has
    not ended; the finish and [DONE] come after the turn's record, and what streamed is what was recorded."""
    gw = gateway_for()
    session = gw.open()["sessions"][0]
    fake.script.append("Tokens as they come.")
    fake.hold_last = threading.Event()
    stream = openai_client(session).chat.completions.create(
        model="policy", stream=True, messages=[{"role": "user", "content": "go"}]
    )
    parts = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if len(parts) == 3:
                break
    assert parts == ["T", "o", "k"] and gw.events(TurnRecorded) == []  # still generating, nothing recorded
    fake.hold_last.set()
    rest = list(stream)
    text = "".join(parts) + "".join(c.choices[0].delta.content or "" for c in rest if c.choices)
    [turn] = gw.events(TurnRecorded)
    assert text == "Tokens as they come." == turn.meta["text"]
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "stop"
    assert turn.completion_ids.to_list() == fake.generations[-1]["tokens"]
    assert [path for path, _ in fake.requests].count("/completion") == 0  # streamed: never asked plainly


@pytest.mark.one_server_kind
def test_a_session_key_reaches_only_its_own_sessions_openai_endpoints(gateway_for, fake):
    gw = gateway_for()
    mine, other = gw.open()["sessions"]
    assert gw.control(f"/sessions/{mine['session_id']}/end", {"reward": 1.0}, token=mine["api_key"]).status_code == 401
    assert gw.control("/sessions", {}, token=mine["api_key"]).status_code == 401
    assert httpx2.post(gw.url + "/sessions", json={}).status_code == 401
    forged = mine["api_key"].rsplit("_", 1)[0] + "_" + other["api_key"].rsplit("_", 1)[1]
    altered = other["api_key"][:-1] + ("1" if other["api_key"].endswith("0") else "0")  # one hex digit off
    for key in (forged, "sk-nothing", altered):
        with pytest.raises(openai.AuthenticationError):
            openai_client({**mine, "api_key": key}, max_retries=0).chat.completions.create(
                model="p", messages=[{"role": "user", "content": "x"}]
            )
    openai_client(other).chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    assert [(t.session, t.slot) for t in gw.events(TurnRecorded)] == [(other["session_id"], 1)]
    gw.end(other["session_id"], reward=0.5)
    asked = len(fake.generations)
    with pytest.raises(openai.APIStatusError) as ended:  # 410, and not retried: a retry cannot help
        openai_client(other, max_retries=3).chat.completions.create(
            model="p", messages=[{"role": "user", "content": "y"}]
        )
    assert ended.value.status_code == 410 and "ended" in ended.value.message and len(fake.generations) == asked
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        openai_client(mine).chat.completions.create(model="p", n=2, messages=[{"role": "user", "content": "z"}])


@pytest.mark.one_server_kind
def test_a_retried_request_gets_its_recorded_answer_and_no_second_generation(gateway_for, fake):
    gw = gateway_for()
    session = gw.open()["sessions"][0]
    body = {"model": "p", "messages": [{"role": "user", "content": "once"}]}
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    first = httpx2.post(gw.url + "/v1/chat/completions", json=body, headers=headers).json()
    # What a client sends again after the answer was lost (the gateway died after recording the turn).
    retried = httpx2.post(
        gw.url + "/v1/chat/completions", json=body, headers={**headers, "x-stainless-retry-count": "1"}
    ).json()
    assert retried == {**first, "created": retried["created"]} and len(fake.generations) == 1
    keyed = {**headers, "Idempotency-Key": "abc"}
    asked = httpx2.post(gw.url + "/v1/chat/completions", json=body, headers=keyed).json()  # asked again on purpose
    assert asked["id"] != first["id"] and len(fake.generations) == 2
    assert httpx2.post(gw.url + "/v1/chat/completions", json=body, headers=keyed).json()["id"] == asked["id"]
    assert [t.turn for t in gw.events(TurnRecorded)] == [1, 2]


@pytest.mark.one_server_kind
def test_turns_that_do_not_continue_are_rows_and_the_one_row_contract_refuses_them(gateway_for, fake):
    def two_conversations(gw: Running) -> dict:
        session = gw.open()["sessions"][0]
        chat = openai_client(session)
        chat.chat.completions.create(model="p", messages=[{"role": "user", "content": "first"}])
        chat.chat.completions.create(model="p", messages=[{"role": "user", "content": "another"}])
        return gw.end(session["session_id"], reward=2.0)

    free = gateway_for(n_samples=2)  # no group statistics: several rows train, each with the session's reward
    ended = two_conversations(free)
    assert (ended["outcome"], ended["rows"]) == ("sample", 2)
    armed = gateway_for(n_samples=2, reward_norm=NormSpec("group", "group"))
    ended = two_conversations(armed)
    assert ended["outcome"] == "failed" and "make 2 rows" in ended["error"] and "append-only" in ended["error"]
    [result] = [
        codec.decode(f) for _, f in armed.client.xrange(armed.run.keys.slots) if codec.decode(f).kind == "slot_result"
    ]
    assert isinstance(result, SlotResult) and result.outcome == "failed" and "one-sample-per-slot" in result.error


@pytest.mark.one_server_kind
def test_an_abandoned_session_times_out_with_its_group_and_publishes_nothing(client, gateway_for, fake):
    gw = gateway_for(group_timeout_s=2.0)
    abandoned, ended = gw.open()["sessions"]
    for session in (abandoned, ended):
        openai_client(session).chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
    gw.end(ended["session_id"], reward=1.0)
    wait_until(
        lambda: gw.events(SessionEnded) and len(gw.events(SessionEnded)) == 2,
        timeout=10,
        message="the gateway to time the abandoned session out",
    )
    timed_out = [e for e in gw.events(SessionEnded) if e.session == abandoned["session_id"]]
    assert [(e.outcome, e.turns) for e in timed_out] == [("timeout", 1)]
    with pytest.raises(openai.APIStatusError) as late:
        openai_client(abandoned, max_retries=0).chat.completions.create(
            model="p", messages=[{"role": "user", "content": "x"}]
        )
    assert late.value.status_code == 410
    assert gw.control(f"/sessions/{abandoned['session_id']}/end", {"reward": 1.0}).status_code == 410
    [decision] = _decide(client, gw.run)
    assert decision.slot_outcomes == {"0": "timeout", "1": "sample"} and decision.closed_by == "deadline"
    assert len([1 for _, f in client.xrange(gw.run.keys.slots) if codec.decode(f).kind == "slot_result"]) == 1


def solve(session):
    """An agent for the runner: slot 0 talks twice around a tool and scores 1, slot 1 rejects, slot 2 raises,
    slot 3 hangs past its group's deadline."""
    if session.slot == 3:
        time.sleep(6)
        return 1.0
    messages = [{"role": "user", "content": session.prompt["question"]}]
    reply = session.client.chat.completions.create(model=session.model, messages=messages, tools=TOOLS)
    if session.slot == 2:
        raise ValueError(f"boom after {reply.choices[0].message.content}")
    messages += [
        reply.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": "c", "content": "4"},
    ]
    session.client.chat.completions.create(model=session.model, messages=messages, tools=TOOLS)
    return 1.0 if session.slot == 0 else None


async def solve_async(session):
    reply = await session.client.chat.completions.create(model="p", messages=[{"role": "user", "content": "a"}])
    return float(len(reply.choices[0].message.content))


@pytest.mark.one_server_kind
def test_the_agent_runner_runs_each_slots_agent_and_reports_its_verdict(client, gateway_for, fake):
    gw = gateway_for(tasks=1, n_samples=4, group_timeout_s=3.0)
    worker = WorkerClient(client, gw.run.keys, claim_idle_s=30)
    runner = AgentProcess(worker, solve, gateway_url=gw.url, token=TOKEN, n_samples=4, burst=True, retries=0)
    assert runner.run() == 1
    assert runner.outcomes == {"sample": 1, "rejected": 1, "failed": 1, "timeout": 1}
    [decision] = _decide(client, gw.run)
    assert decision.slot_outcomes == {"0": "sample", "1": "rejected", "2": "failed", "3": "timeout"}
    failed = [codec.decode(f) for _, f in client.xrange(gw.run.keys.slots)]
    [error] = [e.error for e in failed if getattr(e, "outcome", None) == "failed"]
    assert error.startswith("ValueError: boom after ok")
    assert client.xpending(gw.run.keys.tasks, "workers")["pending"] == 0  # opening the sessions acknowledged it

    other = gateway_for(tasks=2, n_samples=2)
    runner = AgentProcess(
        WorkerClient(client, other.run.keys), solve_async, gateway_url=other.url, token=TOKEN, n_samples=2, burst=True
    )
    assert runner.run() == 2 and runner.outcomes == {"sample": 4}
    assert {d.decision for d in _decide(client, other.run)} == {"complete"}


def test_a_reachable_gateway_needs_a_token_and_a_loopback_one_makes_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv("STREAMGRP_GATEWAY_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="reachable from other machines"):
        GatewayConfig(gateway_host="0.0.0.0").token(tmp_path)
    token, written = GatewayConfig().token(tmp_path)
    assert written == tmp_path / "gateway-token" and written.read_text().strip() == token
    assert written.stat().st_mode & 0o777 == 0o600
    given = tmp_path / "given"
    given.write_text("s3cret\n")
    assert GatewayConfig(gateway_host="0.0.0.0", gateway_token_file=given).token(tmp_path) == ("s3cret", None)
    assert Path(tmp_path / "gateway-token").exists()


@pytest.mark.one_server_kind
def test_an_online_app_posts_a_sessions_reward_after_it_ended_and_that_completes_the_group(client, gateway_for):
    gw = gateway_for(group_timeout_s=60.0)
    later, now = gw.open()["sessions"]  # online mode: the gateway took the task for the app
    for session in (later, now):
        openai_client(session).chat.completions.create(model="p", messages=[{"role": "user", "content": "go"}])
    ended = gw.end(later["session_id"], reward_pending=True)
    assert (ended["outcome"], ended["reward_pending"]) == ("sample", True)
    gw.end(now["session_id"], reward=1.0)
    assert gw.control(f"/sessions/{now['session_id']}/reward", {"reward": 2.0}).status_code == 410
    assert _decide(client, gw.run) == []  # the group waits for the reward
    posted = gw.control(f"/sessions/{later['session_id']}/reward", {"reward": 0.25})
    assert posted.status_code == 200, posted.text
    [decision] = _decide(client, gw.run)
    assert decision.decision == "complete" and decision.slot_outcomes == {"0": "sample", "1": "sample"}
    assert [m.reward for m in decision.members] == [0.25, 1.0]
