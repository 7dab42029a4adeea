"""The inference adapters' pure parts: version parsing, backoff bounds, server choice, weights on disk,
the LM trainer's mismatch figures."""

from __future__ import annotations

import random

import pytest
import torch

from streamgrp.services.inference.adapter import Retry
from streamgrp.services.inference.dialect import version_from
from streamgrp.services.inference.pool import ServerPool
from streamgrp.train.weights import save_version


@pytest.mark.parametrize(("value", "pattern", "expected"), [
    ("12", None, 12), (3, None, 3), ("v7", None, 7), ("default", None, None), (True, None, None),
    (-1, None, None), ("policy@v12", r"@v(\d+)$", 12), ("policy", r"@v(\d+)$", None), (None, None, None)])
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
    save_version(tmp_path, 12, {"w": torch.ones(1)})  # a rewrite replaces the whole directory
    assert set(safetensors.load_file(str(path / "model.safetensors"))) == {"w"}


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


def _llama_reply(tokens: list[int], probs_for: int, stop_type: str = "limit") -> dict:
    return {"tokens": tokens, "content": "ab", "stop_type": stop_type, "model": "policy@v0",
            "completion_probabilities": [{"id": t, "logprob": -0.5} for t in tokens[:probs_for]]}


def test_llama_cpp_tokens_of_a_held_back_character_are_dropped_with_a_note():
    from streamgrp.services.inference.llamacpp import LlamaCpp

    generation = LlamaCpp().parse(_llama_reply([5, 6, 200], probs_for=2))
    assert generation.token_ids == [5, 6] and generation.logprobs == [-0.5, -0.5]
    assert generation.finish == "length" and "1 trailing token(s) of an incomplete character dropped" in generation.reason
    whole = LlamaCpp().parse(_llama_reply([5, 6], probs_for=2, stop_type="eos"))
    assert whole.token_ids == [5, 6] and whole.finish == "stop" and whole.reason == ""


def test_llama_cpp_a_reply_missing_more_probabilities_than_a_character_is_refused():
    from streamgrp.services.inference.dialect import ProtocolError
    from streamgrp.services.inference.llamacpp import LlamaCpp

    with pytest.raises(ProtocolError, match="6 tokens but 2 completion_probabilities"):
        LlamaCpp().parse(_llama_reply([1, 2, 3, 4, 5, 6], probs_for=2))


def test_the_lm_trainers_grpo_step_moves_a_real_causal_lm_and_records_loss_and_mismatch():
    """The training half of `consumers.lm_trainer` on a tiny random Llama (transformers, built from a config:
    no download); the real-model end-to-end test runs the recomputation only, to fit CI's time."""
    transformers = pytest.importorskip("transformers")
    from types import SimpleNamespace

    from streamgrp.consumers.lm_trainer import _step, token_logprobs
    from streamgrp.core.policy import NormSpec

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    token_ids = torch.randint(0, 64, (4, 6))
    attention = torch.ones(4, 6)
    attention[3, 5] = 0  # one padded position
    loss_mask = torch.zeros(4, 6, dtype=torch.bool)
    loss_mask[:, 3:] = True
    loss_mask[3, 5] = False
    with torch.no_grad():  # the "server's" log-probabilities: the same weights, so the mismatch starts near 0
        served = token_logprobs(model, token_ids, attention) * loss_mask
    batch = SimpleNamespace(token_ids=token_ids, attention_mask=attention, loss_mask=loss_mask, logprobs=served,
                            rewards=torch.tensor([1.0, 0.0, 0.5, 0.0]), group_sizes=[2, 2], rows=4,
                            step_loss_tokens=int(loss_mask.sum()))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    metrics = _step(model, optimizer, batch, NormSpec("group", "group"))
    assert metrics["tokens_compared"] == int(loss_mask.sum()) and metrics["logprob_abs_diff_mean"] < 1e-4
    assert "loss" in metrics and abs(metrics["loss"]) < 10
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it trained
    again = _step(model, None, batch, NormSpec("group", "group"))  # recomputation only: now the policy moved
    assert "loss" not in again and again["logprob_abs_diff_mean"] > metrics["logprob_abs_diff_mean"]
