"""The settings of rollouts from inference servers and of agent sessions: the inference servers, the
gateway in front of them, and the agent runner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from streamgrp.config.base import _RoleSettings, _Settings, is_loopback, read_secret
from streamgrp.config.roles import WorkerConfig
from streamgrp.errors import ConfigError


class InferenceConfig(_Settings):
    """A rollout adapter's inference servers (`streamgrp.services.inference`): `streamgrp worker --rollout
    vllm|sglang|llamacpp` and `streamgrp weight-sync`."""

    server_url: str = Field(
        "http://127.0.0.1:8080",
        description="inference server base URL; several: "
        "comma-separated (each request goes to one, chosen by --server-choice)",
    )
    server_choice: Literal["round_robin", "least_loaded"] = Field(
        "round_robin",
        description="how a request picks its server: round_robin, or least_loaded (fewest "
        "requests this worker has in flight there)",
    )
    server_model: str | None = Field(
        None,
        description="model name sent with each request (vLLM needs the served model name; unset: the server's default)",
    )
    temperature: float = Field(1.0, ge=0, description="sampling temperature (1.0 samples the policy itself)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; 1.0 is off")
    top_k: int = Field(0, ge=0, description="top-k sampling; 0 is off")
    max_tokens: int = Field(128, ge=1, description="most tokens one completion may have")
    sampling: str | None = Field(
        None,
        description="more sampling parameters as a JSON object, sent as the "
        'server names them (e.g. \'{"stop": ["\\\\n"], "seed": 1}\')',
    )
    request_timeout_s: float = Field(120.0, gt=0, description="one HTTP request's deadline, connect to last byte")
    max_attempts: int = Field(
        4,
        ge=1,
        description="tries per generation after transport errors (unreachable, "
        "timeout, 5xx, a body that is not JSON); 4xx is never retried",
    )
    backoff_s: float = Field(0.5, ge=0, description="first retry's pause; doubled per retry, with jitter")
    backoff_max_s: float = Field(8.0, ge=0, description="longest pause between retries")
    restart_wait_s: float = Field(
        60.0,
        ge=0,
        description="how long one request waits for a lone server that went "
        "away (refused, dropped, 503 while loading: a restart for a weight sync) to answer "
        "/health again; a restart waited through is not a failed attempt",
    )
    on_abort: Literal["resubmit", "fail"] = Field(
        "resubmit",
        description="a generation the server aborted "
        "(weight update, preemption): resubmit it with the tokens so "
        "far, or record the slot as failed with the reason",
    )
    max_resubmits: int = Field(4, ge=0, description="resubmissions of one aborted generation before the slot fails")
    segment_tokens: int = Field(
        0,
        ge=0,
        description="partial rollouts: stream each generation and record every "
        "this many tokens of it, and each aborted or broken part, as a durable segment of its "
        "slot; a worker that takes over the task of one that stopped continues each slot from "
        "its segments, not from scratch (0: off)",
    )
    segment_s: float = Field(
        30.0,
        ge=0,
        description="with --segment-tokens: also record a segment once this many "
        "seconds passed since the last, for slow generations (0: by tokens only)",
    )
    segment_stream: bool = Field(
        True,
        description="with --segment-tokens: one streamed request per generation, cut "
        "into segments as it arrives; off: a request per segment (each prefills the whole "
        "context again)",
    )
    reward: str = Field(
        "streamgrp.services.inference.rewards:answer_reward",
        description="module:function(prompt, completion_ids, text) -> float, or None to reject",
    )
    vllm_token_ids: Literal["return_token_ids", "tokens_as_token_ids"] = Field(
        "return_token_ids",
        description="how vLLM returns completion ids: return_token_ids (vLLM >= 0.10.2) or "
        "tokens_as_token_ids ('token_id:N' strings, older vLLM)",
    )
    version_pattern: str = Field(
        r"@v(\d+)$",
        description="regex whose group 1 is the weight version in the model "
        "name a server reports, for servers that report no weight version of their own",
    )
    keep_text: bool = Field(
        True,
        description="keep the completion text in the sample's meta (the token ids are "
        "what trains; the text is for reading and checks)",
    )


class GatewayConfig(_RoleSettings):
    """`streamgrp gateway`: the OpenAI-compatible endpoint of agent sessions (`streamgrp.services.gateway`),
    in front of the inference servers its [inference] settings name."""

    gateway_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="address the gateway listens on; one other machines reach (0.0.0.0) needs a gateway token",
    )
    gateway_port: int = Field(8000, ge=0, le=65535, description="port the gateway listens on (0: any free one)")
    gateway_url: str | None = Field(
        None,
        description="the gateway's base URL as agents reach it, handed out with each session (unset: http://HOST:PORT)",
    )
    gateway_token_file: Path | None = Field(
        None,
        description="file holding the gateway's token, which opening and "
        "ending sessions takes (unset: the token's own environment variable, "
        "else a new one written to DATA_DIR/gateway-token, loopback only)",
    )
    gateway_token: SecretStr | None = Field(
        None, description="the gateway's token itself; environment only", json_schema_extra={"flag": None}
    )
    dialect: Literal["llamacpp", "vllm", "sglang"] = Field("llamacpp", description="the inference servers' kind")
    tokenizer: str | None = Field(
        None,
        description="the model's Hugging Face tokenizer (a directory or name) for "
        "its chat template; needed for vllm and sglang (unset with llamacpp: "
        "llama-server's own /apply-template and /tokenize)",
    )
    tool_parser: Literal["hermes", "none"] = Field(
        "hermes",
        description="how tool calls in the model's text become "
        "OpenAI tool_calls: hermes (<tool_call>{json}</tool_call>) or none",
    )
    max_entry_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="a session's sample larger than this once encoded is published as a failed slot saying so",
    )
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="largest request body the gateway reads")
    gateway_threads: int = Field(
        32,
        ge=1,
        description="threads making the store's calls (sessions opened and "
        "ended; a turn's record is made on the event loop, on a thread only "
        "when that gets no answer or the server is a cluster) at once",
    )
    refresh_s: float = Field(
        1.0,
        gt=0,
        description="how often sessions past their group's deadline are timed out and the run's version is read",
    )
    claim_idle_s: float = Field(
        30.0, gt=0, description="reclaim a dead worker's task after it sat this long unacknowledged"
    )
    crash_after_turn: int | None = Field(
        None,
        ge=1,
        description="tests: SIGKILL the gateway right after it records "
        "the Nth turn since it started, before that turn is answered",
    )

    def token(self, data_dir: Path) -> tuple[str, Path | None]:
        """(the token, the file a new one was written to or None): from --gateway-token-file, then
        STREAMGRP_GATEWAY_TOKEN, else a new one in ``data_dir`` (mode 0600), which only a loopback gateway
        may make up: a reachable one needs a token its apps were given."""
        given = read_secret(self.gateway_token, self.gateway_token_file, "--gateway-token-file")
        if given is not None:
            return given, None
        if not is_loopback(self.gateway_host):
            raise ConfigError(
                f"--gateway-host {self.gateway_host} is reachable from other machines, and no gateway "
                "token is set: give --gateway-token-file or STREAMGRP_GATEWAY_TOKEN (apps open and end "
                "sessions with it), or listen on 127.0.0.1"
            )
        import secrets

        path = data_dir / "gateway-token"
        path.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_text(token + "\n")
        return token, path


class AgentConfig(_Settings):
    """`streamgrp agent`: runs an agent function once per slot, each in a gateway session."""

    agent: str | None = Field(
        None,
        description="module:function(session) run once per slot; returns the reward, "
        "None to reject, or raises to fail (session.client is an OpenAI client of its session)",
    )
    gateway_url: str = Field("http://127.0.0.1:8000", description="the gateway's base URL")
    gateway_token_file: Path | None = Field(
        None,
        description="file holding the gateway's token (unset: the "
        "token's own environment variable, else DATA_DIR/gateway-token)",
    )
    gateway_token: SecretStr | None = Field(
        None, description="the gateway's token itself; environment only", json_schema_extra={"flag": None}
    )
    concurrency: int = Field(16, ge=1, description="sessions run at once (whole tasks: n_samples each)")
    claim_idle_s: float = Field(
        30.0, gt=0, description="reclaim a dead worker's task after it sat this long unacknowledged"
    )
    max_tasks: int | None = Field(None, ge=1, description="exit after this many tasks (default: run until stopped)")
    burst: bool = Field(False, description="exit when no task is waiting instead of blocking")
    take_partitions: str | None = Field(
        None,
        description="comma-separated run partitions to take tasks from (default "
        "all); results always go to their task's partition",
    )
    agent_retries: int = Field(
        6,
        ge=0,
        description="retries of each agent request the gateway could not answer "
        "(it restarts, or an inference server is away)",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="one HTTP request's deadline, connect to last byte")

    def token(self, data_dir: Path) -> str:
        """The gateway's token: --gateway-token-file, STREAMGRP_GATEWAY_TOKEN, else the one a loopback gateway
        wrote to ``data_dir``."""
        given = read_secret(self.gateway_token, self.gateway_token_file, "--gateway-token-file")
        if given is not None:
            return given
        path = data_dir / "gateway-token"
        try:
            return path.read_text().strip()
        except OSError:
            raise ConfigError(
                f"no gateway token: give --gateway-token-file or STREAMGRP_GATEWAY_TOKEN (the gateway's "
                f"own), or run on the gateway's machine with its --data-dir ({path} is missing)"
            ) from None

    def partition_numbers(self) -> tuple[int, ...] | None:
        return WorkerConfig(take_partitions=self.take_partitions).partition_numbers()
