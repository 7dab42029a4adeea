"""llama.cpp's ``llama-server`` native ``/completion``, token ids in and out.

Request: ``POST /completion`` with the prompt as a token-id array (so no BOS is added and nothing is
tokenized), ``n_predict``, ``return_tokens: true`` (the generated ids in ``tokens``) and ``n_probs: 1``
(``completion_probabilities``: per reported token its ``id`` and ``logprob``, the log-softmax of the
raw logits, before any sampler). Every sampler llama-server turns on by default that would make the
sampled distribution differ from the policy's (top-k 40, min-p 0.05, repetition penalties) is turned
off, so at temperature 1 the tokens are samples of exactly the distribution the log-probs describe.
``stop_type`` says why it stopped (``eos``/``word``: stop, ``limit``: length); llama.cpp has no abort
reply (a server restarted mid-request breaks the connection: a transport error).

How llama-server builds the reply (tools/server, ``process_token`` and ``send_final_response``): every
sampled id goes into ``tokens``, but a token's probability entry is kept only when the text generated
so far ends in a complete UTF-8 character. The tokens of a character spread over several byte tokens,
but its last, and the tokens of a character cut off at the end, have no entry; after a stop word, the
last entries (as many as the stop word's own tokenization has) are cut too. Entries are never reordered
or grouped, so they are the ids of ``tokens`` with some left out. `parse` aligns them (an entry is taken
only where its position is certain) and names the positions left without one in
`Generation.unscored`; `score_requests` scores each such token again, teacher-forced on the same server
(the token after its prefix, forced by a logit bias, which changes sampling, not the reported
pre-sampling log-probability). A token whose piece ends inside a character is never reported even
then, so the request forces a plain ASCII token instead and reads the token from the top log-probs.
A scoring reply that names another model than the generation's (weight-sync restarted the server on a
new version in between) makes the adapter generate the segment again on the new weights.

Streaming (``stream: true``; tools/server ``send_partial_response`` and the ``to_json_non_oaicompat``
of its partial and final results): one ``data:`` event per token that completes a character, with
``tokens: [id]``, its ``completion_probabilities`` entry and ``tokens_predicted`` (every token
generated so far, held back ones too); the last event has ``stop: true``, ``stop_type``, ``model`` and
``tokens: []`` (no ``[DONE]``). A token held back is never streamed at all, so a jump in
``tokens_predicted`` (or a last count above the tokens streamed) means ids this stream cannot give:
`Delta.lost`, and the adapter asks for the rest without streaming, where ``tokens`` has them all. The
events name no model before the last, so the adapter reads it first from ``GET /v1/models``
(``data[0].id``, the alias).

The weight version comes from the model alias the reply names (``--alias smollm2@v3`` with the
adapter's ``--version-pattern``). llama.cpp cannot load new weights over HTTP: ``streamgrp
weight-sync --dialect llamacpp`` restarts the server it owns on each version's ``model.gguf``
(`streamgrp.services.inference.weight_sync`).
"""

from __future__ import annotations

import math
from typing import Any

from streamgrp.services.inference.dialect import (
    Delta,
    Dialect,
    Finish,
    Generation,
    InferenceError,
    ProtocolError,
    Sampling,
    StreamParser,
    stream_error,
    token_list,
    version_from,
)

#: Samplers llama-server enables by default, set to their neutral values (see the module docstring).
NEUTRAL_SAMPLERS = {
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "mirostat": 0,
}
STOP_TYPES: dict[str, Finish] = {"eos": "stop", "word": "stop", "limit": "length"}
#: A logit bias no other token's logit overcomes: the scoring requests' way to force a token.
FORCE_BIAS = 1000.0
#: Top log-probs a scoring request asks for first (the sampled token is nearly always among them), then all
#: (llama-server clamps n_probs to the vocabulary).
SCORE_TOP, SCORE_ALL = 64, 1 << 17


class LlamaCpp(Dialect):
    name = "llamacpp"
    reserved = frozenset(
        {
            "prompt",
            "n_predict",
            "max_tokens",
            "n_probs",
            "logprobs",
            "return_tokens",
            "stream",
            "post_sampling_probs",
            "response_fields",
            "n_cmpl",
            "n",
        }
    )
    anchor_text = "a"

    def __init__(self, *, version_pattern: str | None = None) -> None:
        self.version_pattern = version_pattern

    def generate(self, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "prompt": prompt_ids,
            "n_predict": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            **NEUTRAL_SAMPLERS,
            "n_probs": 1,
            "return_tokens": True,
            "stream": False,
        }
        if sampling.model:
            body["model"] = sampling.model
        return "/completion", {**body, **(sampling.extra or {})}

    def parse(self, body: Any) -> Generation:
        if not isinstance(body, dict):
            raise ProtocolError(f"llama.cpp reply is not an object: {str(body)[:200]}")
        ids = token_list(body.get("tokens"), "llama.cpp tokens")
        entries = _entries(body, ids)
        stop_type = body.get("stop_type")
        if stop_type not in STOP_TYPES:
            raise ProtocolError(f"llama.cpp stop_type {stop_type!r} is not eos, word or limit")
        owners = align(ids, [entry["id"] for entry in entries])
        if owners is None:
            raise ProtocolError(
                f"llama.cpp reply: its {len(entries)} completion_probabilities are not the ids of its "
                f"{len(ids)} tokens in order (ids {[e['id'] for e in entries][:20]} vs tokens "
                f"{ids[:20]}), so no log-probability can be matched to its token; is this "
                "llama-server's /completion?"
            )
        values = [math.nan if owner is None else entries[owner]["logprob"] for owner in owners]
        model = str(body.get("model", ""))
        reason = str(body.get("stopping_word") or "") + (" (context truncated)" if body.get("truncated") else "")
        return Generation(
            ids,
            values,
            str(body.get("content", "")),
            STOP_TYPES[stop_type],
            reason=reason.strip(),
            weight_version=version_from(model, self.version_pattern) if self.version_pattern else None,
            model=model,
            unscored=tuple(i for i, owner in enumerate(owners) if owner is None),
        )

    def stream_generate(self, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict[str, Any]] | None:
        path, body = self.generate(prompt_ids, sampling)
        return path, {**body, "stream": True}

    def stream_parser(self) -> StreamParser:
        return _Stream(self)

    model_path = "/v1/models"

    def parse_model(self, body: Any) -> tuple[str, int | None]:
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise ProtocolError(f"llama.cpp /v1/models reply names no model: {str(body)[:200]}")
        return str(data[0]["id"]), self._version(str(data[0]["id"]))

    def _version(self, model: str) -> int | None:
        return version_from(model, self.version_pattern) if self.version_pattern else None

    def tokenize(self, prompt: dict[str, Any], model: str | None) -> tuple[str, dict[str, Any]] | None:
        if isinstance(prompt.get("text"), str):
            # parse_special: a prompt written with the chat template's special tokens keeps them as tokens.
            return "/tokenize", {"content": prompt["text"], "add_special": True, "parse_special": True}
        return None

    def score_requests(
        self, context: list[int], token: int, anchor: int | None, sampling: Sampling
    ) -> list[tuple[str, dict[str, Any], int]]:
        def forcing(forced: int, n_probs: int) -> tuple[str, dict[str, Any], int]:
            body: dict[str, Any] = {
                "prompt": context,
                "n_predict": 1,
                "n_probs": n_probs,
                "return_tokens": True,
                "stream": False,
                "temperature": 1.0,
                "top_k": 0,
                "logit_bias": [[forced, FORCE_BIAS]],
            }
            return "/completion", ({**body, "model": sampling.model} if sampling.model else body), n_probs

        if anchor is None or anchor == token:
            return [forcing(token, 1)]
        # Most tokens are found among the anchor's top log-probs; a token whose piece is a whole character
        # (or only continuation bytes) is reported when forced itself, at any rank; all log-probs last.
        return [forcing(anchor, SCORE_TOP), forcing(token, 1), forcing(anchor, SCORE_ALL)]

    def parse_score(self, body: Any, token: int) -> tuple[float | None, str]:
        if not isinstance(body, dict):
            raise ProtocolError(f"llama.cpp reply is not an object: {str(body)[:200]}")
        model = str(body.get("model", ""))
        entries = body.get("completion_probabilities") or []
        if not isinstance(entries, list) or not entries:
            return None, model
        entry = entries[0]
        candidates = [entry, *(entry.get("top_logprobs") or [])] if isinstance(entry, dict) else [entry]
        for candidate in candidates:
            if isinstance(candidate, dict) and candidate.get("id") == token:
                return _logprob(candidate, "scoring reply"), model
        return None, model

    def load_weights(self, url: str, path: str, version: int, *, timeout_s: float) -> str:
        raise InferenceError(
            "llama.cpp cannot load weights over HTTP: run `streamgrp weight-sync --dialect llamacpp "
            "--llama-server-cmd ...`, which restarts the server on each version's model.gguf"
        )


class _Stream(StreamParser):
    """llama-server's /completion events (see the module docstring); ``seen``: tokens streamed so far."""

    def __init__(self, dialect: LlamaCpp) -> None:
        self.dialect = dialect
        self.seen = 0

    def feed(self, event: Any) -> Delta:
        stream_error(event, "llama.cpp")
        if not isinstance(event, dict):
            raise ProtocolError(f"llama.cpp stream event is not an object: {str(event)[:200]}")
        predicted = event.get("tokens_predicted")
        if event.get("stop") is True:
            if event.get("tokens"):  # a whole reply (the server did not stream): its ids up to the first unscored
                generation = self.dialect.parse(event)
                kept = generation.unscored[0] if generation.unscored else len(generation.token_ids)
                return Delta(
                    generation.token_ids[:kept],
                    generation.logprobs[:kept],
                    "",
                    generation.finish,
                    reason=generation.reason,
                    model=generation.model,
                    weight_version=generation.weight_version,
                    lost=kept < len(generation.token_ids),
                )
            stop_type = event.get("stop_type")
            if stop_type not in STOP_TYPES:
                raise ProtocolError(f"llama.cpp stop_type {stop_type!r} is not eos, word or limit")
            model = str(event.get("model", ""))
            reason = str(event.get("stopping_word") or "") + (" (context truncated)" if event.get("truncated") else "")
            return Delta(
                [],
                [],
                "",
                STOP_TYPES[stop_type],
                reason=reason.strip(),
                model=model,
                weight_version=self.dialect._version(model),
                lost=type(predicted) is int and predicted > self.seen,
            )
        ids = token_list(event.get("tokens") or [], "llama.cpp stream tokens")
        if not ids:
            return Delta([], [])  # progress, or a begin marker
        if type(predicted) is int and predicted > self.seen + len(ids):
            return Delta([], [], lost=True)  # tokens of a split character came before these, never streamed
        entries = _entries(event, ids)
        if [entry["id"] for entry in entries] != ids:
            raise ProtocolError(
                f"llama.cpp stream event's completion_probabilities {str(entries)[:200]} are not "
                f"one per token of {ids}: is n_probs set?"
            )
        self.seen += len(ids)
        return Delta(ids, [entry["logprob"] for entry in entries], str(event.get("content") or ""))


def align(ids: list[int], entry_ids: list[int]) -> list[int | None] | None:
    """Per token position, the index of the entry that is certainly its own, or None; None in all when
    ``entry_ids`` are not ``ids`` with some left out (in order).

    Entry k sits at or after the earliest position a left-to-right match gives it and at or before the
    latest a right-to-left match gives it; where the two agree, no other placement exists. Where they
    differ (a repeated id inside a run of left-out tokens), no position in between is trusted: those
    tokens are scored again, which costs a request, never a wrong log-probability."""
    earliest, position = [], 0
    for entry in entry_ids:
        while position < len(ids) and ids[position] != entry:
            position += 1
        if position == len(ids):
            return None
        earliest.append(position)
        position += 1
    latest, position = [], len(ids) - 1
    for entry in reversed(entry_ids):
        while ids[position] != entry:
            position -= 1
        latest.append(position)
        position -= 1
    owners: list[int | None] = [None] * len(ids)
    for index, (first, last) in enumerate(zip(earliest, reversed(latest))):
        if first == last:
            owners[first] = index
    return owners


def _entries(body: dict[str, Any], ids: list[int]) -> list[dict[str, Any]]:
    """The ``completion_probabilities`` entries, each with an int ``id`` and a float ``logprob``."""
    entries = body.get("completion_probabilities")
    if entries is None:
        # llama-server leaves the field out when no entry is kept (every token held back, or none made);
        # a server that ignored n_probs says so in the settings it echoes.
        settings = body.get("generation_settings")
        if isinstance(settings, dict) and settings.get("n_probs") == 0:
            raise ProtocolError(
                "llama.cpp reply has no completion_probabilities and its generation_settings say "
                "n_probs 0: the server ignored the request's n_probs (is it llama-server's "
                "/completion?)"
            )
        return []
    if not isinstance(entries, list):
        raise ProtocolError(f"llama.cpp completion_probabilities is not a list: {str(entries)[:200]}")
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict) or type(entry.get("id")) is not int:
            raise ProtocolError(f"llama.cpp completion_probabilities[{position}] has no token id: {str(entry)[:120]}")
        entry["logprob"] = _logprob(entry, f"completion_probabilities[{position}]")
    return entries


def _logprob(entry: dict[str, Any], where: str) -> float:
    value = entry.get("logprob")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = " (post_sampling_probs must stay off)" if "prob" in entry else ""
        raise ProtocolError(f"llama.cpp {where} has no numeric logprob: {str(entry)[:120]}{hint}")
    return float(value)
