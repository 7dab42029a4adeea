"""What every inference server dialect provides, and what one generation comes back as.

A `Dialect` turns token ids into one server's request body and that server's reply into a
`Generation`: the completion's token ids, the server's log-probability of each, its text, why it
stopped, and the weight version it reports (if it reports one). Dialects are pure translation: no
I/O, no retries (`streamgrp.services.inference.adapter` owns those), except `load_weights`, the
weight-publishing call, which each dialect makes its own way.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

from streamgrp.services.inference.http import InferenceError

Finish = Literal["stop", "length", "abort"]


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
    """One server answer: ``token_ids`` and ``logprobs`` have one entry per generated token."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish: Finish
    reason: str = ""
    weight_version: int | None = None
    model: str = ""


class Dialect(ABC):
    """One server kind's request and reply shapes."""

    name: str = ""

    @abstractmethod
    def generate(self, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) asking for a completion of ``prompt_ids`` with ids and log-probabilities back."""

    @abstractmethod
    def parse(self, body: Any) -> Generation:
        """The `Generation` in a 2xx reply; `ProtocolError` when it is not there."""

    def tokenize(self, prompt: dict[str, Any], model: str | None) -> tuple[str, dict[str, Any]] | None:
        """(path, body) asking the server to tokenize a text or chat prompt once; None if it cannot."""
        return None

    def parse_tokens(self, body: Any) -> list[int]:
        return token_list(body.get("tokens") if isinstance(body, dict) else None, "tokens")

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
