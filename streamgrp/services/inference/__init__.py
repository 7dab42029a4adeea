"""Rollouts from real inference servers: one adapter per server dialect behind one interface.

    streamgrp worker --rollout vllm     --server-url http://gpu0:8000 --server-model policy
    streamgrp worker --rollout sglang   --server-url http://gpu0:30000,http://gpu1:30000
    streamgrp worker --rollout llamacpp --server-url http://127.0.0.1:8080

Layout: `http` (JSON over HTTP, one deadline, errors sorted into retry / do not retry), `pool`
(round-robin or least-loaded server choice), `dialect` (the interface and the `Generation` every
dialect parses into), `vllm`, `sglang`, `llamacpp` (request and reply shapes, weight loading),
`retries` (a request retried, waited through restarts, its reply bounded), `adapter`
(`InferenceRollout`: aborts, log-probabilities, versions, the `Sample`), `rewards` (defaults),
`weight_sync` (the `streamgrp weight-sync` role). No torch: a worker stays light.
"""

from __future__ import annotations

from typing import Any

from streamgrp.config import InferenceConfig, load_callable
from streamgrp.errors import ConfigError
from streamgrp.services.inference.adapter import InferenceRollout, Retry
from streamgrp.services.inference.dialect import Dialect, Sampling
from streamgrp.services.inference.pool import ServerPool

__all__ = ["ADAPTERS", "InferenceRollout", "build_rollout", "make_dialect", "server_urls"]

#: ``--rollout`` names that select an adapter instead of a ``module:function``.
ADAPTERS = ("vllm", "sglang", "llamacpp")


def make_dialect(name: str, config: InferenceConfig) -> Dialect:
    from streamgrp.services.inference.llamacpp import LlamaCpp
    from streamgrp.services.inference.sglang import SGLang
    from streamgrp.services.inference.vllm import VLLM

    if name == "vllm":
        return VLLM(token_ids=config.vllm_token_ids, version_pattern=config.version_pattern)
    if name == "sglang":
        return SGLang(version_pattern=config.version_pattern)
    if name == "llamacpp":
        return LlamaCpp(version_pattern=config.version_pattern)
    raise ConfigError(f"no inference adapter {name!r}; use one of {', '.join(ADAPTERS)} or a module:function")


def server_urls(config: InferenceConfig) -> list[str]:
    urls = [url.strip() for url in config.server_url.split(",") if url.strip()]
    if not urls:
        raise ConfigError("--server-url is empty; give the inference server's base URL (several: comma-separated)")
    return urls


def build_rollout(name: str, config: InferenceConfig) -> InferenceRollout:
    """The rollout function `streamgrp worker --rollout NAME` runs, from its [inference] settings."""
    extra: dict[str, Any] | None = None
    if config.sampling:
        import orjson

        try:
            extra = orjson.loads(config.sampling)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"--sampling {config.sampling!r} is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ConfigError(f"--sampling must be a JSON object of sampling parameters, not {config.sampling!r}")
    sampling = Sampling(
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        extra=extra,
        model=config.server_model,
    )
    return InferenceRollout(
        make_dialect(name, config),
        ServerPool(server_urls(config), config.server_choice),
        sampling,
        load_callable(config.reward),
        retry=Retry(config.max_attempts, config.backoff_s, config.backoff_max_s),
        request_timeout_s=config.request_timeout_s,
        on_abort=config.on_abort,
        max_resubmits=config.max_resubmits,
        keep_text=config.keep_text,
        restart_wait_s=config.restart_wait_s,
        segment_tokens=config.segment_tokens,
        segment_s=config.segment_s,
        segment_stream=config.segment_stream,
    )
