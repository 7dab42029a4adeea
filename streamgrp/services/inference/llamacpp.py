"""llama.cpp's ``llama-server`` native ``/completion``, token ids in and out.

Request: ``POST /completion`` with the prompt as a token-id array (so no BOS is added and nothing is
tokenized), ``n_predict``, ``return_tokens: true`` (the generated ids in ``tokens``) and ``n_probs: 1``
(``completion_probabilities``: per generated token its ``id`` and ``logprob``, the log-softmax of
the raw logits, before any sampler). Every sampler llama-server turns on by default that would make
the sampled distribution differ from the policy's (top-k 40, min-p 0.05, repetition penalties) is
turned off, so at temperature 1 the tokens are samples of exactly the distribution the log-probs
describe. ``stop_type`` says why it stopped (``eos``/``word``: stop, ``limit``: length); llama.cpp
has no abort reply (a server restarted mid-request breaks the connection: a transport error).

The weight version comes from the model alias the reply names (``--alias smollm2@v3`` with the
adapter's ``--version-pattern``). llama.cpp cannot load new weights over HTTP: ``streamgrp
weight-sync --dialect llamacpp`` restarts the server it owns on each version's ``model.gguf``
(`streamgrp.services.inference.weight_sync`).
"""

from __future__ import annotations

from typing import Any

from streamgrp.services.inference.dialect import (
    Dialect,
    Generation,
    InferenceError,
    ProtocolError,
    Sampling,
    token_list,
    version_from,
)

#: Samplers llama-server enables by default, set to their neutral values (see the module docstring).
NEUTRAL_SAMPLERS = {"min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0}
STOP_TYPES = {"eos": "stop", "word": "stop", "limit": "length"}
#: A UTF-8 character is at most 4 bytes, so at most 3 byte tokens can precede its missing last byte.
MAX_HELD_BACK = 3


class LlamaCpp(Dialect):
    name = "llamacpp"

    def __init__(self, *, version_pattern: str | None = None) -> None:
        self.version_pattern = version_pattern

    def generate(self, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"prompt": prompt_ids, "n_predict": sampling.max_tokens,
                                "temperature": sampling.temperature, "top_p": sampling.top_p,
                                "top_k": sampling.top_k, **NEUTRAL_SAMPLERS,
                                "n_probs": 1, "return_tokens": True, "stream": False}
        if sampling.model:
            body["model"] = sampling.model
        return "/completion", {**body, **(sampling.extra or {})}

    def parse(self, body: Any) -> Generation:
        if not isinstance(body, dict):
            raise ProtocolError(f"llama.cpp reply is not an object: {str(body)[:200]}")
        ids = token_list(body.get("tokens"), "llama.cpp tokens")
        probs = body.get("completion_probabilities")
        if not isinstance(probs, list):
            raise ProtocolError("llama.cpp reply has no completion_probabilities; the request sets n_probs, so "
                                "this server ignores it (is it llama-server's /completion?)")
        stop_type = body.get("stop_type")
        if stop_type not in STOP_TYPES:
            raise ProtocolError(f"llama.cpp stop_type {stop_type!r} is not eos, word or limit")
        finish, notes = STOP_TYPES[stop_type], []
        if stop_type == "word" and len(probs) < len(ids):
            ids = ids[:len(probs)]  # the stop word's tokens are cut from the probabilities, not from tokens
        elif 0 < len(ids) - len(probs) <= MAX_HELD_BACK:
            # llama-server reports a token's probability with its text, and holds back the text of a
            # trailing incomplete UTF-8 character: those last tokens come with no log-probability. The
            # prefix that has them is still a sample of the policy, cut short; the rest is not trained on.
            notes.append(f"{len(ids) - len(probs)} trailing token(s) of an incomplete character dropped")
            ids, finish = ids[:len(probs)], "length"
        if len(probs) != len(ids):
            raise ProtocolError(f"llama.cpp reply: {len(ids)} tokens but {len(probs)} completion_probabilities")
        values = []
        for position, (token, entry) in enumerate(zip(ids, probs)):
            if not isinstance(entry, dict) or entry.get("id") != token or type(entry.get("logprob")) not in (int, float):
                raise ProtocolError(f"llama.cpp completion_probabilities[{position}] is not the logprob of token "
                                    f"{token}: {str(entry)[:120]} (post_sampling_probs must stay off)")
            values.append(float(entry["logprob"]))
        model = str(body.get("model", ""))
        reason = str(body.get("stopping_word") or "") + (" (context truncated)" if body.get("truncated") else "")
        reason = "; ".join(part for part in (reason.strip(), *notes) if part)
        return Generation(ids, values, str(body.get("content", "")), finish, reason=reason,
                          weight_version=version_from(model, self.version_pattern) if self.version_pattern else None,
                          model=model)

    def tokenize(self, prompt: dict[str, Any], model: str | None) -> tuple[str, dict[str, Any]] | None:
        if isinstance(prompt.get("text"), str):
            # parse_special: a prompt written with the chat template's special tokens keeps them as tokens.
            return "/tokenize", {"content": prompt["text"], "add_special": True, "parse_special": True}
        return None

    def load_weights(self, url: str, path: str, version: int, *, timeout_s: float) -> str:
        raise InferenceError("llama.cpp cannot load weights over HTTP: run `streamgrp weight-sync --dialect llamacpp "
                             "--llama-server-cmd ...`, which restarts the server on each version's model.gguf")
