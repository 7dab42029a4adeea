"""Least privilege per role: the Redis/Valkey ACL users of one run, built from the run's key names.

Owns, for each role (worker, assembler, batcher, trainer, archiver, a read-only inspector, the agent
sessions' gateway, the reward stage's rewarder and a follower), the keys it may only read, the keys it may read and
write, and the commands it may run,
and renders them as ACL-file lines (``streamgrp acl RUN``; ``ops/acl/*.acl`` are these lines for the run
``RUN``). Every key is one of the run's `RunKeys`, so a role's user can touch its own run only.
It deliberately ignores how users reach the server (``--acl-file``, ``ACL SETUSER``) and their
passwords, which `render` takes as SHA-256 hashes.

Why the rules look the way they do:

- A key passed to a script (``EVALSHA``) needs read *and* write permission, whatever the script
  does with it; commands the script runs are checked against the caller's user too. So a role
  gets write permission on exactly the keys its scripts take, and only the commands its scripts
  and its own calls need. Readers that must not write (trainer ranks, the inspector) use plain read
  commands (payloads come by XRANGE), which need read permission only.
- Only the batcher may write the control stream (the run's record, and its terminal and finished
  events), the decisions stream's readers' state and the steps stream. Trainers append their
  policy-version events to control too, so readers trust a terminal event only when the batcher's
  own state hash (which trainers may only read) names its entry (`streamgrp.store.control`).
- No role has ``CONFIG``, ``FLUSHALL``, ``KEYS``, ``DEBUG``, ``ACL`` or any other ``@dangerous``
  command except ``INFO`` (the connection check reads the server version and memory settings).
- The registry of runs (``sg:runs``) is read by every role and written (one ``ZADD``, its only write
  there) by the batcher.
- A write command is granted only on the keys that need it (ACL selectors, Redis 7+/Valkey): the user's
  root rules hold the read commands, ``FCALL`` (whose keys need read and write permission) and the keys;
  each write command comes from a selector ``(+cmd ~key ...)`` naming the keys the role's functions and its
  own calls write with it (``confined``). So ``DEL``/``SET`` reach only a role's lease (the trainer's: its
  policy version and weights), a worker reads and acknowledges only the task queue, not the slot log,
  and no role may ``XADD`` to the task queue but the batcher. Redis 7 checks the commands a function runs
  against the caller's rules, so what a function writes its caller may also write directly: those writes
  are checked where they are read (see the README's Security section).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from streamgrp.store import payloads
from streamgrp.store.keys import RUNS, RunKeys

__all__ = [
    "ROLES",
    "RoleAccess",
    "access",
    "password_hash",
    "render",
    "render_run",
    "rules",
    "template_for",
    "user_name",
]

#: What every role's connection needs: the version and settings check, health checks, streamgrp's functions
#: (`streamgrp.store.scripts`; never EVAL or SCRIPT LOAD: no Lua of its own) and the
#: server clock. Only commands Redis 7.0 knows: a rule naming an unknown one stops the ACL file loading.
COMMON_COMMANDS = ("ping", "info", "time", "fcall", "fcall_ro")

ROLES = ("worker", "assembler", "batcher", "trainer", "archiver", "inspector", "gateway", "rewarder", "follower")

#: What a lease's functions write (lease_acquire/renew/release.lua): granted on the role's lease key only.
_LEASE_WRITES = ("set", "pexpire", "del")
#: Taking tasks from a queue as one of its consumer group's consumers.
_TAKE = ("xreadgroup", "xack", "xautoclaim", "xgroup|create")
_RUN_LOOKUP = ("xrange", "zrange", "zrevrange")


@dataclass(frozen=True)
class RoleAccess:
    """One role's rights in one run: keys read only, keys read and written, commands on all of them, and
    ``confined``: (commands, keys) pairs, commands granted on those keys only (one ACL selector each)."""

    role: str
    about: str
    read: tuple[str, ...]
    write: tuple[str, ...]
    commands: tuple[str, ...]
    confined: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()

    def may(self, command: str, key: str) -> bool:
        """Whether the user may run ``command`` on ``key`` (its root rules or a selector)."""
        if command in self.commands:
            return key in self.read or key in self.write
        return any(command in commands and key in keys for commands, keys in self.confined)

    def can_write(self, key: str) -> bool:
        return key in self.write


def user_name(run: str, role: str) -> str:
    """The ACL user of ``role`` in ``run``: ``sg-RUN-ROLE``."""
    return f"sg-{run}-{role}"


def access(keys: RunKeys, role: str, partitions: int = 1, layout: str = payloads.KEYS) -> RoleAccess:
    """``role``'s rights in the run of ``keys`` with ``partitions`` partitions whose payloads are kept in
    ``layout`` (`streamgrp.store.payloads`: ``keys`` for the runs this version creates, ``stream`` for
    older ones); `ValueError` naming the roles for an unknown one.

    A partitioned run's keys of each partition are the same kinds as an unpartitioned run's under
    another hash tag: each role gets, in every partition, the rights it has on those kinds (the
    batcher also the partitions' issued markers and its record of acknowledgements owed)."""
    try:
        build = _BUILDERS[role]
    except KeyError:
        raise ValueError(f"unknown role {role!r}; the roles are {', '.join(ROLES)}") from None
    if layout not in (payloads.KEYS, payloads.STREAM):
        raise ValueError(f"unknown payload layout {layout!r}; the layouts are {payloads.KEYS}, {payloads.STREAM}")
    rights = build(keys, layout == payloads.KEYS)
    if partitions == 1:
        return rights
    kinds = {getattr(keys, name): name for name in _PARTITION_KINDS}  # the run's own fold keys, by kind
    parts = keys.partitions(partitions)

    def spread(names: tuple[str, ...]) -> tuple[str, ...]:
        out: list[str] = []
        for key in names:
            if key in kinds:
                if kinds[key] in _RUN_WIDE_TOO:
                    out.append(key)
                out += [getattr(part, kinds[key]) for part in parts]
            elif key == keys.pattern:
                out += [key, keys.partition_pattern]
            else:
                out.append(key)
        return tuple(dict.fromkeys(out))

    extra = (keys.batcher_unacked, keys.batcher_settled, *(part.issued for part in parts)) if role == "batcher" else ()
    # The batcher reads and clears the acknowledgements a partitioned run's commits record.
    commands = (*rights.commands, "hkeys", "hdel") if role == "batcher" else rights.commands
    confined = tuple((names, spread(on)) for names, on in rights.confined)
    return RoleAccess(
        rights.role, rights.about, spread(rights.read), (*spread(rights.write), *extra), commands, confined
    )


#: Kinds a partitioned run has run-wide as well: the batcher's counters and the control stream's dead letters.
_RUN_WIDE_TOO = ("deadletter", "deadlettered", "counts", "deadletter_counts")
#: `PartitionKeys` attributes: the keys every partition has its own of.
_PARTITION_KINDS = (
    "tasks",
    "slots",
    "payloads",
    "decisions",
    "deadletter",
    "deadlettered",
    "decided",
    "counts",
    "deadletter_counts",
    "assembler_lease",
    "sessions",
    "session_pattern",
    "session_deadlines",
    "segments",
    "payload_keys",
    "payload_staging",
)


def _publishing(k: RunKeys, keyed: bool) -> tuple[tuple[str, ...], tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]]:
    """The keys a role that publishes slot results writes for their payloads, and the selectors that confine
    those writes. ``keyed`` (a ``keys``-layout run): SET only on staging keys, RENAME and PERSIST only on
    payload keys (publish_staged.lua, session_end.lua), no XADD on the payloads stream. Otherwise the old
    layout's: XADD on the payloads stream, and XDEL on the slot log (publish.lua takes back a slot header
    whose payload it could not write)."""
    if keyed:
        return (k.payloads, k.payload_keys), (
            (("set",), (k.payload_staging,)),
            (("rename", "persist"), (k.payload_keys,)),
        )
    return (k.payloads,), ((("xadd",), (k.payloads,)), (("xdel",), (k.slots,)))


def _worker(k: RunKeys, keyed: bool) -> RoleAccess:
    written, payload_writes = _publishing(k, keyed)
    return RoleAccess(
        "worker",
        "takes tasks, records their slots' segments, publishes slot results and their payloads, "
        "dead-letters bad tasks; reads the run's record, the policy version and the published weights",
        read=(k.control, k.version, k.weights("*"), RUNS),
        write=(k.tasks, k.slots, *written, k.segments, k.deadletter, k.deadlettered, k.deadletter_counts),
        commands=(*_RUN_LOOKUP, "get", "exists"),  # EXISTS: publish_staged.lua checks its staged keys
        # the task queue only: the slot log's entries are the assembler's; XPENDING: segment.lua checks the
        # caller still holds the task
        confined=(
            ((*_TAKE, "xpending"), (k.tasks,)),
            (("xadd",), (k.slots, k.segments, k.deadletter)),
            *payload_writes,
            (("hsetnx", "hincrby"), (k.deadlettered, k.deadletter_counts)),
        ),
    )


def _assembler(k: RunKeys, keyed: bool) -> RoleAccess:
    written = (k.slots, k.decisions, k.deadletter, k.decided, k.counts, k.assembler_lease)
    return RoleAccess(
        "assembler",
        "folds the slot log into group decisions, writes each once, dead-letters bad slot entries",
        read=(*_others(k, written), *_payload_reads(k, keyed), RUNS),
        write=written,
        commands=(*_RUN_LOOKUP, "get", "mget", "xinfo|groups", "hexists", "hmget", "hget"),
        confined=(
            (_LEASE_WRITES, (k.assembler_lease,)),
            (("xreadgroup", "xautoclaim", "xack", "xgroup|create"), (k.slots,)),
            (("xadd",), (k.slots, k.decisions, k.deadletter)),
            (("hsetnx", "hset", "hincrby"), (k.decided, k.counts)),
        ),
    )


def _payload_reads(k: RunKeys, keyed: bool) -> tuple[str, ...]:
    """What a role that reads payloads reads beside the payloads stream in a ``keys``-layout run (with MGET)."""
    return (k.payload_keys,) if keyed else ()


def _batcher(k: RunKeys, keyed: bool) -> RoleAccess:
    written = (
        k.control,
        k.decisions,
        k.steps,
        k.discarded,
        k.counts,
        k.batcher_lease,
        k.batcher_state,
        k.tasks,
        k.slots,
        k.deadletter,
        k.deadlettered,
        k.deadletter_counts,
    )
    return RoleAccess(
        "batcher",
        "creates the run, issues tasks, turns decisions into steps, writes the run's terminal and finished events",
        # The shared registry of runs: read, and one ZADD of its own run (no DEL/SET/XADD of it, so one run's
        # credential cannot break the registry every run reads).
        read=(*_others(k, written), k.version, k.committed, k.decided, RUNS),
        write=written,
        commands=(
            *_RUN_LOOKUP,
            "get",
            "xlen",
            "xreadgroup",
            "xack",
            "xadd",
            "xgroup|create",
            "xinfo|stream",
            "xinfo|groups",
            "hget",
            "hmget",
            "hset",
            "hsetnx",
            "hincrby",
            "hexists",
            "hgetall",
            "hlen",
            "hvals",
        ),
        confined=((_LEASE_WRITES, (k.batcher_lease,)), (("zadd",), (RUNS,)), (("xdel",), (k.tasks,))),
    )  # issue_tasks.lua takes back a task the group log cannot take


def _trainer(k: RunKeys, keyed: bool) -> RoleAccess:
    written = (
        k.control,
        k.committed,
        k.commits,
        k.version,
        k.trainer_metrics,
        k.weights("*"),
        k.deadletter,
        k.deadlettered,
        k.deadletter_counts,
        k.attempt,
        k.checkpoint,
    )
    return RoleAccess(
        "trainer",
        "reads steps and their payloads, commits or fails them, advances the policy version, "
        "publishes weights and per-step metrics",
        read=(k.steps, k.payloads, *_payload_reads(k, keyed), k.slots, k.batcher_state, RUNS),
        write=written,
        commands=(
            *_RUN_LOOKUP,
            "xread",
            "xadd",
            "get",
            "mget",
            "multi",
            "exec",
            "hget",
            "hset",
            "hsetnx",
            "hincrby",
            "hgetall",
            "hdel",
        ),
        # SET: the policy version (trainer_commit.lua) and the published weights; DEL: weights it retires.
        confined=((("set",), (k.version, k.weights("*"))), (("del",), (k.weights("*"),))),
    )


def _archiver(k: RunKeys, keyed: bool) -> RoleAccess:
    trimmed = tuple(stream for name, stream in k.all_streams().items() if name != "control")
    return RoleAccess(
        "archiver",
        "copies every stream and hash to disk and records its progress; with --retention trims "
        "the streams behind the archive",
        read=(
            k.control,
            k.decided,
            k.counts,
            k.deadletter_counts,
            k.committed,
            k.batcher_state,
            k.trainer_metrics,
            k.version,
            k.checkpoint,
            k.attempt,
            k.session_deadlines,
            RUNS,
        ),
        write=(k.archive, k.follow, *trimmed, *_payload_reads(k, keyed)),  # follow: reads followers' positions,
        # records their skips; payload keys: read into the archive, unlinked by retention behind it
        commands=(
            *_RUN_LOOKUP,
            "get",
            "mget",
            "hget",
            "xinfo|groups",
            "xinfo|stream",
            "xpending",
            "xtrim",
            "hgetall",
            "hset",
            "hsetnx",
            "multi",
            "exec",
        ),
        confined=((("unlink",), _payload_reads(k, keyed)),) if keyed else (),
    )


def _inspector(k: RunKeys, keyed: bool) -> RoleAccess:
    return RoleAccess(
        "inspector",
        "reads everything of the run (runs, steps, verify, inspect, replay, report); writes nothing",
        read=(k.pattern, RUNS),
        write=(),
        commands=(
            *_RUN_LOOKUP,
            "xrevrange",
            "xlen",
            "xread",
            "xinfo|groups",
            "xinfo|stream",
            "xpending",
            "get",
            "mget",
            "hget",
            "hmget",
            "hgetall",
            "hlen",
            "hvals",
            "hexists",
        ),
    )


def _gateway(k: RunKeys, keyed: bool) -> RoleAccess:
    written, payload_writes = _publishing(k, keyed)
    # Its functions (session_open/turn/end.lua) take the task queue (to acknowledge a task whose sessions
    # they open), the sessions' keys, and the group log and payloads (a session's end publishes its result);
    # online mode takes tasks itself, as a worker does, and dead-letters a task that does not decode.
    return RoleAccess(
        "gateway",
        "opens agent sessions for tasks (acknowledging each), records their turns, ends them publishing "
        "their slot results, takes tasks for online apps; reads the run's record and the policy version",
        read=(k.control, k.version, RUNS),
        write=(
            k.tasks,
            k.slots,
            *written,
            k.sessions,
            k.session_pattern,
            k.session_deadlines,
            k.deadletter,
            k.deadlettered,
            k.deadletter_counts,
        ),
        commands=(
            *_RUN_LOOKUP,
            "get",
            "exists",
            "hset",
            "hget",
            "hmget",
            "hgetall",
            "hsetnx",
            "hincrby",
            "zadd",
            "zrem",
            "zrangebyscore",
            "zcard",
        ),
        confined=(
            ((*_TAKE, "xpending"), (k.tasks,)),  # the task queue only, as a worker
            (("xadd",), (k.slots, k.sessions, k.deadletter)),
            *payload_writes,
        ),
    )


def _rewarder(k: RunKeys, keyed: bool) -> RoleAccess:
    return RoleAccess(
        "rewarder",
        "takes the slot results that wait for their reward (its consumer group on the group log), reads "
        "their payloads, posts their rewards",
        read=(k.payloads, *_payload_reads(k, keyed), k.control, k.version, RUNS),
        write=(k.slots,),
        commands=(
            *_RUN_LOOKUP,
            "mget",
            "xrevrange",
            "xreadgroup",
            "xack",
            "xautoclaim",
            "xclaim",
            "xgroup|create",
            "xadd",
        ),
    )


def _follower(k: RunKeys, keyed: bool) -> RoleAccess:
    # Reads like the inspector; writes only the followers' positions, through follow_position.lua (whose
    # commands are checked against this user too, hence hset and hdel on that one hash).
    return RoleAccess(
        "follower",
        "reads the run (decisions, slot results, steps) as a named consumer beside it; records only its position",
        read=(k.pattern, RUNS),
        write=(k.follow,),
        commands=(
            *_RUN_LOOKUP,
            "xrevrange",
            "xlen",
            "xinfo|groups",
            "xinfo|stream",
            "get",
            "mget",
            "hget",
            "hmget",
            "hgetall",
            "hlen",
            "hvals",
            "hexists",
            "hset",
            "hdel",
        ),
    )


_BUILDERS = {
    "worker": _worker,
    "assembler": _assembler,
    "batcher": _batcher,
    "trainer": _trainer,
    "archiver": _archiver,
    "inspector": _inspector,
    "gateway": _gateway,
    "rewarder": _rewarder,
    "follower": _follower,
}


def _others(keys: RunKeys, written: Iterable[str]) -> tuple[str, ...]:
    """The run's streams not in ``written``: a role that reports consumer lag reads every stream's groups."""
    mine = set(written)
    return tuple(stream for stream in keys.all_streams().values() if stream not in mine)


def password_hash(password: str) -> str:
    """The ``#<sha256>`` form an ACL file takes instead of the password itself."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def render(rights: RoleAccess, run: str, *, password_hashes: Sequence[str] = ()) -> str:
    """One ACL-file line for ``rights``; without a password hash the user exists but cannot log in yet."""
    return f"user {user_name(run, rights.role)} " + " ".join(rules(rights, password_hashes=password_hashes))


def rules(rights: RoleAccess, *, password_hashes: Sequence[str] = ()) -> list[str]:
    """The ACL rules of ``rights``, one item each (a selector ``(...)`` is one), as ``ACL SETUSER`` takes them."""
    passwords = " ".join(password_hashes) if password_hashes else ""
    selectors = [
        "(" + " ".join([*(f"+{command}" for command in commands), *(f"~{key}" for key in keys)]) + ")"
        for commands, keys in rights.confined
    ]
    return [
        "on",
        "resetpass",
        *([passwords] if passwords else []),
        "resetkeys",
        "resetchannels",
        "-@all",
        *(f"+{command}" for command in dict.fromkeys((*COMMON_COMMANDS, *rights.commands))),
        *(f"%R~{key}" for key in rights.read),
        *(f"~{key}" for key in rights.write),
        *selectors,
    ]


def render_run(
    run: str,
    roles: Iterable[str] = ROLES,
    *,
    passwords: dict[str, str] | None = None,
    partitions: int = 1,
    layout: str = payloads.KEYS,
) -> list[str]:
    """The ACL lines of ``roles`` in ``run`` (of ``partitions`` partitions, its payloads in ``layout``), each
    with its password's hash when ``passwords`` has one."""
    keys = RunKeys(run)
    lines = []
    for role in roles:
        hashes = [password_hash(passwords[role])] if passwords and role in passwords else []
        lines.append(render(access(keys, role, partitions, layout), run, password_hashes=hashes))
    return lines


#: The run name ``ops/acl/*.acl`` are written for; `template_for` turns them into another run's rules.
TEMPLATE_RUN = "RUN"


def template_for(text: str, run: str) -> str:
    """An ``ops/acl`` file (written for the run ``RUN``) as the rules of ``run``."""
    RunKeys(run)  # a valid name: it becomes part of key patterns
    return text.replace(f"{{{TEMPLATE_RUN}}}", f"{{{run}}}").replace(f"sg-{TEMPLATE_RUN}-", f"sg-{run}-")
