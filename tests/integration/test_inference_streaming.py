"""Contract tests of streamed generation against a local HTTP server streaming in each dialect's shapes
(`tests.inference_fakes`: vLLM's completion chunks, SGLang's cumulative and incremental /generate events,
llama-server's partial and final results): one request per generation, cut into segments as it arrives;
an abort or a stream broken by a restart keeps what it streamed and goes on from it under the new
version; an error event keeps the tokens before it; llama-server's held-back tokens of a split character
are asked for again unstreamed. No Redis here: the segments go to a recorder standing in for
`SlotSegments` (`test_slot_segments` records them in a real server)."""

from __future__ import annotations

import pytest
from inference_fakes import Action, byte_tokens, close_enough, logprob_of, next_tokens, start

from streamgrp.services.inference import InferenceRollout
from streamgrp.services.inference.adapter import Retry
from streamgrp.services.inference.dialect import ProtocolError, Sampling
from streamgrp.services.inference.llamacpp import LlamaCpp
from streamgrp.services.inference.pool import ServerPool
from streamgrp.services.inference.sglang import SGLang
from streamgrp.services.inference.vllm import VLLM

PATTERN = r"@v(\d+)$"
PROMPT = [11, 12, 13]


class Recorder:
    """The adapter's side of `SlotSegments`: no durable prefix, every segment recorded in order."""

    def __init__(self) -> None:
        self.chain: list = []
        self.segments: list[tuple[list[int], list[float], int | None, str]] = []

    def record(self, ids: list[int], logprobs: list[float], version: int | None, cause: str) -> None:
        self.segments.append((list(ids), list(logprobs), version, cause))

    def shape(self) -> list[tuple[int, int | None, str]]:
        return [(len(ids), version, cause) for ids, _, version, cause in self.segments]


@pytest.fixture(params=["vllm", "vllm-old", "sglang", "sglang-incremental", "llamacpp"])
def fake(request):
    server, stop = start(request.param.removesuffix("-incremental"))
    server.incremental = request.param.endswith("-incremental")
    yield server
    stop()


def rollout(fake, *, max_tokens=20, segment_tokens=8, request_timeout_s=5.0, **kwargs) -> InferenceRollout:
    dialect = {
        "vllm": VLLM(version_pattern=PATTERN),
        "vllm-old": VLLM(token_ids="tokens_as_token_ids", version_pattern=PATTERN),
        "sglang": SGLang(version_pattern=PATTERN),
        "llamacpp": LlamaCpp(version_pattern=PATTERN),
    }[fake.dialect]
    return InferenceRollout(
        dialect,
        ServerPool([fake.url]),
        Sampling(max_tokens=max_tokens, model="policy"),
        lambda prompt, ids, text: 1.0,
        retry=Retry(3, 0.01, 0.05),
        request_timeout_s=request_timeout_s,
        segment_tokens=segment_tokens,
        **kwargs,
    )


def test_a_streamed_generation_is_one_request_cut_into_segments_with_the_servers_logprobs(fake):
    segments = Recorder()
    completion = rollout(fake).complete(PROMPT, slot=segments)
    expected = next_tokens(PROMPT, 20)
    assert completion.token_ids == expected and close_enough(completion.logprobs, [logprob_of(t) for t in expected])
    assert [
        (body["stream"], body.get("max_tokens") or body.get("n_predict") or body["sampling_params"]["max_new_tokens"])
        for body in fake.generations()
    ] == [(True, 20)]
    assert segments.shape() == [(8, None, "chunk"), (8, None, "chunk"), (4, None, "length")]
    assert [t for ids, *_ in segments.segments for t in ids] == expected  # the segments are the completion, in order
    assert completion.finish == "length" and completion.streams == 1 and len(fake.generated) == 20


def test_a_segment_is_also_cut_after_segment_s_seconds(fake):
    fake.then(Action(token_delay=0.05))
    segments = Recorder()
    rollout(fake, max_tokens=6, segment_tokens=1000, segment_s=0.12).complete(PROMPT, slot=segments)
    sizes = [size for size, _, _ in segments.shape()]
    assert sum(sizes) == 6 and len(sizes) >= 2 and segments.shape()[-1][2] == "length"


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_the_last_segment_carries_the_end_even_when_the_tokens_fill_whole_segments(fake, finish):
    fake.then(Action(tokens=16, finish=finish))
    segments = Recorder()
    completion = rollout(fake, max_tokens=16 if finish == "length" else 20).complete(PROMPT, slot=segments)
    assert segments.shape() == [(8, None, "chunk"), (8, None, finish)] and completion.finish == finish


def test_an_abort_keeps_its_streamed_tokens_and_is_resubmitted_under_the_new_version(fake):
    if fake.dialect == "llamacpp":
        pytest.skip("llama-server has no abort reply: a restart breaks the stream (the next test)")
    fake.then(Action("abort", tokens=5, version=1))
    fake.default = Action(version=2)
    segments = Recorder()
    completion = rollout(fake).complete(PROMPT, slot=segments)
    first = next_tokens(PROMPT, 5)
    assert completion.token_ids == first + next_tokens(PROMPT + first, 15)
    assert segments.shape() == [(5, 1, "abort"), (8, 2, "chunk"), (7, 2, "length")]
    assert completion.versions == [1, 2] and completion.resubmits == 1 and len(fake.generated) == 20
    assert [body[_prompt_field(fake)] for body in fake.generations()] == [PROMPT, PROMPT + first]


def test_a_stream_broken_by_a_restart_keeps_what_it_streamed_and_goes_on_from_it_on_the_new_weights(fake):
    """A weight sync restarting the server mid-stream: the 5 tokens streamed are a segment of the old version;
    the restart is waited through; the rest streams from prompt + those 5 on the new version; no token is
    generated twice."""
    fake.model = "smollm2@v1"
    fake.then(Action(cut_after=5, seconds=0.3, version=1, model="smollm2@v1", model_after="smollm2@v2"))
    fake.default = Action(version=2, model="smollm2@v2")
    segments = Recorder()
    completion = rollout(fake).complete(PROMPT, slot=segments)
    first = next_tokens(PROMPT, 5)
    assert completion.token_ids == first + next_tokens(PROMPT + first, 15)
    assert segments.shape() == [(5, 1, "abort"), (8, 2, "chunk"), (7, 2, "length")]
    assert completion.versions == [1, 2] and completion.interrupted == 1 and completion.resubmits == 0
    assert len(fake.generated) == 20  # nothing streamed before the restart was generated again
    assert [body[_prompt_field(fake)] for body in fake.generations()] == [PROMPT, PROMPT + first]
    assert [path for path, _ in fake.requests].count("/health") >= 2  # the restart was waited through


def test_an_error_event_mid_stream_keeps_the_tokens_before_it(fake):
    fake.then(Action(error_after=3))
    segments = Recorder()
    completion = rollout(fake, max_tokens=10).complete(PROMPT, slot=segments)
    first = next_tokens(PROMPT, 3)
    assert completion.token_ids == first + next_tokens(PROMPT + first, 7)
    assert segments.shape() == [(3, None, "abort"), (7, None, "length")] and completion.interrupted == 1


def test_a_stream_longer_than_the_request_deadline_keeps_its_tokens_and_goes_on_in_a_new_one(fake):
    fake.then(Action(token_delay=0.3))
    segments = Recorder()
    completion = rollout(fake, max_tokens=10, request_timeout_s=1.0).complete(PROMPT, slot=segments)
    kept = segments.shape()[0][0]
    assert 1 <= kept <= 4 and segments.shape()[0][2] == "abort" and completion.interrupted == 1
    first = next_tokens(PROMPT, kept)
    assert completion.token_ids == first + next_tokens(PROMPT + first, 10 - kept)


def test_a_stream_that_breaks_before_its_first_token_is_retried_like_any_request(fake):
    fake.then(Action("close"), Action(cut_after=0))
    segments = Recorder()
    completion = rollout(fake, max_tokens=10).complete(PROMPT, slot=segments)
    assert completion.token_ids == next_tokens(PROMPT, 10) and segments.shape() == [
        (8, None, "chunk"),
        (2, None, "length"),
    ]
    assert completion.attempts == 3 and completion.interrupted == 0


def test_more_streamed_tokens_than_asked_fail_the_slot(fake):
    fake.then(Action(over=2))
    with pytest.raises(ProtocolError, match="has 21 tokens, more than the 20 the request allowed"):
        rollout(fake).complete(PROMPT, slot=Recorder())


def test_an_unfinite_streamed_logprob_fails_the_slot(fake):
    fake.then(Action(logprob=1e308))
    with pytest.raises(ProtocolError, match=r"completion token 0 is .*not a finite float32"):
        rollout(fake).complete(PROMPT, slot=Recorder())


def _prompt_field(fake) -> str:
    return "input_ids" if fake.dialect == "sglang" else "prompt"


@pytest.fixture
def fake_llama():
    server, stop = start("llamacpp")
    yield server
    stop()


def test_llama_cpp_tokens_held_back_from_the_stream_are_asked_for_unstreamed(fake_llama):
    """llama-server streams nothing for a token that leaves a character cut, so the stream cannot give the ids
    of 中's first two bytes: the tokens before them are kept, the rest is asked for without streaming (whose
    reply lists every id; the held-back ones are scored again), then streaming goes on."""
    fake_llama.then(Action(text="ab中c"), Action(text="中c"))
    segments = Recorder()
    completion = rollout(fake_llama, max_tokens=8, segment_tokens=4).complete(PROMPT, slot=segments)
    ab = byte_tokens("ab")
    rest = next_tokens(PROMPT + ab + byte_tokens("中c"), 2)
    assert completion.token_ids == ab + byte_tokens("中c") + rest
    assert close_enough(completion.logprobs, [logprob_of(t) for t in completion.token_ids])
    assert segments.shape() == [(2, None, "chunk"), (4, None, "chunk"), (2, None, "length")]
    assert completion.unstreamed == 1 and completion.rescored == 2 and completion.streams == 2
    streamed = [bool(body.get("stream")) for body in fake_llama.generations()]
    assert streamed == [True, False, True]


def test_llama_cpp_a_tail_held_back_at_the_end_of_a_stream_is_asked_for_unstreamed(fake_llama):
    fake_llama.then(Action(text="ab中"), Action(text="中"))
    segments = Recorder()
    completion = rollout(fake_llama, max_tokens=5, segment_tokens=4).complete(PROMPT, slot=segments)
    assert completion.token_ids == byte_tokens("ab中") and completion.finish == "length"
    assert segments.shape() == [(2, None, "chunk"), (3, None, "length")] and completion.unstreamed == 1


def test_llama_cpp_the_version_of_a_segment_cut_mid_stream_is_the_served_models(fake_llama):
    fake_llama.model = "smollm2@v7"
    fake_llama.default = Action(model="smollm2@v7")
    segments = Recorder()
    completion = rollout(fake_llama, max_tokens=12).complete(PROMPT, slot=segments)
    assert segments.shape() == [(8, 7, "chunk"), (4, 7, "length")] and completion.versions == [7]
    assert [path for path, _ in fake_llama.requests].count("/v1/models") == 1
