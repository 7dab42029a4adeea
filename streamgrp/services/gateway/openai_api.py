"""OpenAI's request and reply shapes for the gateway: ``/v1/chat/completions`` and ``/v1/completions``.

Owns reading a request body into what one turn needs (`ChatRequest`, `CompletionRequest`: messages or
prompt, tools, sampling, streaming, what to report) and writing a turn back as OpenAI's reply, whole or
as server-sent chunks, and errors as OpenAI's error object. Refuses, with a 400 that says why, what a
session cannot honour: more than one choice (a session is one trajectory), penalties and logit biases
(they would make the sampled tokens come from another distribution than the recorded log-probabilities),
``echo``/``suffix``/``best_of``, and non-text message parts.

A streamed answer is generated first and then sent as chunks (its content in one), because the turn
is recorded before any of it is sent: a client never holds an answer the run could lose. Log-probability
entries name tokens as ``token_id:N`` (vLLM's convention), since the gateway works in ids; with vLLM's
``return_token_ids`` a reply also carries ``prompt_token_ids`` and each choice's ``token_ids``.
Pure: no I/O, no clock (``created`` is given).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
#: Sampling fields a session refuses when set to anything but their neutral value.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}
MAX_STOP = 16


class RequestError(ValueError):
    """A request the gateway cannot serve as asked; ``param`` names the field (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Sampled:
    """The sampling a turn asks for (unset: the gateway's defaults)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Report:
    """What the reply carries besides the answer."""

    model: str = ""
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    token_ids: bool = False


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    sampled: Sampled
    report: Report
    extra_template: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    sampled: Sampled
    report: Report


def parse_chat(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools must be a list of objects", "tools")
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    return ChatRequest(
        [_message(m, i) for i, m in enumerate(messages)],
        tools or None,
        body.get("tool_choice"),
        _sampled(body, "max_completion_tokens"),
        _report(body, chat=True),
        extra or {},
    )


def parse_completion(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name in ("echo", "suffix"):
        if body.get(name):
            raise RequestError(f"{name} is not supported: a session records what was generated, nothing else", name)
    if body.get("best_of") not in (None, 1):
        raise RequestError("best_of must be 1: a session is one trajectory", "best_of")
    return CompletionRequest(_prompt(body.get("prompt")), _sampled(body, None), _report(body, chat=False))


def _message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(f"{where} must be an object with a role of {', '.join(sorted(ROLES))}", where)
    out = {k: v for k, v in message.items() if v is not None}
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content: only text parts are supported", where)
            texts.append(part["text"])
        out["content"] = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string, a list of text parts or null", where)
    elif content is None and message.get("role") == "assistant":
        out["content"] = None if message.get("tool_calls") else ""
    elif content is None:
        raise RequestError(f"{where}.content is missing", where)
    return out


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return prompt
    raise RequestError(
        "prompt must be a non-empty string or list of token ids (one prompt: a session is one trajectory)", "prompt"
    )


def _sampled(body: dict[str, Any], alias: str | None) -> Sampled:
    if body.get("n") not in (None, 1):
        raise RequestError("n must be 1: a session is one trajectory; open one session per sample", "n")
    for name, neutral in _NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            raise RequestError(
                f"{name} is not supported: it would sample tokens from another distribution than "
                "the log-probabilities the turn records",
                name,
            )
    if body.get("logit_bias"):
        raise RequestError(
            "logit_bias is not supported: it would sample tokens from another distribution than the "
            "log-probabilities the turn records",
            "logit_bias",
        )
    max_tokens = body.get(alias) if alias and body.get(alias) is not None else body.get("max_tokens")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOP} non-empty strings", "stop")
    return Sampled(
        max_tokens=_number(max_tokens, "max_tokens", int, 1),
        temperature=_number(body.get("temperature"), "temperature", float, 0.0),
        top_p=_number(body.get("top_p"), "top_p", float, 0.0),
        top_k=_number(body.get("top_k"), "top_k", int, 0),
        stop=stops,
        seed=_number(body.get("seed"), "seed", int, None),
    )


def _number(value: Any, name: str, kind: type, minimum: float | None) -> Any:
    if value is None:
        return None
    if type(value) is bool or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}", name)
    if minimum is not None and value < minimum:
        raise RequestError(f"{name} must be at least {minimum}", name)
    return kind(value)


def _report(body: dict[str, Any], *, chat: bool) -> Report:
    options = body.get("stream_options")
    logprobs = body.get("logprobs")
    return Report(
        model=str(body.get("model") or ""),
        stream=bool(body.get("stream")),
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        logprobs=bool(logprobs) if chat else (logprobs is not None and logprobs is not False),
        token_ids=bool(body.get("return_token_ids")),
    )


# -- replies ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One turn's answer, whatever the endpoint: what the reply is written from."""

    reply_id: str
    created: int
    model: str
    text: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish: str
    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else self.finish

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.completion_ids),
            "total_tokens": len(self.prompt_ids) + len(self.completion_ids),
        }


def chat_reply(answer: Answer, report: Report) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": answer.finish_reason,
        "logprobs": (_chat_logprobs(answer.completion_ids, answer.logprobs) if report.logprobs else None),
    }
    reply = {
        "id": answer.reply_id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "choices": [choice],
        "usage": answer.usage(),
    }
    return _with_ids(reply, answer, report)


def chat_chunks(answer: Answer, report: Report) -> list[dict[str, Any]]:
    """The answer as ``chat.completion.chunk`` objects: the role, the content, the tool calls, the finish
    (and the usage, when ``stream_options.include_usage`` asked for it)."""
    base = chunk_base("chat", answer.reply_id, answer.created, answer.model)
    content = (
        [delta_chunk("chat", base, answer.content, answer.completion_ids, answer.logprobs, report)]
        if answer.content
        else []
    )
    return [*opening_chunks("chat", base), *content, *closing_chunks("chat", base, answer, report)]


def chunk_base(endpoint: str, reply_id: str, created: int, model: str) -> dict[str, Any]:
    """What every chunk of one streamed answer carries."""
    kind = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
    return {"id": reply_id, "object": kind, "created": created, "model": model}


def opening_chunks(endpoint: str, base: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat stream opens with the role; a completion stream with its text."""
    if endpoint != "chat":
        return []
    return [
        {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
        }
    ]


def delta_chunk(
    endpoint: str, base: dict[str, Any], text: str, token_ids: Sequence[int], logprobs: Sequence[float], report: Report
) -> dict[str, Any]:
    """One part of the generated text (with its tokens' log-probabilities when the request asked for them)."""
    if endpoint == "chat":
        values = _chat_logprobs(token_ids, logprobs) if report.logprobs else None
        return {
            **base,
            "choices": [{"index": 0, "delta": {"content": text}, "logprobs": values, "finish_reason": None}],
        }
    values = _completion_logprobs(token_ids, logprobs) if report.logprobs else None
    return {**base, "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": values}]}


def closing_chunks(endpoint: str, base: dict[str, Any], answer: Answer, report: Report) -> list[dict[str, Any]]:
    """What follows the text: the tool calls (chat), the finish, the usage when asked for."""
    chunks = []
    if endpoint == "chat":
        if answer.tool_calls:
            calls = [{"index": i, **call} for i, call in enumerate(answer.tool_calls)]
            chunks.append(
                {
                    **base,
                    "choices": [{"index": 0, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}],
                }
            )
        chunks.append(
            {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": answer.finish_reason}]}
        )
    else:
        chunks.append({**base, "choices": [{"index": 0, "text": "", "finish_reason": answer.finish, "logprobs": None}]})
    if report.include_usage:
        chunks.append({**base, "choices": [], "usage": answer.usage()})
    return chunks


def completion_reply(answer: Answer, report: Report) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": answer.text,
        "finish_reason": answer.finish,
        "logprobs": (_completion_logprobs(answer.completion_ids, answer.logprobs) if report.logprobs else None),
    }
    reply = {
        "id": answer.reply_id,
        "object": "text_completion",
        "created": answer.created,
        "model": answer.model,
        "choices": [choice],
        "usage": answer.usage(),
    }
    return _with_ids(reply, answer, report)


def completion_chunks(answer: Answer, report: Report) -> list[dict[str, Any]]:
    base = chunk_base("completions", answer.reply_id, answer.created, answer.model)
    return [
        delta_chunk("completions", base, answer.text, answer.completion_ids, answer.logprobs, report),
        *closing_chunks("completions", base, answer, report),
    ]


def _chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": f"token_id:{t}", "logprob": value, "bytes": None, "top_logprobs": []}
            for t, value in zip(token_ids, logprobs)
        ]
    }


def _completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[float]) -> dict[str, Any]:
    return {
        "tokens": [f"token_id:{t}" for t in token_ids],
        "token_logprobs": list(logprobs),
        "top_logprobs": None,
        "text_offset": None,
    }


def _with_ids(reply: dict[str, Any], answer: Answer, report: Report) -> dict[str, Any]:
    if report.token_ids:
        reply["prompt_token_ids"] = answer.prompt_ids
        reply["choices"][0]["token_ids"] = answer.completion_ids
    return reply


def error_body(message: str, kind: str, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def assistant_signature(message: Mapping[str, Any]) -> tuple[str, tuple[tuple[str, str, str], ...]]:
    """What identifies an assistant message the gateway returned: its content and its tool calls
    (id, name, arguments), however the client re-serialized them."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            return ("\0unmatched", ())
        calls.append((str(call.get("id", "")), str(function.get("name", "")), str(function.get("arguments", ""))))
    content = message.get("content")
    return (content if isinstance(content, str) else "", tuple(calls))
