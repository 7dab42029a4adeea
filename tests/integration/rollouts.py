"""Rollout functions that crash tests load into worker processes by ``module:function``."""

import time

from streamgrp.services.synthetic import synthetic_rollout


def stalls_at_slot_two(request):
    """The synthetic rollout, except slot 2 hangs: a SIGKILL then lands mid-group for sure."""
    if request.slot == 2:
        time.sleep(60)
    return synthetic_rollout(request)
