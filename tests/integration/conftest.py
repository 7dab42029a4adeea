"""Factories for integration tests: a joined run, issuers, workers and assemblers on a real server."""

from __future__ import annotations

import threading

import pytest

from streamgrp.config import AssemblerConfig, RunConfig, WorkerConfig
from streamgrp.services.assembler import Assembler
from streamgrp.services.worker import WorkerClient, WorkerProcess
from streamgrp.store.runs import join_run
from streamgrp.store.tasks import TaskIssuer


@pytest.fixture
def make_run(client, run_name):
    def make(**run_settings):
        return join_run(client, run_name, RunConfig(**run_settings))

    return make


@pytest.fixture
def drain():
    """Run workers then the assembler to completion, in burst mode."""

    def run(client, run, rollout, *, concurrency=4, assembler_config=None):
        worker = WorkerProcess(
            WorkerClient(client, run.keys),
            rollout,
            WorkerConfig(burst=True, concurrency=concurrency),
            n_samples=run.config.n_samples,
        )
        worker.run()
        assembler = Assembler(client, run, assembler_config or AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05))
        return assembler.run(burst=True)

    return run


@pytest.fixture
def issuer(client):
    def make(run):
        return TaskIssuer(client, run.keys)

    return make


@pytest.fixture
def background():
    """Start callables on threads; stop and join them at teardown."""
    stops, threads = [], []

    def start(target, *args, **kwargs):
        stop = threading.Event()
        thread = threading.Thread(target=target, args=args, kwargs={**kwargs, "stop": stop}, daemon=True)
        thread.start()
        stops.append(stop)
        threads.append(thread)
        return stop, thread

    yield start
    for stop in stops:
        stop.set()
    for thread in threads:
        thread.join(timeout=10)
