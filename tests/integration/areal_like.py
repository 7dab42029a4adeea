"""A workflow written like AReaL's RLVR example, and a fake inference engine, for `streamgrp.services.workflow`.

The workflow follows AReaL's ``RLVRWorkflow.arun_episode`` (one episode: tokenize the messages,
``engine.agenerate`` one response, score it, return ``[1, L]`` tensors with per-token versions);
nothing of AReaL is imported. The engine answers like AReaL's ``ModelResponse`` and, as an engine
whose weights change mid-generation would, stamps the first part of a completion with an older
version than the rest. Every call's outcome is recorded, so a test can compare with the slot log.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import torch

from streamgrp.services.workflow import workflow_rollout


@dataclass
class ModelRequest:
    rid: str
    input_ids: list[int]
    gconfig: dict
    tokenizer: object = None


@dataclass
class ModelResponse:
    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: str = "stop"

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


class CharTokenizer:
    """Characters as token ids; enough of a tokenizer for the workflow."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True, **_):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + (
            "<assistant>" if add_generation_prompt else ""
        )
        return [ord(c) for c in text] if tokenize else text

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


class FakeEngine:
    """``agenerate`` answers call ``i`` with 3 + i % 4 tokens; call ``i % 5 == 1`` raises (an engine failure).

    Versions: the first token was generated at version ``i % 3``, the rest at ``i % 3 + 1`` (the weights
    changed mid-generation). ``oldest`` maps each completion to the version its sample must get.
    No ``get_version``: the adapter supplies it.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.oldest: dict[tuple[int, ...], int] = {}

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        i = self.calls
        self.calls += 1
        await asyncio.sleep(0.001)  # a real engine yields while generating
        if i % 5 == 1:
            raise ConnectionError(f"inference server dropped request {req.rid}")
        output = [1000 + i] + [ord("a") + (i + k) % 26 for k in range(2 + i % 4)]
        versions = [i % 3] + [i % 3 + 1] * (len(output) - 1)
        self.oldest[tuple(output)] = i % 3
        return ModelResponse(req.input_ids, output, [-0.5] * len(output), versions)


def reward_fn(prompt, completion, prompt_ids, completion_ids, **data):
    """None (unscorable: the workflow rejects the episode) for completions ending in 'z' or 'y'."""
    if completion[-1] in "yz":
        return None
    return sum(1.0 for c in completion if c in data["answer"]) / len(completion)


@dataclass
class RLVRWorkflow:
    """Shaped like AReaL's RLVRWorkflow: one episode per call, ``[1, L]`` tensors, None for a rejection."""

    reward_fn: object
    gconfig: dict
    tokenizer: CharTokenizer
    outcomes: list = field(default_factory=list)

    async def arun_episode(self, engine, data):
        input_ids = self.tokenizer.apply_chat_template(data["messages"], tokenize=True, add_generation_prompt=True)
        req = ModelRequest(rid=uuid.uuid4().hex, input_ids=input_ids, gconfig=self.gconfig, tokenizer=self.tokenizer)
        try:
            resp = await engine.agenerate(req)
        except Exception:
            self.outcomes.append("failed")
            raise
        engine.get_version()  # AReaL's workflow reads it (to name its dump directory)
        completion = self.tokenizer.decode(resp.output_tokens)
        reward = await asyncio.to_thread(
            self.reward_fn, self.tokenizer.decode(input_ids), completion, resp.input_tokens, resp.output_tokens, **data
        )
        if reward is None:
            self.outcomes.append("rejected")
            return None
        self.outcomes.append("sample")
        seq = resp.input_tokens + resp.output_tokens
        return dict(
            input_ids=torch.tensor(seq).unsqueeze(0),
            loss_mask=torch.tensor([0] * resp.input_len + [1] * resp.output_len).unsqueeze(0),
            logprobs=torch.tensor([0.0] * resp.input_len + resp.output_logprobs).unsqueeze(0),
            versions=torch.tensor([-1] * resp.input_len + resp.output_versions).unsqueeze(0),
            attention_mask=torch.ones(len(seq), dtype=torch.bool).unsqueeze(0),
            rewards=torch.tensor([float(reward)]),
        )


workflow = RLVRWorkflow(reward_fn, {"max_new_tokens": 8}, CharTokenizer())
engine = FakeEngine()
#: What `streamgrp worker --rollout areal_like:rollout` would load.
rollout = workflow_rollout(workflow, engine=lambda: engine)
