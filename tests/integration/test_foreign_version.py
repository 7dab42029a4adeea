"""A policy version key that holds no integer (a trainer's credential may SET it; streamgrp never writes
one) stops no service: the batcher keeps the last good version and says so once, and the next trainer
commit writes a good version again (real server)."""

from __future__ import annotations

import logging

import pytest
import redis
from made_steps import make_steps

from streamgrp.config import BatcherConfig
from streamgrp.services.batcher import Batcher
from streamgrp.store import scripts
from streamgrp.store.version import VersionReader
from streamgrp.train.trainer import TrainerClient


def test_a_version_that_is_no_integer_is_ridden_by_readers_and_mended_by_the_next_commit(client, make_run, caplog):
    run = make_run(n_samples=3, dp_size=1, batch_size=2)
    make_steps(client, run, groups=6, steps=2)
    trainer = TrainerClient(client, run)
    with trainer.batches(rank=0, world_size=1) as batches:
        first = next(iter(batches))
        first.commit()
        assert int(client.get(run.keys.version)) == 1

        client.set(run.keys.version, "x")
        reader = VersionReader(run.keys)
        reader.last = 1
        with caplog.at_level(logging.ERROR, logger="streamgrp.store.version"):
            assert reader.read(client) == 1 and reader.read(client) == 1
        assert sum("holds b'x'" in r.message for r in caplog.records) == 1  # said once
        batcher = Batcher(client, run, BatcherConfig(round_s=0.05, lease_ttl_s=5))
        assert batcher._current_version() == 0  # its last good one: it had read none; no exception

        second = trainer.load(trainer.manifest(1), 0, 1)
        second._client = trainer
        second.commit()  # the commit writes a good version over the foreign value
    assert client.get(run.keys.version) == b"2"


def test_the_trainer_functions_check_their_whole_input_before_writing(client, make_run):
    run = make_run(n_samples=3, dp_size=1, batch_size=2)
    keys = run.keys
    commit = scripts.register(client, "trainer_commit.lua")
    with pytest.raises(redis.ResponseError, match="BAD_INPUT"):
        commit(
            keys=[keys.committed, keys.commits, keys.version, keys.control, keys.attempt],
            args=[0, 0, 1, "{}", "{}", 0, "x"],
        )  # a version that is no number
    record = scripts.register(client, "checkpoint_record.lua")
    with pytest.raises(redis.ResponseError, match="BAD_INPUT"):
        record(keys=[keys.checkpoint, keys.commits, keys.attempt], args=["last", 0, "{}"])
    assert client.hlen(keys.committed) == 0 and client.xlen(keys.commits) == 0 and client.exists(keys.checkpoint) == 0
