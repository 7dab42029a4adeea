"""The demo's toy task under a worker's --concurrency: several threads of one process call `rollout` at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import orjson
import pytest
import torch

from streamgrp.consumers import toy_task
from streamgrp.core.events import Sample

THREADS = 8


class Published:
    """A weight cache with fixed versions (no Redis); each read takes a while, as a real one does."""

    def __init__(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        self.states = states

    def get(self, version: int):
        time.sleep(0.005)
        usable = [v for v in self.states if v <= version]
        return (max(usable), self.states[max(usable)]) if usable else None


@pytest.fixture
def fresh_module(monkeypatch):
    """The module as a new worker process has it: nothing loaded yet."""
    for name, value in (("_cache", None), ("_policy", None), ("_policy_version", None)):
        monkeypatch.setattr(toy_task, name, value)
    return monkeypatch


def _request(index: int, version: int = 0) -> SimpleNamespace:
    return SimpleNamespace(prompt={"p": index % toy_task.VOCAB}, task_id=f"t{index}", slot=0, version=version)


def _all_at_once(requests: list[SimpleNamespace]) -> list[Sample | None]:
    barrier = threading.Barrier(len(requests))

    def one(request):
        barrier.wait()
        return toy_task.rollout(request)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def test_the_first_rollouts_of_a_new_worker_all_find_a_policy(fresh_module):
    # Setting the policy up takes a while (torch builds the modules); a thread arriving meanwhile must wait
    # for it, not find the cache set and the policy still None.
    real = toy_task.initial_policy

    def slow_initial_policy(seed: int = 0):
        time.sleep(0.2)
        return real(seed)

    fresh_module.setattr(toy_task, "initial_policy", slow_initial_policy)
    fresh_module.setattr(toy_task.WeightCache, "from_env", lambda: Published({}))
    samples = _all_at_once([_request(i) for i in range(THREADS)])
    assert all(isinstance(sample, Sample) and sample.version == 0 for sample in samples)


def test_each_sample_is_generated_by_the_weights_of_the_version_it_names(fresh_module):
    states = {}
    for version in (1, 2):
        torch.manual_seed(100 + version)
        shapes = toy_task.initial_policy().state_dict()
        states[version] = {name: torch.randn_like(tensor) for name, tensor in shapes.items()}
    fresh_module.setattr(toy_task.WeightCache, "from_env", lambda: Published(states))
    requests = [_request(i, version=1 + i % 2) for i in range(4 * THREADS)]
    samples = [s for chunk in range(0, len(requests), THREADS) for s in _all_at_once(requests[chunk : chunk + THREADS])]
    policies = {}
    for version, state in states.items():
        policies[version] = toy_task.initial_policy()
        policies[version].load_state_dict(state)
    for request, sample in zip(requests, samples):
        assert sample.version == request.version
        ids = torch.tensor([sample.token_ids.to_list()])  # one row
        with torch.no_grad():
            expected = toy_task.token_logprobs(policies[sample.version], ids)[0]
        assert torch.allclose(torch.tensor(sample.logprobs.to_list()), expected, atol=1e-6)


def test_the_reference_trainer_refuses_rows_of_another_task_saying_what_to_do():
    from streamgrp.consumers import grpo_trainer
    from streamgrp.errors import ConfigError

    fits = torch.tensor([[3, *range(toy_task.LENGTH)]])
    assert toy_task.batch_problem(fits % toy_task.VOCAB) is None
    foreign = fits.clone()
    foreign[0, 4] = 17  # a real tokenizer's id: out of the toy policy's embedding
    assert (
        toy_task.batch_problem(foreign) == f"it holds token id 17, the toy task's vocabulary is 0..{toy_task.VOCAB - 1}"
    )
    assert "rows hold 3 tokens" in toy_task.batch_problem(fits[:, :3])
    with pytest.raises(ConfigError, match=r"step 4 is not the demo's toy task \(it holds token id 17.*--train-fn"):
        grpo_trainer._step(toy_task.ToyPolicy(), None, SimpleNamespace(step=4, token_ids=foreign), None, None)


def test_make_prompts_writes_count_lines_and_has_help(capsys):
    from streamgrp.consumers import make_prompts

    assert make_prompts.main(["3"]) == 0
    assert [orjson.loads(line)["i"] for line in capsys.readouterr().out.splitlines()] == [0, 1, 2]
    with pytest.raises(SystemExit) as exit_info:
        make_prompts.main(["--help"])
    assert exit_info.value.code == 0 and "JSONL" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        make_prompts.main(["many"])
    assert exit_info.value.code == 2 and "invalid int value: 'many'" in capsys.readouterr().err
