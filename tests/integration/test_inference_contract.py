"""Contract tests of the inference adapters against a local HTTP server answering in each dialect's
documented shapes (`tests.inference_fakes`): the right `Sample`, the right failures, bounded retries,
resubmitted aborts, versions, and never a hang. No Redis here; `test_inference_worker` runs the
adapter inside a real worker."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from inference_fakes import (
    Action,
    byte_tokens,
    close_enough,
    logprob_of,
    next_tokens,
    start,
    text_of,
)

from streamgrp.services.inference import InferenceRollout
from streamgrp.services.inference.adapter import GenerationFailed, Retry
from streamgrp.services.inference.dialect import ProtocolError, Sampling
from streamgrp.services.inference.http import ClientError, ReplyTooLarge
from streamgrp.services.inference.llamacpp import LlamaCpp
from streamgrp.services.inference.pool import ServerPool
from streamgrp.services.inference.sglang import SGLang
from streamgrp.services.inference.vllm import VLLM

DIALECTS = ("vllm", "vllm-old", "sglang", "llamacpp")
PATTERN = r"@v(\d+)$"
PROMPT = [11, 12, 13]


def make_dialect(name: str):
    if name == "vllm":
        return VLLM(version_pattern=PATTERN)
    if name == "vllm-old":
        return VLLM(token_ids="tokens_as_token_ids", version_pattern=PATTERN)
    if name == "sglang":
        return SGLang(version_pattern=PATTERN)
    return LlamaCpp(version_pattern=PATTERN)


@pytest.fixture(params=DIALECTS)
def fake(request):
    server, stop = start(request.param)
    yield server
    stop()


def rollout(fake, *, urls=None, max_tokens=6, attempts=3, timeout_s=2.0, reward=None, **kwargs) -> InferenceRollout:
    return InferenceRollout(
        make_dialect(fake.dialect),
        ServerPool(urls or [fake.url]),
        Sampling(max_tokens=max_tokens, model="policy"),
        reward or (lambda prompt, ids, text: float(len(ids))),
        retry=Retry(attempts, 0.01, 0.05),
        request_timeout_s=timeout_s,
        **kwargs,
    )


def slot(prompt=None, version=3):
    return SimpleNamespace(task_id="t1", slot=0, n_samples=4, prompt=prompt or {"prompt_ids": PROMPT}, version=version)


def rows(sample):
    return sample.token_ids.to_list(), sample.loss_mask.to_list(), sample.logprobs.to_list()


def test_a_completion_becomes_prompt_plus_completion_with_the_servers_logprobs(fake):
    sample = rollout(fake)(slot())
    completion = next_tokens(PROMPT, 6)
    ids, mask, logprobs = rows(sample)
    assert ids == PROMPT + completion
    assert mask == [0, 0, 0] + [1] * 6
    assert close_enough(logprobs, [0.0] * 3 + [logprob_of(t) for t in completion])
    assert sample.rewards == (6.0,) and sample.row_lengths == (9,)
    assert sample.version == 3  # the server reports none: the version when the request started
    assert sample.meta["text"] == text_of(completion) and sample.meta["finish"] == "length"
    (body,) = fake.generations()
    assert body[{"sglang": "input_ids"}.get(fake.dialect, "prompt")] == PROMPT  # token ids in, never text


def test_the_servers_reported_weight_version_wins(fake):
    fake.then(Action(version=7))
    assert rollout(fake)(slot(version=9)).version == 7


def test_a_text_prompt_is_tokenized_once_by_the_server(fake):
    if fake.dialect == "sglang":
        pytest.skip("covered by vllm and llamacpp; SGLang's /tokenize has the same shape as vLLM's")
    adapter = rollout(fake)
    first, second = adapter(slot({"text": "hi"})), adapter(slot({"text": "hi"}))
    assert rows(first)[0][:2] == [ord("h"), ord("i")] == rows(second)[0][:2]
    assert [path for path, _ in fake.requests].count("/tokenize") == 1


def test_an_abort_is_resubmitted_with_the_tokens_so_far_and_keeps_the_oldest_version(fake):
    if fake.dialect == "llamacpp":
        pytest.skip("llama-server has no abort reply (a restart breaks the connection)")
    fake.then(Action("abort", tokens=2, version=4), Action(version=5))
    sample = rollout(fake)(slot(version=4))
    first = next_tokens(PROMPT, 2)
    second = next_tokens(PROMPT + first, 4)
    assert rows(sample)[0] == PROMPT + first + second
    resubmitted = fake.generations()[1]
    assert resubmitted[{"sglang": "input_ids"}.get(fake.dialect, "prompt")] == PROMPT + first
    assert sample.meta["resubmits"] == 1 and sample.meta["versions"] == [4, 5]
    assert sample.version == 4  # it spans a weight change: the oldest version it used


def test_an_abort_fails_the_slot_with_the_reason_when_asked(fake):
    if fake.dialect == "llamacpp":
        pytest.skip("llama-server has no abort reply")
    fake.then(Action("abort", tokens=1))
    with pytest.raises(GenerationFailed, match="aborted the generation after 1 tokens"):
        rollout(fake, on_abort="fail")(slot())


def test_resubmissions_are_bounded(fake):
    if fake.dialect == "llamacpp":
        pytest.skip("llama-server has no abort reply")
    fake.default = Action("abort", tokens=1)
    with pytest.raises(GenerationFailed, match="after 2 resubmissions already"):
        rollout(fake, max_resubmits=2)(slot())
    assert len(fake.generations()) == 3


@pytest.mark.parametrize(
    "failure",
    [
        Action("status", status=503),
        Action("raw", raw=b'{"choices": [tr'),
        Action("close"),
        Action("status", status=429),
    ],
)
def test_transport_errors_are_retried_then_succeed(fake, failure):
    fake.then(failure, failure)
    sample = rollout(fake, attempts=3)(slot())
    assert sample.meta["attempts"] == 3 and len(fake.generations()) == 3


def test_a_server_restarting_for_a_weight_sync_is_waited_through_not_counted_as_attempts(fake):
    """A lone server answering 503 while it loads (llama-server restarted by weight-sync) longer than the
    whole backoff ladder: the request waits for its /health and is sent again, and the slot is a sample."""
    fake.loading_until = time.monotonic() + 1.0
    started = time.monotonic()
    sample = rollout(fake, attempts=2)(slot())  # backoff 0.01-0.05 s: without waiting through, failed at once
    assert 1.0 <= time.monotonic() - started < 3.0
    assert rows(sample)[0] == PROMPT + next_tokens(PROMPT, 6) and sample.meta["attempts"] == 2
    assert [path for path, _ in fake.requests].count("/health") >= 10  # polled, every 50 ms
    fake.loading_until = time.monotonic() + 1.0
    with pytest.raises(GenerationFailed, match="2 attempts failed.*HTTP 503: Loading model"):
        rollout(fake, attempts=2, restart_wait_s=0.0)(slot())  # without a wait, two attempts are two failures


def test_retries_are_bounded_and_the_slot_fails_with_the_last_error(fake):
    fake.default = Action("status", status=500, body={"error": {"message": "CUDA out of memory"}})
    started = time.monotonic()
    with pytest.raises(GenerationFailed, match="3 attempts failed.*HTTP 500: CUDA out of memory"):
        rollout(fake, attempts=3)(slot())
    assert len(fake.generations()) == 3 and time.monotonic() - started < 2


def test_a_4xx_is_not_retried(fake):
    fake.default = Action("status", status=400, body={"error": {"message": "prompt too long"}})
    with pytest.raises(ClientError, match="HTTP 400: prompt too long"):
        rollout(fake, attempts=4)(slot())
    assert len(fake.generations()) == 1


@pytest.mark.parametrize("slow", [Action("hang", seconds=3.0), Action("trickle", seconds=0.05)])
def test_a_silent_or_trickling_server_is_cut_off_at_the_deadline(fake, slow):
    fake.default = slow
    started = time.monotonic()
    with pytest.raises(GenerationFailed, match="timed out"):
        rollout(fake, attempts=2, timeout_s=0.4)(slot())
    assert time.monotonic() - started < 2.5  # 2 attempts x 0.4 s + backoff, never the server's pace


def test_a_slow_answer_inside_the_deadline_is_fine(fake):
    fake.then(Action("trickle", seconds=0.0005))
    assert rows(rollout(fake, timeout_s=10)(slot()))[0] == PROMPT + next_tokens(PROMPT, 6)


def test_a_reply_without_the_requested_ids_is_a_protocol_error_not_retried(fake):
    fake.default = Action("raw", raw=b'{"choices": [{"text": "x"}], "meta_info": {}, "tokens": "no"}')
    with pytest.raises(ProtocolError):
        rollout(fake, attempts=4)(slot())
    assert len(fake.generations()) == 1


def test_the_reward_function_rejects_with_none(fake):
    seen = []
    adapter = rollout(fake, reward=lambda prompt, ids, text: seen.append((prompt, ids, text)))
    assert adapter(slot({"prompt_ids": PROMPT, "answer": 4})) is None
    assert seen == [({"prompt_ids": PROMPT, "answer": 4}, next_tokens(PROMPT, 6), text_of(next_tokens(PROMPT, 6)))]


def test_a_dead_server_among_live_ones_is_failed_over(fake):
    dead = "http://127.0.0.1:9"  # discard port: nothing listens there
    adapter = rollout(fake, urls=[dead, fake.url], attempts=2)
    for _ in range(3):
        assert adapter(slot()).meta["server"] == fake.url
    assert len(fake.generations()) == 3


def test_bad_prompts_say_what_to_give():
    adapter = InferenceRollout(SGLang(), ServerPool(["http://127.0.0.1:9"]), Sampling(max_tokens=4), lambda *a: 0.0)
    with pytest.raises(ValueError, match="give prompt_ids"):
        adapter(slot({"messages": [{"role": "user", "content": "hi"}]}))
    with pytest.raises(ValueError, match="non-empty list of token ids"):
        adapter(slot({"prompt_ids": []}))


def test_least_loaded_prefers_the_idle_server():
    pool = ServerPool(["http://a", "http://b"], "least_loaded")
    with pool.lease() as first, pool.lease() as second, pool.lease() as third:
        assert {first, second} == {"http://a", "http://b"} and third in ("http://a", "http://b")
        assert pool.in_flight[third] == 2
    assert pool.in_flight == {"http://a": 0, "http://b": 0}


# -- one log-probability per generated token, and replies bounded by what was asked ---------------------------


@pytest.fixture
def fake_llama():
    server, stop = start("llamacpp")
    yield server
    stop()


MULTI_BYTE = "中文 ok 😀 汉字!"


def test_llama_cpp_tokens_of_multi_byte_characters_get_their_own_log_probabilities(fake_llama):
    """llama-server reports a probability entry only where the text ends in a whole character; every other
    token is scored again, teacher-forced, and the sample has one log-probability per generated id."""
    fake_llama.then(Action(text=MULTI_BYTE))
    sample = rollout(fake_llama, max_tokens=64)(slot())
    completion = byte_tokens(MULTI_BYTE)
    ids, mask, logprobs = rows(sample)
    assert ids == PROMPT + completion and mask == [0] * 3 + [1] * len(completion)
    assert close_enough(logprobs, [0.0] * 3 + [logprob_of(t) for t in completion])
    held_back = sum(len(c.encode()) - 1 for c in MULTI_BYTE)  # all but each character's last byte
    assert held_back == 11 and sample.meta["rescored"] == held_back and sample.meta["finish"] == "stop"
    assert sample.meta["text"] == MULTI_BYTE
    # each scored on its own prefix, on the server that generated it
    scored = fake_llama.scorings()
    assert len(scored) == held_back
    assert sorted(len(body["prompt"]) - len(PROMPT) for body in scored) == [
        i for i, _ in enumerate(completion) if i not in _positions_with_entries(MULTI_BYTE)
    ]


def _positions_with_entries(text: str) -> set[int]:
    ends, at = set(), -1
    for character in text:
        at += len(character.encode())
        ends.add(at)
    return ends


def test_llama_cpp_a_character_cut_off_by_the_token_limit_keeps_its_tokens(fake_llama):
    fake_llama.then(Action(text="ab中"))
    sample = rollout(fake_llama, max_tokens=4)(slot())  # "a", "b" and two of 中's three bytes
    assert rows(sample)[0] == PROMPT + byte_tokens("ab中")[:4]
    assert close_enough(rows(sample)[2], [0.0] * 3 + [logprob_of(t) for t in byte_tokens("ab中")[:4]])
    assert sample.meta["finish"] == "length" and sample.meta["rescored"] == 2


def test_llama_cpp_a_token_found_only_among_all_log_probabilities_is_still_scored(fake_llama):
    # 200 other tokens rank above 中's two held-back bytes in the fake's distribution, so the first scoring
    # request (top 64) misses both. Forced, the continuation byte is reported; the lead byte is not (its piece
    # ends inside a character): all log-probabilities find it.
    fake_llama.generated += [1001 + i * 7 for i in range(200)]  # logprob_of = -1/8, the highest
    fake_llama.then(Action(text="中"))
    sample = rollout(fake_llama, max_tokens=8)(slot())
    assert close_enough(rows(sample)[2][3:], [logprob_of(t) for t in byte_tokens("中")])
    assert [body["n_probs"] for body in fake_llama.scorings()] == [64, 1, 1 << 17, 64, 1]


def test_llama_cpp_a_token_no_request_can_score_fails_the_slot_saying_why(fake_llama):
    nothing = Action("raw", raw=b'{"content": "", "tokens": [1], "stop_type": "limit", "model": "smollm2"}')
    fake_llama.then(Action(text="中"), Action(), nothing, nothing, nothing)  # Action(): the anchor's /tokenize
    with pytest.raises(
        ProtocolError,
        match="completion token 0 \\(id 2228\\) came without a log-probability, and "
        "scoring it again teacher-forced gave none either",
    ):
        rollout(fake_llama, max_tokens=8)(slot())


def test_llama_cpp_a_weight_sync_between_generating_and_scoring_generates_the_segment_again(fake_llama):
    """Issue 38: llama-server generated a multi-byte reply on version 1, then weight-sync restarted it on
    version 2 before the held-back tokens were scored again. The scoring request meets the restart (the
    connection dropped, then 503 while loading), waits it through, and is answered by version 2: the
    segment is generated again on version 2, and nothing of version 1's reply is recorded."""
    fake_llama.then(
        Action(text="中", model="smollm2@v1"),
        Action(),  # the anchor's /tokenize
        Action("restart", seconds=0.3),
        Action(model="smollm2@v2"),  # scoring: restarted, now v2
        Action(text="é", model="smollm2@v2"),
        Action(model="smollm2@v2"),
    )  # again, scored on v2
    sample = rollout(fake_llama, max_tokens=8)(slot())
    ids, mask, logprobs = rows(sample)
    assert ids == PROMPT + byte_tokens("é") and close_enough(logprobs[3:], [logprob_of(t) for t in byte_tokens("é")])
    assert sample.version == 2 and sample.meta["versions"] == [2] and sample.meta["model"] == "smollm2@v2"
    assert sample.meta["regenerated"] == 1 and sample.meta["rescored"] == 1 and sample.meta["text"] == "é"
    assert [g["prompt"] for g in fake_llama.generations()] == [PROMPT, PROMPT]  # the same segment, from its start
    assert [path for path, _ in fake_llama.requests].count("/health") >= 2  # the restart was waited through


def test_llama_cpp_a_server_whose_model_keeps_changing_before_scoring_fails_the_slot(fake_llama):
    """The regenerations are bounded: a server that answers every scoring with another model than it generated
    with fails the slot saying so, and never records a log-probability of the other model."""
    from streamgrp.services.inference.adapter import MAX_REGENERATIONS

    fake_llama.then(Action(text="中", model="smollm2@v1"), Action())
    for version in range(2, MAX_REGENERATIONS + 3):
        fake_llama.then(Action(model=f"smollm2@v{version}"), Action(text="中", model=f"smollm2@v{version}"))
    with pytest.raises(
        GenerationFailed,
        match=f"changed models between generating \\('smollm2@v{MAX_REGENERATIONS + 1}'"
        f"\\) and scoring .*after {MAX_REGENERATIONS} generations again",
    ):
        rollout(fake_llama, max_tokens=8)(slot())
    assert len(fake_llama.generations()) == MAX_REGENERATIONS + 1


def test_more_tokens_than_asked_fail_the_slot(fake):
    fake.then(Action(over=2))
    with pytest.raises(ProtocolError, match="has 8 tokens, more than the 6 the request allowed"):
        rollout(fake, max_tokens=6)(slot())


@pytest.mark.parametrize(("value", "message"), [(1e308, "not a finite float32"), (0.5, "above 0 by more than")])
def test_log_probabilities_that_cannot_train_fail_the_slot(fake, value, message):
    fake.then(Action(logprob=value))
    with pytest.raises(ProtocolError, match=f"completion token 0 is .*{message}"):
        rollout(fake)(slot())
    assert len(fake.generations()) == 1  # not retried: the same request gets the same answer


def test_float_noise_above_zero_is_recorded_as_zero(fake):
    fake.then(Action(logprob=3e-5))
    assert rows(rollout(fake)(slot()))[2][3] == 0.0


@pytest.mark.parametrize("kind", ["raw", "flood"])
def test_a_reply_far_larger_than_max_tokens_justifies_is_cut_off_and_not_retried(fake, kind):
    # 6 tokens after a 3-token prompt: about 74 KB allowed; 4 MB is not read to the end.
    fake.default = Action(kind, raw=b'{"text": "' + b"x" * (4 << 20) + b'"}')
    with pytest.raises(ReplyTooLarge, match="over the \\d+ bytes allowed.*9 tokens' worth.*not retried"):
        rollout(fake, attempts=3, timeout_s=10)(slot())
    assert len(fake.generations()) == 1


def test_a_long_completion_is_not_mistaken_for_a_runaway_reply(fake):
    sample = rollout(fake, max_tokens=2000, timeout_s=10)(slot())
    assert len(rows(sample)[0]) == 3 + 2000
