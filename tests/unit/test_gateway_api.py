"""The gateway's OpenAI shapes (`openai_api`), tool-call parsing (`tool_calls`) and a session's continuation and
retry rules (`live`), without a server: replies are checked against the official ``openai`` client's own types."""

from __future__ import annotations

import asyncio

import openai.types.chat as chat_types
import orjson
import pytest
from openai import types

from streamgrp.core.events import RawArray, TurnRecorded
from streamgrp.services.gateway.live import LiveSession, LiveTurn, text_digest
from streamgrp.services.gateway.openai_api import (
    Answer,
    RequestError,
    chat_chunks,
    chat_reply,
    completion_chunks,
    completion_reply,
    parse_chat,
    parse_completion,
)
from streamgrp.services.gateway.tool_calls import parse_tool_calls

CALL = '<tool_call>\n{"name": "calc", "arguments": {"x": "2+2"}}\n</tool_call>'


def _answer(**changes) -> Answer:
    values = {
        "reply_id": "chatcmpl-p0-0123456789abcdef-1",
        "created": 1,
        "model": "policy",
        "text": "Hello",
        "content": "Hello",
        "tool_calls": [],
        "finish": "stop",
        "prompt_ids": [1, 2, 3],
        "completion_ids": [4, 5],
        "logprobs": [-0.5, -0.25],
    }
    return Answer(**{**values, **changes})


def test_replies_are_what_the_openai_client_parses():
    content, calls = parse_tool_calls(f"Let me see. {CALL}", "hermes", call_prefix="call_x_1")
    answer = _answer(text=f"Let me see. {CALL}", content=content, tool_calls=calls)
    report = parse_chat(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
    ).report
    reply = chat_types.ChatCompletion.model_validate(chat_reply(answer, report))
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content == "Let me see."
    assert reply.choices[0].message.tool_calls[0].id == "call_x_1_0"
    assert orjson.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"x": "2+2"}
    assert [e.token for e in reply.choices[0].logprobs.content] == ["token_id:4", "token_id:5"]
    assert reply.usage.total_tokens == 5 and reply.model_extra["prompt_token_ids"] == [1, 2, 3]
    chunks = [chat_types.ChatCompletionChunk.model_validate(c) for c in chat_chunks(answer, report)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Let me see."
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [call[0].function.name for call in calls] == ["calc"]
    assert chunks[-1].usage.completion_tokens == 2 and chunks[-2].choices[0].finish_reason == "tool_calls"
    text = parse_completion({"prompt": "x", "logprobs": 0})
    done = types.Completion.model_validate(completion_reply(_answer(), text.report))
    assert done.choices[0].text == "Hello" and done.choices[0].logprobs.token_logprobs == [-0.5, -0.25]
    streamed = completion_chunks(_answer(), text.report)  # as OpenAI streams: finish_reason null until the last
    assert [c["choices"][0]["text"] for c in streamed] == ["Hello", ""]
    assert types.Completion.model_validate(streamed[-1]).choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"messages": []}, "non-empty"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n must be 1"),
        ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, "another distribution"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1}}, "another distribution"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "at least 1"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "a number"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop must be"),
    ],
)
def test_a_chat_request_a_session_cannot_honour_is_refused_saying_why(body, match):
    with pytest.raises(RequestError, match=match):
        parse_chat(body)


def test_requests_are_read_as_one_turn_needs_them():
    request = parse_chat(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            ],
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "stop": "END",
            "temperature": 0.5,
            "presence_penalty": 0,
            "tools": [{"type": "function"}],
        }
    )
    assert request.messages[0]["content"] == "ab" and request.messages[1]["content"] is None
    assert (request.sampled.max_tokens, request.sampled.stop, request.sampled.temperature) == (7, ("END",), 0.5)
    assert parse_completion({"prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]
    for bad in ({"prompt": ""}, {"prompt": ["a", "b"]}, {"prompt": "x", "echo": True}, {"prompt": "x", "best_of": 2}):
        with pytest.raises(RequestError):
            parse_completion(bad)


def test_tool_calls_are_parsed_only_where_the_format_holds_one():
    assert parse_tool_calls(f"a {CALL} b {CALL}", "hermes", call_prefix="c") == (
        "a  b",
        [
            {"id": f"c_{i}", "type": "function", "function": {"name": "calc", "arguments": '{"x":"2+2"}'}}
            for i in range(2)
        ],
    )
    assert parse_tool_calls(CALL, "hermes", call_prefix="c")[0] is None  # only calls: no content
    assert parse_tool_calls(CALL, "none", call_prefix="c") == (CALL, [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken, "hermes", call_prefix="c") == (broken, [])


def _session(*texts: str) -> LiveSession:
    session = LiveSession(
        session_id="p0-0123456789abcdef",
        task_id="t",
        slot=0,
        task_entry="1-0",
        deadline=None,
        version=0,
        status="open",
        key_digest="",
    )
    for number, text in enumerate(texts, start=1):
        turn = LiveTurn(
            number=number,
            prompt_ids=[number],
            completion_ids=[number + 100],
            logprobs=[-1.0],
            version=0,
            finish="stop",
            text=text,
            endpoint="chat",
            model="m",
            tools=True,
        )
        turn.answer_from_text(session.session_id, "hermes")
        session.turns.append(turn)
    return session


def test_the_assistant_message_sent_back_is_rendered_as_the_text_that_was_generated():
    session = _session(f"Let me see. {CALL}")
    returned = {"role": "assistant", "content": session.turns[0].content, "tool_calls": session.turns[0].tool_calls}
    rewritten = session.with_own_words([{"role": "user", "content": "q"}, returned, {"role": "tool", "content": "4"}])
    assert rewritten[1] == {"role": "assistant", "content": f"Let me see. {CALL}"}
    edited = {**returned, "content": "I changed it."}
    assert session.with_own_words([edited])[0] is edited  # not what the gateway returned: rendered as sent


def test_a_prompt_continues_the_newest_turn_whose_prompt_and_completion_it_begins_with():
    session = _session("one", "two")
    session.turns[0].prefix_chars, session.turns[0].prefix_digest = 5, text_digest("P1+C1")
    session.turns[1].prefix_chars, session.turns[1].prefix_digest = 11, text_digest("P1+C1+P2+C2")
    assert session.continued("P1+C1+P2+C2 and more").number == 2
    assert session.continued("P1+C1 and else").number == 1
    assert session.continued("P1+X") is None


def test_only_a_retry_of_the_last_turn_is_answered_from_its_record():
    session = _session("a", "b")
    session.turns[1].idempotency = "k1"
    assert session.replayable([2], retried=True, idempotency="").number == 2
    assert session.replayable([2], retried=False, idempotency="k1").number == 2
    assert session.replayable([2], retried=False, idempotency="") is None  # asked again on purpose: a new turn
    assert session.replayable([1], retried=True, idempotency="") is None  # not the last turn's prompt


def test_a_session_read_back_from_its_events_answers_as_before():
    event = TurnRecorded(
        session="p0-0123456789abcdef",
        task_id="t",
        slot=0,
        turn=1,
        prompt_ids=RawArray.from_values([1, 2], "int32"),
        completion_ids=RawArray.from_values([3], "int32"),
        logprobs=RawArray.from_values([-0.5], "float32"),
        version=4,
        finish="stop",
        meta={
            "text": f"x {CALL}",
            "endpoint": "chat",
            "tools": True,
            "prefix_chars": 9,
            "prefix_digest": "d",
            "idempotency": "k",
        },
    )
    turn = LiveTurn.of(event, "hermes")
    assert (turn.prompt_ids, turn.completion_ids, turn.logprobs, turn.version) == ((1, 2), (3,), (-0.5,), 4)
    assert turn.content == "x" and turn.tool_calls[0]["id"] == "call_89abcdef_1_0"
    assert (turn.prefix_chars, turn.prefix_digest, turn.idempotency) == (9, "d", "k")


def test_a_session_lock_serializes_its_turns():
    session = _session()
    order: list[str] = []

    async def turn(name: str) -> None:
        async with session.lock:
            order.append(f"{name} in")
            await asyncio.sleep(0.01)
            order.append(f"{name} out")

    async def both() -> None:
        await asyncio.gather(turn("a"), turn("b"))

    asyncio.run(both())
    assert order == ["a in", "a out", "b in", "b out"]


def test_a_hugging_face_tokenizer_renders_and_tokenizes_as_vllm_and_sglang_servers_do(monkeypatch):
    """`TokenizerTemplate` (vLLM, SGLang): the model's own chat template with the tools, a whole prompt with the
    tokenizer's special tokens and a continuation without, and completion text with special tokens kept."""
    import sys
    import types as modules

    from streamgrp.services.gateway.templates import TokenizerTemplate

    calls: list[tuple] = []

    class Tokenizer:
        def apply_chat_template(self, messages, **options):
            calls.append(("render", len(messages), options))
            return "<s>rendered"

        def encode(self, text, add_special_tokens):
            calls.append(("encode", text, add_special_tokens))
            return [7, 8]

        def decode(self, ids, **options):
            calls.append(("decode", ids, options))
            return "text</s>"

    fake = modules.ModuleType("transformers")
    fake.AutoTokenizer = type("AutoTokenizer", (), {"from_pretrained": staticmethod(lambda name: Tokenizer())})
    monkeypatch.setitem(sys.modules, "transformers", fake)
    template = TokenizerTemplate("org/model")

    async def use() -> tuple:
        return (
            await template.render([{"role": "user", "content": "x"}], [{"type": "function"}], None, {"k": 1}),
            await template.tokenize("a", special=True),
            await template.tokenize("b", special=False),
            await template.detokenize([1, 2]),
        )

    assert asyncio.run(use()) == ("<s>rendered", [7, 8], [7, 8], "text</s>")
    assert calls == [
        ("render", 1, {"tools": [{"type": "function"}], "tokenize": False, "add_generation_prompt": True, "k": 1}),
        ("encode", "a", True),
        ("encode", "b", False),
        ("decode", [1, 2], {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}),
    ]
