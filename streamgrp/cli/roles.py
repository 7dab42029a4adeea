"""Handlers of the subcommands that run a process of a run: server, worker, assembler, batcher, trainer,
archiver, and the demo that runs them all.

Owns turning a role's settings into the service object and running it until its stop event (or,
with ``--burst``, until it is drained). Each handler imports its service only when it runs, so one
command never pays for another's imports (the trainer's torch above all).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from streamgrp.cli.context import connected, interrupted_exit_code, serve_metrics, settings, stop_event
from streamgrp.config import (
    DEMO_RUN_DEFAULTS,
    MODEL_RUN_DEFAULTS,
    ArchiverConfig,
    AssemblerConfig,
    BatcherConfig,
    ConnectionConfig,
    DemoConfig,
    InferenceConfig,
    RewarderConfig,
    RunConfig,
    TrainerConfig,
    WeightSyncConfig,
    WorkerConfig,
    env_name,
    load,
    load_callable,
    read_toml,
)
from streamgrp.errors import ConfigError, StreamgrpError

__all__ = [
    "REFERENCE_TRAINER",
    "cmd_archiver",
    "cmd_assembler",
    "cmd_batcher",
    "cmd_demo",
    "cmd_server",
    "cmd_trainer",
    "cmd_weight_sync",
    "cmd_worker",
]

#: The reference GRPO trainer `streamgrp trainer` runs; an example, so named by string, never imported here.
REFERENCE_TRAINER = "streamgrp.consumers.grpo_trainer:train"

log = logging.getLogger("streamgrp")  # the CLI's messages log as "streamgrp", whichever module sends them


def _stoppable(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A handler that runs until stopped, with the process's SIGTERM and SIGINT handlers installed before
    anything else, so a signal that arrives while it starts (imports, settings, the server) is not lost.

    A role stopped that way finishes its round, releases what it holds and exits 0, as a server does: a
    supervisor (systemd, honcho, Kubernetes) stopping a service is not a failure. The demo is the
    exception (`cmd_demo`)."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        stop_event()
        return handler(args)

    return run


@_stoppable
def cmd_server(args: argparse.Namespace) -> int:
    from streamgrp.cli.server_foreground import serve_forever

    connection = settings(args, ConnectionConfig)
    return serve_forever(
        connection.data_dir,
        port=args.port,
        bind=args.bind,
        appendfsync=args.appendfsync,
        password=connection.secret(),
        acl_file=args.acl_file,
        tls=connection.tls(),
        maxmemory=connection.maxmemory,
        stop=stop_event(),
    )


def _join(client, connection: ConnectionConfig, args: argparse.Namespace, role: str, *, burst: bool = False):
    """The batcher creates the run (or joins it); every other role opens it read-only, waiting for the batcher
    to create it when ``--run`` names it (not in burst mode), else taking the latest run."""
    from streamgrp.store.runs import await_run, join_run, resolve_run_name

    if role == "batcher":
        run = join_run(client, resolve_run_name(client, connection.run, create=True), settings(args, RunConfig))
    else:
        run_name = resolve_run_name(client, connection.run, create=False)
        run = await_run(
            client,
            run_name,
            settings(args, RunConfig),
            stop=stop_event(),
            wait=connection.run is not None and not burst,
            who=role,
        )
    log.info("%s joined run %s", role, run.name)
    return run


@_stoppable
def cmd_worker(args: argparse.Namespace) -> int:
    from streamgrp.services.worker import WorkerClient, WorkerProcess
    from streamgrp.store.version import VersionReader

    config = settings(args, WorkerConfig)
    rollout = _rollout(config.rollout, args)
    with connected(args, role=True) as (client, connection, handle):
        run = _join(client, connection, args, "worker", burst=config.burst)
        _lend_to_rollouts(client, run.keys, handle.url)
        metrics = serve_metrics(config, role="worker", run=run.name)
        worker = WorkerClient(
            client,
            run.keys,
            claim_idle_s=config.claim_idle_s,
            max_entry_bytes=config.max_entry_bytes,
            metrics=metrics,
            partitions=run.partitions,
            take_from=config.partition_numbers(),
        )
        process = WorkerProcess(
            worker,
            rollout,
            config,
            n_samples=run.config.n_samples,
            version=functools.partial(VersionReader(run.keys).read, client),
            metrics=metrics,
        )
        done = process.run(stop_event())
        log.info("worker %s finished %d tasks", worker.name, done)
    return 0


@_stoppable
def cmd_rewarder(args: argparse.Namespace) -> int:
    from streamgrp.services.rewarder import Rewarder
    from streamgrp.store.rewards import RewardClient

    config = settings(args, RewarderConfig)
    if not config.reward:
        raise ConfigError("streamgrp rewarder needs --reward module:function (the function that scores a ScoreRequest)")
    reward = load_callable(config.reward)
    with connected(args, role=True) as (client, connection, handle):
        run = _join(client, connection, args, "rewarder", burst=config.burst)
        _lend_to_rollouts(client, run.keys, handle.url)
        metrics = serve_metrics(config, role="rewarder", run=run.name)
        rewarder = Rewarder(
            RewardClient(client, run.keys, claim_idle_s=config.claim_idle_s, partitions=run.partitions),
            reward,
            concurrency=config.concurrency,
            timeout_s=config.reward_timeout_s,
            retries=config.retries,
            metrics=metrics,
        )
        posted = rewarder.run(stop_event(), until_idle_s=2.0 if config.burst else None)
        log.info("rewarder %s posted %d rewards", rewarder.client.name, posted)
    return 0


#: Secrets a rollout does not need; its subprocesses would inherit them from the worker's environment.
_ROLLOUT_HIDDEN = ("STREAMGRP_PASSWORD", "STREAMGRP_PASSWORD_FILE", "STREAMGRP_TLS_KEY_FILE")


def _lend_to_rollouts(client, keys, url: str) -> None:
    """Give rollout code what it needs (weights by version) through the worker's own connection, and leave in
    the environment only the run's name and the server's address without credentials."""
    from streamgrp.store.credentials import url_without_password
    from streamgrp.store.lent import lend

    lend(client, keys)
    for name in _ROLLOUT_HIDDEN:
        os.environ.pop(name, None)
    os.environ["STREAMGRP_REDIS_URL"], os.environ["STREAMGRP_RUN"] = url_without_password(url), keys.run


def _rollout(spec: str, args: argparse.Namespace):
    """An inference adapter for ``vllm``, ``sglang`` or ``llamacpp`` (its [inference] settings), else
    ``module:function``."""
    from streamgrp.services.inference import ADAPTERS, build_rollout

    if spec in ADAPTERS:
        return build_rollout(spec, settings(args, InferenceConfig))
    return load_callable(spec)


@_stoppable
def cmd_assembler(args: argparse.Namespace) -> int:
    from streamgrp.services.assembler import Assembler

    config = settings(args, AssemblerConfig)
    with connected(args, role=True) as (client, connection, _):
        run = _join(client, connection, args, "assembler", burst=config.burst)
        metrics = serve_metrics(
            config,
            role="assembler",
            run=run.name,
            client=client,
            streams=run.streams([config.partition]) if config.partition < run.config.partitions else {},
        )
        assembler = Assembler(client, run, config, metrics=metrics, partition=config.partition)
        written = assembler.run(stop_event(), burst=config.burst)
        log.info("assembler %s wrote %d decisions", assembler.name, written)
    return 0


@_stoppable
def cmd_batcher(args: argparse.Namespace) -> int:
    from streamgrp.services.batcher import Batcher
    from streamgrp.services.feeder import DatasetIdentity, load_dataset

    config = settings(args, BatcherConfig)
    group_filter = load_callable(config.group_filter) if config.group_filter else None
    dataset = load_dataset(config.dataset) if config.dataset else None
    with connected(args, role=True) as (client, connection, _):
        run = _join(client, connection, args, "batcher")
        metrics = serve_metrics(config, role="batcher", run=run.name, client=client, streams=run.streams())
        batcher = Batcher(
            client,
            run,
            config,
            group_filter=group_filter,
            dataset=dataset,
            metrics=metrics,
            dataset_identity=DatasetIdentity.of(config.dataset) if config.dataset else None,
        )
        outcome = batcher.run(stop_event(), burst=config.burst)
        log.info(
            "batcher %s: run %s is %s after %d steps written here",
            batcher.name,
            run.name,
            outcome,
            batcher.steps_written,
        )
    return 1 if outcome == "failed" else 0


@_stoppable
def cmd_trainer(args: argparse.Namespace) -> int:
    from streamgrp.cli.extras import require
    from streamgrp.train.distributed import resolve_config

    require("a trainer rank", "trainer")  # every trainer reads batches through streamgrp.train, which is torch
    config = settings(args, TrainerConfig)
    train = load_callable(config.train_fn)
    ranks = resolve_config(config)  # flags, else torchrun's RANK/WORLD_SIZE/..., else one process
    with connected(args, role=True) as (client, connection, _):
        run = _join(client, connection, args, f"trainer rank {ranks.rank}")
        try:
            steps = train(
                client, run, config, metrics=serve_metrics(config, role="trainer", run=run.name, rank=ranks.rank)
            )
        except StreamgrpError:
            raise
        except Exception as exc:
            if not stop_event().is_set():
                raise
            # A peer rank that stopped first ends this rank's collective: an effect of the stop, not a fault
            # of the step, which stays uncommitted (not failed) for the next start (streamgrp.train.trainer).
            log.warning(
                "trainer rank %d stopped during a step (%s: %s); it resumes there at the next start",
                ranks.rank,
                type(exc).__name__,
                str(exc).splitlines()[0][:200] if str(exc) else "",
            )
        else:
            log.info("trainer rank %d committed %d steps", ranks.rank, steps)
    if ranks.world_size > 1:
        _exit_without_finalizing(0)
    return 0


def _exit_without_finalizing(code: int) -> None:
    """End a rank that was in a process group without the interpreter's finalization: its steps are
    committed and its process group destroyed, yet torch's C++ threads can still abort the process while
    Python tears down (SIGABRT, "terminate called without an active exception", seen once in CI after a
    rank's last commit line), which its supervisor would report as a crash. Nothing is left to flush but
    the logs and the standard streams."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


@_stoppable
def cmd_weight_sync(args: argparse.Namespace) -> int:
    from streamgrp.services.inference import make_dialect, server_urls
    from streamgrp.services.inference.weight_sync import LlamaServerProcess, WeightSync
    from streamgrp.store.runs import open_run, resolve_run_name

    config = settings(args, WeightSyncConfig)
    inference = settings(args, InferenceConfig)
    urls = server_urls(inference)
    llama = None
    if config.dialect == "llamacpp":
        if not config.llama_server_cmd or len(urls) != 1:
            raise ConfigError(
                "--dialect llamacpp: weight-sync restarts the one llama-server it owns; give "
                "--llama-server-cmd (its command line without --model) and one --server-url"
            )
        llama = LlamaServerProcess(
            config.llama_server_cmd, urls[0], ready_timeout_s=config.load_timeout_s, log_path=config.llama_server_log
        )
    with connected(args, role=True) as (client, connection, _):
        run = open_run(client, resolve_run_name(client, connection.run, create=False))
        serve_metrics(config, role="weight-sync", run=run.name)  # its process metrics and the run's info
        sync = WeightSync(
            client,
            run.keys,
            make_dialect(config.dialect, inference),
            urls,
            config.weights_dir,
            load_timeout_s=config.load_timeout_s,
            llama=llama,
        )
        try:
            loaded = sync.run(stop_event(), poll_s=config.poll_s, burst=config.burst)
        finally:
            if llama is not None:
                llama.stop()
        log.info("weight-sync for run %s: %d loads", run.name, loaded)
    return 0


@_stoppable
def cmd_archiver(args: argparse.Namespace) -> int:
    from streamgrp.services.archiver import Archiver, default_archive_dir
    from streamgrp.store.runs import open_run, resolve_run_name

    config = settings(args, ArchiverConfig)
    stop = stop_event()
    with connected(args, role=True) as (client, connection, _):
        while True:  # the archiver never creates a run: it waits for the one it was given
            try:
                run = open_run(client, resolve_run_name(client, connection.run, create=False))
                break
            except ConfigError:
                if config.burst or connection.run is None or stop.wait(1.0):
                    raise
        directory = config.archive_dir or default_archive_dir(connection.data_dir, run.name)
        archiver = Archiver(client, run.keys, directory, config, dp_size=run.config.dp_size)
        log.info(
            "archiver for run %s writing to %s (retention %s)", run.name, directory, "on" if config.retention else "off"
        )
        started = time.monotonic()
        archived = archiver.run(stop, burst=config.burst)
        log.info(
            "archiver: %d entries archived in %.1fs, %d trimmed from the server",
            archived,
            time.monotonic() - started,
            archiver.trimmed,
        )
    return 0


@_stoppable
def cmd_demo(args: argparse.Namespace) -> int:
    from streamgrp.cli.demo import run_demo
    from streamgrp.cli.extras import require

    require("the demo (its trainer ranks, and its toy task's workers)", "trainer")
    toml = read_toml(args.config)
    connection = load(ConnectionConfig, toml=toml, overrides=vars(args))
    demo = load(DemoConfig, toml=toml, overrides=vars(args))
    defaults = DEMO_RUN_DEFAULTS
    if demo.model is not None:  # a real model: its own defaults and processes (streamgrp.cli.demo_model)
        from streamgrp.cli.demo_model import run_model_demo as run_demo

        require("demo --model (its trainer loads the GGUF with transformers)", "llm")
        defaults = MODEL_RUN_DEFAULTS
        if not _set_by_user("steps", DemoConfig, "demo", args, toml):
            demo = demo.model_copy(update={"steps": 8})
    # The demo's settings sit under the user's: a flag, a STREAMGRP_ variable or the TOML file wins.
    run_settings = load(RunConfig, toml=toml, overrides=vars(args), defaults=defaults)
    demo = _ranks_from_dp_size(demo, run_settings, toml, args)
    try:
        run_demo(connection, run_settings, demo, stop=stop_event())
    except KeyboardInterrupt:
        # Unlike a role, the demo is a job that runs to an end: a stop signal means it did not finish, so it
        # exits as the shell reports a job a signal ended (130 SIGINT, 143 SIGTERM), once everything stopped.
        print("\nstreamgrp demo: interrupted; every process it started was stopped", file=sys.stderr)
        return interrupted_exit_code()
    return 0


def _set_by_user(name: str, model: type, section: str, args: argparse.Namespace, toml: dict[str, Any]) -> bool:
    """Whether a flag, the setting's STREAMGRP_ variable or the TOML file gives ``name``."""
    return getattr(args, name, None) is not None or env_name(name, model) in os.environ or name in toml.get(section, {})


def _ranks_from_dp_size(
    demo: DemoConfig, run_settings: RunConfig, toml: dict[str, Any], args: argparse.Namespace
) -> DemoConfig:
    """The demo starts ``--ranks`` trainer ranks, so the run's dp_size is that number: a --dp-size given
    alone sets it, and one that disagrees with --ranks is an error rather than silently replaced."""
    dp_given = _set_by_user("dp_size", RunConfig, "run", args, toml)
    ranks_given = _set_by_user("ranks", DemoConfig, "demo", args, toml)
    if not dp_given or run_settings.dp_size == demo.ranks:
        return demo
    if ranks_given:
        raise ConfigError(
            f"--dp-size {run_settings.dp_size} and --ranks {demo.ranks} disagree: the demo starts one "
            "trainer process per rank, so give one of them (or the same number to both)"
        )
    return demo.model_copy(update={"ranks": run_settings.dp_size})
