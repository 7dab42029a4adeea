"""vLLM's OpenAI-compatible completions, token ids in and out.

Request: ``POST /v1/completions`` with the prompt as a list of token ids, ``logprobs: 0`` (the
sampled token's log-probability only) and either ``return_token_ids: true`` (vLLM >= 0.10.2: the
choice carries ``token_ids``) or ``return_tokens_as_token_ids: true`` (older: each entry of
``logprobs.tokens`` is a ``"token_id:N"`` string). Reply: ``choices[0]`` with ``text``,
``logprobs.token_logprobs`` (one per generated id, a byte token of a split character too; vLLM
clamps -inf to -9999.0) and ``finish_reason`` (``stop``, ``length``, or ``abort`` when the
server aborted the request, e.g. ``POST /pause?mode=abort`` before a weight update).

Streaming (``stream: true``; vllm/entrypoints/openai/completion/serving.py,
``completion_stream_generator``): each ``data:`` event is a ``text_completion`` chunk whose
``choices[0]`` holds only what is new: ``text``, ``logprobs.token_logprobs`` and ``token_ids`` (or
``logprobs.tokens`` as ``"token_id:N"``) of the tokens generated since the last event, and
``finish_reason`` (null until the last; ``abort`` on an abort, its tokens so far streamed already);
every event names the ``model``; a usage chunk has no choices; ``data: [DONE]`` ends the stream and an
error mid-stream comes as ``data: {"error": {...}}``.

vLLM reports no weight version with a completion, so the version comes from the served model name
(``--served-model-name policy@v12`` with the adapter's ``--version-pattern``) or, failing that, is
the run's version when the request started.

Weight loading (`load_weights`) uses vLLM's RL endpoints, served with ``VLLM_SERVER_DEV_MODE=1``:
``/pause?mode=abort``, ``/collective_rpc`` calling ``reload_weights`` on the new directory,
``/update_weight_version``, then ``/resume`` (also when loading failed, so the server never stays paused).
"""

from __future__ import annotations

from typing import Any

from streamgrp.services.inference.dialect import (
    Delta,
    Dialect,
    Finish,
    Generation,
    ProtocolError,
    Sampling,
    StreamParser,
    check_lengths,
    float_list,
    stream_error,
    token_list,
    version_from,
)
from streamgrp.services.inference.http import request_json

FINISH: dict[str | None, Finish] = {"stop": "stop", "length": "length", "abort": "abort", None: "stop"}


class VLLM(Dialect):
    name = "vllm"
    reserved = frozenset(
        {
            "prompt",
            "max_tokens",
            "max_completion_tokens",
            "logprobs",
            "n",
            "best_of",
            "echo",
            "stream",
            "use_beam_search",
            "return_token_ids",
            "return_tokens_as_token_ids",
        }
    )

    def __init__(self, *, token_ids: str = "return_token_ids", version_pattern: str | None = None) -> None:
        self.token_ids = token_ids
        self.version_pattern = version_pattern

    def generate(self, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "prompt": prompt_ids,
            "max_tokens": sampling.max_tokens,
            "n": 1,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
        }
        if sampling.model:
            body["model"] = sampling.model
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        body["return_token_ids" if self.token_ids == "return_token_ids" else "return_tokens_as_token_ids"] = True
        return "/v1/completions", {**body, **(sampling.extra or {})}

    def parse(self, body: Any) -> Generation:
        choice = self._choice(body)
        ids, values = self._values(choice)
        finish = choice.get("finish_reason")
        if finish not in FINISH:
            raise ProtocolError(f"vLLM finish_reason {finish!r} is not one of stop, length, abort")
        model = str(body.get("model", ""))
        return Generation(
            ids,
            values,
            str(choice.get("text", "")),
            FINISH[finish],
            reason=str(choice.get("stop_reason") or ""),
            model=model,
            weight_version=self._version(model),
        )

    def stream_generate(self, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict[str, Any]] | None:
        path, body = self.generate(prompt_ids, sampling)
        return path, {**body, "stream": True}

    def stream_parser(self) -> StreamParser:
        return _Stream(self)

    def _version(self, model: str) -> int | None:
        return version_from(model, self.version_pattern) if self.version_pattern else None

    @staticmethod
    def _choice(body: Any) -> dict[str, Any]:
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ProtocolError(f"vLLM reply has no choices: {str(body)[:200]}")
        return choices[0]

    def _values(self, choice: dict[str, Any]) -> tuple[list[int], list[float]]:
        logprobs = choice.get("logprobs")
        if not isinstance(logprobs, dict):
            raise ProtocolError(
                "vLLM reply has no logprobs; the request asks for logprobs: 0, so this server ignores it (is it vLLM?)"
            )
        values = float_list(logprobs.get("token_logprobs"), "vLLM logprobs.token_logprobs")
        if self.token_ids == "return_token_ids":
            if choice.get("token_ids") is None:
                raise ProtocolError(
                    "vLLM reply has no token_ids: this vLLM predates return_token_ids (0.10.2); "
                    "use --vllm-token-ids tokens_as_token_ids"
                )
            ids = token_list(choice["token_ids"], "vLLM choices[0].token_ids")
        else:
            ids = [_token_id(token) for token in logprobs.get("tokens") or []]
        check_lengths(ids, values, "vLLM reply")
        return ids, values

    def tokenize(self, prompt: dict[str, Any], model: str | None) -> tuple[str, dict[str, Any]] | None:
        body: dict[str, Any] = {"model": model} if model else {}
        if isinstance(prompt.get("messages"), list):
            return "/tokenize", {**body, "messages": prompt["messages"], "add_generation_prompt": True}
        if isinstance(prompt.get("text"), str):
            return "/tokenize", {**body, "prompt": prompt["text"]}
        return None

    def load_weights(self, url: str, path: str, version: int, *, timeout_s: float) -> str:
        request_json("POST", f"{url}/pause?mode=abort", {}, timeout_s=timeout_s)
        try:
            request_json(
                "POST",
                f"{url}/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": path}},
                timeout_s=timeout_s,
            )
            request_json("POST", f"{url}/update_weight_version", {"new_version": str(version)}, timeout_s=timeout_s)
        finally:
            request_json("POST", f"{url}/resume", {}, timeout_s=timeout_s)
        return f"reloaded {path} as weight version {version}"


class _Stream(StreamParser):
    """vLLM's completion chunks: each holds only the tokens new since the last (see the module docstring)."""

    def __init__(self, dialect: VLLM) -> None:
        self.dialect = dialect

    def feed(self, event: Any) -> Delta:
        stream_error(event, "vLLM")
        if isinstance(event, dict) and event.get("choices") == []:
            return Delta([], [])  # the usage chunk
        choice = self.dialect._choice(event)
        finish = choice.get("finish_reason")
        if finish is not None and finish not in FINISH:
            raise ProtocolError(f"vLLM finish_reason {finish!r} is not one of stop, length, abort")
        # a chunk without tokens (the finish alone) may come without logprobs; one with tokens or text may not
        empty = choice.get("logprobs") is None and not choice.get("token_ids") and not choice.get("text")
        ids, values = ([], []) if empty else self.dialect._values(choice)
        model = str(event.get("model", ""))
        return Delta(
            ids,
            values,
            str(choice.get("text") or ""),
            None if finish is None else FINISH[finish],
            reason=str(choice.get("stop_reason") or ""),
            model=model,
            weight_version=self.dialect._version(model),
        )


def _token_id(token: Any) -> int:
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    raise ProtocolError(
        f"vLLM token {str(token)[:50]!r} is not 'token_id:N': the server ignored "
        "return_tokens_as_token_ids; newer vLLM: use --vllm-token-ids return_token_ids"
    )
