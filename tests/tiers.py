"""The test tiers: plain ``pytest`` is the fast tier a developer runs while working; ``pytest --full``
(or ``STREAMGRP_TEST_FULL=1``; what ``.ci/run`` runs) is the whole suite. `tests/conftest.py` decides
which tests each tier collects; property tests ask `examples` how many cases to try."""

from __future__ import annotations

import os

#: ``1``: the whole suite, as ``--full`` sets it (read by test modules as they are imported).
FULL_ENV = "STREAMGRP_TEST_FULL"
#: The fast tier tries this share of a property test's examples (at least `MIN_FAST_EXAMPLES`).
FAST_SHARE = 0.1
MIN_FAST_EXAMPLES = 25


def full() -> bool:
    return os.environ.get(FULL_ENV) == "1"


def examples(count: int) -> int:
    """``count`` property examples in the full suite, a tenth of them (at least 25) in the fast tier."""
    return count if full() else min(count, max(MIN_FAST_EXAMPLES, int(count * FAST_SHARE)))
