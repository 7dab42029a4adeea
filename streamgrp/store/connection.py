"""The connection to the server: riding out outages, refusing settings that lose data, replica waits.

Owns how every streamgrp process talks to Redis/Valkey. `connect` returns a `ServerClient` (one
server) or, with ``cluster=True``, a `ClusterClient` (a Redis Cluster, discovered from the node in
the URL). Both are redis-py clients (`Riding` holds what they share) whose commands ride out an
*outage* (a refused or reset connection, a paused server's read timeout, ``LOADING`` while a
restarted server reads its AOF, ``BUSY`` while a script or function runs past the server's time
limit, ``OOM`` from a full ``noeviction`` server, ``READONLY`` during a
failover, ``CLUSTERDOWN``/``TRYAGAIN`` or no reachable node of a cluster): the command is sent again with bounded
exponential backoff and full jitter, one warning is logged when the outage starts and one when
the server is back, and after ``outage_budget_s`` seconds of one outage the command raises
`OutageBudgetExceeded`. A stop requested meanwhile (SIGTERM) raises `StopRequested`, so a
process shuts down quietly while the server is gone. Every new connection (the first, and each
reconnect after an outage or an idle server's restart) checks that the server does not evict keys:
a restarted or replaced server may have come back configured otherwise. A TLS certificate refusal
is no outage: it raises `ServerError` at once (`credentials.tls_refusal`).

A ``BUSY`` server (a script stuck in a loop, from any client with the right to run one) answers
nothing else until the script ends or an administrator sends ``SCRIPT KILL``/``FUNCTION KILL``; the
commands that met it did not run, so repeating them is as safe as after a refused connection.

Why retry here and not with redis-py's own ``Retry``: redis-py retries every command blindly.
Most of ours are safe to repeat: reads, acknowledgements, the commit scripts (each checks a
marker, a cursor or an expected step before it writes, so a repeat after a lost reply writes
nothing twice), and ``XADD`` of a slot result (a second copy is folded as a ``duplicate``: first
result wins). Three are not: ``XREADGROUP``, ``XAUTOCLAIM`` and ``XCLAIM`` move entries into a
consumer's pending list, so a lost reply leaves entries there that the process never saw. Those
raise the outage to the role, which waits for the server and resumes from its pending entries,
exactly as after a crash (`Outage.wait_for_server`, then each role's rebuild). Counters outside
scripts (``INCR``, ``HINCRBY``) are never repeated either.

On a cluster every key of one run (of one partition of a partitioned run) is in one slot
(`streamgrp.store.keys`), and no script or transaction spans two, so each goes to one primary; redis-py follows
``MOVED``/``ASK`` redirections itself, and this
module retries only what it retries on one server. A cluster client's own retry loop is off, as the
single client's is: `Outage` is the one policy.

What this module deliberately ignores: what the commands mean. Roles decide what to do after an
outage; this module only says that one happened (`ServerClient.outages`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.cluster import ClusterPipeline, TransactionStrategy
from redis.retry import Retry

from streamgrp.config import TlsFiles
from streamgrp.errors import ConfigError, ServerError
from streamgrp.store.credentials import (  # noqa: F401 - url_without_password here too
    auth_options,
    safe_url,
    tls_refusal,
    url_warnings,
    url_without_password,
)
from streamgrp.store.outage import (  # noqa: F401 - the outage policy's names, importable from here as before
    DEFAULT_OUTAGE_BUDGET_S,
    NOT_REPEATED,
    OUTAGE_ERRORS,
    Outage,
    is_outage,
)
from streamgrp.store.resp import RespPacker
from streamgrp.store.server_checks import (  # noqa: F401 - the server checks' names, importable from here as before
    MEMORY_WARNING_RATIO,
    MIN_SERVER_VERSION,
    check_server_settings,
    eviction_checked,
    refuse_eviction,
    refused,
    server_info,
)
from streamgrp.store.streams import keep_every_field

log = logging.getLogger(__name__)
T = TypeVar("T")

#: A read that takes longer than this is taken for a paused server. Every blocking read streamgrp
#: makes blocks for well under it (`MAX_BLOCK_MS`).
SOCKET_TIMEOUT_S = 10.0
MAX_BLOCK_MS = 5000


class Riding:
    """What the single-server and the cluster client share: commands that ride out outages (`Outage`)
    and waits for replicas after writes.

    Commands other than `NOT_REPEATED` ones are sent again through an outage; pipelines are too,
    as a whole, when every command in them may be repeated. A client whose ``riding`` is False (see
    ``without_retries``) fails at once instead.
    """

    #: None until `connect` sets it: a cluster client sends commands while it is built (COMMAND), and
    #: `connect` rides out an outage around the whole construction instead.
    outage: Outage | None = None
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000
    riding: bool = True
    _waitaof: bool | None = None

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if not self.riding or self.outage is None or _command_name(args) in NOT_REPEATED:
            try:
                return self._send(*args, **options)
            except redis.ConnectionError as exc:  # raised to the role as an outage, unless waiting cannot help
                refusal = tls_refusal(exc, self.outage.name if self.outage is not None else "the server")
                if refusal is not None:
                    raise refusal from None
                raise
        return self.outage.call(self._send, *args, **options)

    def _send(self, *args: Any, **options: Any) -> Any:
        """The command sent once, by the redis-py client class this is mixed into."""
        raise NotImplementedError

    def without_retries(self) -> redis.Redis:
        """A client on the same connections that fails at once in an outage."""
        raise NotImplementedError

    @property
    def outages(self) -> int:
        return self.outage.count if self.outage is not None else 0

    def wait_for_replicas(self) -> None:
        """After a commit: wait until ``wait_replicas`` replicas have it (WAITAOF where the server has it).

        A replica that does not confirm within ``wait_timeout_ms`` is logged, not fatal: the write is
        on the primary, and what asynchronous replication can lose is documented in the README.
        """
        if self.wait_replicas <= 0:
            return
        if self._waitaof is not False:
            try:
                replicas = _fewest(self._replica_wait("WAITAOF", 0, self.wait_replicas, self.wait_timeout_ms))
                self._waitaof = True
            except redis.ResponseError:
                self._waitaof = False  # Redis 7.0 has no WAITAOF
        if self._waitaof is False:
            replicas = _fewest(self._replica_wait("WAIT", self.wait_replicas, self.wait_timeout_ms))
        if replicas < self.wait_replicas:
            log.warning(
                "only %d of %d replicas confirmed a write within %d ms",
                replicas,
                self.wait_replicas,
                self.wait_timeout_ms,
            )

    def _replica_wait(self, *args: Any) -> Any:
        return self.execute_command(*args)


def _fewest(reply: Any) -> int:
    """Replicas that confirmed, from a WAIT or WAITAOF reply (``[local, replicas]``), or from one such
    reply per node (a dict or a list of them): the fewest any node reports."""
    if isinstance(reply, dict):
        return min((_fewest(value) for value in reply.values()), default=0)
    if isinstance(reply, (list, tuple)):
        if reply and isinstance(reply[0], (list, tuple)):
            return min(_fewest(item) for item in reply)
        return int(reply[-1]) if reply else 0
    return int(reply)


class ServerClient(Riding, redis.Redis):
    """A redis-py client of one server that rides out outages and waits for replicas (`Riding`)."""

    def _send(self, *args: Any, **options: Any) -> Any:
        return redis.Redis.execute_command(self, *args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        pipe = _RepeatablePipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.outage = self.outage
        return pipe

    def without_retries(self) -> redis.Redis:
        """A plain client on the same connections, for callers that must not wait (metrics scrapes)."""
        return redis.Redis(connection_pool=self.connection_pool)


class ClusterClient(Riding, redis.RedisCluster):
    """A redis-py cluster client that rides out outages and waits for replicas (`Riding`).

    A run's keys share one hash tag, so its scripts and transactions each go to one primary. The
    replica wait is sent to every primary: WAIT and WAITAOF count only the writes of the
    connection they are sent on, so a primary this process did not write to answers at once, and the
    one it wrote to waits for its replicas.
    """

    def _send(self, *args: Any, **options: Any) -> Any:
        return redis.RedisCluster.execute_command(self, *args, **options)

    def pipeline(self, transaction: bool | None = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        if self.riding:
            # A ClusterPipeline is built from this client's parts; the subclass adds only `execute`.
            pipe.__class__ = _RepeatableClusterPipeline
            pipe.outage = self.outage
        return pipe

    def without_retries(self) -> redis.Redis:
        """This client, failing at once in an outage, on the same connections and slot table (typed as
        `connect` types every client)."""
        view = object.__new__(_ClusterView)
        view.__dict__.update(self.__dict__)
        view.riding = False
        return cast(redis.Redis, view)

    def _replica_wait(self, *args: Any) -> Any:
        return self.execute_command(*args, target_nodes=redis.RedisCluster.PRIMARIES)


class _ClusterView(ClusterClient):
    """`ClusterClient.without_retries`: shares the client's nodes, so closing it closes nothing."""

    def close(self) -> None:
        pass

    def __del__(self) -> None:
        pass


class _RepeatablePipeline(Pipeline):
    """A pipeline sent again as a whole through an outage when all its commands may be repeated."""

    outage: Outage | None = None

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack = list(self.command_stack)
        outage = self.outage
        if outage is None or any(_command_name(args) in NOT_REPEATED for args, _options in stack):
            return super().execute(raise_on_error)
        scripts = list(self.scripts)

        def attempt() -> list[Any]:
            self.command_stack = list(stack)  # a failed execute resets the pipeline; queue it again
            self.scripts = set(scripts)
            return Pipeline.execute(self, raise_on_error)

        return outage.call(attempt)


class _RepeatableClusterPipeline(ClusterPipeline):
    """`_RepeatablePipeline` for a cluster: its commands are queued again before each attempt."""

    outage: Outage | None = None

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack = [(command.args, dict(command.options)) for command in self._execution_strategy.command_queue]
        outage = self.outage
        if outage is None or any(_command_name(args) in NOT_REPEATED for args, _options in stack):
            return super().execute(raise_on_error)

        def attempt() -> list[Any]:
            self.reset()  # a failed execute resets the pipeline too; queue it again
            for args, options in stack:
                self.execute_command(*args, **dict(options))
            transaction = isinstance(self._execution_strategy, TransactionStrategy)
            replies = ClusterPipeline.execute(self, raise_on_error)
            return self._parsed(replies, stack) if transaction else replies

        return outage.call(attempt)

    def _parsed(self, replies: list[Any], stack: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """A transaction's replies parsed as a node's client parses them outside one.

        redis-py's cluster transactions skip the per-command reply parsing its other pipelines do
        (``XINFO GROUPS`` keys stay bytes, ``XPENDING`` stays a list), so the same code would read
        different shapes on a cluster; the nodes' callbacks (`keep_every_field`'s among them) apply here."""
        node = next((n.redis_connection for n in self.nodes_manager.nodes_cache.values() if n.redis_connection), None)
        if node is None:
            return replies
        parsed = []
        for reply, (args, options) in zip(replies, stack):
            name = str(args[0], "utf-8") if isinstance(args[0], bytes) else str(args[0])
            callback = node.response_callbacks.get(name)
            if (
                callback is not None
                and name not in self.cluster_response_callbacks
                and not isinstance(reply, Exception)
            ):
                options = {key: value for key, value in options.items() if key != "keys"}
                reply = callback(reply, **options)
            parsed.append(reply)
        return parsed


def _command_name(args: tuple[Any, ...]) -> bytes:
    name = args[0] if args else b""
    if isinstance(name, str):
        name = name.encode()
    return name.split(b" ", 1)[0].upper()


def connect(
    url: str,
    *,
    outage_budget_s: float = DEFAULT_OUTAGE_BUDGET_S,
    stop: threading.Event | None = None,
    wait_replicas: int = 0,
    wait_timeout_ms: int = 1000,
    check_settings: bool = True,
    password: str | None = None,
    tls: TlsFiles | None = None,
    cluster: bool = False,
    budget_flag: str = "--outage-budget-s",
) -> redis.Redis:
    """A client for ``url`` once the server answers (waiting through an outage at start).

    ``cluster`` False: a `ServerClient` of the one server at ``url`` (refused, with the remedy, when
    that server is a Redis Cluster node). True: a `ClusterClient` of the cluster the node at ``url``
    belongs to. Checks that the server (on a cluster, every primary) is Redis/Valkey >= 7.0 and,
    unless ``check_settings`` is False, that it will not evict keys (`check_server_settings`).
    ``password`` is used when the URL carries none (so it need not appear in a URL someone may
    print); ``tls`` (a ``rediss://`` URL) verifies the server against its CA and presents its client
    certificate; on a cluster both apply to every node.

    Either client is returned typed as a `redis.Redis`, as streamgrp's code takes every client: the cluster
    client answers the same commands, and redis-py gives the two no common base class.
    """
    where = safe_url(url)
    for warning in url_warnings(url):
        log.warning("%s", warning)
    options = dict(
        decode_responses=False,
        socket_keepalive=True,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=SOCKET_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
        **auth_options(url, password, tls),
    )
    if check_settings:
        # A cluster client runs its own connection set-up first, then this; a single client only this.
        options["redis_connect_func"] = eviction_checked(where, set_up=not cluster)
    outage = Outage(
        budget_s=outage_budget_s,
        stop=stop,
        name=f"the {'cluster' if cluster else 'server'} at {where}",
        budget_flag=budget_flag,
    )
    client: ServerClient | ClusterClient
    if cluster:
        client = outage.call(_join_cluster, url, options, where)
    else:
        # redis-py's from_url builds the class it is called on, though its hint says redis.Redis.
        client = cast(
            ServerClient, ServerClient.from_url(url, health_check_interval=30, command_packer=RespPacker(), **options)
        )
    keep_every_field(client)
    client.outage = outage
    client.wait_replicas = wait_replicas
    client.wait_timeout_ms = wait_timeout_ms
    servers = (
        [(client.get_redis_connection(node), f"{where} (primary {node.name})") for node in client.get_primaries()]
        if isinstance(client, ClusterClient)
        else [(client, where)]
    )
    for server, server_where in servers:
        info = outage.call(server_info, server, server_where)
        version = tuple(int(part) for part in str(info.get("redis_version", "0.0")).split(".")[:2])
        if version < MIN_SERVER_VERSION:
            raise ServerError(f"{server_where} runs Redis {info.get('redis_version')}; streamgrp needs 7.0 or newer")
        if not cluster and int(info.get("cluster_enabled", 0) or 0):
            raise ConfigError(
                f"the server at {where} is a Redis Cluster node: connect with --cluster "
                "(STREAMGRP_CLUSTER=1, or cluster = true in the config file's [connection] table)"
            )
        if check_settings:
            # A named ACL user is a role's: its rules deny CONFIG, so asking would only fill the ACL log.
            outage.call(check_server_settings, server, server_where, read_config=not urlsplit(url).username)
    return cast(redis.Redis, client)


def _join_cluster(url: str, options: dict[str, Any], where: str) -> ClusterClient:
    """A `ClusterClient` from the node at ``url``; an unreachable cluster is an outage (raised as is)."""
    try:
        # redis-py's from_url builds the class it is called on, though its hint says redis.RedisCluster.
        return cast(ClusterClient, ClusterClient.from_url(url, **options))
    except (redis.exceptions.RedisClusterUnreachableError, redis.ConnectionError, redis.TimeoutError) as exc:
        if isinstance(exc, redis.AuthenticationError):
            raise refused(where, exc) from None
        raise
    except redis.exceptions.RedisClusterException as exc:
        text = str(exc)
        if any(word in text for word in ("username-password", "WRONGPASS", "NOAUTH", "Authentication")):
            raise refused(where, exc) from None
        if "cluster" in text.lower() and ("not enabled" in text.lower() or "support disabled" in text.lower()):
            raise ConfigError(
                f"--cluster is set but the server at {where} is not a Redis Cluster node ({text}); "
                "unset --cluster (STREAMGRP_CLUSTER) or give the URL of a cluster node"
            ) from None
        raise ServerError(f"cannot join the cluster at {where}: {text}") from None


def outage_of(client: redis.Redis) -> Outage:
    """The client's outage policy; a plain redis-py client (tests) gets a default one of its own."""
    outage = getattr(client, "outage", None)
    if outage is None:
        outage = Outage()
        try:  # one policy per client, so every user of it counts the same outages
            setattr(client, "outage", outage)  # noqa: B010 - a plain client declares no such attribute
        except AttributeError:
            pass
    return outage


def without_retries(client: redis.Redis) -> redis.Redis:
    """A client on the same connections that fails at once in an outage (shutdown, scrapes)."""
    return client.without_retries() if isinstance(client, Riding) else client


def ride(client: redis.Redis, attempt: Callable[[], T]) -> T:
    """``attempt()``, sent again through outages when ``client`` rides them out (as its own commands
    do), else once: for reads a caller runs on a connection of its own (`streams.stream_entries`)."""
    if isinstance(client, Riding) and client.riding and client.outage is not None:
        return client.outage.call(attempt)
    return attempt()


def wait_for_replicas(client: redis.Redis) -> None:
    """`Riding.wait_for_replicas` for any client (a plain one never waits)."""
    if isinstance(client, Riding):
        client.wait_for_replicas()
