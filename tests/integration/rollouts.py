"""Rollout functions that crash tests load into worker processes by ``module:function``."""

import time

from streamgrp.services.synthetic import synthetic_rollout


def stalls_at_slot_two(request):
    """The synthetic rollout, except slot 2 hangs: a SIGKILL then lands mid-group for sure."""
    if request.slot == 2:
        time.sleep(60)
    return synthetic_rollout(request)


def credential_free_toy(request):
    """The demo's toy rollout, after checking that the worker gave rollout code no credential to pass on."""
    import os
    from urllib.parse import urlsplit

    from consumers.toy_task import rollout

    seen = [name for name in ("STREAMGRP_PASSWORD", "STREAMGRP_PASSWORD_FILE", "STREAMGRP_TLS_KEY_FILE")
            if name in os.environ]
    if urlsplit(os.environ.get("STREAMGRP_REDIS_URL", "")).password is not None:
        seen.append("the password in STREAMGRP_REDIS_URL")
    if seen:
        raise RuntimeError(f"the rollout sees credentials: {', '.join(seen)}")
    return rollout(request)
