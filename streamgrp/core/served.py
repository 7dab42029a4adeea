"""Whether the policy the workers are served keeps up with the run's: the warning for weights that are
not being published (an inference server left on version 0 while the trainer goes on), which
otherwise shows only as every group dropped stale and, much later, as a stall.

Pure: the batcher hands it the newest policy version among the samples of each group decided (the
version the workers' servers reported) and, at each round's end, the run's version and the time.
The served version is *behind* when it is more than ``max_staleness`` versions older than the run's,
so that every group it produces is stale, while groups keep being decided (no groups at all is the
stall bound's business, `streamgrp.core.stall`). Behind for ``grace_s``, it warns, then at most once a
minute while it lasts. Invariants: ``behind_seconds`` is 0 whenever the served version is within the
staleness bound or no group was decided in the last ``grace_s``; a warning names both versions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GRACE_S = 30.0
WARNING_INTERVAL_S = 60.0


@dataclass
class ServedTracker:
    max_staleness: int
    grace_s: float = GRACE_S
    served: int | None = None  # the newest version among decided groups' samples
    last_decided: float | None = None
    behind_since: float | None = None
    _last_warning: float | None = field(default=None, repr=False)

    def decided(self, newest_member_version: int | None, now: float) -> None:
        """A group was decided; ``newest_member_version``: its newest sample's policy version (None: unknown)."""
        self.last_decided = now
        if newest_member_version is not None and (self.served is None or newest_member_version > self.served):
            self.served = newest_member_version

    def behind_seconds(self, run_version: int, now: float) -> float:
        """How long the served version has been too far behind ``run_version`` (0: it is not)."""
        behind = (
            self.served is not None
            and run_version - self.served > self.max_staleness
            and self.last_decided is not None
            and now - self.last_decided < self.grace_s
        )
        if not behind:
            self.behind_since = None
            return 0.0
        if self.behind_since is None:
            self.behind_since = now
        return now - self.behind_since

    def warning(self, run_version: int, now: float) -> str | None:
        """The message to log at a round's end, when one is due."""
        behind = self.behind_seconds(run_version, now)
        if behind < self.grace_s:
            return None
        if self._last_warning is not None and now - self._last_warning < WARNING_INTERVAL_S:
            return None
        self._last_warning = now
        return (
            f"workers serve v{self.served}, the run is at v{run_version}: are weights being published? For "
            f"{behind:.0f}s every group decided was more than max_staleness={self.max_staleness} versions behind, "
            "so each is dropped as stale. The trainer must write each version's weights (--weights-dir; the lm "
            "trainer writes vNNNNNN/model.gguf) and `streamgrp weight-sync` must hand them to the inference "
            "servers (check its log and the WeightsServed events in the control stream)."
        )
