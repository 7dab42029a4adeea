"""Agent sessions: an OpenAI-compatible gateway whose every turn is durable, token-exact training data.

    streamgrp gateway --server-url http://127.0.0.1:8080           # in front of llama-server (or vLLM, SGLang)
    streamgrp agent --agent myagent:solve                          # runs myagent.solve once per slot

A *session* is one slot of a task. Its agent talks to ``/v1/chat/completions`` or ``/v1/completions``
with the session's key; each request is one turn, rendered by the model's chat template, generated from
token ids by the inference server, and recorded (prompt ids, completion ids, log-probabilities, version)
in the run before it is answered. When the session ends with a reward, its turns become the slot's
sample: one row while each prompt continues the previous prompt and completion, loss mask 1 on
generated tokens only (`streamgrp.core.session_rows`).

Layout: `openai_api` (request and reply shapes), `tool_calls` (tool-call parsers), `upstream` (the
inference servers), `templates` (chat templates), `live` (a session in memory: continuation, retries), `gateway`
(the sessions' lifecycle per request), `server` (the aiohttp server), `agent` (`streamgrp agent`).
The store's side is `streamgrp.store.sessions`; the metrics are `streamgrp.cli.metrics`'s (role ``gateway``).
Needs the ``gateway`` extra (aiohttp; ``openai`` for `streamgrp agent`).
"""

from __future__ import annotations

__all__ = ["AgentSession"]


def __getattr__(name: str):
    if name == "AgentSession":
        from streamgrp.services.gateway.agent import AgentSession

        return AgentSession
    raise AttributeError(name)
