"""What every inference server dialect provides, and what one generation comes back as.

A `Dialect` turns token ids into one server's request body and that server's reply into a
`Generation`: the completion's token ids, the server's log-probability of each, its text, why it
stopped, and the weight version it reports (if it reports one). Dialects are pure translation: no
I/O, no retries (`streamgrp.services.inference.retries` owns those), except `load_weights`, the
weight-publishing call, which each dialect makes its own way.

A reply may lack some log-probabilities it owes (llama-server leaves out the tokens that end inside a
multi-byte character): the `Generation` names those positions in ``unscored``, and the dialect says how
to score each again (`score_requests`, `parse_score`); the adapter sends those requests. Every
log-probability then passes `checked_logprobs`: finite (as the float32 it is stored as) and not above 0
beyond float noise.

Streaming: `stream_generate` is the same request asking for a server-sent event stream, and a
`StreamParser` (one per stream: servers differ in whether an event holds the new tokens or all so
far) turns each event into a `Delta`: the tokens the event adds with their log-probabilities, and, on
the last, why the generation ended. A stream that cannot carry every token id (llama-server holds back
the tokens of a character split over several) says so with `Delta.lost`: the adapter keeps what came
before and asks for the rest without streaming.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

from streamgrp.core.value_checks import LOGPROB_TOLERANCE
from streamgrp.errors import ConfigError
from streamgrp.services.inference.http import InferenceError

Finish = Literal["stop", "length", "abort"]

#: float32's largest finite value: a logprob at or beyond it becomes inf when stored as float32. llama.cpp
#: writes log(0) as -FLT_MAX (its JSON cannot hold -inf), which is refused the same way.
FLOAT32_MAX = 3.4028234663852886e38


class ProtocolError(InferenceError):
    """A 2xx reply whose JSON lacks what the request asked for (token ids, log-probabilities), or holds them
    inconsistently: the server's version or flags do not match the adapter's; not retried."""


@dataclass(frozen=True)
class Sampling:
    """The sampling settings every dialect translates into its own parameter names."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    extra: dict[str, Any] | None = None
    model: str | None = None


@dataclass(frozen=True)
class Generation:
    """One server answer: ``token_ids`` and ``logprobs`` have one entry per generated token; at the
    positions in ``unscored`` the reply had no log-probability (the entry is NaN until scored again)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish: Finish
    reason: str = ""
    weight_version: int | None = None
    model: str = ""
    unscored: tuple[int, ...] = ()


class StreamError(InferenceError):
    """An event in a stream that reports an error instead of tokens (the server gave up mid-generation);
    the tokens before it are kept and the rest is asked for again."""


@dataclass(frozen=True)
class Delta:
    """What one stream event adds: token ids with one log-probability each; ``finish`` set on the last.
    ``lost``: the server generated tokens this stream does not carry, from here on nothing is trusted."""

    token_ids: list[int]
    logprobs: list[float]
    text: str = ""
    finish: Finish | None = None
    reason: str = ""
    model: str = ""
    weight_version: int | None = None
    lost: bool = False


class StreamParser(ABC):
    """One stream's events, in order, into `Delta` values (holds what the stream has given so far)."""

    @abstractmethod
    def feed(self, event: Any) -> Delta:
        """The `Delta` of ``event``; `StreamError` for an error event, `ProtocolError` for a malformed one."""


def stream_error(event: Any, server: str) -> None:
    """`StreamError` when ``event`` is an error object (``{"error": ...}``: vLLM, SGLang and llama-server
    alike; vLLM's older ``{"object": "error", "message": ...}``)."""
    if isinstance(event, dict) and ("error" in event or event.get("object") == "error"):
        error = event.get("error", event)
        message = error.get("message", error) if isinstance(error, dict) else error
        raise StreamError(f"the {server} stream reported an error: {str(message)[:300]}")


class Dialect(ABC):
    """One server kind's request and reply shapes."""

    name: str = ""
    #: Request fields the dialect sets itself for the reply it parses; `--sampling` may not set them.
    reserved: frozenset[str] = frozenset()

    def check_extra(self, extra: dict[str, Any] | None) -> None:
        """Refuse `--sampling` fields that would change the reply's shape (ids, log-probabilities, length)."""
        clash = sorted(set(extra or {}) & self.reserved)
        if clash:
            raise ConfigError(
                f"--sampling sets {', '.join(clash)}, which the {self.name} adapter sets itself to get "
                "one log-probability per generated token id back; remove it (the length is "
                "--max-tokens)"
            )

    @abstractmethod
    def generate(self, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) asking for a completion of ``prompt_ids`` with ids and log-probabilities back."""

    @abstractmethod
    def parse(self, body: Any) -> Generation:
        """The `Generation` in a 2xx reply; `ProtocolError` when it is not there."""

    def stream_generate(self, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict[str, Any]] | None:
        """(path, JSON body) asking for the completion as a stream of events; None: the dialect cannot stream."""
        return None

    def stream_parser(self) -> StreamParser:
        raise NotImplementedError(f"the {self.name} adapter does not stream")

    #: GET path whose reply names the served model, for a dialect whose stream events do not (llama.cpp's
    #: name it only in the last): asked before each stream, so a segment cut mid-stream knows its version.
    model_path: str | None = None

    def parse_model(self, body: Any) -> tuple[str, int | None]:
        """(model name, weight version) in the reply to `model_path`."""
        return "", None

    def tokenize(self, prompt: dict[str, Any], model: str | None) -> tuple[str, dict[str, Any]] | None:
        """(path, body) asking the server to tokenize a text or chat prompt once; None if it cannot."""
        return None

    def parse_tokens(self, body: Any) -> list[int]:
        return token_list(body.get("tokens") if isinstance(body, dict) else None, "tokens")

    #: Text whose last token is a plain ASCII one (scoring requests force it where the token to score
    #: could not be reported itself); None: the dialect needs none.
    anchor_text: str | None = None

    def score_requests(
        self, context: list[int], token: int, anchor: int | None, sampling: Sampling
    ) -> list[tuple[str, dict[str, Any], int]]:
        """(path, body, entries the reply may list) requests, tried in order until one gives the log-probability
        of ``token`` right after ``context``; only dialects that leave `Generation.unscored` positions have any."""
        return []

    def parse_score(self, body: Any, token: int) -> tuple[float | None, str]:
        """(the log-probability of ``token`` in a `score_requests` reply or None, the model name the reply gives)."""
        return None, ""

    @abstractmethod
    def load_weights(self, url: str, path: str, version: int, *, timeout_s: float) -> str:
        """Tell the server at ``url`` to serve the weights in ``path`` as ``version``; a line for the record."""


def token_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise ProtocolError(f"{what} is not a list of token ids: {str(value)[:200]}")
    return value


def float_list(value: Any, what: str) -> list[float]:
    if not isinstance(value, list) or not all(type(v) in (int, float) for v in value):
        raise ProtocolError(f"{what} is not a list of numbers: {str(value)[:200]}")
    return [float(v) for v in value]


def checked_logprobs(values: list[float], where: str) -> list[float]:
    """``values`` with float noise above 0 (at most `LOGPROB_TOLERANCE`, the one `Sample` allows too: a
    log-softmax of p = 1 in float32) set to 0; `ProtocolError` for a value that is not finite as float32 or
    is positive beyond the tolerance, naming its position. Refused here, the slot fails with the server's
    reply named, instead of the sample being dead-lettered later."""
    checked = []
    for position, value in enumerate(values):
        if not (math.isfinite(value) and abs(value) < FLOAT32_MAX):
            raise ProtocolError(
                f"{where}: the log-probability of completion token {position} is {value!r}, not a "
                "finite float32 (a token the server gives probability 0, or a broken reply); the "
                "slot fails rather than train on it"
            )
        if value > LOGPROB_TOLERANCE:
            raise ProtocolError(
                f"{where}: the log-probability of completion token {position} is {value!r}, above 0 "
                f"by more than the {LOGPROB_TOLERANCE} float-noise tolerance, so it is no "
                "log-probability; check that the server reports log-softmax values (not logits or "
                "probabilities after sampling)"
            )
        checked.append(min(value, 0.0))
    return checked


def check_lengths(ids: list[int], logprobs: list[float], where: str) -> None:
    if len(ids) != len(logprobs):
        raise ProtocolError(f"{where}: {len(ids)} token ids but {len(logprobs)} log-probabilities")


def version_from(value: Any, pattern: str | None = None) -> int | None:
    """An integer weight version from a reported one ("12", 12, "v12") or from a model name matching ``pattern``."""
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, str):
        text = value.strip()
        if pattern is not None:
            match = re.search(pattern, text)
            return int(match.group(1)) if match else None
        match = re.fullmatch(r"v?(\d+)", text)
        return int(match.group(1)) if match else None
    return None
