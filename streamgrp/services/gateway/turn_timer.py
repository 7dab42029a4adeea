"""`TurnTimer`: a turn's clock, apart from the time it waited for inference servers (the gateway's overhead)."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class TurnTimer:
    """A turn's clock: when it started and how long it waited for inference servers (template, tokenizer,
    generation) since."""

    started: float
    upstream: float = 0.0

    @classmethod
    def start(cls) -> TurnTimer:
        return cls(time.perf_counter())

    def own(self) -> float:
        """The turn's time so far apart from the inference servers': the gateway's overhead."""
        return max(0.0, time.perf_counter() - self.started - self.upstream)
