"""Length buckets of generations, for the bias monitor (what became of long generations against short
ones): the batcher's ``streamgrp_generations_total{length}`` and the report's bias chart use these
same buckets. Pure."""

from __future__ import annotations

#: Upper bounds of the length buckets (a generation's loss tokens), and their labels; above the last: "more".
LENGTH_BOUNDS = (256, 1024, 4096, 16384)
LENGTH_LABELS = ("256", "1k", "4k", "16k", "more")


def length_bucket(tokens: int) -> str:
    """The label of the bucket a generation of ``tokens`` loss tokens falls in."""
    for bound, label in zip(LENGTH_BOUNDS, LENGTH_LABELS):
        if tokens <= bound:
            return label
    return LENGTH_LABELS[-1]
