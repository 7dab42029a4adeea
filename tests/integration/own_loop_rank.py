"""A data-parallel rank of a minimal own trainer loop, written from the README: gloo, `Collectives`,
`TrainerClient.batches`. Its "gradient" is one all-reduce of ``[step, step_loss_tokens]``, so a sum
over ranks that trained different steps shows in the record.

    python own_loop_rank.py REDIS_URL RUN RANK WORLD DIST_URL RECORD [KILL_AT_STEP]

Appends one JSON line per trained step to RECORD: ``rank``, ``step``, ``attempt``, the reduced
``[step sum, loss-token sum]`` and the step's own loss tokens. With KILL_AT_STEP the rank SIGKILLs
itself after training that step and before committing it.
"""

from __future__ import annotations

import os
import signal
import sys

import orjson
import redis
import torch
import torch.distributed as dist

from streamgrp.store.runs import open_run
from streamgrp.train.distributed import Collectives
from streamgrp.train.trainer import TrainerClient


def main(url: str, run_name: str, rank: int, world: int, dist_url: str, record: str, kill_at: int | None) -> None:
    dist.init_process_group("gloo", init_method=dist_url, rank=rank, world_size=world)
    client = redis.Redis.from_url(url)
    trainer = TrainerClient(client, open_run(client, run_name), poll_s=0.1)
    collectives = Collectives(world)
    with trainer.batches(rank=rank, world_size=world, agree=collectives.any_rank) as batches:
        for batch in batches:
            gradient = torch.tensor([float(batch.step), float(batch.step_loss_tokens)])
            collectives.all_reduce(gradient)
            with open(record, "ab") as out:
                out.write(
                    orjson.dumps(
                        {
                            "rank": rank,
                            "step": batch.step,
                            "attempt": batch.attempt,
                            "reduced": gradient.tolist(),
                            "loss_tokens": batch.step_loss_tokens,
                        }
                    )
                    + b"\n"
                )
            if batch.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            batch.commit()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], int(args[2]), int(args[3]), args[4], args[5], int(args[6]) if len(args) > 6 else None)
