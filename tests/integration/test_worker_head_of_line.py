"""A worker at capacity publishes every finished result in the round after it finished, never behind a slow
rollout: results that finish while a publish is on the wire used to wait for the next rollout to finish
(here a 3 s one), which under load pushes them past their group's deadline."""

import time

import pytest

from streamgrp.config import WorkerConfig
from streamgrp.core import codec
from streamgrp.services.synthetic import make_sample
from streamgrp.services.worker import WorkerClient, WorkerProcess
from streamgrp.store.streams import entry_time

PUBLISH_S = 0.2  # a publish this slow makes results finish while it is on the wire
SLOW_S = 3.0


class SlowPublish(WorkerClient):
    """A real worker client whose every publish takes PUBLISH_S longer (a loaded server, a far one)."""

    def publish_many(self, results, **kwargs):
        time.sleep(PUBLISH_S)
        return super().publish_many(results, **kwargs)


@pytest.mark.one_server_kind  # the worker's rounds
def test_one_slow_rollout_holds_no_finished_result_past_its_round(client, make_run, issuer):
    run = make_run(n_samples=4)
    tasks = issuer(run).issue([{"i": i} for i in range(3)])
    slow_task = tasks[0].task_id
    finished: dict[tuple[str, int], float] = {}

    def rollout(request):
        time.sleep(SLOW_S if (request.task_id, request.slot) == (slow_task, 0) else 0.05 * (request.slot + 1))
        finished[(request.task_id, request.slot)] = time.time()
        return make_sample(tokens=4)

    # concurrency 8 over groups of 4: two tasks at once, so the worker is at capacity with a third waiting
    worker = WorkerProcess(SlowPublish(client, run.keys), rollout, WorkerConfig(concurrency=8, burst=True), n_samples=4)
    worker.run()
    assert worker.tasks_done == 3
    published = {}
    for entry_id, fields in client.xrange(run.keys.slots):
        header = fields[b"h"]
        if b'"slot_result"' in header:
            event = codec.decode(fields)
            published[(event.task_id, event.slot)] = entry_time(entry_id.decode())
    assert set(published) == set(finished)
    waits = {key: published[key] - finished[key] for key in finished if key != (slow_task, 0)}
    # A round is one publish (PUBLISH_S) plus the wait for the next slot; behind the slow rollout it was ~3 s.
    held = {key: round(wait, 2) for key, wait in waits.items() if wait > 2 * PUBLISH_S + 0.3}
    assert not held, f"results held behind the slow rollout: {held}"
