"""The inference adapters' pure parts: version parsing, backoff bounds, server choice, weights on disk,
the LM trainer's mismatch figures."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from streamgrp.errors import WeightsConflict
from streamgrp.services.inference.adapter import Retry
from streamgrp.services.inference.dialect import version_from
from streamgrp.services.inference.pool import ServerPool
from streamgrp.train.weights import save_version


@pytest.mark.parametrize(
    ("value", "pattern", "expected"),
    [
        ("12", None, 12),
        (3, None, 3),
        ("v7", None, 7),
        ("default", None, None),
        (True, None, None),
        (-1, None, None),
        ("policy@v12", r"@v(\d+)$", 12),
        ("policy", r"@v(\d+)$", None),
        (None, None, None),
    ],
)
def test_weight_versions_are_read_only_when_they_are_integers(value, pattern, expected):
    assert version_from(value, pattern) == expected


def test_backoff_doubles_is_capped_and_jittered_below_the_cap():
    retry, rng = Retry(attempts=10, base_s=0.5, cap_s=4.0), random.Random(1)
    pauses = [retry.pause(n, rng) for n in range(1, 10)]
    assert all(0.25 <= p <= 4.0 for p in pauses) and max(pauses[4:]) <= 4.0 and pauses[0] <= 0.5


def test_round_robin_skips_a_server_cooling_down_after_a_failure():
    now = [0.0]
    pool = ServerPool(["http://a", "http://b", "http://c"], cooldown_s=2.0, clock=lambda: now[0])
    picks = []
    for _ in range(3):
        with pool.lease() as url:
            picks.append(url)
    assert picks == ["http://a", "http://b", "http://c"]
    pool.failed("http://a")
    with pool.lease() as first, pool.lease() as second:
        assert "http://a" not in (first, second)
    now[0] = 5.0  # cooled down: back in the rotation
    picks = []
    for _ in range(3):
        with pool.lease() as url:
            picks.append(url)
    assert sorted(picks) == ["http://a", "http://b", "http://c"]


def test_version_directories_are_safetensors_written_whole(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    state = {"w": torch.randn(3, 2), "b": torch.zeros(4, dtype=torch.bfloat16), "n": torch.arange(3)}
    path = save_version(tmp_path, 12, state)
    assert path.name == "v000012" and not (tmp_path / "v000012.partial").exists()
    loaded = safetensors.load_file(str(path / "model.safetensors"))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    assert save_version(tmp_path, 12, {name: t.clone() for name, t in state.items()}) == path  # same state: no-op
    with pytest.raises(WeightsConflict, match="already holds another weight state"):
        save_version(tmp_path, 12, {"w": torch.ones(1)})  # a version names one state
    assert set(safetensors.load_file(str(path / "model.safetensors"))) == set(state)


def test_the_lm_trainers_mismatch_counts_only_completion_tokens():
    from streamgrp.consumers.lm_trainer import mismatch

    server = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]])
    trainer = torch.tensor([[9.0, -1.5, -2.0], [9.0, -0.5, 9.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    result = mismatch(server, trainer, mask)
    assert result["tokens_compared"] == 3
    assert result["logprob_abs_diff_mean"] == pytest.approx(0.5 / 3) and result["logprob_abs_diff_max"] == 0.5
    assert result["logprob_diff_mean"] == pytest.approx(0.5 / 3) and result["kl_estimate"] > 0
    assert mismatch(server, trainer, torch.zeros_like(mask)) == {"tokens_compared": 0}


def _llama_reply(tokens: list[int], entries: list[int], stop_type: str = "limit") -> dict:
    return {
        "tokens": tokens,
        "content": "ab",
        "stop_type": stop_type,
        "model": "policy@v0",
        "completion_probabilities": [{"id": t, "logprob": -0.5 - t / 100} for t in entries],
    }


@pytest.mark.parametrize(
    ("tokens", "entries", "unscored"),
    [
        ([5, 6, 200], [5, 6], (2,)),  # a character cut off at the end: its byte token has no entry
        ([5, 201, 202, 7], [5, 202, 7], (1,)),  # a 2-token character inside the text: the first has none
        ([201, 202, 203], [203], (0, 1)),  # a 3-byte character, the only one
        ([201], [], (0,)),  # nothing kept at all
        ([5, 6], [5, 6], ()),
    ],
)
def test_llama_cpp_tokens_without_a_probability_entry_are_kept_and_named_for_scoring(tokens, entries, unscored):
    from streamgrp.services.inference.llamacpp import LlamaCpp

    reply = _llama_reply(tokens, entries)
    if not entries:
        del reply["completion_probabilities"]  # llama-server leaves the field out when it kept no entry
    generation = LlamaCpp().parse(reply)
    assert generation.token_ids == tokens and generation.unscored == unscored and generation.finish == "length"
    for position, (token, value) in enumerate(zip(tokens, generation.logprobs)):
        assert math.isnan(value) if position in unscored else value == -0.5 - token / 100


def test_llama_cpp_a_repeated_id_in_a_held_back_run_is_scored_again_not_guessed():
    from streamgrp.services.inference.llamacpp import LlamaCpp, align

    # [lead, 98, 98]: the one entry for 98 may be either position; both are scored again.
    assert align([300, 98, 98], [98]) == [None, None, None]
    assert align([7, 300, 98, 98, 7], [7, 98, 7]) == [0, None, None, None, 2]
    generation = LlamaCpp().parse(_llama_reply([300, 98, 98], [98]))
    assert generation.unscored == (0, 1, 2)


def test_llama_cpp_a_stop_words_tokens_are_kept_as_generated():
    from streamgrp.services.inference.llamacpp import LlamaCpp

    # llama-server cuts the stop word's entries, not its tokens: the policy generated them, as it does EOS.
    generation = LlamaCpp().parse({**_llama_reply([5, 6, 7, 8], [5, 6], "word"), "stopping_word": "\n\n"})
    assert generation.token_ids == [5, 6, 7, 8] and generation.unscored == (2, 3) and generation.finish == "stop"


def test_llama_cpp_entries_that_are_not_its_tokens_in_order_are_refused():
    from streamgrp.services.inference.dialect import ProtocolError
    from streamgrp.services.inference.llamacpp import LlamaCpp

    with pytest.raises(ProtocolError, match="are not the ids of its 3 tokens in order"):
        LlamaCpp().parse(_llama_reply([1, 2, 3], [2, 1]))
    with pytest.raises(ProtocolError, match="no numeric logprob.*post_sampling_probs must stay off"):
        LlamaCpp().parse({**_llama_reply([1], []), "completion_probabilities": [{"id": 1, "prob": 0.5}]})
    with pytest.raises(ProtocolError, match="ignored the request's n_probs"):
        LlamaCpp().parse(
            {**_llama_reply([1], []), "completion_probabilities": None, "generation_settings": {"n_probs": 0}}
        )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1e308, "not a finite float32"),
        (-1e39, "not a finite float32"),
        (float("nan"), "not a finite float32"),
        (float("-inf"), "not a finite float32"),
        (-3.4028234663852886e38, "not a finite float32"),
        (0.5, "above 0 by more than"),
        (0.0011, "above 0 by more than"),
    ],
)
def test_log_probabilities_that_cannot_train_fail_the_slot(value, message):
    from streamgrp.services.inference.dialect import ProtocolError, checked_logprobs

    with pytest.raises(ProtocolError, match=f"completion token 1 is .*{message}"):
        checked_logprobs([-1.0, value], "the test reply")


def test_float_noise_above_zero_is_recorded_as_zero():
    from streamgrp.services.inference.dialect import LOGPROB_TOLERANCE, checked_logprobs

    assert checked_logprobs([-2.5, LOGPROB_TOLERANCE / 2, 0.0, -3e38], "r") == [-2.5, 0.0, 0.0, -3e38]


@pytest.mark.parametrize(
    ("dialect", "extra", "field"),
    [
        ("llamacpp", {"stream": True}, "stream"),
        ("llamacpp", {"post_sampling_probs": True}, "post_sampling_probs"),
        ("llamacpp", {"n_probs": 5}, "n_probs"),
        ("vllm", {"logprobs": 5}, "logprobs"),
        ("vllm", {"echo": True}, "echo"),
        ("sglang", {"stream": True}, "stream"),
        ("sglang", {"sampling_params": {"max_new_tokens": 9}}, "max_new_tokens"),
    ],
)
def test_sampling_extras_that_would_change_the_replys_shape_are_refused(dialect, extra, field):
    from streamgrp.config import InferenceConfig
    from streamgrp.errors import ConfigError
    from streamgrp.services.inference import build_rollout

    with pytest.raises(ConfigError, match=f"--sampling sets .*{field}.*remove it"):
        build_rollout(dialect, InferenceConfig(sampling=json.dumps(extra)))
    build_rollout(dialect, InferenceConfig(sampling=json.dumps({"seed": 3})))  # a sampling parameter is fine


def test_the_lm_trainers_grpo_step_moves_a_real_causal_lm_and_records_loss_and_mismatch():
    """The training half of `consumers.lm_trainer` on a tiny random Llama (transformers, built from a config:
    no download); the real-model end-to-end test runs the recomputation only, to fit CI's time."""
    transformers = pytest.importorskip("transformers")
    from types import SimpleNamespace

    from streamgrp.consumers.lm_trainer import _step, token_logprobs
    from streamgrp.core.policy import NormSpec

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)
    token_ids = torch.randint(0, 64, (4, 6))
    attention = torch.ones(4, 6)
    attention[3, 5] = 0  # one padded position
    loss_mask = torch.zeros(4, 6, dtype=torch.bool)
    loss_mask[:, 3:] = True
    loss_mask[3, 5] = False
    with torch.no_grad():  # the "server's" log-probabilities: the same weights, so the mismatch starts near 0
        served = token_logprobs(model, token_ids, attention) * loss_mask
    batch = SimpleNamespace(
        token_ids=token_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        logprobs=served,
        rewards=torch.tensor([1.0, 0.0, 0.5, 0.0]),
        group_sizes=[2, 2],
        rows=4,
        step_loss_tokens=int(loss_mask.sum()),
    )
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    metrics = _step(model, optimizer, batch, NormSpec("group", "group"))
    assert metrics["tokens_compared"] == int(loss_mask.sum()) and metrics["logprob_abs_diff_mean"] < 1e-4
    assert "loss" in metrics and abs(metrics["loss"]) < 10
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it trained
    again = _step(model, None, batch, NormSpec("group", "group"))  # recomputation only: now the policy moved
    assert "loss" not in again and again["logprob_abs_diff_mean"] > metrics["logprob_abs_diff_mean"]
