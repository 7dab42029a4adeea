"""Task feeding within the staleness window (SPEC section 4), run inside the batcher process.

Why inside the batcher: the window depends on the current policy version and on how many issued
groups were accepted or dropped, which the batcher already tracks each round, and a single
lease-holding process then owns both "how much work exists" and "what becomes a step". The feeder
issues a new task only while ``issued - dropped - discarded < (max_staleness + version + 1) *
batch_size``. Issuing is one fenced `TaskWriter` call that checks the lease and the dataset cursor, so a restarted
or zombie batcher can never issue a prompt twice; task ids are the dataset position (``t00000042``).

Under ``staleness="wait"`` the feeder also keeps the version each undecided task was issued at (the
oldest of them is what the batch fold's hold counts, `streamgrp.core.batch_fold.window_allows`): from its
own issues, and for the tasks issued before it became active, from the task streams (once, at takeover).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import orjson
import redis

from streamgrp.config import load_object
from streamgrp.core import codec, counters
from streamgrp.core.batch_fold import feeder_capacity
from streamgrp.core.events import TaskIssued
from streamgrp.errors import ConfigError
from streamgrp.store.keys import PartitionKeys, RunKeys
from streamgrp.store.streams import entry_id_str
from streamgrp.store.tasks import MAX_TASKS_PER_CALL, TaskWriter

log = logging.getLogger(__name__)


def load_dataset(spec: str) -> Iterator[dict[str, Any]]:
    """Prompts from a JSONL file (one JSON object per line) or a ``module:iterable`` (or factory)."""
    path = Path(spec)
    if path.suffix in (".jsonl", ".json") or path.exists():
        if not path.exists():
            raise ConfigError(f"dataset file {spec} does not exist; pass a JSONL file or module:iterable")
        return _jsonl(path)
    target = load_object(spec)
    if callable(target) and not hasattr(target, "__iter__"):
        target = target()  # a factory of prompts
    return (_as_prompt(item, spec) for item in target)


@dataclass(frozen=True)
class DatasetIdentity:
    """What names a dataset, recorded with the run so a batcher joining later feeds the same one: a file
    by the SHA-256 of its bytes and their count (a copy elsewhere is the same dataset; one with lines
    appended since continues it: the feeder's cursor takes them as new prompts; an edited one is another),
    a ``module:iterable`` by the spec as given."""

    spec: str
    size: int | None = None
    sha256: str | None = None

    @classmethod
    def of(cls, spec: str) -> DatasetIdentity:
        path = Path(spec)
        if not path.is_file():
            return cls(spec)
        with path.open("rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        return cls(spec, path.stat().st_size, digest)

    def record(self) -> str:
        return orjson.dumps({"spec": self.spec, "size": self.size, "sha256": self.sha256}).decode()

    @classmethod
    def from_record(cls, text: str) -> DatasetIdentity:
        try:
            fields = orjson.loads(text)
            return cls(str(fields["spec"]), fields.get("size"), fields.get("sha256"))
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return cls(text)  # not one of ours: compared as a spec, so only the same text matches

    def continues(self, recorded: DatasetIdentity) -> bool:
        """Whether this dataset is ``recorded`` or continues it (the recorded file's bytes, then more)."""
        if recorded.sha256 is None or self.sha256 is None:
            return recorded.sha256 is None and self.sha256 is None and recorded.spec == self.spec
        if recorded.size is None or self.size is None or self.size < recorded.size:
            return False
        if self.size == recorded.size:
            return self.sha256 == recorded.sha256
        with Path(self.spec).open("rb") as handle:  # hash the recorded length's prefix of this file
            prefix = hashlib.sha256()
            left = recorded.size
            while left:
                chunk = handle.read(min(left, 1 << 20))
                if not chunk:
                    return False
                prefix.update(chunk)
                left -= len(chunk)
        return prefix.hexdigest() == recorded.sha256

    def __str__(self) -> str:
        if self.sha256 is None:
            return self.spec
        return f"{Path(self.spec).name} ({self.size} bytes, sha256 {self.sha256[:16]})"


def check_feed(run: str, state: dict[str, str], feed: DatasetIdentity, max_steps: str) -> None:
    """`ConfigError` when the run (its batcher state hash, ``state``) records another dataset (one ``feed``
    does not continue: `DatasetIdentity.continues`) or ``--max-steps`` than a batcher's: taking over with
    them would feed other prompts after the recorded ones, or end the run at another step."""
    if "terminal" in state or "finished" in state:
        return  # nothing more is fed to an ended run (its next batcher only settles what was owed)
    differs: list[tuple[str, object, object]] = []
    recorded = state.get("feed:dataset")
    if recorded is not None and not feed.continues(DatasetIdentity.from_record(recorded)):
        differs.append(("dataset", DatasetIdentity.from_record(recorded), feed))
    if state.get("feed:max_steps", max_steps) != max_steps:
        differs.append(("max_steps", state["feed:max_steps"], max_steps))
    if differs:
        said = "; ".join(f"{name} {recorded}, this batcher's {mine}" for name, recorded, mine in differs)
        raise ConfigError(
            f"run {run} was started with another feed: {said}. A batcher of the run (a standby "
            "taking over, or a restart) must be given the same --dataset and --max-steps"
        )


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                item = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number} is not JSON ({exc}); each line must be one JSON object") from None
            yield _as_prompt(item, f"{path}:{number}")


def _as_prompt(item: Any, where: str) -> dict[str, Any]:
    if isinstance(item, dict):
        return item
    if isinstance(item, str):
        return {"text": item}
    raise ConfigError(f"dataset item at {where} is a {type(item).__name__}; give a JSON object or a string")


def task_position(task_id: str) -> int | None:
    """The dataset position a feeder's task id names (``t00000042``: 42), None for another's id."""
    if len(task_id) > 1 and task_id[0] == "t" and task_id[1:].isdigit():
        return int(task_id[1:])
    return None


class Feeder:
    """Issues dataset prompts as tasks while the staleness window has room."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        dataset: Iterator[dict[str, Any]],
        *,
        batch_size: int,
        max_staleness: int,
        producer: str,
        max_chunk: int = MAX_TASKS_PER_CALL,
        partitions: Sequence[PartitionKeys] | None = None,
        track_in_flight: bool = False,
    ) -> None:
        self.client = client
        self.keys = keys
        self.partitions = tuple(partitions) if partitions else keys.partitions(1)
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.producer = producer
        self.max_chunk = max_chunk
        self.exhausted = False
        #: The staleness window had no room at the last `feed` (the batcher waits for trainers then).
        self.window_full = False
        self._writer = TaskWriter(client, keys, self.partitions)
        self._items = iter(dataset)
        self._position = 0  # dataset items read from ``_items`` so far
        self._held: list[dict[str, Any]] = []  # read but not (yet) issued: they end at ``_position``
        self.cursor = 0
        #: Undecided tasks' dataset positions -> the version each was issued at (``track_in_flight`` only).
        self.track_in_flight = track_in_flight
        self._in_flight: dict[int, int] = {}
        self._oldest = 0  # no undecided task is below this position
        self.resume()

    def resume(self) -> None:
        """Continue after what this or any other batcher issued (at start, and after a lost lease).

        The dataset is an iterator read once per process, so a batcher that loses its lease and later
        takes over again must neither re-skip what it already read nor drop the prompts it read for an
        issue that the fence refused.
        """
        cursor = int(self.client.hget(self.keys.batcher_state, "feeder_cursor") or 0)
        first_held = self._position - len(self._held)
        self._held = self._held[max(0, cursor - first_held) :]
        for _ in islice(self._items, max(0, cursor - self._position)):
            self._position += 1
        self.cursor = cursor
        self.exhausted = False
        if self.track_in_flight:
            self._load_in_flight()

    def _load_in_flight(self) -> None:
        """The undecided tasks of the run and the versions they were issued at, from the task streams
        (a task trimmed from them by retention is not known: it was issued long ago and is decided)."""
        self._in_flight.clear()
        self._oldest = 0
        for part in self.partitions:
            start = "-"
            while True:
                page = self.client.xrange(part.tasks, min=start, count=1000)
                if not page:
                    break
                issued = []
                for _, fields in page:
                    try:
                        event = codec.decode(fields)
                    except Exception:  # noqa: BLE001 - not a task of ours: nothing to wait for
                        continue
                    position = task_position(getattr(event, "task_id", ""))
                    if isinstance(event, TaskIssued) and position is not None:
                        issued.append((event.task_id, position, event.version))
                decided = self.client.hmget(part.decided, [task for task, _, _ in issued]) if issued else []
                for (_, position, version), hit in zip(issued, decided):
                    if hit is None:
                        self._in_flight[position] = version
                start = "(" + entry_id_str(page[-1][0] or b"")

    def settle(self, task_ids: Sequence[str]) -> None:
        """These tasks are decided: no longer in flight."""
        for task_id in task_ids:
            position = task_position(task_id)
            if position is not None:
                self._in_flight.pop(position, None)

    def oldest_in_flight(self) -> int | None:
        """The oldest version an undecided task was issued at (None: every issued task is decided)."""
        while self._in_flight and self._oldest not in self._in_flight:
            self._oldest += 1  # positions only grow: each is passed once
        return self._in_flight.get(self._oldest)

    def _prompts(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` prompts (fewer at the end of the dataset), without consuming them."""
        for item in islice(self._items, max(0, n - len(self._held))):
            self._held.append(item)
            self._position += 1
        return self._held[:n]

    def outstanding(self) -> int:
        """Issued tasks not dropped by the assembler nor discarded by the batcher."""
        discarded = self.client.hget(self.keys.counts, counters.GROUPS_DISCARDED)  # the batcher's, run-wide
        dropped = sum(
            int(self.client.hget(part.counts, counters.decisions("dropped")) or 0)  # each assembler's
            for part in self.partitions
        )
        return self.cursor - dropped - int(discarded or 0)

    def feed(self, version: int, lease_token: str) -> int:
        """Issue as many tasks as the window allows now; returns how many."""
        if self.exhausted:
            self.window_full = True  # nothing more to issue: rounds wait on in-flight work or trainers
            return 0
        room = feeder_capacity(version, self.max_staleness, self.batch_size) - self.outstanding()
        self.window_full = room <= 0
        issued = 0
        while room > 0 and not self.exhausted:
            prompts = self._prompts(min(room, self.max_chunk))
            if len(prompts) < min(room, self.max_chunk):
                self.exhausted = True
            if not prompts:
                break
            now = self._writer.now()
            events = [
                TaskIssued(
                    task_id=f"t{self.cursor + i:08d}",
                    prompt=prompt,
                    version=version,
                    issued_at=now,
                    producer=self.producer,
                    seq=self.cursor + i,
                )
                for i, prompt in enumerate(prompts)
            ]
            try:
                self.cursor = self._writer.write(events, lease_token=lease_token, cursor=self.cursor)
            except redis.exceptions.ResponseError as exc:
                if not str(exc).startswith("LOG"):
                    raise
                # A foreign entry at the largest stream id: no task can be issued to this run again. The
                # batcher goes on; with nothing decided its stall bound ends the run, saying why.
                log.error("no task can be issued: %s", exc)
                self.window_full = True
                break
            del self._held[: len(prompts)]
            if self.track_in_flight:
                self._in_flight.update((event.seq, version) for event in events)
            issued += len(prompts)
            room -= len(prompts)
        if issued:
            log.debug("issued %d tasks (cursor %d, version %d)", issued, self.cursor, version)
        return issued
