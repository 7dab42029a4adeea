"""Settings for every role: one pydantic model per concern, filled from a TOML file, `STREAMGRP_`
environment variables and command-line flags (later sources win).

The TOML file has one table per model (``[connection]``, ``[run]``, ``[worker]``, ``[assembler]``);
a field ``name`` of any model is the flag ``--name`` (dashes for underscores) and the environment
variable ``STREAMGRP_NAME``. A field name means the same thing in every model it appears in
(``burst``: exit when idle), so one flat namespace of flags and variables serves every command. Settings objects are passed explicitly; there is no global.

`RunConfig` is the part recorded as the run's first event; a process whose group policy differs
from the recorded one refuses to start (`streamgrp.store.runs`).
"""

from __future__ import annotations

import importlib
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from streamgrp.core.policy import GroupPolicy, NormSpec
from streamgrp.errors import ConfigError

ENV_PREFIX = "STREAMGRP_"
CONFIG_ENV = "STREAMGRP_CONFIG"


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _RoleSettings(_Settings):
    """What every long-running role has: its metrics endpoint (loopback only unless told otherwise)."""

    metrics_port: int = Field(0, ge=0, le=65535, description="serve Prometheus /metrics on this port (0: off)")
    metrics_address: str = Field("127.0.0.1", min_length=1, description="address the metrics endpoint listens on "
                                 "(0.0.0.0 or :: for every interface, so another machine's Prometheus can scrape it)")


@dataclass(frozen=True)
class TlsFiles:
    """This process's certificate and key, and the CA it trusts for the other end (PEM files).

    For ``streamgrp server``: the server's certificate and key, and the CA that signs client
    certificates (clients must present one). For every other process: its client certificate and
    key, and the CA that signed the server's certificate."""

    cert_file: Path
    key_file: Path
    ca_cert_file: Path


class ConnectionConfig(_Settings):
    """Where the server is, how to authenticate and encrypt, and which run to use.

    The password is never a flag (a process's arguments are readable by every user of the machine):
    it comes from ``--password-file`` or the ``STREAMGRP_PASSWORD`` environment variable.
    """

    redis_url: str | None = Field(None, description="Redis/Valkey URL (redis://, rediss://, unix://); "
                                  "unset starts or reuses the embedded server in --data-dir")
    cluster: bool = Field(False, description="--redis-url is a node of a Redis Cluster: use the cluster client, "
                          "which finds the other nodes from it")
    data_dir: Path = Field(Path(".streamgrp"), description="embedded server data directory (AOF files, logs)")
    maxmemory: str = Field("50%", description="memory cap of the embedded server this command starts: bytes, "
                           "512mb, 4gb, or a share of this machine's memory such as 50%; 0 for none. A full server "
                           "refuses writes (noeviction), which roles wait out; ignored with --redis-url")
    run: str | None = Field(None, description="run name; inspection commands default to the latest run")
    outage_budget_s: float = Field(300.0, gt=0, description="ride out a server outage (down, paused, restarting, "
                                   "loading, full) for this long before giving up")
    command_budget_s: float = Field(10.0, gt=0, description="one-shot commands (runs, steps, verify, inspect, "
                                    "replay, report, export, delete, acl) give up on an unreachable server after "
                                    "this long; services ride outages for --outage-budget-s")
    wait_replicas: int = Field(0, ge=0, description="after each commit wait until this many replicas have it "
                               "(WAITAOF, or WAIT on Redis 7.0); 0: do not wait")
    wait_timeout_ms: int = Field(1000, ge=1, description="how long one replica wait may take before a warning")
    password_file: Path | None = Field(None, description="file holding the password: `server` gives it to the "
                                       "default user; every other command authenticates with it (as the URL's "
                                       "user) unless the URL carries one")
    password: SecretStr | None = Field(None, description="the password itself; environment only, never a flag",
                                       json_schema_extra={"flag": None})
    tls_cert_file: Path | None = Field(None, description="TLS certificate (PEM): the server's for `server`, this "
                                       "client's otherwise")
    tls_key_file: Path | None = Field(None, description="private key (PEM) of --tls-cert-file")
    tls_ca_cert_file: Path | None = Field(None, description="CA certificate (PEM): the one that signs client "
                                          "certificates for `server`, the one that signed the server's otherwise")

    @model_validator(mode="after")
    def _check_secrets(self) -> ConnectionConfig:
        if self.password is not None and self.password_file is not None:
            raise ValueError("both STREAMGRP_PASSWORD and --password-file are set; give one of them")
        if self.password is not None and not self.password.get_secret_value():
            raise ValueError("STREAMGRP_PASSWORD is empty, which would turn authentication off; unset it or set a "
                             "password")
        tls = (self.tls_cert_file, self.tls_key_file, self.tls_ca_cert_file)
        if any(tls) and not all(tls):
            raise ValueError("TLS needs all three of --tls-cert-file, --tls-key-file and --tls-ca-cert-file")
        return self

    @field_validator("redis_url")
    @classmethod
    def _a_redis_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{url.split('@')[-1][:120]!r} is not a Redis URL: give redis://HOST:PORT/DB, "
                             "rediss://HOST:PORT/DB (TLS) or unix:///PATH")
        return url

    def secret(self) -> str | None:
        """The password, from STREAMGRP_PASSWORD or the first line of --password-file; None when neither is set."""
        if self.password is not None:
            return self.password.get_secret_value()
        if self.password_file is None:
            return None
        try:
            text = self.password_file.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read --password-file {self.password_file}: {exc.strerror}; fix the path or "
                              "its permissions") from None
        if not text or not text[0].strip():
            raise ConfigError(f"--password-file {self.password_file} is empty; write the password on its first line")
        return text[0].strip()

    def tls(self) -> TlsFiles | None:
        if self.tls_cert_file is None or self.tls_key_file is None or self.tls_ca_cert_file is None:
            return None
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_ca_cert_file)


class RunConfig(_Settings):
    """Run-wide semantics, recorded once as the run's first event."""

    n_samples: int = Field(4, description="slots per task (samples per prompt)")
    min_usable_group_size: int | None = Field(None, description="explicit minimum usable slots per group")
    drop_incomplete_group: bool = Field(False, description="drop any group with an unusable slot")
    reward_norm: NormSpec | None = Field(None, description="reward normalization: 'group,group', 'batch,batch', JSON, or none")
    adv_norm: NormSpec | None = Field(None, description="advantage normalization, same forms as --reward-norm")
    group_timeout_s: float | None = Field(600.0, gt=0, description="seconds after issue when missing slots count as timeout")
    dp_size: int = Field(1, ge=1, description="data-parallel trainer ranks; every step has one shard per rank")
    batch_size: int = Field(8, ge=1, description="groups per step (fixed mode) and the feeder's window unit")
    batch_mode: Literal["fixed", "dynamic"] = Field("fixed", description="fixed: batch_size groups per step; "
                                                    "dynamic: the trainable groups of a round, at least dp_size")
    max_batch_size: int = Field(4096, ge=1, description="most groups one step may hold (dynamic mode takes at most "
                                "this many per step; fixed mode's batch_size may not exceed it)")
    max_staleness: int = Field(1, ge=0, description="drop groups more than this many policy versions old")
    max_empty_rounds: int = Field(8, ge=1, description="stall bound: consecutive rounds without a trainable group")
    stall_timeout_s: float = Field(1800.0, ge=0, description="stall bound: seconds without progress (both must hold)")
    partitions: int = Field(1, ge=1, le=64, description="task partitions, each with its own streams (under its own hash "
                            "tag, so on its own Redis Cluster node) and its own assembler (`assembler --partition`)")
    vocab_size: int | None = Field(None, ge=1, le=2**31 - 1, description="the model's vocabulary size: workers and "
                                   "assemblers refuse a sample with a token id at or above it (unset: ids are only "
                                   "checked to be at least 0)")

    @model_validator(mode="after")
    def _check_batching(self) -> RunConfig:
        if self.batch_mode == "fixed" and self.batch_size < self.dp_size:
            raise ValueError(f"batch_size ({self.batch_size}) is smaller than dp_size ({self.dp_size}): every rank "
                             "needs at least one group per step; raise batch_size or lower dp_size")
        if self.batch_mode == "fixed" and self.batch_size > self.max_batch_size:
            raise ValueError(f"batch_size ({self.batch_size}) is over max_batch_size ({self.max_batch_size}); lower "
                             "batch_size or raise max_batch_size")
        if self.max_batch_size < self.dp_size:
            raise ValueError(f"max_batch_size ({self.max_batch_size}) is smaller than dp_size ({self.dp_size}); "
                             "every rank needs at least one group per step")
        return self

    @model_serializer(mode="wrap")
    def _omit_unset_vocab(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A run without a vocabulary records what runs recorded before the field existed, so streamgrp
        # versions without it (which refuse unknown fields) still open the run.
        settings = handler(self)
        if settings.get("vocab_size", 0) is None:
            del settings["vocab_size"]
        return settings

    def policy(self) -> GroupPolicy:
        return GroupPolicy(n_samples=self.n_samples, min_usable_group_size=self.min_usable_group_size,
                           drop_incomplete_group=self.drop_incomplete_group, reward_norm=self.reward_norm,
                           adv_norm=self.adv_norm)


class WorkerConfig(_RoleSettings):
    """A rollout worker process."""

    rollout: str = Field("streamgrp.services.synthetic:synthetic_rollout", description="module:function called per slot")
    concurrency: int = Field(4, ge=1, description="slots run at once (async functions) or threads (sync ones)")
    claim_idle_s: float = Field(30.0, gt=0, description="reclaim a dead worker's task after it sat this long unacknowledged")
    max_tasks: int | None = Field(None, ge=1, description="exit after this many tasks (default: run until stopped)")
    max_entry_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="a sample larger than this once encoded is "
                                 "published as a failed slot saying so (the assembler would dead-letter it)")
    burst: bool = Field(False, description="exit when no task is waiting instead of blocking")
    take_partitions: str | None = Field(None, description="comma-separated run partitions to take tasks from (default "
                                        "all); results always go to their task's partition")

    def partition_numbers(self) -> tuple[int, ...] | None:
        """``take_partitions`` as numbers (None: all), or `ConfigError` naming the setting."""
        if self.take_partitions is None or not self.take_partitions.strip():
            return None
        try:
            return tuple(int(part) for part in self.take_partitions.split(","))
        except ValueError:
            raise ConfigError(f"take_partitions={self.take_partitions!r}: give partition numbers separated by commas, "
                              "like 0,2") from None


class RewarderConfig(_RoleSettings):
    """A reward stage process (`streamgrp rewarder`): scores results published with their reward pending."""

    reward: str | None = Field(None, description="module:function called per result with a ScoreRequest; returns a "
                               "number, one number per row, or None (rejected); sync or async (required)")
    concurrency: int = Field(16, ge=1, description="results scored at once")
    reward_timeout_s: float = Field(60.0, gt=0, description="one scoring's deadline; a timeout is retried")
    retries: int = Field(2, ge=0, description="retries of a scoring that timed out or lost its connection (any "
                         "other exception fails the slot at once)")
    claim_idle_s: float = Field(30.0, gt=0, description="take over a stopped rewarder's results after they sat this "
                                "long unscored")
    burst: bool = Field(False, description="exit once nothing has waited for a reward for 2 seconds")


class FollowConfig(_RoleSettings):
    """A follower (`streamgrp follow NAME`, `streamgrp.store.follower`): a named consumer of one run's stream."""

    follow_stream: Literal["decisions", "slots", "steps"] = Field("decisions", description="the stream to follow")
    follow_start: Literal["first", "now"] = Field("first", description="where a new follower begins: the first entry "
                                                  "the server holds, or what is written from now on (a known one "
                                                  "resumes where it stopped)")
    follow_handler: str | None = Field(None, description="module:function called with each Followed or Skipped item "
                                       "(default: print each as a JSON line)")
    until_finished: bool = Field(False, description="exit once the run has ended and nothing new came for 2 seconds")
    forget: bool = Field(False, description="remove the follower's position (retention stops keeping for it) and exit")
    list_followers: bool = Field(False, description="print every follower of the run (position, lag, skips) and exit")


class InferenceConfig(_Settings):
    """A rollout adapter's inference servers (`streamgrp.services.inference`): `streamgrp worker --rollout
    vllm|sglang|llamacpp` and `streamgrp weight-sync`."""

    server_url: str = Field("http://127.0.0.1:8080", description="inference server base URL; several: "
                            "comma-separated (each request goes to one, chosen by --server-choice)")
    server_choice: Literal["round_robin", "least_loaded"] = Field(
        "round_robin", description="how a request picks its server: round_robin, or least_loaded (fewest "
        "requests this worker has in flight there)")
    server_model: str | None = Field(None, description="model name sent with each request (vLLM needs the served "
                                     "model name; unset: the server's default)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (1.0 samples the policy itself)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; 1.0 is off")
    top_k: int = Field(0, ge=0, description="top-k sampling; 0 is off")
    max_tokens: int = Field(128, ge=1, description="most tokens one completion may have")
    sampling: str | None = Field(None, description="more sampling parameters as a JSON object, sent as the "
                                 "server names them (e.g. '{\"stop\": [\"\\\\n\"], \"seed\": 1}')")
    request_timeout_s: float = Field(120.0, gt=0, description="one HTTP request's deadline, connect to last byte")
    max_attempts: int = Field(4, ge=1, description="tries per generation after transport errors (unreachable, "
                              "timeout, 5xx, a body that is not JSON); 4xx is never retried")
    backoff_s: float = Field(0.5, ge=0, description="first retry's pause; doubled per retry, with jitter")
    backoff_max_s: float = Field(8.0, ge=0, description="longest pause between retries")
    restart_wait_s: float = Field(60.0, ge=0, description="how long one request waits for a lone server that went "
                                  "away (refused, dropped, 503 while loading: a restart for a weight sync) to answer "
                                  "/health again; a restart waited through is not a failed attempt")
    on_abort: Literal["resubmit", "fail"] = Field("resubmit", description="a generation the server aborted "
                                                  "(weight update, preemption): resubmit it with the tokens so "
                                                  "far, or record the slot as failed with the reason")
    max_resubmits: int = Field(4, ge=0, description="resubmissions of one aborted generation before the slot fails")
    segment_tokens: int = Field(0, ge=0, description="partial rollouts: stream each generation and record every "
                                "this many tokens of it, and each aborted or broken part, as a durable segment of its "
                                "slot; a worker that takes over the task of one that stopped continues each slot from "
                                "its segments, not from scratch (0: off)")
    segment_s: float = Field(30.0, ge=0, description="with --segment-tokens: also record a segment once this many "
                             "seconds passed since the last, for slow generations (0: by tokens only)")
    segment_stream: bool = Field(True, description="with --segment-tokens: one streamed request per generation, cut "
                                 "into segments as it arrives; off: a request per segment (each prefills the whole "
                                 "context again)")
    reward: str = Field("streamgrp.services.inference.rewards:answer_reward",
                        description="module:function(prompt, completion_ids, text) -> float, or None to reject")
    vllm_token_ids: Literal["return_token_ids", "tokens_as_token_ids"] = Field(
        "return_token_ids", description="how vLLM returns completion ids: return_token_ids (vLLM >= 0.10.2) or "
        "tokens_as_token_ids ('token_id:N' strings, older vLLM)")
    version_pattern: str = Field(r"@v(\d+)$", description="regex whose group 1 is the weight version in the model "
                                 "name a server reports, for servers that report no weight version of their own")
    keep_text: bool = Field(True, description="keep the completion text in the sample's meta (the token ids are "
                            "what trains; the text is for reading and checks)")


class GatewayConfig(_RoleSettings):
    """`streamgrp gateway`: the OpenAI-compatible endpoint of agent sessions (`streamgrp.services.gateway`),
    in front of the inference servers its [inference] settings name."""

    gateway_host: str = Field("127.0.0.1", min_length=1, description="address the gateway listens on; one other "
                              "machines reach (0.0.0.0) needs a gateway token")
    gateway_port: int = Field(8000, ge=0, le=65535, description="port the gateway listens on (0: any free one)")
    gateway_url: str | None = Field(None, description="the gateway's base URL as agents reach it, handed out with "
                                    "each session (unset: http://HOST:PORT)")
    gateway_token_file: Path | None = Field(None, description="file holding the gateway's token, which opening and "
                                            "ending sessions takes (unset: the token's own environment variable, "
                                            "else a new one written to DATA_DIR/gateway-token, loopback only)")
    gateway_token: SecretStr | None = Field(None, description="the gateway's token itself; environment only",
                                            json_schema_extra={"flag": None})
    dialect: Literal["llamacpp", "vllm", "sglang"] = Field("llamacpp", description="the inference servers' kind")
    tokenizer: str | None = Field(None, description="the model's Hugging Face tokenizer (a directory or name) for "
                                  "its chat template; needed for vllm and sglang (unset with llamacpp: "
                                  "llama-server's own /apply-template and /tokenize)")
    tool_parser: Literal["hermes", "none"] = Field("hermes", description="how tool calls in the model's text become "
                                                   "OpenAI tool_calls: hermes (<tool_call>{json}</tool_call>) or none")
    max_entry_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="a session's sample larger than this once "
                                 "encoded is published as a failed slot saying so")
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="largest request body the gateway reads")
    gateway_threads: int = Field(32, ge=1, description="threads making the store's calls (sessions opened and "
                                 "ended; a turn's record is made on the event loop, on a thread only "
                                 "when that gets no answer or the server is a cluster) at once")
    refresh_s: float = Field(1.0, gt=0, description="how often sessions past their group's deadline are timed out "
                             "and the run's version is read")
    claim_idle_s: float = Field(30.0, gt=0, description="reclaim a dead worker's task after it sat this long "
                                "unacknowledged")
    crash_after_turn: int | None = Field(None, ge=1, description="tests: SIGKILL the gateway right after it records "
                                         "the Nth turn since it started, before that turn is answered")

    def token(self, data_dir: Path) -> tuple[str, Path | None]:
        """(the token, the file a new one was written to or None): from --gateway-token-file, then
        STREAMGRP_GATEWAY_TOKEN, else a new one in ``data_dir`` (mode 0600), which only a loopback gateway
        may make up: a reachable one needs a token its apps were given."""
        given = read_secret(self.gateway_token, self.gateway_token_file, "--gateway-token-file")
        if given is not None:
            return given, None
        if not is_loopback(self.gateway_host):
            raise ConfigError(f"--gateway-host {self.gateway_host} is reachable from other machines, and no gateway "
                              "token is set: give --gateway-token-file or STREAMGRP_GATEWAY_TOKEN (apps open and end "
                              "sessions with it), or listen on 127.0.0.1")
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

    agent: str | None = Field(None, description="module:function(session) run once per slot; returns the reward, "
                              "None to reject, or raises to fail (session.client is an OpenAI client of its session)")
    gateway_url: str = Field("http://127.0.0.1:8000", description="the gateway's base URL")
    gateway_token_file: Path | None = Field(None, description="file holding the gateway's token (unset: the "
                                            "token's own environment variable, else DATA_DIR/gateway-token)")
    gateway_token: SecretStr | None = Field(None, description="the gateway's token itself; environment only",
                                            json_schema_extra={"flag": None})
    concurrency: int = Field(16, ge=1, description="sessions run at once (whole tasks: n_samples each)")
    claim_idle_s: float = Field(30.0, gt=0, description="reclaim a dead worker's task after it sat this long "
                                "unacknowledged")
    max_tasks: int | None = Field(None, ge=1, description="exit after this many tasks (default: run until stopped)")
    burst: bool = Field(False, description="exit when no task is waiting instead of blocking")
    take_partitions: str | None = Field(None, description="comma-separated run partitions to take tasks from (default "
                                        "all); results always go to their task's partition")
    agent_retries: int = Field(6, ge=0, description="retries of each agent request the gateway could not answer "
                               "(it restarts, or an inference server is away)")
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
            raise ConfigError(f"no gateway token: give --gateway-token-file or STREAMGRP_GATEWAY_TOKEN (the gateway's "
                              f"own), or run on the gateway's machine with its --data-dir ({path} is missing)") from None

    def partition_numbers(self) -> tuple[int, ...] | None:
        return WorkerConfig(take_partitions=self.take_partitions).partition_numbers()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is reachable from this machine only."""
    import ipaddress

    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def read_secret(value: SecretStr | None, path: Path | None, flag: str) -> str | None:
    """A secret from its file (first line) or its environment variable's value; None when neither is set."""
    if path is not None:
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read {flag} {path}: {exc.strerror}; fix the path or its permissions") from None
        if not lines or not lines[0].strip():
            raise ConfigError(f"{flag} {path} is empty; write the secret on its first line")
        return lines[0].strip()
    if value is not None:
        if not value.get_secret_value():
            raise ConfigError("an empty secret would turn authentication off; unset it or set one")
        return value.get_secret_value()
    return None


class WeightSyncConfig(_RoleSettings):
    """`streamgrp weight-sync`: after each committed step, tell every inference server to load the new weights."""

    dialect: Literal["vllm", "sglang", "llamacpp"] = Field("sglang", description="the servers' kind")
    weights_dir: Path = Field(Path("weights"), description="where the trainer writes one directory per version "
                              "(vNNNNNN/, safetensors)")
    poll_s: float = Field(0.5, gt=0, description="how often the run's version is checked")
    load_timeout_s: float = Field(600.0, gt=0, description="how long one server may take to load a version")
    llama_server_cmd: str | None = Field(None, description="llamacpp only: command line that starts llama-server "
                                         "on --server-url's port (--reuse-port, model and alias are appended); "
                                         "weight-sync then owns the server and hands over to a new one on each "
                                         "version's model.gguf")
    llama_server_log: Path | None = Field(None, description="llamacpp only: append llama-server's output here "
                                          "(unset: a temporary file; its tail is shown when it fails to start)")
    burst: bool = Field(False, description="serve until the run ends (finished or failed), then stop and exit")


class BatcherConfig(_RoleSettings):
    """The batcher process, which also feeds tasks within the staleness window."""

    round_s: float = Field(1.0, gt=0, description="length of one collection round")
    lease_ttl_s: float = Field(5.0, gt=0, description="a standby takes over this long after the active one died")
    dataset: str | None = Field(None, description="prompts to issue: a JSONL file or module:iterable (unset: no feeding)")
    group_filter: str | None = Field(None, description="module:function predicate over a GroupDecided; False drops it as filtered")
    max_steps: int | None = Field(None, ge=1, description="stop after writing this many steps")
    burst: bool = Field(False, description="exit after the first read that brings nothing new")


class TrainerConfig(_RoleSettings):
    """A reference trainer rank (`streamgrp.consumers.grpo_trainer`).

    ``rank``, ``world_size``, ``local_rank`` and ``dist_url`` left unset come from torchrun's variables
    (`streamgrp.train.distributed.resolve`), so ``torchrun --nproc-per-node N`` needs none of them.
    """

    rank: int | None = Field(None, ge=0, description="this process's DP rank (unset: $RANK as torchrun sets it, else 0)")
    world_size: int | None = Field(None, ge=1, description="DP ranks in all; must equal the run's dp_size "
                                   "(unset: $WORLD_SIZE as torchrun sets it, else 1)")
    local_rank: int | None = Field(None, ge=0, description="this process's index on its machine, for picking a device "
                                   "(unset: $LOCAL_RANK as torchrun sets it, else the rank)")
    dist_url: str | None = Field(None, description="torch.distributed rendezvous (gloo) for world_size > 1 (unset: "
                                 "env:// when torchrun set MASTER_ADDR and MASTER_PORT, else tcp://127.0.0.1:29511)")
    lr: float = Field(0.05, gt=0, description="Adam learning rate")
    fail_at_step: int | None = Field(None, ge=0, description="inject an exception at this step (replay demos, tests)")
    crash_at: str | None = Field(None, pattern=r"^(train|checkpoint):\d+$", description="tests: SIGKILL this rank at "
                                 "a point of a step, 'train:S' after training step S and before committing it, "
                                 "'checkpoint:S' halfway through writing step S's checkpoint; not again when the step is trained again")
    checkpoint_dir: Path | None = Field(None, description="reference trainers (grpo, lm): write a checkpoint (weights "
                                        "and optimizer state, safetensors) here every --checkpoint-every steps, and on "
                                        "start resume from the newest recorded one, training the steps after it again")
    checkpoint_every: int = Field(10, ge=1, description="reference trainer: steps between checkpoints (with "
                                  "--checkpoint-dir)")
    keep_checkpoints: int = Field(2, ge=1, description="reference trainer: checkpoints kept on disk (with "
                                  "--checkpoint-dir); older ones are removed once a newer one is recorded")
    peer_wait_s: float = Field(300.0, gt=0, description="how long a rank waits for the other ranks of its "
                               "group to join (and in any one collective) before it fails naming them")
    train_fn: str = Field("streamgrp.consumers.grpo_trainer:train", description="module:function(client, run, config, metrics=) "
                          "the trainer process runs (streamgrp.consumers.lm_trainer:train: a real language model)")
    model_gguf: Path | None = Field(None, description="lm trainer: the GGUF file of the policy the inference servers "
                                    "serve, loaded in torch (transformers) to recompute log-probabilities")
    lm_lr: float = Field(0.0, ge=0, description="lm trainer: learning rate; 0 only recomputes the log-probabilities "
                         "and reports the mismatch with the server's per step")
    weights_dir: Path | None = Field(None, description="write each version's weights here for `streamgrp "
                                     "weight-sync` (vNNNNNN/: model.safetensors; the lm trainer: model.gguf)")
    gguf_outtype: Literal["f16", "f32"] = Field("f16", description="lm trainer: the float type of the GGUF it "
                                                "writes per version (f16: half the file, llama-server generates "
                                                "about twice as fast on a CPU; f32: what it trained, exactly)")


class DemoConfig(_Settings):
    """`streamgrp demo`: a whole asynchronous RL run on the embedded server."""

    steps: int = Field(60, ge=1, description="optimizer steps to train")
    workers: int = Field(3, ge=1, description="rollout worker processes")
    ranks: int = Field(2, ge=1, description="trainer ranks (DP size)")
    reject_rate: float = Field(0.2, ge=0, le=1, description="fraction of slots the toy reward function rejects")
    fail_rate: float = Field(0.1, ge=0, le=1, description="fraction of slots whose rollout raises")
    as_json: bool = Field(False, description="print the summary as one JSON object on the last line",
                          json_schema_extra={"flag": "json"})
    timeout_s: float = Field(600.0, gt=0, description="stop everything if the run takes longer")
    trainer_fail_at_step: int | None = Field(None, ge=0, description="inject a trainer fault at this step (replay demo)")
    prometheus: bool = Field(False, description="serve every process's metrics and scrape them with a local "
                             "Prometheus (the prometheus binary on PATH); prints its URL")
    model: Path | None = Field(None, description="run on a real language model instead of the toy task: this GGUF "
                               "file served by llama-server, trained by streamgrp.consumers.lm_trainer (needs the llm extra)")
    llama_server: str = Field("llama-server", description="with --model: the llama-server binary (ops/llama-server.sh "
                              "builds one)")
    lm_lr: float = Field(0.0, ge=0, description="lm trainer: learning rate; 0 only recomputes the log-probabilities "
                         "and reports the mismatch with the server's per step")


#: The demo's run settings where the user sets none (flag, environment or TOML): GRPO-style group
#: normalization, groups of 6, a short deadline and stall bound for a run of about a minute.
DEMO_RUN_DEFAULTS: dict[str, Any] = {"n_samples": 6, "batch_size": 8, "max_staleness": 1, "group_timeout_s": 30.0,
                                     "reward_norm": NormSpec("group", "group"), "stall_timeout_s": 120.0}
#: ``demo --model``'s: groups of 4, one rank, a deadline that fits CPU generation; the default staleness
#: bound, since llama-server serves each version the trainer writes (weight-sync hands it over).
MODEL_RUN_DEFAULTS: dict[str, Any] = {"n_samples": 4, "batch_size": 4, "dp_size": 1, "group_timeout_s": 600.0,
                                      "reward_norm": NormSpec("group", "group"), "stall_timeout_s": 600.0}


class AssemblerConfig(_RoleSettings):
    """The group assembler process."""

    tick_interval_s: float = Field(0.25, gt=0, description="how often deadlines are checked")
    read_count: int = Field(512, ge=1, description="entries read and committed per round")
    lease_ttl_s: float = Field(5.0, gt=0, description="a standby takes over this long after the active assembler died")
    max_entry_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="larger slot entries are dead-lettered "
                                 "(as a stub: sizes and a digest, not the payload)")
    read_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="about how many bytes one read round may bring "
                            "in (fewer entries per read once entries are large)")
    max_open_groups: int = Field(100_000, ge=1, description="refuse (dead-letter) a task issued while this many "
                                 "groups are open: a flood of fake tasks cannot exhaust memory")
    burst: bool = Field(False, description="exit after the first read that brings nothing new")
    partition: int = Field(0, ge=0, description="the run partition this assembler folds: a partitioned run has one "
                           "assembler per partition (0 to partitions - 1)")


class ArchiverConfig(_Settings):
    """The archiver process (`streamgrp.services.archiver`), and retention (`streamgrp.services.retention`)."""

    archive_dir: Path | None = Field(None, description="where the run's archive goes (default DATA_DIR/archive/RUN)")
    segment_bytes: int = Field(64 * 1024 * 1024, ge=4096, description="start a new segment file past this size")
    archive_read_count: int = Field(1000, ge=1, description="entries read per stream per pass")
    poll_s: float = Field(0.5, gt=0, description="pause between passes once caught up")
    snapshot_interval_s: float = Field(5.0, ge=0, description="snapshot the run's hashes at most this often")
    retention: bool = Field(False, description="trim the run's streams behind the archive and every reader "
                            "(off by default: the archive then holds the only copy of old entries)")
    retention_interval_s: float = Field(10.0, ge=0, description="seconds between retention passes")
    max_follow_lag_s: float = Field(0.0, ge=0, description="trim past a follower (streamgrp follow) whose oldest "
                                    "unread entry is older than this, recording the skip it then sees (0: never)")
    burst: bool = Field(False, description="archive what is there, snapshot, trim (with --retention) and exit")


class RunsConfig(_Settings):
    """`streamgrp runs`: what to show of each run."""

    sizes: bool = Field(False, description="also show each run's keys, their memory on the server (MEMORY USAGE), "
                        "entries per stream, and its archive's size on disk")


class DeleteConfig(_Settings):
    """`streamgrp delete RUN` (`streamgrp.store.run_admin`): when a run may be deleted, and what goes with it."""

    force: bool = Field(False, description="delete even a live run (a process holds its lease, an archiver writes "
                        "its archive, or it has not ended and was active within --idle-s)")
    delete_archive: bool = Field(False, description="also remove the run's archive directory (kept by default: "
                                 "after retention it holds the only copy of the run)")
    idle_s: float = Field(60.0, ge=0, description="a run that has not ended counts as live while an entry was "
                          "appended or a consumer read within this many seconds")
    yes: bool = Field(False, description="delete without asking (asked on a terminal; without a terminal, "
                      "delete refuses unless this is given)")


class ExportConfig(_Settings):
    """`streamgrp export` (`streamgrp.replay.export`): where the Parquet files go."""

    out: Path | None = Field(None, description="directory for the Parquet files and run.json (default export-RUN)")
    follow: bool = Field(False, description="follow the run: append a Parquet file of its new decisions every "
                         "--flush-s, resuming where the follower --follow-name stopped (see docs/guides/follow.md)")
    follow_name: str = Field("export", description="the follower name --follow records its position under")
    flush_s: float = Field(5.0, gt=0, description="with --follow: seconds between files")


T = TypeVar("T", bound=_Settings)

SECTIONS: dict[str, type[_Settings]] = {
    "connection": ConnectionConfig,
    "run": RunConfig,
    "worker": WorkerConfig,
    "rewarder": RewarderConfig,
    "assembler": AssemblerConfig,
    "batcher": BatcherConfig,
    "trainer": TrainerConfig,
    "demo": DemoConfig,
    "archiver": ArchiverConfig,
    "inference": InferenceConfig,
    "weight_sync": WeightSyncConfig,
    "gateway": GatewayConfig,
    "agent": AgentConfig,
    "runs": RunsConfig,
    "delete": DeleteConfig,
    "export": ExportConfig,
    "follow": FollowConfig,
}


def read_toml(path: str | Path | None) -> dict[str, Any]:
    """The TOML file's tables; None reads ``$STREAMGRP_CONFIG`` if set, else nothing."""
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        return {}
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; fix --config / {CONFIG_ENV}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config file {path} has unknown tables {unknown}; known tables are {sorted(SECTIONS)}")
    return data


def load(model: type[T], *, toml: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None, defaults: Mapping[str, Any] | None = None) -> T:
    """Build one settings model: the model's defaults < ``defaults`` (a command's own, such as the demo's
    run settings) < TOML table < environment < explicit overrides (flags)."""
    section = _section_name(model)
    values: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k in model.model_fields}
    values.update((toml or {}).get(section, {}))
    env = os.environ if env is None else env
    for name in model.model_fields:
        raw = env.get(env_name(name, model))
        if raw is not None:
            values[name] = parse_env_value(model, name, raw)
    for name, value in (overrides or {}).items():
        if name in model.model_fields and value is not None:
            values[name] = value
    try:
        return model(**values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or section}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid [{section}] settings: {problems}") from None


def env_name(field: str, model: type[BaseModel] | None = None) -> str:
    """``STREAMGRP_`` and the flag's name: ``--json`` (field ``as_json``) is ``STREAMGRP_JSON``; a field
    with no flag (a secret) goes by its own name."""
    extra = model.model_fields[field].json_schema_extra if model is not None else None
    if isinstance(extra, dict) and extra.get("flag", field) is None:
        return ENV_PREFIX + field.upper()
    return ENV_PREFIX + flag_name(field, model)[2:].replace("-", "_").upper()


def flag_name(field: str, model: type[BaseModel] | None = None) -> str:
    """``--field-name``, or the field's own short flag (``as_json`` is ``--json``)."""
    extra = model.model_fields[field].json_schema_extra if model is not None else None
    name = extra.get("flag", field) if isinstance(extra, dict) else field
    return "--" + str(name).replace("_", "-")


def parse_env_value(model: type[_Settings], name: str, raw: str) -> Any:
    """Text from an environment variable or flag, turned into what the field expects."""
    annotation = str(model.model_fields[name].annotation)
    if "SecretStr" in annotation:
        return raw  # a password is taken as it is: "none" or surrounding spaces may be part of it
    text = raw.strip()
    if text.lower() in ("none", "null") and "None" in annotation:
        return None
    if "NormSpec" in annotation:
        return parse_norm(text)
    if "bool" in annotation:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{env_name(name, model)}={raw!r}: expected true or false")
    return text


def parse_norm(text: str) -> NormSpec | None:
    """``group,group`` / ``batch,none`` shorthand, a JSON object, or ``none``."""
    if text.lower() in ("none", "null", ""):
        return None
    if text.startswith("{"):
        try:
            return NormSpec(**orjson.loads(text))
        except (orjson.JSONDecodeError, ValidationError, TypeError) as exc:
            raise ConfigError(f"normalization {text!r} is not a valid NormSpec: {exc}") from None
    parts = [p.strip().lower() for p in text.split(",")]
    if len(parts) != 2:
        raise ConfigError(f"normalization {text!r}: write 'MEAN,STD' with each of group, batch or none")
    levels = [None if p in ("none", "null") else p for p in parts]
    try:
        return NormSpec(levels[0], levels[1])
    except ValidationError:
        raise ConfigError(f"normalization {text!r}: each level must be group, batch or none") from None


def _section_name(model: type[_Settings]) -> str:
    for name, candidate in SECTIONS.items():
        if candidate is model:
            return name
    raise KeyError(model)


# -- settings that name Python objects ("module:attribute") ------------------------------------------

def load_object(spec: str) -> Any:
    """Import ``module:attribute`` (attribute paths allowed after the colon)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{spec!r} is not 'module:name'; for example streamgrp.services.synthetic:synthetic_rollout")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name == "consumers":  # the examples' name before they installed inside the package
            raise ConfigError(f"cannot import {module_name!r} for {spec!r}: the examples are "
                              f"'streamgrp.{module_name}' now") from None
        raise ConfigError(f"cannot import {module_name!r} for {spec!r}: {exc}; is it on PYTHONPATH?") from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"{module_name!r} has no attribute {attr!r} (from {spec!r})") from None
    return target


def load_callable(spec: str) -> Callable[..., Any]:
    """Import ``module:function`` and check it can be called."""
    target = load_object(spec)
    if not callable(target):
        raise ConfigError(f"{spec!r} is not callable")
    return target
