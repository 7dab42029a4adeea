"""The gateway SIGKILLed mid-session, twice, while `streamgrp agent` drives three-turn sessions through it and a
batcher, an assembler and a trainer rank train what the sessions publish: every process real.

The first kill is the gateway's own, right after it recorded a turn and before it answered it
(``--crash-after-turn``); the second is the test's, at a random moment while turns are being generated.
Each time a new gateway starts on the same port, and the sessions are **resumed**: the agents' OpenAI
clients retry what went unanswered, the new gateway reads each session back from the run, answers a
turn it had recorded from that record (never generating it twice), and generates the others. Then:
every turn an agent was answered is in the run, token for token; every session ended with its sample,
none timed out or failed; every slot was published once and trained once; `streamgrp verify` passes.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections import Counter

import orjson
import pytest
from gateway_fakes import start as start_fake
from pipeline import CHILD_ENV, TrainerRank, check_run, events, write_dataset
from processes import RoleProcess, wait_until

from streamgrp.cli.children import free_port
from streamgrp.core.events import SessionEnded, SlotResult, StepManifest, TurnRecorded
from streamgrp.store.runs import open_run

pytestmark = [pytest.mark.slow, pytest.mark.one_server_kind]

PROMPTS, N_SAMPLES, TURNS = 8, 4, 3
#: Sessions the agent runner drives at once.
AGENTS = 8
RUN_FLAGS = [
    "--n-samples",
    str(N_SAMPLES),
    "--batch-size",
    "2",
    "--dp-size",
    "1",
    "--group-timeout-s",
    "120",
    "--max-staleness",
    "100",
]

AGENT = '''
import os, threading
import orjson

LOCK = threading.Lock()


def three_turns(session):
    """Three turns with a tool message between each; every answer received is logged, then the reward."""
    messages = [{"role": "user", "content": f"task {session.task_id} slot {session.slot}"}]
    for turn in range(3):
        reply = session.client.chat.completions.create(model=session.model, messages=messages)
        message = reply.choices[0].message
        with LOCK, open(os.environ["ANSWERS"], "ab") as log:
            log.write(orjson.dumps({"session": session.session_id, "id": reply.id, "content": message.content})
                      + b"\\n")
        messages += [message.model_dump(exclude_none=True), {"role": "tool", "content": f"result {turn}"}]
    return 1.0
'''


def test_a_gateway_killed_mid_session_resumes_every_session_and_trains_nothing_twice(
    client, redis_url, run_name, tmp_path
):
    fake, server = start_fake()
    fake.delay_s = 0.05  # generations in flight when the test's kill comes
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "crash_agents.py").write_text(AGENT)
    token = tmp_path / "token"
    token.write_text("gateway-secret\n")
    answers = tmp_path / "answers.jsonl"
    port = free_port("127.0.0.1")
    common = ["--redis-url", redis_url, "--run", run_name]
    env = {
        **CHILD_ENV,
        "PYTHONPATH": os.pathsep.join([CHILD_ENV["PYTHONPATH"], str(tmp_path / "agents")]),
        "ANSWERS": str(answers),
    }
    roles = {
        "batcher": RoleProcess(
            "batcher",
            [
                *common,
                *RUN_FLAGS,
                "--round-s",
                "0.1",
                "--lease-ttl-s",
                "1",
                "--dataset",
                str(write_dataset(tmp_path / "prompts.jsonl", PROMPTS)),
            ],
            tmp_path / "batcher",
            env=env,
        ),
        "assembler": RoleProcess(
            "assembler", [*common, "--lease-ttl-s", "1", "--tick-interval-s", "0.1"], tmp_path / "assembler", env=env
        ),
        "agent": RoleProcess(
            "agent",
            [
                *common,
                "--agent",
                "crash_agents:three_turns",
                "--gateway-url",
                f"http://127.0.0.1:{port}",
                "--gateway-token-file",
                str(token),
                "--concurrency",
                str(AGENTS),
                "--agent-retries",
                "10",
                "--burst",
                "false",
            ],
            tmp_path / "agent",
            env=env,
        ),
    }
    gateway_args = [
        *common,
        "--server-url",
        fake.url,
        "--gateway-port",
        str(port),
        "--gateway-token-file",
        str(token),
        "--refresh-s",
        "0.2",
        "--max-tokens",
        "32",
    ]
    gateway = RoleProcess("gateway", [*gateway_args, "--crash-after-turn", "10"], tmp_path / "gateway", env=env)
    trainer = TrainerRank(redis_url, run_name, 0, 1, tmp_path / "trainer", step_s=0.05)
    for role in (*roles.values(), gateway):
        role.log_dir.mkdir()
    try:
        for role in (roles["batcher"], roles["assembler"], gateway, roles["agent"]):
            role.start()
        trainer.start()
        run = wait_until(lambda: _opened(client, run_name), timeout=60, message="the batcher to create the run")

        # The gateway's own SIGKILL, after recording its tenth turn, whose answer is then never sent.
        assert gateway.proc.wait(timeout=90) == -9, gateway.output()[-3000:]
        recorded = len(events(client, run.keys.sessions, TurnRecorded))
        gateway.args = gateway_args
        gateway.start()
        wait_until(
            lambda: len(events(client, run.keys.sessions, TurnRecorded)) >= recorded + 25,
            timeout=90,
            message="turns after the first restart",
        )
        time.sleep(random.Random(7).uniform(0.0, 0.3))
        gateway.kill()  # the test's: at a random moment, generations in flight
        gateway.start()

        wait_until(
            lambda: trainer.proc.poll() is not None,
            timeout=180,
            interval=0.2,
            message="the trainer to train every step",
        )
        assert trainer.proc.returncode == 0 and trainer.out.read_text().endswith("done\n"), trainer.output()[-3000:]
    finally:
        for role in (roles["agent"], gateway, roles["assembler"], roles["batcher"]):
            if role.proc is not None and role.proc.poll() is None:
                try:
                    role.stop()
                except subprocess.TimeoutExpired:
                    pass  # killed by stop
        if trainer.proc is not None and trainer.proc.poll() is None:
            trainer.kill()
        server.shutdown()
        server.server_close()

    turns = events(client, run.keys.sessions, TurnRecorded)
    ended = events(client, run.keys.sessions, SessionEnded)
    # Every session resumed: three turns, numbered without a gap, and its sample published.
    assert len(ended) == PROMPTS * N_SAMPLES and {e.outcome for e in ended} == {"sample"}
    assert all(e.turns == TURNS and e.rows == 1 for e in ended)
    by_session = Counter(t.session for t in turns)
    assert set(by_session.values()) == {TURNS} and len(by_session) == PROMPTS * N_SAMPLES
    # Every answer an agent received is a recorded turn, the same text; the recorded-but-unanswered turn was
    # answered from its record after the restart, not generated again.
    recorded = {f"chatcmpl-{t.session}-{t.turn}": t.meta["text"] for t in turns}
    received = [orjson.loads(line) for line in answers.read_bytes().splitlines()]
    assert len(received) == PROMPTS * N_SAMPLES * TURNS
    assert all(recorded[answer["id"]] == answer["content"] for answer in received)
    # A generation either kill cut off (generated, never recorded) was asked for again: at most one per session
    # in flight (AGENTS) at each of the two kills; the gateway's own kill comes while other sessions generate too.
    assert 0 <= len(fake.generations) - len(turns) <= 2 * AGENTS
    assert "answered again from its record" in gateway.output()
    # Nothing published or trained twice; the run's own checks; verify re-folds and re-shards it all.
    results = events(client, run.keys.slots, SlotResult)
    assert Counter((r.task_id, r.slot) for r in results) == Counter(
        {(f"t{i:08d}", slot): 1 for i in range(PROMPTS) for slot in range(N_SAMPLES)}
    )
    trained = [
        (group.task_id, member.slot)
        for manifest in events(client, run.keys.steps, StepManifest)
        for shard in manifest.shards
        for group in shard.groups
        for member in group.members
    ]
    assert sorted(trained) == sorted(set(trained)) and len(trained) == PROMPTS * N_SAMPLES
    assert check_run(client, open_run(client, run_name), prompts=PROMPTS) == PROMPTS // 2
    verify = subprocess.run(
        [sys.executable, "-m", "streamgrp", "verify", "--redis-url", redis_url, "--run", run_name],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **CHILD_ENV},
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _opened(client, run_name):
    try:
        return open_run(client, run_name)
    except Exception:  # noqa: BLE001 - not created yet
        return None
