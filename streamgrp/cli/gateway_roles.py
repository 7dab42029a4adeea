"""Handlers of `streamgrp gateway` and `streamgrp agent` (`streamgrp.services.gateway`).

Owns turning their settings into the service objects and running them until the process's stop event:
the gateway's token (given, or made up for a loopback gateway and written where a local `streamgrp
agent` finds it), its metrics, and what an agent's code may see of the runner's environment (neither
the server's password nor the gateway's token).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from streamgrp.cli.context import connected, serve_metrics, settings, stop_event
from streamgrp.config import AgentConfig, ConnectionConfig, GatewayConfig, InferenceConfig, RunConfig, load_callable
from streamgrp.errors import ConfigError

__all__ = ["cmd_agent", "cmd_gateway"]

log = logging.getLogger("streamgrp")

#: Secrets an agent's code does not need; its tools and subprocesses would inherit them otherwise.
_AGENT_HIDDEN = (
    "STREAMGRP_PASSWORD",
    "STREAMGRP_PASSWORD_FILE",
    "STREAMGRP_TLS_KEY_FILE",
    "STREAMGRP_GATEWAY_TOKEN",
    "STREAMGRP_GATEWAY_TOKEN_FILE",
)


def _open(client, connection: ConnectionConfig, args: argparse.Namespace, who: str):
    from streamgrp.store.runs import await_run, resolve_run_name

    run = await_run(
        client,
        resolve_run_name(client, connection.run, create=False),
        settings(args, RunConfig),
        stop=stop_event(),
        wait=connection.run is not None,
        who=who,
    )
    log.info("%s joined run %s", who, run.name)
    return run


def cmd_gateway(args: argparse.Namespace) -> int:
    stop = stop_event()  # first: a signal while it starts is not lost
    from streamgrp.cli.extras import require

    require("the gateway", "gateway")
    from streamgrp.services.gateway.gateway import Gateway
    from streamgrp.services.gateway.server import GatewayServer, serve
    from streamgrp.services.gateway.templates import make_template
    from streamgrp.services.gateway.upstream import Upstream

    config = settings(args, GatewayConfig)
    inference = settings(args, InferenceConfig)
    token, written = config.token(settings(args, ConnectionConfig).data_dir)
    if written is not None:
        log.info("gateway token written to %s (a local `streamgrp agent` with the same --data-dir reads it)", written)
    upstream = Upstream.from_config(config.dialect, inference)
    template = make_template(upstream, config.tokenizer)
    with connected(args, role=True) as (client, connection, _):
        run = _open(client, connection, args, "gateway")
        metrics = serve_metrics(config, role="gateway", run=run.name)
        public = config.gateway_url or f"http://{_host(config.gateway_host)}:{config.gateway_port}"
        gateway = Gateway(
            client,
            run,
            upstream,
            template,
            public_url=public,
            tool_parser=config.tool_parser,
            max_entry_bytes=config.max_entry_bytes,
            metrics=metrics,
            threads=config.gateway_threads,
            claim_idle_s=config.claim_idle_s,
            crash_after_turn=config.crash_after_turn,
        )

        def ready(port: int) -> None:
            if config.gateway_url is None and port != config.gateway_port:
                gateway.public_url = f"http://{_host(config.gateway_host)}:{port}"

        server = GatewayServer(
            gateway,
            token=token,
            max_request_bytes=config.max_request_bytes,
            models=(inference.server_model or "policy",),
        )
        try:
            asyncio.run(
                serve(server, config.gateway_host, config.gateway_port, stop, refresh_s=config.refresh_s, ready=ready)
            )
        finally:
            gateway.close()
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    stop = stop_event()
    from streamgrp.cli.extras import require

    require("the agent runner", "gateway")
    from streamgrp.services.gateway.agent import AgentProcess
    from streamgrp.services.worker import WorkerClient

    config = settings(args, AgentConfig)
    if not config.agent:
        raise ConfigError(
            "give --agent module:function, the agent run once per slot (it gets a session whose "
            ".client is an OpenAI client of its own session, and returns the reward)"
        )
    agent = load_callable(config.agent)
    token = config.token(settings(args, ConnectionConfig).data_dir)
    with connected(args, role=True) as (client, connection, _):
        run = _open(client, connection, args, "agent")
        for name in _AGENT_HIDDEN:
            os.environ.pop(name, None)
        worker = WorkerClient(
            client,
            run.keys,
            claim_idle_s=config.claim_idle_s,
            partitions=run.partitions,
            take_from=config.partition_numbers(),
        )
        process = AgentProcess(
            worker,
            agent,
            gateway_url=config.gateway_url,
            token=token,
            n_samples=run.config.n_samples,
            concurrency=config.concurrency,
            max_tasks=config.max_tasks,
            burst=config.burst,
            retries=config.agent_retries,
            request_timeout_s=config.request_timeout_s,
        )
        done = process.run(stop)
        log.info(
            "agent runner %s finished %d tasks; sessions by outcome: %s",
            worker.name,
            done,
            dict(sorted(process.outcomes.items())),
        )
    return 0


def _host(host: str) -> str:
    """``host`` as a URL's host: an unspecified address is reached on loopback, IPv6 in brackets."""
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
