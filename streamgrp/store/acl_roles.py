"""Each role's rights in one run, before partitioning: the keys it reads, the keys it writes, and the commands
it may run on them (all of them, or confined to some keys by an ACL selector).

Owns `RoleAccess`, the list of roles, and one builder per role that names, from the run's `RunKeys`, what
that role's functions and its own calls touch (the comments say which script needs which right). It
deliberately ignores partitions (`streamgrp.store.acl.access` spreads these rights over a partitioned
run's keys) and the ACL-file text (`streamgrp.store.acl.render`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from streamgrp.store import payloads
from streamgrp.store.keys import RUNS, RunKeys

__all__ = ["BUILDERS", "ROLES", "RoleAccess"]

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


def _turns(k: RunKeys, keyed: bool) -> tuple[tuple[str, ...], tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]]:
    """The keys the gateway writes for its turns' tensors in a ``keys``-layout run, and the selectors that
    confine those writes: SET only on the sessions' staging keys, RENAME only from those to turn keys (a
    selector of its own, so never to or from a payload key), PERSIST only on turn keys (session_turn.lua).
    None in the old layout, whose turns keep their tensors in the sessions stream."""
    if not keyed:
        return (), ()
    staging, turns = payloads.staged_pattern(k.sessions), payloads.turn_pattern(k.sessions)
    return (staging, turns), ((("set",), (staging,)), (("rename",), (staging, turns)), (("persist",), (turns,)))


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


def _turn_reads(k: RunKeys, keyed: bool) -> tuple[str, ...]:
    """What a role that reads agent sessions' turns reads beside the sessions stream in a ``keys``-layout run."""
    return (payloads.turn_pattern(k.sessions),) if keyed else ()


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
        write=(k.archive, k.follow, *trimmed, *_payload_reads(k, keyed), *_turn_reads(k, keyed)),  # follow: reads
        # followers' positions, records their skips; payload and turn keys: read into the archive, unlinked by
        # retention behind it
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
        confined=((("unlink",), (*_payload_reads(k, keyed), *_turn_reads(k, keyed))),) if keyed else (),
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
    turn_keys, turn_writes = _turns(k, keyed)
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
            *turn_keys,
            k.deadletter,
            k.deadlettered,
            k.deadletter_counts,
        ),
        commands=(
            *_RUN_LOOKUP,
            "get",
            "exists",
            *(("mget",) if keyed else ()),  # a restarted gateway reads its sessions' turns from their keys
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
            *turn_writes,
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


#: The builder of each role's rights: `(keys, keyed) -> RoleAccess`, ``keyed`` for a ``keys``-layout run.
BUILDERS: dict[str, Callable[[RunKeys, bool], RoleAccess]] = {
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
