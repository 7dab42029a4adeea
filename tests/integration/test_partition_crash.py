"""A partitioned run on its own 3-node cluster: SIGKILL the assembler of one partition and the server
of the node that holds another, restart both (the node from its AOF), and every task still gets
exactly one decision, in its own partition, with every slot entry acknowledged.

The cluster's nodes write their AOF with ``appendfsync always``: a node that is SIGKILLed keeps every
write it answered, which is what a partitioned run on a cluster needs (see the README's partitioned
runs section) since a batcher or feeder acts on one node's answer in another node's keys.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
from processes import RoleProcess, wait_until

from streamgrp.config import RunConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, SlotResult
from streamgrp.store.connection import connect
from streamgrp.store.keys import ASSEMBLER_GROUP, task_partition
from streamgrp.store.runs import join_run
from streamgrp.store.tasks import TaskIssuer

pytestmark = pytest.mark.slow

GROUPS = 600
PARTITIONS = 3
PROMPT = {"tokens": 32, "reject_rate": 0.1, "fail_rate": 0.1, "seed": 5, "sleep_s": 0.004}


@pytest.fixture
def own_cluster(tmp_path):
    from cluster import LocalCluster, cluster_binaries

    binaries = cluster_binaries()
    if binaries is None:
        pytest.skip("no redis-server and redis-cli to start a local Redis Cluster with")
    cluster = LocalCluster(tmp_path / "cluster", *binaries, appendfsync="always")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _decided(client, run) -> int:
    return sum(client.hlen(part.decided) for part in run.partitions)


def test_sigkill_a_partitions_assembler_and_another_partitions_node_loses_and_doubles_nothing(
    own_cluster, tmp_path, run_name
):
    rng = random.Random(7)
    client = connect(own_cluster.url, cluster=True)
    run = join_run(client, run_name, RunConfig(n_samples=4, group_timeout_s=3600.0, partitions=PARTITIONS))
    issued = TaskIssuer(client, run.keys, partitions=run.partitions).issue([PROMPT] * GROUPS)
    env = {"STREAMGRP_CLUSTER": "1", "STREAMGRP_REDIS_URL": own_cluster.url}
    common = ["--run", run_name]
    workers = [
        RoleProcess("worker", [*common, "--concurrency", "4", "--claim-idle-s", "2"], tmp_path / f"w{i}", env)
        for i in range(2)
    ]
    assemblers = [
        RoleProcess(
            "assembler",
            [*common, "--partition", str(p), "--lease-ttl-s", "1", "--tick-interval-s", "0.1"],
            tmp_path / f"asm{p}",
            env,
        )
        for p in range(PARTITIONS)
    ]
    processes = [*workers, *assemblers]
    for process in processes:
        process.log_dir.mkdir()
        process.start()
    victim_node = client.get_node_from_key(run.partitions[2].slots).port
    assert victim_node != client.get_node_from_key(run.partitions[1].slots).port  # two nodes hit, not one twice
    try:
        wait_until(
            lambda: client.hlen(run.partitions[1].decided) > 10,
            timeout=60,
            message="partition 1's assembler to decide something",
        )
        time.sleep(rng.uniform(0.05, 0.3))
        assemblers[1].kill()  # mid-fold, holding its lease
        wait_until(
            lambda: client.hlen(run.partitions[2].decided) > 10,
            timeout=60,
            message="partition 2's assembler to decide something",
        )
        own_cluster.kill(victim_node)  # the node of partition 2's keys, with its assembler mid-round
        time.sleep(1.0)
        own_cluster.restart(victim_node)
        assemblers[1].start()

        wait_until(lambda: _decided(client, run) == GROUPS, timeout=240, interval=0.2, message="every task decided")
        for part in run.partitions:
            wait_until(
                lambda part=part: client.xpending(part.slots, ASSEMBLER_GROUP)["pending"] == 0,
                timeout=60,
                message=f"partition {part.index}'s slot log fully acknowledged",
            )
    finally:
        for process in processes:
            if process.proc is not None and process.proc.poll() is None:
                process.kill()
        failed = [p.output()[-3000:] for p in processes if p.proc is not None and p.proc.returncode not in (0, -9)]
    assert not failed, "\n".join(failed)

    every = Counter()
    for part in run.partitions:
        decided = [codec.decode(f) for _, f in client.xrange(part.decisions)]
        tasks = Counter(d.task_id for d in decided if isinstance(d, GroupDecided))
        assert all(n == 1 for n in tasks.values()), f"partition {part.index} decided a task twice"
        assert all(task_partition(t, PARTITIONS) == part.index for t in tasks)
        every.update(tasks)
    assert every == Counter({event.task_id: 1 for event in issued})
    assert assemblers[1].starts == 2 and own_cluster.processes[own_cluster.ports.index(victim_node)].poll() is None


def test_a_publish_whose_node_is_down_rides_the_outage_and_lands_once(own_cluster, run_name):
    """A keys-layout publish is one pipeline (the staged payloads and the function); a cluster pipeline hands
    back a dead node's connection error as a reply instead of raising it, so the worker rides the outage
    itself: it neither dies nor loses the results, and they land once the node is back."""
    import threading

    from streamgrp.services.synthetic import make_sample
    from streamgrp.services.worker_client import WorkerClient

    client = connect(own_cluster.url, cluster=True)
    run = join_run(client, run_name, RunConfig(n_samples=2))
    [task] = TaskIssuer(client, run.keys).issue([{}])
    worker = WorkerClient(client, run.keys)
    [taken] = worker.take(1, block_ms=None)
    port = client.get_node_from_key(run.keys.slots).port
    outages = client.outage.count
    own_cluster.kill(port)
    restart = threading.Timer(1.0, own_cluster.restart, [port])
    restart.start()
    try:
        ids = worker.publish_many([(task.task_id, slot, make_sample(tokens=32)) for slot in range(2)], done=[taken])
    finally:
        restart.join()
    assert client.outage.count > outages
    # The group log holds the task's own entry too: only its slot results count.
    results = {
        entry_id.decode(): event
        for entry_id, fields in client.xrange(run.keys.slots)
        if isinstance(event := codec.decode(fields), SlotResult) and event.task_id == task.task_id
    }
    assert sorted(event.slot for event in results.values()) == [0, 1]
    assert sorted(ids) == sorted(results)
