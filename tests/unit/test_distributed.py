"""Where a trainer rank's identity comes from (`streamgrp.train.distributed`): settings, then torchrun, then
defaults."""

from __future__ import annotations

import logging

import pytest
import torch

from streamgrp.config import TrainerConfig, load
from streamgrp.errors import ConfigError
from streamgrp.train.distributed import (
    DEFAULT_DIST_URL,
    Collectives,
    resolve,
    resolve_config,
)

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}


def test_one_process_without_torchrun_or_flags():
    dist = resolve(env={})
    assert (dist.rank, dist.world_size, dist.local_rank, dist.init_method) == (0, 1, 0, DEFAULT_DIST_URL)
    assert not dist.under_torchrun


def test_torchrun_variables_are_the_default():
    dist = resolve(env=TORCHRUN)
    assert (dist.rank, dist.world_size, dist.local_rank, dist.init_method) == (1, 2, 1, "env://")
    assert dist.under_torchrun and dist.sources["rank"] == "torchrun"


def test_flags_override_torchrun_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="streamgrp.train.distributed"):
        dist = resolve(rank=0, dist_url="tcp://10.0.0.1:1234", env=TORCHRUN)
    assert (dist.rank, dist.world_size, dist.init_method) == (0, 2, "tcp://10.0.0.1:1234")
    assert dist.sources == {"rank": "flag", "world_size": "torchrun", "local_rank": "torchrun", "init_method": "flag"}
    assert "rank=0 from the settings overrides 1" in caplog.text


def test_ranks_by_hand_use_the_tcp_default_and_their_rank_as_local_rank():
    dist = resolve(rank=1, world_size=3, env={})
    assert (dist.local_rank, dist.init_method) == (1, DEFAULT_DIST_URL)


def test_env_rendezvous_needs_both_master_variables():
    assert resolve(env={"MASTER_ADDR": "h"}).init_method == DEFAULT_DIST_URL
    assert resolve(env={"MASTER_ADDR": "h", "MASTER_PORT": "1"}).init_method == "env://"


@pytest.mark.parametrize(
    "env, flags, message",
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, {}, "rank 2 (from torchrun) is outside 0..1 (world size from torchrun)"),
        ({}, {"rank": 1}, "rank 1 (from flag) is outside 0..0 (world size from default)"),
        ({"RANK": "one"}, {}, "$RANK='one' is not an integer"),
        ({"WORLD_SIZE": "0"}, {}, "$WORLD_SIZE=0 must be >= 1"),
    ],
)
def test_bad_identities_say_what_to_change(env, flags, message):
    with pytest.raises(ConfigError) as caught:
        resolve(env=env, **flags)
    assert message in str(caught.value)


def test_trainer_settings_leave_the_identity_unset_so_torchrun_fills_it():
    config = load(TrainerConfig, env={})
    assert (config.rank, config.world_size, config.local_rank, config.dist_url) == (None, None, None, None)
    assert resolve_config(config, env=TORCHRUN).rank == 1
    flagged = load(TrainerConfig, env={"STREAMGRP_RANK": "0"})
    assert resolve_config(flagged, env=TORCHRUN).rank == 0


def test_collectives_record_each_call_of_a_step():
    collectives = Collectives(1)
    grads = collectives.all_reduce(torch.ones(5))
    collectives.batch_reduce(torch.zeros(3, dtype=torch.float64))
    assert torch.equal(grads, torch.ones(5))  # one rank: the sum is the tensor itself
    assert collectives.take() == "all_reduce:float32[5] all_reduce:float64[3]"
    assert collectives.take() == "none"


VOTE_RANK = """
import sys
from streamgrp.train.distributed import Collectives, process_group, resolve
rank, url = int(sys.argv[1]), sys.argv[2]
flags = [[False, False], [False, True], [True, True]]
with process_group(resolve(rank=rank, world_size=2, dist_url=url)):
    collectives = Collectives(2)
    print([collectives.any_rank(pair[rank]) for pair in flags], collectives.take())
"""


def test_any_rank_is_true_on_every_rank_when_one_rank_votes_true():
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", VOTE_RANK, str(rank), url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for rank in (0, 1)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    # The votes are not a step's training calls: nothing recorded for the collectives log line.
    assert [out.strip() for out, _ in outputs] == ["[False, True, True] none"] * 2
    assert Collectives(1).any_rank(True) is True and Collectives(1).any_rank(False) is False
