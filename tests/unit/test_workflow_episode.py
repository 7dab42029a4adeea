"""`sample_from_episode`: an AReaL-style episode dict as a `Sample`, and the errors that say what to return."""

from __future__ import annotations

import pytest
import torch

from streamgrp.services.workflow import WorkflowRollout, sample_from_episode


def episode(**overrides):
    result = {
        "input_ids": torch.tensor([[5, 6, 7, 8]]),
        "loss_mask": torch.tensor([[0, 1, 1, 1]]),
        "logprobs": torch.tensor([[0.0, -0.5, -0.25, -1.0]]),
        "versions": torch.tensor([[-1, 3, 2, 4]]),
        "attention_mask": torch.ones(1, 4, dtype=torch.bool),
        "rewards": torch.tensor([0.5]),
    }
    return {**result, **overrides}


def test_one_row_with_its_oldest_token_version():
    sample = sample_from_episode(episode(), version=9)
    assert (sample.token_ids.to_list(), sample.loss_mask.to_list()) == ([5, 6, 7, 8], [0, 1, 1, 1])
    assert sample.logprobs.to_list() == [0.0, -0.5, -0.25, -1.0]
    assert (sample.rewards, sample.version, sample.row_lengths) == ((0.5,), 2, (4,))


def test_padded_rows_are_trimmed_and_padding_versions_ignored():
    padded = episode(
        input_ids=torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]]),
        loss_mask=torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]]),
        logprobs=torch.zeros(2, 4),
        versions=torch.tensor([[-1, 4, 4, 0], [-1, 5, 5, 5]]),
        attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
        rewards=torch.tensor([[1.0], [0.0]]),
    )
    sample = sample_from_episode(padded, version=9)
    assert (sample.row_lengths, sample.rewards, sample.version) == ((3, 4), (1.0, 0.0), 4)


def test_lists_and_no_versions_fall_back_to_the_requested_version():
    plain = {"input_ids": [[1, 2]], "loss_mask": [[0, 1]], "logprobs": [[0.0, -1.0]], "rewards": 1.0}
    assert sample_from_episode(plain, version=7).version == 7
    assert sample_from_episode({**plain, "versions": [[-1, -1]]}, version=7).version == 7


@pytest.mark.parametrize(
    "result, message",
    [
        ([1, 2], "returned list, not a dict"),
        ({"input_ids": [[1]]}, "lacks ['loss_mask', 'logprobs', 'rewards']"),
        (episode(loss_mask=torch.tensor([[0, 1, 1]])), "loss_mask has shape [1, 3] but input_ids has [1, 4]"),
        (episode(rewards=torch.tensor([0.5, 1.0])), "rewards has 2 values for 1 rows"),
        (episode(attention_mask=torch.tensor([[0, 1, 1, 1]])), "attention_mask row 0 is not ones then zeros"),
    ],
)
def test_malformed_episodes_say_what_to_return(result, message):
    with pytest.raises((TypeError, ValueError), match=message.replace("[", r"\[").replace("]", r"\]")):
        sample_from_episode(result, version=0)


def test_workflow_and_engine_are_checked_up_front():
    class NotAWorkflow:
        def arun_episode(self, engine, data):  # not async
            return None

    class Workflow:
        async def arun_episode(self, engine, data):
            return None

    with pytest.raises(TypeError, match="no 'async def arun_episode"):
        WorkflowRollout(NotAWorkflow(), engine=lambda: None)
    with pytest.raises(TypeError, match="engine must have an agenerate method"):
        WorkflowRollout(Workflow(), engine=42)
