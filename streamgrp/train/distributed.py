"""Trainer ranks under torchrun's conventions: who a process is, the rendezvous, and its collectives.

Owns where a trainer rank's identity comes from. Each of rank, world size, local rank and rendezvous
is taken, in this order, from an explicit setting (a flag, a ``STREAMGRP_`` variable or the TOML
file), from the variables torchrun (``torch.distributed.elastic``) exports to every process it
starts (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` for ``env://``),
or from the one-process defaults. So ``torchrun --nproc-per-node 2 -m streamgrp.consumers.grpo_trainer ...``
needs no rank flags, and a flag still overrides what torchrun says (with a warning, since under
torchrun every process gets the same flags).

Also owns `Collectives`, the one path a trainer's collective calls take, which records what each
step called: every rank must make the same calls per step whatever its shard holds (SPEC section 3),
and the record is what shows it. Deliberately ignores which backend or device a trainer trains on
beyond picking ``cuda:LOCAL_RANK`` when CUDA is there; torch is imported only when a function needs it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamgrp.errors import ConfigError, TrainerGroupError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: The rendezvous of ranks started by hand (flags, the demo) when neither a URL nor torchrun gives one.
DEFAULT_DIST_URL = "tcp://127.0.0.1:29511"
#: Variables torchrun exports to each process it starts.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """One trainer process's place in the data-parallel group, and where each value came from."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str
    #: name -> "flag", "torchrun" or "default", for messages and logs
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def under_torchrun(self) -> bool:
        return "torchrun" in self.sources.values()

    def device(self) -> torch.device:
        """``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
        import torch

        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    def describe(self) -> str:
        where = ", ".join(f"{name} from {source}" for name, source in self.sources.items())
        return f"rank {self.rank} of {self.world_size} (local rank {self.local_rank}, {self.init_method}; {where})"


def resolve(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    dist_url: str | None = None,
    env: Mapping[str, str] | None = None,
) -> DistEnv:
    """The process's `DistEnv`: explicit values win, then torchrun's variables in ``env``, then defaults."""
    env = os.environ if env is None else env
    sources: dict[str, str] = {}
    rank = _pick("rank", rank, _env_int(env, "RANK", minimum=0), 0, sources)
    world_size = _pick("world_size", world_size, _env_int(env, "WORLD_SIZE", minimum=1), 1, sources)
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"rank {rank} (from {sources['rank']}) is outside 0..{world_size - 1} (world size from "
            f"{sources['world_size']}); give each process a rank below the world size, or let torchrun "
            "set RANK and WORLD_SIZE and pass neither flag"
        )
    # Ranks started by hand on one machine: the rank is also the index on the machine.
    local_rank = _pick("local_rank", local_rank, _env_int(env, "LOCAL_RANK", minimum=0), rank, sources)
    rendezvous = "env://" if env.get("MASTER_ADDR") and env.get("MASTER_PORT") else None
    init_method = _pick("init_method", dist_url, rendezvous, DEFAULT_DIST_URL, sources)
    return DistEnv(rank, world_size, local_rank, init_method, sources)


def resolve_config(config: Any, env: Mapping[str, str] | None = None) -> DistEnv:
    """`resolve` from a settings object with ``rank``, ``world_size``, ``local_rank`` and ``dist_url``
    fields (`streamgrp.config.TrainerConfig`), unset fields being None."""
    return resolve(
        rank=config.rank,
        world_size=config.world_size,
        local_rank=getattr(config, "local_rank", None),
        dist_url=config.dist_url,
        env=env,
    )


def _pick(name: str, explicit: Any, from_torchrun: Any, default: Any, sources: dict[str, str]) -> Any:
    if explicit is not None:
        if from_torchrun is not None and from_torchrun != explicit:
            log.warning(
                "%s=%r from the settings overrides %r from torchrun's environment; under torchrun every "
                "process gets the same flags, so drop the flag unless that is what you mean",
                name,
                explicit,
                from_torchrun,
            )
        sources[name] = "flag"
        return explicit
    if from_torchrun is not None:
        sources[name] = "torchrun"
        return from_torchrun
    sources[name] = "default"
    return default


def _env_int(env: Mapping[str, str], name: str, *, minimum: int) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(
            f"${name}={raw!r} is not an integer; torchrun sets it to one, so unset it or fix what set it"
        ) from None
    if value < minimum:
        raise ConfigError(f"${name}={value} must be >= {minimum}")
    return value


#: How long a rank waits for its peers to join the process group (and in any one collective).
PEER_WAIT_S = 300.0


@contextlib.contextmanager
def process_group(dist: DistEnv, *, backend: str = "gloo", peer_wait_s: float = PEER_WAIT_S) -> Iterator[bool]:
    """Join the data-parallel process group for the block when there is more than one rank; yields
    whether a group was joined. Leaves an already initialised group alone (the caller owns it). A rank
    whose peers do not all join within ``peer_wait_s`` raises `TrainerGroupError` naming them."""
    import datetime

    import torch.distributed as torch_dist

    joined = dist.world_size > 1 and not torch_dist.is_initialized()
    if joined:
        log.info("joining the process group as %s; waiting up to %gs for every rank", dist.describe(), peer_wait_s)
        timeout = datetime.timedelta(seconds=peer_wait_s)
        store = _restart_store(dist, timeout)
        try:
            if store is not None:
                torch_dist.init_process_group(
                    backend, store=store, rank=dist.rank, world_size=dist.world_size, timeout=timeout
                )
            else:
                torch_dist.init_process_group(
                    backend, init_method=dist.init_method, rank=dist.rank, world_size=dist.world_size, timeout=timeout
                )
        except torch_dist.DistError as exc:
            raise TrainerGroupError(_peers_missing(dist, peer_wait_s, exc)) from None
    try:
        yield joined
    except BaseException:
        if joined and torch_dist.is_initialized():
            torch_dist.destroy_process_group()
        raise
    if joined and torch_dist.is_initialized():
        _leave_together(torch_dist)
        torch_dist.destroy_process_group()


def _restart_store(dist: DistEnv, timeout: Any, env: Mapping[str, str] | None = None) -> Any:
    """Under torchrun's agent store, the rendezvous store of this restart: its keys under the restart's
    own prefix. ``env://`` there uses one prefix for every restart, so after ``--max-restarts`` restarted
    the group, gloo read the peers' addresses of the previous start and failed to connect (seen here)."""
    env = os.environ if env is None else env
    restart = env.get("TORCHELASTIC_RESTART_COUNT")
    if dist.init_method != "env://" or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart is None:
        return None
    import torch.distributed as torch_dist

    agent_store = torch_dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), dist.world_size, False, timeout)
    return torch_dist.PrefixStore(f"/worker/streamgrp-restart-{restart}", agent_store)


def _peers_missing(dist: DistEnv, waited_s: float, exc: BaseException) -> str:
    # Rank 0 hosts the rendezvous: another rank that cannot reach it knows rank 0 is missing; rank 0
    # knows only that not every other rank came.
    missing = "rank 0" if dist.rank != 0 else f"some of ranks 1..{dist.world_size - 1}"
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (
        f"rank {dist.rank} of {dist.world_size} waited {waited_s:g}s at {dist.init_method} and {missing} of its "
        f"trainer group never joined ({first_line}); start every rank of the group (torchrun starts them "
        "together), or wait longer with --peer-wait-s"
    )


#: How long a rank that is done waits for the others before it tears its connections down anyway.
LEAVE_TIMEOUT_S = 30.0


def _leave_together(torch_dist: Any) -> None:
    """Wait (bounded) until every rank is done before tearing the group down: a gloo rank that closes its
    connections while a peer still uses them can abort that peer ("terminate called without an active
    exception", SIGABRT after its last commit; seen in CI)."""
    import datetime

    try:
        torch_dist.monitored_barrier(timeout=datetime.timedelta(seconds=LEAVE_TIMEOUT_S))
    except RuntimeError as exc:  # a peer that failed or stopped early: leave anyway, and say so
        log.warning(
            "not every rank reached the end within %gs (%s); leaving the process group anyway",
            LEAVE_TIMEOUT_S,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )


class Collectives:
    """The collective calls of a trainer rank, each recorded until the step's record is taken.

    Every call goes to ``torch.distributed`` when the world has more than one rank (and is only
    recorded otherwise), so one code path serves one rank and many. `take` returns the step's calls
    as text, ``all_reduce:float32[336] all_reduce:float64[4]``: ranks whose texts differ at a step
    would have hung or mixed up their tensors, which is why the reference trainer logs it every step.
    """

    def __init__(self, world_size: int, *, group: Any = None, device: Any = "cpu") -> None:
        self.world_size = world_size
        self.group = group
        #: Where `any_rank` puts its vote: the backend's device (a CUDA device for NCCL).
        self.device = device
        self._calls: list[str] = []

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over every rank, in place; returns it."""
        self._calls.append(f"all_reduce:{str(tensor.dtype).removeprefix('torch.')}[{tensor.numel()}]")
        if self.world_size > 1:
            import torch.distributed as torch_dist

            torch_dist.all_reduce(tensor, group=self.group)
        return tensor

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (a one-element MAX all-reduce; not recorded). Passed as
        ``agree`` to `streamgrp.train.trainer.TrainerClient.batches` it stands for `max_over_ranks`."""
        if self.world_size == 1:
            return flag
        import torch
        import torch.distributed as torch_dist

        vote = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        torch_dist.all_reduce(vote, op=torch_dist.ReduceOp.MAX, group=self.group)
        return bool(vote.item())

    def max_over_ranks(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``values`` over every rank (one int64 MAX all-reduce; not recorded:
        it is the batch stream's per-step vote, `streamgrp.train.agreement`, not a call of the step's
        training). The ``agree`` of `streamgrp.train.trainer.TrainerClient.batches`."""
        if self.world_size == 1:
            return list(values)
        import torch
        import torch.distributed as torch_dist

        vote = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        torch_dist.all_reduce(vote, op=torch_dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in vote.tolist()]

    @classmethod
    def from_default_group(cls, world_size: int) -> Collectives | None:
        """Collectives over ``torch.distributed``'s default group when it is initialised with
        ``world_size`` ranks (a loop that set up its own process group), else None."""
        try:
            import torch.distributed as torch_dist
        except ImportError:
            return None
        if not (torch_dist.is_available() and torch_dist.is_initialized()) or torch_dist.get_world_size() != world_size:
            return None
        device: str | torch.device = "cpu"
        if torch_dist.get_backend() == "nccl":
            import torch

            device = torch.device("cuda", torch.cuda.current_device())
        return cls(world_size, device=device)

    def barrier(self) -> None:
        """Wait until every rank reached this call (not recorded: a checkpoint's, not the step's)."""
        if self.world_size > 1:
            import torch.distributed as torch_dist

            torch_dist.barrier(group=self.group)

    def batch_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`streamgrp.train.advantages.BatchReduce`: batch statistics of `normalize` over all ranks."""
        return self.all_reduce(tensor)

    def take(self) -> str:
        """The calls since the last `take`, as one line of text; clears them."""
        calls, self._calls = self._calls, []
        return " ".join(calls) or "none"
