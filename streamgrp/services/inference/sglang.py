"""SGLang's native ``/generate``, token ids in and out, with the weight version it serves.

Request: ``POST /generate`` with ``input_ids``, ``sampling_params`` (``max_new_tokens``,
``temperature``, ``top_p``, ``top_k``; -1 is off) and ``return_logprob: true``. Reply: ``text``,
``output_ids`` and ``meta_info``, whose ``output_token_logprobs`` holds one ``[logprob, token_id,
text-or-null]`` triple per generated token (a byte token of a split character has its own),
``finish_reason`` is ``{"type": "stop"|"length"|"abort", ...}`` (an abort carries ``message``:
``/pause_generation`` in abort mode, ``/abort_request``, or a weight update with ``abort_all_requests``),
and newer versions add ``weight_version`` (a string; ``"default"`` until a weight update sets one).

Streaming (``stream: true``; python/sglang/srt/entrypoints/http_server.py ``generate_request`` writes
``data: <out>`` per output and ``data: [DONE]`` last, an error as ``data: {"error": {"message": ...}}``;
python/sglang/srt/managers/tokenizer_manager.py builds ``out``): by default each event is cumulative
(``output_ids`` and ``meta_info.output_token_logprobs`` of every token so far; ``text`` may be null
until the last), with ``--incremental-streaming-output`` only what is new. Either way
``meta_info.completion_tokens`` counts every token so far, so the new ones are the last
``completion_tokens - seen`` entries: the parser needs no flag. ``finish_reason`` is null until the
last event; ``weight_version`` is in every one.

Weight loading: ``POST /update_weights_from_disk`` with ``model_path`` and ``weight_version``; in-flight
requests are aborted (they come back as aborts with their tokens so far, which the adapter resubmits).
"""

from __future__ import annotations

from typing import Any

from streamgrp.errors import ConfigError
from streamgrp.services.inference.dialect import (
    Delta,
    Dialect,
    Finish,
    Generation,
    InferenceError,
    ProtocolError,
    Sampling,
    StreamParser,
    check_lengths,
    stream_error,
    token_list,
    version_from,
)
from streamgrp.services.inference.http import request_json


class SGLang(Dialect):
    name = "sglang"
    reserved = frozenset({"input_ids", "text", "return_logprob", "stream"})
    #: Inside ``sampling_params``: the length is --max-tokens, and one sample per request.
    reserved_sampling = frozenset({"max_new_tokens", "n"})

    def __init__(self, *, version_pattern: str | None = None) -> None:
        self.version_pattern = version_pattern

    def check_extra(self, extra: dict[str, Any] | None) -> None:
        super().check_extra(extra)
        nested = (extra or {}).get("sampling_params")
        clash = sorted(set(nested) & self.reserved_sampling) if isinstance(nested, dict) else []
        if clash:
            raise ConfigError(
                f"--sampling sets sampling_params {', '.join(clash)}, which the sglang adapter sets "
                "itself; remove it (the length is --max-tokens)"
            )

    def generate(self, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict[str, Any]]:
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1,
        }
        extra = dict(sampling.extra or {})
        params.update(extra.pop("sampling_params", {}))
        body: dict[str, Any] = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True}
        if sampling.model:
            body["model"] = sampling.model
        return "/generate", {**body, **extra}

    def parse(self, body: Any) -> Generation:
        if isinstance(body, list) and len(body) == 1:
            body = body[0]  # a batch of one
        meta = _meta(body)
        ids, values = _triples(meta)
        if body.get("output_ids") is not None and token_list(body["output_ids"], "SGLang output_ids") != ids:
            raise ProtocolError("SGLang output_ids differ from the ids in output_token_logprobs")
        check_lengths(ids, values, "SGLang reply")
        finish, reason = _finish(meta.get("finish_reason"))
        model, version = self._model(body, meta)
        return Generation(
            ids, values, str(body.get("text", "")), finish, reason=reason, weight_version=version, model=model
        )

    def stream_generate(self, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict[str, Any]] | None:
        path, body = self.generate(prompt_ids, sampling)
        return path, {**body, "stream": True}

    def stream_parser(self) -> StreamParser:
        return _Stream(self)

    def _model(self, body: dict[str, Any], meta: dict[str, Any]) -> tuple[str, int | None]:
        version = version_from(meta.get("weight_version"))
        model = str(body.get("model", meta.get("model", "")) or "")
        if version is None and self.version_pattern:
            version = version_from(model, self.version_pattern)
        return model, version

    def tokenize(self, prompt: dict[str, Any], model: str | None) -> tuple[str, dict[str, Any]] | None:
        if isinstance(prompt.get("text"), str):
            return "/tokenize", {"prompt": prompt["text"], **({"model": model} if model else {})}
        return None

    def load_weights(self, url: str, path: str, version: int, *, timeout_s: float) -> str:
        reply = request_json(
            "POST",
            f"{url}/update_weights_from_disk",
            {"model_path": path, "weight_version": str(version), "abort_all_requests": True},
            timeout_s=timeout_s,
        ).body
        if not isinstance(reply, dict) or not reply.get("success"):
            message = reply.get("message") if isinstance(reply, dict) else reply
            raise InferenceError(f"SGLang at {url} did not load {path}: {message}")
        return f"{reply.get('message', 'loaded')} (weight version {version})"


class _Stream(StreamParser):
    """SGLang's /generate events, cumulative or incremental (see the module docstring)."""

    def __init__(self, dialect: SGLang) -> None:
        self.dialect = dialect
        self.seen = 0
        self.text = ""

    def feed(self, event: Any) -> Delta:
        stream_error(event, "SGLang")
        meta = _meta(event)
        finish = meta.get("finish_reason")
        kind, reason = _finish(finish) if finish is not None else (None, "")
        if kind == "abort" and meta.get("output_token_logprobs") is None:
            # aborted before it was scheduled: the tokenizer manager answers with the reason alone
            return Delta([], [], finish="abort", reason=reason)
        ids, values = _triples(meta)
        total = meta.get("completion_tokens")
        if type(total) is not int or total < self.seen:
            raise ProtocolError(
                f"SGLang stream event's meta_info.completion_tokens is {total!r} after {self.seen} "
                "tokens: the stream cannot say which of its tokens are new"
            )
        new = total - self.seen
        if len(ids) not in (new, total):
            raise ProtocolError(
                f"SGLang stream event lists {len(ids)} output_token_logprobs for {total} tokens so "
                f"far, {self.seen} of them seen: neither all nor the new ones"
            )
        cumulative = len(ids) == total
        ids, values = ids[len(ids) - new :], values[len(values) - new :]
        text = event.get("text") if isinstance(event.get("text"), str) else ""
        if cumulative and text.startswith(self.text):  # all so far: the new text is what follows the known
            text = text[len(self.text) :]
        self.seen, self.text = total, self.text + text
        model, version = self.dialect._model(event, meta)
        return Delta(ids, values, text, kind, reason=reason, model=model, weight_version=version)


def _meta(body: Any) -> dict[str, Any]:
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        raise ProtocolError(f"SGLang reply has no meta_info: {str(body)[:200]}")
    return meta


def _triples(meta: dict[str, Any]) -> tuple[list[int], list[float]]:
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        raise ProtocolError(
            "SGLang meta_info has no output_token_logprobs; the request sets return_logprob, "
            "so this server ignores it (is it SGLang's native /generate?)"
        )
    ids, values = [], []
    for triple in triples:
        if (
            not isinstance(triple, (list, tuple))
            or len(triple) < 2
            or type(triple[0]) not in (int, float)
            or type(triple[1]) is not int
        ):
            raise ProtocolError(
                f"SGLang output_token_logprobs entry {str(triple)[:80]} is not [logprob, token_id, ...]"
            )
        values.append(float(triple[0]))
        ids.append(triple[1])
    return ids, values


def _finish(value: Any) -> tuple[Finish, str]:
    if value is None:
        return "stop", ""
    kind = value.get("type") if isinstance(value, dict) else value
    if kind not in _FINISHES:
        raise ProtocolError(f"SGLang finish_reason {str(value)[:100]} is not stop, length or abort")
    reason = str(value.get("message") or value.get("matched") or "") if isinstance(value, dict) else ""
    return _FINISHES[kind], reason


_FINISHES: dict[str, Finish] = {"stop": "stop", "length": "length", "abort": "abort"}
