"""A whole run with every role under its own ACL user made from ``ops/acl/``, over TLS where the server has it.

The Redis 7.0 kind serves TLS only (with client certificates); the bundled Valkey is built without
TLS and runs the same run with ACL users over plain TCP. Afterwards the server's ACL log must be
empty (no role was ever refused a command it needs), the worker's user must be refused every write
that could decide groups, write steps or stop the run, and the inspector's user must be able to run
every inspection command and nothing that writes.
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
import redis
from certs import Certs, make_certs
from processes import RoleProcess, wait_until

from streamgrp.cli.children import free_port
from streamgrp.cli.server import EmbeddedServer
from streamgrp.core.events import GroupDecided, SlotResult
from streamgrp.store.acl import ROLES, password_hash, template_for, user_name
from streamgrp.errors import ConfigError
from streamgrp.store import payloads
from streamgrp.services.worker import WorkerClient
from streamgrp.store.connection import connect
from streamgrp.store.keys import RunKeys
from streamgrp.store.scripts import forget_loaded, function_name, load_library
from streamgrp.store.sources import decode_all, default_source

pytestmark = pytest.mark.slow

OPS_ACL = Path(__file__).resolve().parents[2] / "ops" / "acl"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUN_FLAGS = [
    "--n-samples",
    "4",
    "--batch-size",
    "4",
    "--dp-size",
    "2",
    "--group-timeout-s",
    "30",
    "--reward-norm",
    "group,group",
    "--max-staleness",
    "1",
    "--stall-timeout-s",
    "120",
]
STEPS = 3
#: Task entries the worker's user forges in the group log before the run starts: as many as the assembler
#: may hold open, so if they opened groups no issued task could.
FORGED_TASKS = 30


@dataclass
class Secured:
    """A server that knows only the run's role users (and an administrator for the test's own checks)."""

    server: EmbeddedServer
    run: str
    secrets_dir: Path
    certs: Certs | None
    admin_password: str

    @property
    def scheme(self) -> str:
        return "rediss" if self.certs is not None else "redis"

    def url(self, user: str) -> str:
        return f"{self.scheme}://{user}@127.0.0.1:{self.server.port}/0"

    def env(self, role: str) -> dict[str, str]:
        """How a role's process connects: its user in the URL, its password file, the client certificate."""
        env = {
            "STREAMGRP_REDIS_URL": self.url(user_name(self.run, role)),
            "STREAMGRP_PASSWORD_FILE": str(self.secrets_dir / role),
            "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)]),
        }
        if self.certs is not None:
            env.update(
                STREAMGRP_TLS_CERT_FILE=str(self.certs.client.cert_file),
                STREAMGRP_TLS_KEY_FILE=str(self.certs.client.key_file),
                STREAMGRP_TLS_CA_CERT_FILE=str(self.certs.client.ca_cert_file),
            )
        return env

    def client(self, role: str) -> redis.Redis:
        password = (self.secrets_dir / role).read_text().strip()
        return connect(self.url(user_name(self.run, role)), password=password, tls=self._tls())

    def admin(self) -> redis.Redis:
        return connect(self.url("admin"), password=self.admin_password, tls=self._tls())

    def _tls(self):
        return self.certs.client if self.certs is not None else None


@pytest.fixture
def secured(server_kind, kind_binary, tmp_path, run_name):
    certs = make_certs(tmp_path / "certs") if server_kind == "redis7" else None
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir(mode=0o700)
    admin_password = secrets.token_urlsafe(16)
    lines = [
        (OPS_ACL / "default.acl").read_text().strip(),
        f"user admin on {password_hash(admin_password)} ~* &* +@all",
    ]
    for role in ROLES:
        password = secrets.token_urlsafe(16)
        (secrets_dir / role).write_text(password + "\n")
        (secrets_dir / role).chmod(0o600)
        rule = template_for((OPS_ACL / f"{role}.acl").read_text(), run_name).strip()
        lines.append(rule.replace(" resetpass ", f" resetpass {password_hash(password)} ", 1))
    users = tmp_path / "users.acl"
    users.write_text("\n".join(lines) + "\n")
    server = EmbeddedServer(
        tmp_path / "server", binary=kind_binary, acl_file=users, tls=certs.server if certs is not None else None
    )
    server.start()
    try:
        secured = Secured(server, run_name, secrets_dir, certs, admin_password)
        load_library(secured.admin())  # the administrator's step: roles may call functions, never load them
        yield secured
    finally:
        server.stop()


def _dataset(path: Path) -> Path:
    from streamgrp.consumers.toy_task import prompts

    with path.open("wb") as handle:
        for prompt, _ in zip(prompts(seed=0, reject_rate=0.2, fail_rate=0.1), range(STEPS * 4 * 4 + 64)):
            handle.write(orjson.dumps(prompt) + b"\n")
    return path


def _roles(secured: Secured, tmp_path: Path) -> dict[str, RoleProcess]:
    run, data = ["--run", secured.run], ["--data-dir", str(tmp_path / "data")]
    dist = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    specs = {
        "trainer0": ("trainer", [*run, "--rank", "0", "--world-size", "2", "--dist-url", dist]),
        "trainer1": ("trainer", [*run, "--rank", "1", "--world-size", "2", "--dist-url", dist]),
        "worker": ("worker", [*run, "--rollout", "rollouts:credential_free_toy", "--concurrency", "4"]),
        "assembler": ("assembler", [*run, "--tick-interval-s", "0.2", "--max-open-groups", str(FORGED_TASKS)]),
        "archiver": ("archiver", [*run, *data, "--retention", "--retention-interval-s", "1", "--poll-s", "0.2"]),
        "batcher": (
            "batcher",
            [
                *run,
                *RUN_FLAGS,
                "--dataset",
                str(_dataset(tmp_path / "prompts.jsonl")),
                "--max-steps",
                str(STEPS),
                "--round-s",
                "0.5",
            ],
        ),
    }
    processes = {}
    for label, (role, args) in specs.items():
        (tmp_path / label).mkdir()
        processes[label] = RoleProcess(role, args, tmp_path / label, env=secured.env(role.rstrip("01")))
    # A follower beside the run, under its own user: it prints every decision and records its position.
    (tmp_path / "follower").mkdir()
    processes["follower"] = RoleProcess(
        "follow", [*run, "acl-follower", "--until-finished"], tmp_path / "follower", env=secured.env("follower")
    )
    return processes


def _acl_log(admin: redis.Redis) -> list:
    return admin.execute_command("ACL", "LOG")


def test_a_role_on_a_server_without_the_functions_is_told_who_must_load_them(secured):
    admin = secured.admin()
    admin.function_flush()
    forget_loaded()
    worker = secured.client("worker")
    with pytest.raises(ConfigError, match="load it once as an administrator.*streamgrp functions"):
        WorkerClient(worker, RunKeys(secured.run))
    load_library(admin)
    WorkerClient(worker, RunKeys(secured.run))  # and once it is loaded, the role starts
    worker.close()
    admin.close()


def _attack_as_worker(secured: Secured) -> None:
    """What the worker's user may write and a run must survive: forged task entries, a tick and a payload at
    ids in the future (every later slot result moves after it), a consumer group of its own on the queue."""
    from streamgrp.core import codec
    from streamgrp.core.events import TaskIssued, Tick

    keys, worker = RunKeys(secured.run), secured.client("worker")
    for i in range(FORGED_TASKS):
        worker.xadd(
            keys.slots,
            codec.encode(
                TaskIssued(task_id=f"forged-{i}", prompt={"a": 1}, version=0, issued_at=4e9, producer="forger", seq=i)
            ),
        )
    # its payloads are keys: one staged, then moved to a future slot entry's payload key (a later publish
    # there replaces it); it may not append to the payloads stream (the dry runs below)
    staged = payloads.staged_key(keys.payloads)
    worker.set(staged, payloads.frame(b"{}", b""), px=60_000)
    worker.rename(staged, payloads.key(keys.payloads, "99999999999999-0"))
    worker.xadd(keys.slots, codec.encode(Tick(now=4e12, producer="forger", seq=0)), id="99999999999998-0")
    worker.xgroup_create(keys.tasks, "forged", id="0", mkstream=True)
    worker.close()


def test_a_whole_run_with_each_role_under_its_own_user(secured, tmp_path):
    _attack_as_worker(secured)
    roles = _roles(secured, tmp_path)
    try:
        for role in roles.values():  # the batcher last: the others open the run read-only and wait for it
            role.start()
        wait_until(
            lambda: (
                all(roles[r].proc.poll() is not None for r in ("trainer0", "trainer1", "batcher"))
                or any(p.proc.poll() not in (None, 0) for p in roles.values())
            ),
            timeout=240,
            interval=0.5,
            message="the run to finish",
        )
        # A role that failed by itself is the cause; the others are only stopped (or killed) after it.
        failed = {label: role.proc.returncode for label, role in roles.items() if role.proc.poll() not in (None, 0)}
        assert not failed, "\n".join(
            f"{label} exited {code}:\n{roles[label].output()[-3000:]}" for label, code in failed.items()
        )
        # The worker and the assembler see the run end and exit by themselves (a SIGTERM sent while one is
        # already tearing its interpreter down would end it with -15); only the archiver is stopped.
        for label in ("follower", "worker", "assembler"):
            wait_until(
                lambda label=label: roles[label].proc.poll() is not None, timeout=60, message=f"the {label} to finish"
            )
        roles["archiver"].stop()
    finally:
        for role in roles.values():
            if role.proc is not None and role.proc.poll() is None:
                role.kill()
    for label, role in roles.items():
        assert role.proc.returncode == 0, f"{label} exited {role.proc.returncode}:\n{role.output()[-3000:]}"
    admin = secured.admin()
    assert _acl_log(admin) == [], "a role was refused a command its rules should allow"

    keys = RunKeys(secured.run)
    # Retention may have trimmed the slot log already: read it through the archive where it did.
    results = [event for _, event in decode_all(default_source(admin, keys, tmp_path / "data"), "slots")]
    leaks = {r.error for r in results if isinstance(r, SlotResult) and "sees credentials" in (r.error or "")}
    assert leaks == set() and any(isinstance(r, SlotResult) and r.outcome == "sample" for r in results)
    assert int(admin.hget(keys.counts, "steps") or 0) == STEPS
    assert int(admin.hget(keys.counts, "deadletter:task_not_issued")) == FORGED_TASKS
    assert int(admin.hget(keys.counts, "deadletter:tick_from_future")) == 1
    followed = [line for line in roles["follower"].output().splitlines() if line.startswith('{"stream"')]
    decided = [e for e, _ in decode_all(default_source(admin, keys, tmp_path / "data"), "decisions")]
    assert [orjson.loads(line)["entry_id"] for line in followed] == decided
    _inspector_reads_everything(secured, tmp_path, admin, keys)
    assert _acl_log(admin) == [], "the inspector was refused a command an inspection needs"
    _worker_cannot_write_what_decides_or_stops_the_run(secured, keys)
    _inspector_and_trainer_cannot_write_what_they_only_read(secured, keys)
    _dry_runs(admin, keys)


def _inspector_reads_everything(secured: Secured, tmp_path: Path, admin: redis.Redis, keys: RunKeys) -> None:
    import subprocess

    decided = next(event for _, event in decode_all(default_source(admin, keys, tmp_path / "data"), "decisions"))
    assert isinstance(decided, GroupDecided)
    env = {**os.environ, **secured.env("inspector")}
    for command in (
        ["runs"],
        ["steps"],
        ["verify"],
        ["inspect", decided.task_id],
        ["replay", "0", "--rank", "0"],
        ["report", "--out", str(tmp_path / "report.html")],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "streamgrp", *command, "--run", secured.run, "--data-dir", str(tmp_path / "data")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{command}: {done.stdout}\n{done.stderr}"


def _worker_cannot_write_what_decides_or_stops_the_run(secured: Secured, keys: RunKeys) -> None:
    worker = secured.client("worker")
    for key in (
        keys.control,
        keys.decisions,
        keys.steps,
        keys.batcher_state,
        keys.committed,
        RunKeys("another-run").slots,
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.xadd(key, {"h": b"{}"}) if "batcher" not in key and "committed" not in key else worker.hset(
                key, "terminal", "1"
            )
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.config_set("appendonly", "no")
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.execute_command("FLUSHALL")
    worker.close()


def _inspector_and_trainer_cannot_write_what_they_only_read(secured: Secured, keys: RunKeys) -> None:
    inspector = secured.client("inspector")
    for write in (
        lambda: inspector.xadd(keys.slots, {"h": b"{}"}),
        lambda: inspector.hset(keys.counts, "x", 1),
        lambda: inspector.set(keys.version, 99),
        lambda: inspector.xtrim(keys.slots, maxlen=0),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            write()
    trainer = secured.client("trainer")
    with pytest.raises(redis.exceptions.NoPermissionError):  # so a terminal event it appends is refused
        trainer.hset(keys.batcher_state, "terminal", "1-1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        trainer.xadd(keys.steps, {"h": b"{}"})
    inspector.close()
    trainer.close()


def _dry_runs(admin: redis.Redis, keys: RunKeys) -> None:
    """ACL DRYRUN: what each user may run, without running it."""

    def allowed(role: str, *command: str) -> bool:
        return admin.execute_command("ACL", "DRYRUN", user_name(keys.run, role), *command) in (b"OK", "OK")

    publish = function_name("publish.lua")
    batch_commit = function_name("batch_commit.lua")
    assert allowed("worker", "XADD", keys.slots, "*", "h", "x")
    assert not allowed("worker", "XADD", keys.control, "*", "h", "x")
    assert not allowed("worker", "FCALL", batch_commit, "1", keys.decisions)  # a function's keys need permission
    assert allowed("worker", "FCALL", publish, "2", keys.slots, keys.payloads)
    staged = payloads.staged_key(keys.payloads)
    assert allowed(
        "worker", "FCALL", function_name("publish_staged.lua"), "4", keys.slots, keys.payloads, keys.tasks, staged
    )
    assert allowed("worker", "SET", staged, "x", "NX", "PX", "1000")
    assert not allowed("worker", "SET", payloads.key(keys.payloads, "1-1"), "x")  # only staging keys
    assert not allowed("worker", "XADD", keys.payloads, "*", "h", "x")  # a keys run's payloads stream is idle
    assert not allowed("worker", "RENAME", staged, keys.slots)  # nor overwrite the slot log with a staged key
    assert allowed("trainer", "MGET", payloads.key(keys.payloads, "1-1"))
    assert not allowed("trainer", "SET", payloads.key(keys.payloads, "1-1"), "x")
    assert allowed("archiver", "UNLINK", payloads.key(keys.payloads, "1-1"))
    assert not allowed("archiver", "UNLINK", keys.slots)
    segment = function_name("segment.lua")
    assert allowed("worker", "FCALL", segment, "2", keys.tasks, keys.segments)
    assert allowed("worker", "XPENDING", keys.tasks, "workers", "-", "+", "1")  # what segment.lua checks with
    assert not allowed("gateway", "FCALL", segment, "2", keys.tasks, keys.segments)
    assert not allowed("inspector", "XADD", keys.segments, "*", "h", "x")
    assert allowed(
        "batcher",
        "FCALL",
        batch_commit,
        "7",
        keys.decisions,
        keys.steps,
        keys.discarded,
        keys.counts,
        keys.batcher_lease,
        keys.batcher_state,
        keys.control,
    )
    # the counters the feeder's window and the run's accounting read: only the assembler and batcher write them
    for role in ("worker", "trainer", "archiver", "inspector"):
        assert not allowed(role, "HINCRBY", keys.counts, "decisions:dropped", "-100000")
    assert allowed("worker", "HINCRBY", keys.deadletter_counts, "invalid:tasks", "1")
    assert allowed("inspector", "XRANGE", keys.payloads, "1-0", "1-5")  # how payloads are read: plain XRANGEs
    assert not allowed("inspector", "FCALL", publish, "1", keys.payloads)
    assert allowed("trainer", "XRANGE", keys.payloads, "1-0", "1-5")
    assert not allowed("archiver", "XTRIM", keys.control, "MAXLEN", "0")
    follow_position = function_name("follow_position.lua")
    assert allowed("follower", "FCALL", follow_position, "1", keys.follow, "ack", "x", "decisions", "1-0")
    assert allowed("follower", "XRANGE", keys.decisions, "-", "+")
    for write in (
        ("XADD", keys.decisions, "*", "h", "x"),
        ("HSET", keys.counts, "x", "1"),
        ("FCALL", publish, "2", keys.slots, keys.payloads),
        ("XTRIM", keys.decisions, "MAXLEN", "0"),
    ):
        assert not allowed("follower", *write), write
    for role in ROLES:
        assert not allowed(role, "CONFIG", "SET", "appendonly", "no")
        # no Lua of its own: a loop in it would make the server answer BUSY to every run's clients
        assert not allowed(role, "EVAL", "while true do end", "0")
        assert not allowed(role, "SCRIPT", "LOAD", "return 1")
        assert not allowed(role, "EVALSHA", "0" * 40, "0")
        assert not allowed(role, "FUNCTION", "LOAD", "#!lua name=mine\nredis.register_function('f', function() end)")
        assert not allowed(role, "XRANGE", RunKeys("another-run").control, "-", "+")
