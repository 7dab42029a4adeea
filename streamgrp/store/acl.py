"""Least privilege per role: the Redis/Valkey ACL users of one run, built from the run's key names.

Owns, for each role (worker, assembler, batcher, trainer, archiver, a read-only inspector, the agent
sessions' gateway, the reward stage's rewarder and a follower), the keys it may only read, the keys it may read and
write, and the commands it may run,
and renders them as ACL-file lines (``streamgrp acl RUN``; ``ops/acl/*.acl`` are these lines for the run
``RUN``). Every key is one of the run's `RunKeys`, so a role's user can touch its own run only. Each role's
rights in an unpartitioned run are built in `streamgrp.store.acl_roles`; this module spreads them over a
partitioned run's keys and renders them.
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

from streamgrp.store import payloads
from streamgrp.store.acl_roles import BUILDERS, ROLES, RoleAccess
from streamgrp.store.keys import RunKeys

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
        build = BUILDERS[role]
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
            elif (derived := _derived(key, kinds)) is not None:  # a pattern of keys named after a kind's key
                base, rest = derived
                out += [getattr(part, kinds[base]) + rest for part in parts]
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


def _derived(key: str, kinds: dict[str, str]) -> tuple[str, str] | None:
    """(a kind's key, the rest) of a key pattern built from a partition kind's key and a ``:`` suffix
    (`streamgrp.store.payloads.turn_pattern`: ``<sessions>:turn:*``), spread like that kind; else None."""
    base, sep, _ = key.rpartition(":")
    while sep:
        if base in kinds:
            return base, key[len(base) :]
        base, sep, _ = base.rpartition(":")
    return None


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
