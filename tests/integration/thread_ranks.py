"""Thread ranks of one trainer group: ``agree`` for ranks that are threads of one test process.

`ThreadGroup.for_rank` is an element-wise maximum over the ranks' values, as the MAX all-reduce of
`streamgrp.train.distributed.Collectives.max_over_ranks` is over processes (which
`tests/unit/test_distributed.py` runs on a real gloo group). Records each rank's per-step leaving votes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

#: Length of the per-step vote (`streamgrp.train.agreement.GroupVote.step`); the plan vote is shorter.
STEP_VOTE = 7


class ThreadGroup:
    def __init__(self, world_size: int = 2) -> None:
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.values: list[Sequence[int]] = [()] * world_size
        self.votes: dict[int, list[bool]] = {rank: [] for rank in range(world_size)}

    def for_rank(self, rank: int):
        def reduce_max(values: Sequence[int]) -> list[int]:
            self.values[rank] = list(values)
            if len(values) == STEP_VOTE:
                self.votes[rank].append(bool(values[0]))
            self.barrier.wait()
            result = [max(column) for column in zip(*self.values)]
            self.barrier.wait()  # every rank read the values before any votes again
            return result

        return reduce_max
