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
(`streamgrp.store.keys`), and no script or transaction spans two, so each goes to one primary; redis-py follows ``MOVED``/``ASK`` redirections itself, and this
module retries only what it retries on one server. A cluster client's own retry loop is off, as the
single client's is: `Outage` is the one policy.

What this module deliberately ignores: what the commands mean. Roles decide what to do after an
outage; this module only says that one happened (`ServerClient.outages`).
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis._parsers.helpers import parse_info
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.cluster import ClusterPipeline, TransactionStrategy
from redis.retry import Retry
from redis.utils import str_if_bytes

from streamgrp.config import TlsFiles
from streamgrp.errors import (
    ConfigError,
    OutageBudgetExceeded,
    ServerError,
    StopRequested,
)
from streamgrp.store.credentials import (  # noqa: F401 - url_without_password here too
    auth_options,
    safe_url,
    tls_refusal,
    url_warnings,
    url_without_password,
)
from streamgrp.store.resp import RespPacker
from streamgrp.store.streams import keep_every_field

log = logging.getLogger(__name__)
T = TypeVar("T")

MIN_SERVER_VERSION = (7, 0)
#: Default seconds one outage may last before a process gives up (``--outage-budget-s``).
DEFAULT_OUTAGE_BUDGET_S = 300.0
#: A read that takes longer than this is taken for a paused server. Every blocking read streamgrp
#: makes blocks for well under it (`MAX_BLOCK_MS`).
SOCKET_TIMEOUT_S = 10.0
MAX_BLOCK_MS = 5000
#: Errors that mean "the server does not answer now", not "the command is wrong".
OUTAGE_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,  # refused, reset, and BusyLoadingError (LOADING) is one of these
    redis.TimeoutError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.MasterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,  # CLUSTERDOWN (MasterDownError is one of these)
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.RedisClusterUnreachableError,  # no node of the cluster answers
)
#: Commands never sent again by the client: their lost reply must be handled by the role.
NOT_REPEATED = frozenset({b"XREADGROUP", b"XAUTOCLAIM", b"XCLAIM", b"INCR", b"INCRBY", b"DECR", b"DECRBY",
                          b"HINCRBY", b"HINCRBYFLOAT", b"INCRBYFLOAT"})
MEMORY_WARNING_RATIO = 0.9
#: A ``BUSY`` reply (a script or function running past the time limit), alone or inside a pipeline's
#: annotated error; not ``BUSYKEY`` or ``BUSYGROUP``, which are answers about keys.
_BUSY_REPLY = re.compile(r"(?:^|: )BUSY\s")


def is_outage(exc: BaseException) -> bool:
    """True for an error that says the server is unavailable right now (including a script's OOM and BUSY)."""
    if isinstance(exc, redis.AuthenticationError):  # a ConnectionError to redis-py, but waiting cannot fix it
        return False
    if isinstance(exc, OUTAGE_ERRORS):
        return tls_refusal(exc, "") is None  # a refused certificate is refused on every attempt
    if not isinstance(exc, redis.ResponseError):
        return False
    text = str(exc)
    return "OOM command not allowed" in text or _BUSY_REPLY.search(text) is not None


@dataclass
class Outage:
    """The outage policy of one process, shared by all its threads: backoff, budget, one log line.

    ``budget_s`` bounds one outage (from its first failed command to the next success), not a
    single command. ``stop``, when set, ends every wait with `StopRequested`.
    """

    budget_s: float = DEFAULT_OUTAGE_BUDGET_S
    base_s: float = 0.05
    cap_s: float = 2.0
    stop: threading.Event | None = None
    name: str = "the server"
    #: The setting that raises ``budget_s``, named in the messages.
    budget_flag: str = "--outage-budget-s"
    #: Outages seen so far; roles compare it between rounds to know they must resynchronise.
    count: int = 0
    _down_since: float | None = field(default=None, repr=False)
    _last_error: str = field(default="", repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def down_for(self) -> float:
        """Seconds the current outage has lasted (0 when the server answers)."""
        since = self._down_since
        return 0.0 if since is None else time.monotonic() - since

    def call(self, fn, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, sent again through outages until it answers or the budget runs out."""
        attempt = 0
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                if not is_outage(exc):
                    refusal = tls_refusal(exc, self.name)
                    if refusal is not None:
                        raise refusal from None
                    raise
                self.failed(exc, attempt)
                attempt += 1
                continue
            if self._down_since is not None:
                self.recovered()
            return result

    def failed(self, exc: BaseException, attempt: int = 0) -> None:
        """Record a failure, raise when the budget is spent or a stop was asked, else back off."""
        with self._lock:
            now = time.monotonic()
            if self._down_since is None:
                self._down_since = now
                self.count += 1
                log.warning("%s is unavailable (%s: %s); retrying with backoff for up to %gs (%s)",
                            self.name, type(exc).__name__, _short(exc), self.budget_s, self.budget_flag)
            self._last_error = f"{type(exc).__name__}: {_short(exc)}"
            down_for = now - self._down_since
        if down_for >= self.budget_s:
            raise OutageBudgetExceeded(
                f"{self.name} has been unavailable for {down_for:.0f}s, over the outage budget of {self.budget_s:g}s "
                f"(last error {self._last_error}); check that the server runs and is reachable "
                f"(a full server under noeviction needs more maxmemory or retention), or raise {self.budget_flag}"
            ) from None
        # Full jitter: processes that lost the server together do not come back in lockstep.
        delay = random.uniform(0, min(self.cap_s, self.base_s * 2 ** min(attempt, 16)))
        delay = min(delay, max(0.0, self.budget_s - down_for))
        if self.stop is not None:
            if self.stop.is_set() or self.stop.wait(delay):
                raise StopRequested(f"stopped while {self.name} was unavailable") from None
        else:
            time.sleep(delay)

    def recovered(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            log.warning("%s answers again after %.1fs", self.name, time.monotonic() - self._down_since)
            self._down_since = None

    def ride_out(self, exc: BaseException, client: redis.Redis) -> None:
        """After ``exc`` (an outage) reached a role: wait until the server answers again.

        The role then resumes from what the server says (its pending entries, its commits), since
        the command that failed may or may not have taken effect.
        """
        self.failed(exc)
        self.call(without_retries(client).ping)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


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
                return super().execute_command(*args, **options)
            except redis.ConnectionError as exc:  # raised to the role as an outage, unless waiting cannot help
                refusal = tls_refusal(exc, self.outage.name if self.outage is not None else "the server")
                if refusal is not None:
                    raise refusal from None
                raise
        return self.outage.call(super().execute_command, *args, **options)

    @property
    def outages(self) -> int:
        return self.outage.count if self.outage is not None else 0

    def replicate(self) -> None:
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
            log.warning("only %d of %d replicas confirmed a write within %d ms", replicas, self.wait_replicas,
                        self.wait_timeout_ms)

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

    def pipeline(self, transaction: bool | None = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        if self.riding:
            # A ClusterPipeline is built from this client's parts; the subclass adds only `execute`.
            pipe.__class__ = _RepeatableClusterPipeline
            pipe.outage = self.outage
        return pipe

    def without_retries(self) -> redis.RedisCluster:
        """This client, failing at once in an outage, on the same connections and slot table."""
        view = object.__new__(_ClusterView)
        view.__dict__.update(self.__dict__)
        view.riding = False
        return view

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

    outage: Outage

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack = list(self.command_stack)
        if any(_command_name(args) in NOT_REPEATED for args, _options in stack):
            return super().execute(raise_on_error)
        scripts = list(self.scripts)

        def attempt() -> list[Any]:
            self.command_stack = list(stack)  # a failed execute resets the pipeline; queue it again
            self.scripts = set(scripts)
            return Pipeline.execute(self, raise_on_error)

        return self.outage.call(attempt)


class _RepeatableClusterPipeline(ClusterPipeline):
    """`_RepeatablePipeline` for a cluster: its commands are queued again before each attempt."""

    outage: Outage

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack = [(command.args, dict(command.options)) for command in self._execution_strategy.command_queue]
        if any(_command_name(args) in NOT_REPEATED for args, _options in stack):
            return super().execute(raise_on_error)

        def attempt() -> list[Any]:
            self.reset()  # a failed execute resets the pipeline too; queue it again
            for args, options in stack:
                self.execute_command(*args, **dict(options))
            transaction = isinstance(self._execution_strategy, TransactionStrategy)
            replies = ClusterPipeline.execute(self, raise_on_error)
            return self._parsed(replies, stack) if transaction else replies

        return self.outage.call(attempt)

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
            if callback is not None and name not in self.cluster_response_callbacks and not isinstance(reply, Exception):
                options = {key: value for key, value in options.items() if key != "keys"}
                reply = callback(reply, **options)
            parsed.append(reply)
        return parsed


def _command_name(args: tuple[Any, ...]) -> bytes:
    name = args[0] if args else b""
    if isinstance(name, str):
        name = name.encode()
    return name.split(b" ", 1)[0].upper()


def connect(url: str, *, outage_budget_s: float = DEFAULT_OUTAGE_BUDGET_S, stop: threading.Event | None = None,
            wait_replicas: int = 0, wait_timeout_ms: int = 1000, check_settings: bool = True,
            password: str | None = None, tls: TlsFiles | None = None,
            cluster: bool = False, budget_flag: str = "--outage-budget-s") -> ServerClient | ClusterClient:
    """A client for ``url`` once the server answers (waiting through an outage at start).

    ``cluster`` False: a `ServerClient` of the one server at ``url`` (refused, with the remedy, when
    that server is a Redis Cluster node). True: a `ClusterClient` of the cluster the node at ``url``
    belongs to. Checks that the server (on a cluster, every primary) is Redis/Valkey >= 7.0 and,
    unless ``check_settings`` is False, that it will not evict keys (`check_server_settings`).
    ``password`` is used when the URL carries none (so it need not appear in a URL someone may
    print); ``tls`` (a ``rediss://`` URL) verifies the server against its CA and presents its client
    certificate; on a cluster both apply to every node.
    """
    where = safe_url(url)
    for warning in url_warnings(url):
        log.warning("%s", warning)
    options = dict(decode_responses=False, socket_keepalive=True, socket_timeout=SOCKET_TIMEOUT_S,
                   socket_connect_timeout=SOCKET_TIMEOUT_S, retry=Retry(NoBackoff(), 0),
                   **auth_options(url, password, tls))
    if check_settings:
        # A cluster client runs its own connection set-up first, then this; a single client only this.
        options["redis_connect_func"] = _eviction_checked(where, set_up=not cluster)
    outage = Outage(budget_s=outage_budget_s, stop=stop, name=f"the {'cluster' if cluster else 'server'} at {where}",
                    budget_flag=budget_flag)
    if cluster:
        client: ServerClient | ClusterClient = outage.call(_join_cluster, url, options, where)
    else:
        client = ServerClient.from_url(url, health_check_interval=30, command_packer=RespPacker(), **options)
    keep_every_field(client)
    client.outage = outage
    client.wait_replicas = wait_replicas
    client.wait_timeout_ms = wait_timeout_ms
    servers = ([(client.get_redis_connection(node), f"{where} (primary {node.name})") for node in client.get_primaries()]
               if cluster else [(client, where)])
    for server, server_where in servers:
        info = outage.call(_server_info, server, server_where)
        version = tuple(int(part) for part in str(info.get("redis_version", "0.0")).split(".")[:2])
        if version < MIN_SERVER_VERSION:
            raise ServerError(f"{server_where} runs Redis {info.get('redis_version')}; streamgrp needs 7.0 or newer")
        if not cluster and int(info.get("cluster_enabled", 0) or 0):
            raise ConfigError(f"the server at {where} is a Redis Cluster node: connect with --cluster "
                              "(STREAMGRP_CLUSTER=1, or cluster = true in the config file's [connection] table)")
        if check_settings:
            # A named ACL user is a role's: its rules deny CONFIG, so asking would only fill the ACL log.
            outage.call(check_server_settings, server, server_where, read_config=not urlsplit(url).username)
    return client


def _eviction_checked(where: str, *, set_up: bool) -> Callable[[Any], None]:
    """A redis-py ``redis_connect_func``: on every new connection, refuse a server that evicts keys.

    Checked per connection, not only at `connect`: redis-py reconnects by itself, after an outage
    and after an idle server restarted, and the server that answers then may be configured to
    evict. ``set_up``: run redis-py's own set-up (AUTH, HELLO) first, which the cluster client does itself.
    """
    def connect_func(connection: Any) -> None:
        if set_up:
            connection.on_connect()
        connection.send_command("INFO", "memory")
        info = parse_info(str_if_bytes(connection.read_response()))
        server = where if set_up else f"{where} (node {connection.host}:{connection.port})"
        refuse_eviction(info, server)

    return connect_func


def _join_cluster(url: str, options: dict[str, Any], where: str) -> ClusterClient:
    """A `ClusterClient` from the node at ``url``; an unreachable cluster is an outage (raised as is)."""
    try:
        return ClusterClient.from_url(url, **options)
    except (redis.exceptions.RedisClusterUnreachableError, redis.ConnectionError, redis.TimeoutError) as exc:
        if isinstance(exc, redis.AuthenticationError):
            raise _refused(where, exc) from None
        raise
    except redis.exceptions.RedisClusterException as exc:
        text = str(exc)
        if any(word in text for word in ("username-password", "WRONGPASS", "NOAUTH", "Authentication")):
            raise _refused(where, exc) from None
        if "cluster" in text.lower() and ("not enabled" in text.lower() or "support disabled" in text.lower()):
            raise ConfigError(f"--cluster is set but the server at {where} is not a Redis Cluster node ({text}); "
                              "unset --cluster (STREAMGRP_CLUSTER) or give the URL of a cluster node") from None
        raise ServerError(f"cannot join the cluster at {where}: {text}") from None


def _refused(where: str, exc: BaseException) -> ServerError:
    return ServerError(f"the server at {where} refused the credentials: {exc}; fix the password "
                       "(--password-file, STREAMGRP_PASSWORD, or the one in --redis-url) or the user name")


def _server_info(server: redis.Redis, where: str) -> dict[str, Any]:
    """INFO server and cluster of one server, with errors that say what to change."""
    try:
        return {**server.info("server"), **server.info("cluster")}
    except redis.AuthenticationError as exc:
        raise _refused(where, exc) from None
    except redis.exceptions.NoPermissionError as exc:
        raise ServerError(f"the server at {where} does not let this user run INFO ({exc}); give the user the "
                          "rules `streamgrp acl RUN` prints for its role") from None


def check_server_settings(client: redis.Redis, where: str, *, read_config: bool = True) -> None:
    """Refuse a server that evicts keys; warn when it is nearly full or does not persist.

    ``read_config`` False skips the one check that needs ``CONFIG GET`` (``appendfsync no``).

    An evicting server silently deletes a run's state (committed steps, decisions, leases), so a
    restarted trainer would start again from step 0: that is refused, not warned about.
    """
    memory = client.info("memory")
    refuse_eviction(memory, where)
    maxmemory, used = int(memory.get("maxmemory", 0) or 0), int(memory.get("used_memory", 0) or 0)
    if maxmemory and used >= MEMORY_WARNING_RATIO * maxmemory:
        log.warning("the server at %s uses %d of its %d bytes of maxmemory; writes stop when it is full "
                    "(raise maxmemory or run the archiver with --retention)", where, used, maxmemory)
    persistence = client.info("persistence")
    if not int(persistence.get("aof_enabled", 0) or 0):
        log.warning("the server at %s does not keep an append-only file (appendonly no): a server restart loses "
                    "every write since its last snapshot. Turn it on with CONFIG SET appendonly yes (and "
                    "appendfsync everysec or always), or use the embedded server, which does", where)
        return
    if not read_config:
        return
    try:
        values = client.config_get("appendfsync")
        fsync = values.get(b"appendfsync", values.get("appendfsync"))
    except redis.ResponseError:
        return  # CONFIG may be refused to this user; the AOF is on, which is what matters most
    if fsync in (b"no", "no"):
        log.warning("the server at %s runs appendfsync no: a machine crash can lose about 30 s of acknowledged "
                    "writes; use everysec (about 1 s) or always (none)", where)


def refuse_eviction(memory: dict[str, Any], where: str) -> None:
    """Raise `ConfigError` when ``INFO memory`` says the server evicts keys."""
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    if policy != "noeviction":
        raise ConfigError(
            f"the server at {where} evicts keys (maxmemory-policy {policy}): it would silently delete a run's "
            "committed steps, decisions and leases. Set maxmemory-policy to noeviction (CONFIG SET "
            "maxmemory-policy noeviction, or in its configuration file); a full server then refuses writes, "
            "which streamgrp waits out and reports")


def outage_of(client: redis.Redis) -> Outage:
    """The client's outage policy; a plain redis-py client (tests) gets a default one of its own."""
    outage = getattr(client, "outage", None)
    if outage is None:
        outage = Outage()
        try:
            client.outage = outage  # one policy per client, so every user of it counts the same outages
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


def replicate(client: redis.Redis) -> None:
    """`Riding.replicate` for any client (a plain one never waits)."""
    if isinstance(client, Riding):
        client.replicate()
