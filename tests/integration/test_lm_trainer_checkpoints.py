"""Crash consistency of the real-model trainer (issue 30, item 3): `streamgrp.consumers.lm_trainer` on a tiny
Llama-layout GGUF (`tiny_lm`), checkpointing every 2 steps and keeping 2, is SIGKILLed after training step 3
(its checkpoint of step 1 recorded, steps 0-2 committed, version 4 written to disk but not committed) and
restarted. It resumes after step 1, trains steps 2 and 3 again with their recorded data, and ends with
weights AND Adam's state bit-identical to one uninterrupted pass over the run's recorded steps (replayed
from the log with the trainer's own step function). The steps trained again publish versions above the
one the killed trainer wrote, and retention keeps the newest 2 checkpoints.

Deterministic settings: the CPU, one thread (``OMP_NUM_THREADS=1`` in the child, `torch.set_num_threads`
here). The killed start is a ``streamgrp trainer`` process (the flags as a user gives them); the restart
runs the same ``train`` in this process, which saves a second interpreter's start (transformers' import).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import orjson
import pytest
import torch
from pipeline import CHILD_ENV
from tiny_lm import VOCAB, write_tiny_gguf

from streamgrp.core import codec
from streamgrp.core.events import CheckpointSaved, Sample, TrainingResumed
from streamgrp.core.policy import NormSpec
from streamgrp.train.checkpoint import MODEL_FILE, OPTIMIZER_FILE, optimizer_state
from streamgrp.train.weights import version_dir

pytest.importorskip("transformers")
pytest.importorskip("gguf")

pytestmark = [pytest.mark.slow, pytest.mark.one_server_kind]

STEPS, EVERY, KEEP, LR = 6, 2, 2, 1e-2
N_SAMPLES, GROUPS_PER_STEP = 2, 2


def tiny_rollout(request):
    """A prompt token and 4 generated tokens of the tiny vocabulary; rewards differ within a group, so every
    step has a gradient. A pure function of the prompt and the slot."""
    rng = random.Random(f"{request.prompt['i']}:{request.slot}")
    tokens = [rng.randrange(3, VOCAB) for _ in range(5)]
    logprobs = [0.0, *(-rng.uniform(2.0, 5.0) for _ in range(4))]
    return Sample.from_rows(
        token_ids=[tokens],
        loss_mask=[[0, 1, 1, 1, 1]],
        logprobs=[logprobs],
        rewards=[float(rng.random())],
        version=request.version,
    )


def _events(client, run):
    return [codec.decode(fields) for _, fields in client.xrange(run.keys.commits)]


@pytest.mark.timeout(240)
def test_the_lm_trainer_killed_after_a_checkpoint_resumes_bit_for_bit_and_keeps_two_checkpoints(
    client, redis_url, make_run, tmp_path
):
    from made_steps import make_steps

    from streamgrp.config import TrainerConfig
    from streamgrp.consumers.lm_trainer import train

    source = write_tiny_gguf(tmp_path / "tiny.gguf")
    run = make_run(n_samples=N_SAMPLES, batch_size=GROUPS_PER_STEP)
    make_steps(client, run, groups=STEPS * GROUPS_PER_STEP, steps=STEPS, rollout=tiny_rollout)
    assert client.xlen(run.keys.steps) == STEPS
    checkpoints, weights = tmp_path / "checkpoints", tmp_path / "weights"
    flags = {
        "model_gguf": source,
        "lm_lr": LR,
        "weights_dir": weights,
        "gguf_outtype": "f32",
        "checkpoint_dir": checkpoints,
        "checkpoint_every": EVERY,
        "keep_checkpoints": KEEP,
    }

    # 1. A trainer process, killed after training step 3 (version 4 on disk), before committing it.
    args = [
        sys.executable,
        "-m",
        "streamgrp",
        "trainer",
        "--redis-url",
        redis_url,
        "--run",
        run.keys.run,
        "--train-fn",
        "streamgrp.consumers.lm_trainer:train",
        "--world-size",
        "1",
        "--crash-at",
        "train:3",
        *(item for name, value in flags.items() for item in (f"--{name.replace('_', '-')}", str(value))),
    ]
    killed = subprocess.run(
        args, capture_output=True, timeout=180, env={**os.environ, **CHILD_ENV, "OMP_NUM_THREADS": "1"}
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout.decode()[-3000:] + killed.stderr.decode()[-3000:]
    assert {int(s) for s in client.hgetall(run.keys.committed).values()} == {2}
    assert [e.step for e in _events(client, run) if isinstance(e, CheckpointSaved)] == [1]
    assert (version_dir(weights, 4) / "model.gguf").is_file() and int(client.get(run.keys.version)) == 3

    # 2. Restarted: resumes after the checkpoint of step 1, trains 2 and 3 again, then 4 and 5.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train(client, run, TrainerConfig(world_size=1, rank=0, **flags)) == STEPS - 2
        reference, adam = _uninterrupted_pass(client, run, source)
    finally:
        torch.set_num_threads(threads)
    events = _events(client, run)
    [resumed] = [e for e in events if isinstance(e, TrainingResumed) and e.attempt == 2]
    assert (resumed.step, resumed.reason, resumed.retrain_through, resumed.base_version) == (2, "checkpoint", 2, 4)
    saved = [e for e in events if isinstance(e, CheckpointSaved)]
    assert [(e.step, e.attempt, e.version) for e in saved] == [(1, 1, 2), (3, 2, 6), (5, 2, 8)]
    # Versions never go back: the steps trained again published 5 and 6, above the killed trainer's 4.
    assert int(client.get(run.keys.version)) == 8 and (version_dir(weights, 8) / "model.gguf").is_file()
    # Retention: the newest 2 checkpoints, the one resumed from removed once two newer were recorded.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000003-a2", "step-00000005-a2"]

    final = checkpoints / "step-00000005-a2"
    from safetensors import safe_open
    from safetensors.torch import load_file

    trained = load_file(final / MODEL_FILE)
    assert set(trained) < set(reference) and len(trained) == len(reference) - 1  # the tied output layer: once
    for name, tensor in trained.items():
        assert torch.equal(tensor, reference[name]), f"{name} differs from the uninterrupted pass"
    with safe_open(final / OPTIMIZER_FILE, framework="pt") as opened:
        tensors = {key: opened.get_tensor(key) for key in opened.keys()}  # noqa: SIM118 - not a dict
        state = optimizer_state(tensors, opened.metadata())
    assert orjson.dumps(state["param_groups"]) == orjson.dumps(adam["param_groups"])
    assert state["state"].keys() == adam["state"].keys()
    for param, entries in adam["state"].items():
        for name, value in entries.items():
            assert torch.equal(state["state"][param][name], value), f"Adam's {name} of parameter {param} differs"
    initial = _initial(source)
    assert not torch.equal(reference["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])  # it trained


def _initial(source):
    from streamgrp.consumers.lm_trainer import load_policy

    return load_policy(source).state_dict()


def _uninterrupted_pass(client, run, source) -> tuple[dict[str, torch.Tensor], dict]:
    """Every recorded step replayed from the log and trained in one go by the trainer's `_step`, from the
    source's weights and a fresh Adam: the weights and the optimizer's state dict at the end."""
    from streamgrp.consumers.lm_trainer import _step, load_policy
    from streamgrp.replay.steps import replay_step

    torch.manual_seed(0)
    model = load_policy(source)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model.train(True)
    spec = run.config.adv_norm or run.config.reward_norm or NormSpec("group", "group")
    for step in range(STEPS):
        _step(model, optimizer, replay_step(client, run.keys, step, 0), spec)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}, optimizer.state_dict()
