"""Agent sessions on a real language model: `streamgrp agent` runs an OpenAI-SDK agent per slot through
`streamgrp gateway` in front of llama-server serving SmolLM2-135M (GGUF), and a batcher, an assembler and a
trainer rank train what the sessions publish; every process real. Marker ``llama``.

20 groups of 4 sessions, each two turns with a tool message between. A recording proxy between the gateway
and llama-server keeps every generation, so the checks compare with what the server itself sent: every
recorded completion id is one llama-server generated for exactly that prompt, every recorded
log-probability is llama.cpp's own for its token (the float32 of its reply's ``logprob``; a token the
reply left unscored was scored again by the server, teacher-forced), and each session's two turns are one
row: the second prompt is the first turn's prompt and completion, then the tool message, token for token.
Meanwhile, in a run of its own, an agent that raises is ``failed``, one still running at its group's
deadline is abandoned and ``timeout``, and an external app's sessions (online mode) ended with their
rewards pending are completed by the rewards it posts afterwards.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from gateway_fakes import TOKEN, Running, start_proxy
from llama import binary_and_model, start_llama, stop_llama
from pipeline import CHILD_ENV, Pipeline, check_run, events
from processes import RoleProcess, wait_until
from stored_payloads import payload_at

from streamgrp.cli.children import free_port
from streamgrp.config import AssemblerConfig, RunConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, SamplePayload, SessionEnded, StepManifest, TurnRecorded
from streamgrp.services.assembler import Assembler
from streamgrp.services.gateway.agent import AgentProcess
from streamgrp.services.inference.llamacpp import align
from streamgrp.services.worker import WorkerClient
from streamgrp.store.runs import join_run, open_run
from streamgrp.store.tasks import TaskIssuer

pytestmark = [pytest.mark.llama, pytest.mark.slow]

GROUPS, N_SAMPLES, MAX_TOKENS = 20, 4, 6
RUN_FLAGS = [
    "--n-samples",
    str(N_SAMPLES),
    "--batch-size",
    "4",
    "--dp-size",
    "1",
    "--group-timeout-s",
    "600",
    "--max-staleness",
    "100",
    "--stall-timeout-s",
    "600",
]
AGENT = '''
WORD = {"type": "object", "properties": {"word": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up", "parameters": WORD}}]


def two_turns(session):
    """The question, the answer, a tool's result, the answer to that; the reward: a short second answer."""
    messages = [{"role": "user", "content": session.prompt["question"]}]
    first = session.client.chat.completions.create(model=session.model, messages=messages, tools=TOOLS)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "call_0", "content": "lookup: no entry"}]
    second = session.client.chat.completions.create(model=session.model, messages=messages, tools=TOOLS)
    return 1.0 if second.choices[0].finish_reason == "stop" else 0.0
'''
QUESTIONS = ["What is the capital of France?", "Name a color.", "What is 3+4?", "Say hello.", "Name a fruit."]


@pytest.fixture
def valkey_url(redis_server) -> str:
    """One server kind is enough for the model run; requested before llama-server starts."""
    if redis_server.kind != "valkey":
        pytest.skip("one server kind is enough for the model run")
    return redis_server.url


@pytest.mark.timeout(660)
def test_smollm2_sessions_through_the_gateway_are_llama_servers_own_tokens_trained_once(
    valkey_url, client, run_name, tmp_path
):
    binary, model = binary_and_model()
    llama = start_llama(binary, model, tmp_path / "llama-server.log")
    proxy, proxy_server = start_proxy(llama.url)
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "llama_agents.py").write_text(AGENT)
    (tmp_path / "token").write_text(TOKEN + "\n")
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        "".join(f'{{"seed": {i}, "question": "{QUESTIONS[i % len(QUESTIONS)]}"}}\n' for i in range(GROUPS))
    )
    port = free_port("127.0.0.1")
    env = {**CHILD_ENV, "PYTHONPATH": os.pathsep.join([CHILD_ENV["PYTHONPATH"], str(tmp_path / "agents")])}
    common = ["--redis-url", valkey_url, "--run", run_name]
    pipeline = Pipeline(valkey_url, run_name, tmp_path, dataset, RUN_FLAGS, dp_size=1, workers=0, trainer_step_s=0.0)
    token = ["--gateway-token-file", str(tmp_path / "token")]
    gateway = RoleProcess(
        "gateway",
        [*common, *token, "--server-url", proxy.url, "--gateway-port", str(port), "--max-tokens", str(MAX_TOKENS)],
        tmp_path / "gateway",
        env=env,
    )
    agent = RoleProcess(
        "agent",
        [
            *common,
            *token,
            "--agent",
            "llama_agents:two_turns",
            "--gateway-url",
            f"http://127.0.0.1:{port}",
            "--concurrency",
            "16",
        ],
        tmp_path / "agent",
        env=env,
    )
    verdicts = None
    try:
        pipeline.start()
        for role in (gateway, agent):
            role.log_dir.mkdir()
            role.start()
        verdicts = Verdicts(client, run_name, proxy)
        app_task = verdicts.online_app()
        wait_until(
            lambda: pipeline.trainers_done() or _failed(*pipeline.roles, gateway, agent),
            timeout=480,
            interval=0.5,
            message="the trainer to train every group",
        )
        assert pipeline.trainers_done(), "\n".join(_failed(*pipeline.roles, gateway, agent))
        run = open_run(client, run_name)
        steps = check_run(client, run, prompts=GROUPS)
        _check_against_llama(client, run, proxy.completions)
        _check_trained_rows(client, run, steps)
        verdicts.check(app_task)
    finally:
        if verdicts is not None:
            verdicts.close()
        pipeline.stop()
        for role in (agent, gateway):
            if role.proc is not None and role.proc.poll() is None:
                try:
                    role.stop()
                except subprocess.TimeoutExpired:
                    pass  # killed by stop
        proxy_server.shutdown()
        proxy_server.server_close()
        stop_llama(llama)


def _failed(*roles) -> list[str]:
    return [
        f"{role.role} exited with {role.proc.returncode}:\n{role.output()[-3000:]}"
        for role in roles
        if role.proc is not None and role.proc.poll() not in (None, 0)
    ]


def _check_against_llama(client, run, completions) -> None:
    """Every recorded turn is a generation llama-server made for that prompt, its ids and log-probabilities."""
    generated = defaultdict(list)
    for request, reply in completions:
        if "logit_bias" not in request:  # not a teacher-forced scoring request
            generated[tuple(request["prompt"])].append(reply)
    turns = events(client, run.keys.sessions, TurnRecorded)
    assert len(turns) == 2 * GROUPS * N_SAMPLES
    exact = rescored = 0
    for turn in turns:
        ids, values = turn.completion_ids.to_list(), turn.logprobs.to_list()
        replies = generated[tuple(turn.prompt_ids.to_list())]
        reply = next((r for r in replies if r["tokens"] == ids), None)
        assert reply is not None, f"turn {turn.turn} of {turn.session}: no generation of llama-server gave {ids}"
        replies.remove(reply)
        entries = reply.get("completion_probabilities") or []
        owners = align(ids, [e["id"] for e in entries])
        assert owners is not None and 1 <= len(ids) <= MAX_TOKENS
        for position, owner in enumerate(owners):
            if owner is None:
                rescored += 1
                assert values[position] <= 0.0
            else:
                assert values[position] == float(np.float32(entries[owner]["logprob"])), (turn.session, position)
                exact += 1
    assert exact > 0.9 * (exact + rescored)
    ended = events(client, run.keys.sessions, SessionEnded)
    assert len(ended) == GROUPS * N_SAMPLES and {(e.outcome, e.turns) for e in ended} == {("sample", 2)}
    # Each session is one row: its second prompt continues its first turn exactly, whatever llama-server
    # generated; only a first answer cut off inside a character (its text ends in a replacement character,
    # which the agent sends back) starts a second row.
    first = {t.session: t.meta["text"] for t in turns if t.turn == 1}
    assert all(e.rows == 1 or (e.rows == 2 and "\ufffd" in first[e.session]) for e in ended), [
        (e.rows, first[e.session]) for e in ended if e.rows != 1
    ]
    assert sum(e.rows == 1 for e in ended) >= 0.9 * len(ended)


def _check_trained_rows(client, run, steps: int) -> None:
    turns = defaultdict(dict)
    for turn in events(client, run.keys.sessions, TurnRecorded):
        turns[(turn.task_id, turn.slot)][turn.turn] = turn
    trained = [
        (group.task_id, member)
        for manifest in events(client, run.keys.steps, StepManifest)
        for shard in manifest.shards
        for group in shard.groups
        for member in group.members
    ]
    assert len(trained) == GROUPS * N_SAMPLES and len({(t, m.slot) for t, m in trained}) == len(trained)
    assert len(events(client, run.keys.steps, StepManifest)) == steps
    for task_id, member in trained:
        fields = payload_at(client, run.keys, member.entry)
        payload = codec.decode(fields)
        assert isinstance(payload, SamplePayload)
        one, two = turns[(task_id, member.slot)][1], turns[(task_id, member.slot)][2]
        ids, mask = payload.sample.token_ids.to_list(), payload.sample.loss_mask.to_list()
        p1, c1, p2, c2 = (t.to_list() for t in (one.prompt_ids, one.completion_ids, two.prompt_ids, two.completion_ids))
        if payload.sample.rows == 2:  # the first answer was cut inside a character: two rows, each as recorded
            assert ids == p1 + c1 + p2 + c2 and payload.sample.row_lengths == (len(p1) + len(c1), len(p2) + len(c2))
            continue
        assert p2[: len(p1) + len(c1)] == p1 + c1 and ids == p2 + c2
        assert mask == [0] * len(p1) + [1] * len(c1) + [0] * (len(p2) - len(p1) - len(c1)) + [1] * len(c2)


async def verdicts(session):
    """Slots 0 and 1 answer once; slot 2 raises after its turn; slot 3 is still running at the group's deadline."""
    import asyncio

    reply = await session.client.chat.completions.create(
        model=session.model, messages=[{"role": "user", "content": "Name an animal."}]
    )
    if session.slot == 2:
        raise RuntimeError(f"the agent gave up after {reply.usage.completion_tokens} tokens")
    if session.slot == 3:
        await asyncio.sleep(3600)
    return 0.5


class Verdicts:
    """A run of one task whose agents fail and abandon (beside the main run, so its deadline passes meanwhile),
    through a gateway of this process in front of the same llama-server."""

    def __init__(self, client, run_name: str, proxy) -> None:
        self.client = client
        self.run = join_run(client, f"{run_name}-verdicts", RunConfig(n_samples=N_SAMPLES, group_timeout_s=30.0))
        TaskIssuer(client, self.run.keys).issue([{"question": "animals"}, {"question": "plants"}])
        self.gateway = Running(client, self.run, proxy, max_tokens=MAX_TOKENS)
        self.runner = AgentProcess(
            WorkerClient(client, self.run.keys),
            verdicts,
            gateway_url=self.gateway.url,
            token=TOKEN,
            n_samples=N_SAMPLES,
            max_tasks=1,
            retries=2,
        )
        self.thread = threading.Thread(target=self.runner.run, daemon=True)
        self.thread.start()

    def online_app(self) -> str:
        """An external app's task: it opens the sessions, talks once in each, ends each with its reward pending,
        and posts the rewards afterwards."""
        opened = self.gateway.open()

        def talk(session: dict) -> dict:
            with openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"]) as chat:
                chat.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Name a plant."}])
            return self.gateway.end(session["session_id"], reward_pending=True)

        with ThreadPoolExecutor(N_SAMPLES) as sessions:
            assert all(ended["reward_pending"] for ended in sessions.map(talk, opened["sessions"]))
        for session in opened["sessions"]:
            posted = self.gateway.control(f"/sessions/{session['session_id']}/reward", {"reward": 0.75})
            assert posted.status_code == 200, posted.text
        return opened["task_id"]

    def close(self) -> None:
        self.gateway.close()  # its agents' sessions then fail, which ends the runner's thread

    def check(self, app_task: str) -> None:
        try:
            self.thread.join(timeout=150)
            assert not self.thread.is_alive() and self.runner.tasks_done == 1
            wait_until(
                lambda: len(self.gateway.events(SessionEnded)) == 2 * N_SAMPLES,
                timeout=30,
                message="the abandoned session to time out",
            )
        finally:
            self.close()
        Assembler(self.client, self.run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)
        decisions = {d.task_id: d for d in (codec.decode(f) for _, f in self.client.xrange(self.run.keys.decisions))}
        assert all(isinstance(d, GroupDecided) for d in decisions.values()) and len(decisions) == 2
        app = decisions.pop(app_task)
        [agents] = decisions.values()
        assert agents.slot_outcomes == {"0": "sample", "1": "sample", "2": "failed", "3": "timeout"}
        assert self.runner.outcomes == {"sample": 2, "failed": 1, "timeout": 1}
        # The rewards posted after the sessions ended completed the app's group.
        assert app.decision == "complete" and [m.reward for m in app.members] == [0.75] * N_SAMPLES
