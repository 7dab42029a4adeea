"""A whole run as real processes (batcher feeding a dataset, assembler, workers, trainer ranks), and
the SPEC section 5 checks over what it left on the server. Used by the crash, outage and chaos tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import orjson
from processes import RoleProcess

import streamgrp
from streamgrp.core import codec
from streamgrp.core.events import (
    GroupDecided,
    GroupDiscarded,
    RunFinished,
    SlotResult,
    StepCommitted,
    StepManifest,
    TaskIssued,
)
from streamgrp.store import payloads
from streamgrp.store.keys import ASSEMBLER_GROUP, BATCHER_GROUP, WORKERS_GROUP
from streamgrp.store.streams import entry_id_str

# A trainer rank that uses only the library: it logs each step it starts and commits.
TRAINER_SCRIPT = """
import os, sys, time
from streamgrp.store.runs import connect, open_run
from streamgrp.train.trainer import TrainerClient

url, run_name, rank, world_size, out, step_s = sys.argv[1:7]
rank, world_size, step_s = int(rank), int(world_size), float(step_s)
client = connect(url, cluster=os.environ.get("STREAMGRP_CLUSTER") == "1")
trainer = TrainerClient(client, open_run(client, run_name), poll_s=0.1)
with open(out, "a") as log:
    log.write(f"start {trainer.next_step(rank)}\\n")
    log.flush()
    with trainer.batches(rank=rank, world_size=world_size) as batches:
        for batch in batches:
            time.sleep(step_s)  # the step's work
            log.write(f"step {batch.step}\\n")
            log.flush()
            batch.commit()
    log.write("done\\n")
"""

# The child imports the streamgrp this test imported, wherever the checkout is.
CHILD_ENV = {
    "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(streamgrp.__file__).parents[1]), os.environ.get("PYTHONPATH")])
    )
}


def write_dataset(path: Path, prompts: int, **prompt) -> Path:
    """``prompts`` JSONL lines for the synthetic rollout, each with its own seed."""
    path.write_bytes(b"".join(orjson.dumps({**prompt, "seed": i}) + b"\n" for i in range(prompts)))
    return path


class TrainerRank:
    """One trainer rank as a real process running TRAINER_SCRIPT; same start/kill shape as RoleProcess."""

    def __init__(
        self, url: str, run_name: str, rank: int, world_size: int, directory: Path, *, step_s: float = 0.2
    ) -> None:
        self.role = f"trainer{rank}"
        self.rank = rank
        self.directory = directory
        self.script = directory / "trainer_rank.py"
        self.out = directory / f"rank{rank}.txt"
        self.args = [url, run_name, str(rank), str(world_size), str(self.out), str(step_s)]
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> TrainerRank:
        self.directory.mkdir(exist_ok=True)
        self.script.write_text(TRAINER_SCRIPT)
        self.starts += 1
        with open(self.directory / f"{self.role}-{self.starts}.log", "wb") as log:  # the child keeps its own fd
            self.proc = subprocess.Popen(
                [sys.executable, str(self.script), *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **CHILD_ENV},
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.directory.glob(f"{self.role}-*.log")))

    def steps_logged(self) -> int:
        return self.out.read_text().count("step ") if self.out.exists() else 0


class Pipeline:
    """Every role of one run as real processes: one batcher (feeding ``dataset`` unless None), one assembler,
    ``workers`` workers and ``dp_size`` trainer ranks. Leases and reclaim timers are short so that a
    killed role's successor takes over within about a second.
    """

    def __init__(
        self,
        url: str,
        run_name: str,
        tmp_path: Path,
        dataset: Path | None,
        run_flags: list[str],
        *,
        dp_size: int,
        workers: int = 2,
        trainer_step_s: float = 0.2,
        assembler_flags: tuple[str, ...] = (),
    ) -> None:
        common = ["--redis-url", url, "--run", run_name]
        feeding = ["--dataset", str(dataset)] if dataset is not None else []
        self.batcher = RoleProcess(
            "batcher",
            [*common, *run_flags, *feeding, "--round-s", "0.1", "--lease-ttl-s", "1"],
            tmp_path / "batcher",
            env=CHILD_ENV,
        )
        self.assembler = RoleProcess(
            "assembler",
            [*common, "--lease-ttl-s", "1", "--tick-interval-s", "0.1", *assembler_flags],
            tmp_path / "assembler",
            env=CHILD_ENV,
        )
        self.workers = [
            RoleProcess(
                "worker", [*common, "--concurrency", "4", "--claim-idle-s", "1"], tmp_path / f"worker{i}", env=CHILD_ENV
            )
            for i in range(workers)
        ]
        self.trainers = [
            TrainerRank(url, run_name, rank, dp_size, tmp_path / "trainers", step_s=trainer_step_s)
            for rank in range(dp_size)
        ]

    @property
    def roles(self) -> list:
        return [self.batcher, self.assembler, *self.workers, *self.trainers]

    def start(self) -> None:
        for role in self.roles:
            if isinstance(role, RoleProcess):
                role.log_dir.mkdir(exist_ok=True)
            role.start()

    def exited(self) -> list[str]:
        """Roles whose current process has exited, with their exit code and the tail of their log; workers
        and the assembler that exited 0 after the batcher ended the run (they do, once it has) are not."""
        ended = self.batcher.proc is not None and self.batcher.proc.poll() == 0
        return [
            f"{role.role} (pid {role.pid}) exited with {role.proc.returncode}:\n{role.output()[-3000:]}"
            for role in self.roles
            if role.proc is not None
            and role.proc.poll() is not None
            and not (ended and role.proc.returncode == 0 and role.role in ("worker", "assembler"))
        ]

    def trainers_done(self) -> bool:
        return all(t.proc.poll() == 0 and t.out.read_text().endswith("done\n") for t in self.trainers)

    def stop(self) -> dict[str, int]:
        """SIGTERM whatever still runs; the exit code of each role's last process."""
        codes = {}
        for role in self.roles:
            if role.proc is None:
                continue
            try:
                codes[f"{role.role}:{role.pid}"] = role.stop()
            except subprocess.TimeoutExpired:
                codes[f"{role.role}:{role.pid}"] = -9
        return codes


def events(client, stream, kind) -> list:
    """Every ``kind`` event of ``stream``; a sessions stream's turns with their tensors wherever they live."""
    entries = payloads.with_turns(client, stream, [(entry_id_str(i), f) for i, f in client.xrange(stream)])
    return [e for e in (codec.decode(fields) for _, fields in entries) if isinstance(e, kind)]


def check_run(client, run, *, prompts: int) -> int:
    """Every SPEC section 5 claim that a finished run leaves checkable on the server; the step count.

    Exactly once: each prompt issued once, each task decided once, no slot entry in two decisions,
    steps 0..N-1 written once each, every trainable group in exactly one manifest or discarded,
    every (step, rank) committed once. Nothing lost: every slot published is accounted for and
    nothing is left pending in any consumer group.
    """
    [finish] = events(client, run.keys.control, RunFinished)
    n_steps = finish.steps
    batch_size, dp_size = run.config.batch_size, run.config.dp_size

    raw_steps = client.xrange(run.keys.steps)
    assert [eid.decode() for eid, _ in raw_steps] == [f"{step}-1" for step in range(n_steps)]
    manifests = [codec.decode(fields) for _, fields in raw_steps]
    assert all(isinstance(m, StepManifest) for m in manifests)
    assert [m.step for m in manifests] == list(range(n_steps))
    for manifest in manifests:
        sizes = [len(s.groups) for s in manifest.shards]
        assert len(sizes) == dp_size and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert all(sum(len(s.groups) for s in m.shards) == batch_size for m in manifests[:-1])

    issued = events(client, run.keys.slots, TaskIssued)
    assert [(t.task_id, t.prompt["seed"]) for t in issued] == [(f"t{i:08d}", i) for i in range(prompts)]

    decisions = {eid.decode(): codec.decode(fields) for eid, fields in client.xrange(run.keys.decisions)}
    assert sorted(d.task_id for d in decisions.values()) == [f"t{i:08d}" for i in range(prompts)]
    members = [m.entry for d in decisions.values() for m in d.members]
    assert len(members) == len(set(members)), "a slot entry was folded into two decisions"
    slots = {
        eid.decode(): event
        for eid, event in ((eid, codec.decode(fields)) for eid, fields in client.xrange(run.keys.slots))
    }
    for decision in decisions.values():
        for slot, entry in ((m.slot, m.entry) for m in decision.members):
            event = slots[entry]
            assert (event.task_id, event.slot, event.outcome) == (decision.task_id, slot, "sample")

    trainable = {entry for entry, d in decisions.items() if isinstance(d, GroupDecided) and d.decision != "dropped"}
    batched = [g.decision_entry for m in manifests for s in m.shards for g in s.groups]
    discarded = [d.decision_entry for d in events(client, run.keys.discarded, GroupDiscarded)]
    assert len(batched) == len(set(batched)), "a group is in two manifests"
    assert len(discarded) == len(set(discarded))
    assert not set(batched) & set(discarded)
    assert set(batched) | set(discarded) == trainable
    assert all(decisions[g.decision_entry].task_id == g.task_id for m in manifests for s in m.shards for g in s.groups)

    counts = {k.decode(): int(v) for k, v in client.hgetall(run.keys.counts).items()}
    assert counts["steps"] == n_steps and counts["groups:batched"] == len(batched)
    assert counts.get("groups:discarded", 0) == len(discarded)
    published = sum(1 for event in slots.values() if isinstance(event, SlotResult))
    folded = counts["slots:sample"] + counts.get("slots:rejected", 0) + counts.get("slots:failed", 0)
    accounted = folded + counts.get("slots:duplicate", 0) + counts.get("slots:late", 0) + counts.get("slots:invalid", 0)
    assert accounted == published

    for stream, group in (
        (run.keys.decisions, BATCHER_GROUP),
        (run.keys.slots, ASSEMBLER_GROUP),
        (run.keys.tasks, WORKERS_GROUP),
    ):
        assert client.xpending(stream, group)["pending"] == 0, f"entries left pending in {stream!r}"

    committed = Counter((e.step, e.rank) for e in events(client, run.keys.commits, StepCommitted))
    assert committed == Counter({(step, rank): 1 for step in range(n_steps) for rank in range(dp_size)})
    return n_steps
