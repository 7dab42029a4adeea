"""The chat templates that turn a session's messages into token ids the way the model's server does.

A `ChatTemplate` renders messages to text and tokenizes it the way the model's server does:
`ServerTemplate` asks llama-server itself (``/apply-template``, ``/tokenize`` with special tokens parsed,
``/detokenize``, the last one for one special token at most once); `TokenizerTemplate` uses the model's
Hugging Face tokenizer (for vLLM and SGLang, which have no template endpoint) on a thread. Generating
from the ids is `streamgrp.services.gateway.upstream`'s.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import orjson

from streamgrp.errors import ConfigError
from streamgrp.services.inference.adapter import Completion
from streamgrp.services.inference.dialect import ProtocolError
from streamgrp.services.inference.retries import REPLY_BASE_BYTES

if TYPE_CHECKING:
    from streamgrp.services.gateway.upstream import Upstream


class ChatTemplate(ABC):
    """Messages to text, text to token ids and back, as the model's server does it."""

    @abstractmethod
    async def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        tool_choice: Any,
        extra: dict[str, Any],
    ) -> str:
        """The conversation as the chat template writes it, ending with the assistant's generation prompt."""

    @abstractmethod
    async def tokenize(self, text: str, *, special: bool) -> list[int]:
        """``text``'s ids, special tokens written in it parsed as such; ``special`` adds the tokenizer's own
        (a BOS) as a whole prompt gets them, which a continuation does not."""

    @abstractmethod
    async def detokenize(self, ids: list[int]) -> str:
        """The exact text ``ids`` stand for, special tokens included."""

    async def completion_text(self, completion: Completion) -> str:
        """The exact text of a completion's ids (its reply's text lacks the stop token's)."""
        return await self.detokenize(completion.token_ids)

    async def close(self) -> None:  # noqa: B027 - an optional hook: a template that holds nothing keeps it
        """Release what the template holds (connections)."""


class ServerTemplate(ChatTemplate):
    """llama-server's own template and tokenizer, through its endpoints."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self._pieces: dict[int, str] = {}

    async def _post(self, path: str, body: dict[str, Any], max_bytes: int) -> Any:
        return (await self.upstream.requests.post(path, body, max_bytes=max_bytes))[0]

    async def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        tool_choice: Any,
        extra: dict[str, Any],
    ) -> str:
        body: dict[str, Any] = {"messages": messages}
        if tools:
            body["tools"] = tools
            if tool_choice is not None:
                body["tool_choice"] = tool_choice
        if extra:
            body["chat_template_kwargs"] = extra
        reply = await self._post("/apply-template", body, 2 * len(orjson.dumps(body)) + REPLY_BASE_BYTES)
        if not isinstance(reply, dict) or not isinstance(reply.get("prompt"), str):
            raise ProtocolError(f"/apply-template reply has no prompt text: {str(reply)[:200]}")
        return reply["prompt"]

    async def tokenize(self, text: str, *, special: bool) -> list[int]:
        reply = await self._post(
            "/tokenize",
            {"content": text, "add_special": special, "parse_special": True},
            REPLY_BASE_BYTES + 16 * len(text),
        )
        return self.upstream.dialect.parse_tokens(reply)

    async def detokenize(self, ids: list[int]) -> str:
        reply = await self._post("/detokenize", {"tokens": ids}, REPLY_BASE_BYTES + 1024 * len(ids))
        if not isinstance(reply, dict) or not isinstance(reply.get("content"), str):
            raise ProtocolError(f"/detokenize reply has no content: {str(reply)[:200]}")
        return reply["content"]

    async def completion_text(self, completion: Completion) -> str:
        # llama-server's text of a completion that ended at end-of-generation is every id's but that last
        # token's (its piece, a special token, is asked once); anything else is asked for whole.
        if completion.finish == "stop" and not completion.reason and not completion.resubmits and completion.token_ids:
            last = completion.token_ids[-1]
            if last not in self._pieces:
                self._pieces[last] = await self.detokenize([last])
            return completion.text + self._pieces[last]
        return await self.detokenize(completion.token_ids)

    async def close(self) -> None:
        await self.upstream.requests.close()


class TokenizerTemplate(ChatTemplate):
    """A Hugging Face tokenizer's chat template (``transformers``, imported when one is made), on a thread."""

    def __init__(self, name_or_path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError("--tokenizer needs transformers: pip install 'streamgrp[llm]'") from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a bad path
            raise ConfigError(f"--tokenizer {name_or_path!r} could not be loaded: {exc}") from None

    async def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        tool_choice: Any,
        extra: dict[str, Any],
    ) -> str:
        # transformers' hints: ``tools`` is a list of one item type (a list's item type is invariant) and the
        # overloads keyed by ``tokenize`` do not pass through to_thread's ParamSpec.
        return await asyncio.to_thread(
            self.tokenizer.apply_chat_template,  # type: ignore[arg-type]
            messages,
            tools=tools,  # type: ignore[arg-type]
            tokenize=False,
            add_generation_prompt=True,
            **extra,
        )

    async def tokenize(self, text: str, *, special: bool) -> list[int]:
        return list(await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=special))

    async def detokenize(self, ids: list[int]) -> str:
        # transformers' hint for decode's ``**kwargs`` does not pass through to_thread's ParamSpec.
        return await asyncio.to_thread(
            self.tokenizer.decode,  # type: ignore[arg-type]
            ids,
            skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )


def make_template(upstream: Upstream, tokenizer: str | None) -> ChatTemplate:
    """The template for ``upstream``: the tokenizer given, else llama-server's own; vLLM and SGLang need one."""
    if tokenizer:
        return TokenizerTemplate(tokenizer)
    if upstream.dialect.name != "llamacpp":
        raise ConfigError(
            f"the {upstream.dialect.name} server has no chat template endpoint: give --tokenizer (the "
            "model's Hugging Face tokenizer directory or name) so the gateway renders and tokenizes "
            "conversations as the server would"
        )
    return ServerTemplate(upstream)
