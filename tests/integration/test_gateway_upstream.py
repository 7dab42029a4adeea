"""The gateway's upstream follows the worker's adapter rule for a weight sync between generating and scoring
(issue 34 with issue 38's rule): the part is generated again on the weights the server serves now, never
recorded with log-probabilities of two policies, and the regenerations are bounded."""

from __future__ import annotations

import asyncio

import pytest
from inference_fakes import Action, byte_tokens, close_enough, logprob_of, start

from streamgrp.config import InferenceConfig
from streamgrp.services.gateway.upstream import Upstream
from streamgrp.services.inference.adapter import MAX_REGENERATIONS, GenerationFailed

PROMPT = [1, 2, 3]


@pytest.fixture
def fake_llama():
    server, stop = start("llamacpp")
    yield server
    stop()


def _generate(fake, max_tokens: int = 8):
    upstream = Upstream.from_config(
        "llamacpp", InferenceConfig(server_url=fake.url, max_tokens=max_tokens, restart_wait_s=5.0)
    )

    async def once():
        try:
            return await upstream.generate(PROMPT, upstream.defaults)
        finally:
            await upstream.requests.close()

    return asyncio.run(once())


def test_a_weight_sync_between_generating_and_scoring_generates_the_turn_again_on_the_new_weights(fake_llama):
    fake_llama.then(
        Action(text="中", model="smollm2@v1"),
        Action(),  # the anchor's /tokenize
        Action("restart", seconds=0.3),
        Action(model="smollm2@v2"),  # scoring: restarted, now v2
        Action(text="é", model="smollm2@v2"),
        Action(model="smollm2@v2"),
    )  # again, scored on v2
    completion = _generate(fake_llama)
    assert completion.token_ids == byte_tokens("é") and completion.regenerated == 1
    assert close_enough(completion.logprobs, [logprob_of(t) for t in byte_tokens("é")])
    assert [g["prompt"] for g in fake_llama.generations()] == [PROMPT, PROMPT]  # from the turn's start again


def test_a_server_whose_model_keeps_changing_before_scoring_fails_the_turn(fake_llama):
    fake_llama.then(Action(text="中", model="smollm2@v1"), Action())
    for version in range(2, MAX_REGENERATIONS + 3):
        fake_llama.then(Action(model=f"smollm2@v{version}"), Action(text="中", model=f"smollm2@v{version}"))
    with pytest.raises(GenerationFailed, match=f"after {MAX_REGENERATIONS} generations again"):
        _generate(fake_llama)
    assert len(fake_llama.generations()) == MAX_REGENERATIONS + 1
