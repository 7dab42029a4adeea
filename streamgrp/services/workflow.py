"""AReaL-style rollout workflows as a worker's rollout function: one ``arun_episode`` per slot.

    # mymodule.py
    from streamgrp.services.workflow import workflow_rollout
    rollout = workflow_rollout(MyRLVRWorkflow(reward_fn, gconfig, tokenizer), engine=MyEngine)
    # streamgrp worker --rollout mymodule:rollout

A workflow is any object with ``async arun_episode(engine, data) -> dict | None``, the shape of
AReaL's ``RolloutWorkflow`` (duck-typed: nothing of AReaL is imported). ``data`` is a copy of the
task's prompt dict. The dict it returns holds ``[1, L]`` tensors (torch, numpy or nested lists:
anything with ``tolist``) ``input_ids``, ``loss_mask``, ``logprobs``, ``versions`` (the policy
version of each token, -1 for prompt tokens) and ``attention_mask`` (optional), and ``rewards``
(one per row). ``None`` means the slot is rejected; an exception means it failed. The engine is any
object with ``agenerate`` (and ``get_version``, which the slot's requested version stands in for
when the engine has none), or a zero-argument factory of one, called once on the worker's event
loop at the first slot.

Owns turning one episode into one slot result; AReaL's grouped workflow gathers a prompt's episodes
in memory, here the assembler folds the slots into a group durably, under the run's group policy,
so a lost or late episode cannot hang or bias the group. The sample's version is the oldest
per-token version of the generated tokens (an episode whose weights changed mid-generation is as
old as its oldest token), or the version the worker asked for when no token carries one.
Deliberately ignores any other key a workflow returns (multi-modal inputs, ...). No torch import:
tensors are read through ``tolist``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from streamgrp.core.events import Sample

__all__ = ["REQUIRED_KEYS", "WorkflowRollout", "sample_from_episode", "workflow_rollout"]

#: What every episode dict must hold (``versions`` and ``attention_mask`` are optional).
REQUIRED_KEYS = ("input_ids", "loss_mask", "logprobs", "rewards")
_SHAPE = "an AReaL-style workflow returns [1, L] tensors input_ids, loss_mask, logprobs, versions and rewards"


def workflow_rollout(workflow: Any, *, engine: Any) -> Callable[[Any], Awaitable[Sample | None]]:
    """The rollout function (an ``async def``, so the worker runs it on its event loop) for ``workflow``."""
    return WorkflowRollout(workflow, engine=engine).__call__


class WorkflowRollout:
    """Runs ``workflow.arun_episode`` once per slot and turns its dict into a `Sample`."""

    def __init__(self, workflow: Any, *, engine: Any) -> None:
        if not inspect.iscoroutinefunction(getattr(workflow, "arun_episode", None)):
            raise TypeError(
                f"{type(workflow).__name__} has no 'async def arun_episode(engine, data)'; pass an "
                "AReaL-style RolloutWorkflow"
            )
        is_engine = hasattr(engine, "agenerate") and not isinstance(engine, type)
        if not is_engine and not callable(engine):
            raise TypeError(
                f"engine must have an agenerate method or be a factory of such an object, got {type(engine).__name__}"
            )
        self.workflow = workflow
        self._engine = engine if is_engine else None
        self._factory = None if is_engine else engine
        self._lock: asyncio.Lock | None = None

    async def __call__(self, request: Any) -> Sample | None:
        engine = await self._engine_for_slots()
        if not hasattr(engine, "get_version"):
            engine = _VersionedEngine(engine, request.version)
        result = await self.workflow.arun_episode(engine, dict(request.prompt))
        if result is None:
            return None  # the workflow rejected the episode
        return sample_from_episode(result, version=request.version)

    async def _engine_for_slots(self) -> Any:
        if self._engine is not None:
            return self._engine
        if self._lock is None:  # created on the worker's loop, at its first slot
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._engine is None:
                assert self._factory is not None  # no engine given: a factory was
                made = self._factory()
                self._engine = await made if inspect.isawaitable(made) else made
        return self._engine


class _VersionedEngine:
    """An engine without ``get_version`` (AReaL's RLVR workflow calls it): the slot's version stands in."""

    def __init__(self, engine: Any, version: int) -> None:
        self._engine = engine
        self._version = version

    def get_version(self) -> int:
        return self._version

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def sample_from_episode(result: Mapping[str, Any], *, version: int) -> Sample:
    """One episode dict as a `Sample`: each row trimmed to its attention mask, the oldest token version."""
    if not isinstance(result, Mapping):
        raise TypeError(f"arun_episode returned {type(result).__name__}, not a dict; {_SHAPE}")
    missing = [key for key in REQUIRED_KEYS if key not in result]
    if missing:
        raise ValueError(f"the episode lacks {missing} (it has {sorted(map(str, result))}); {_SHAPE}")
    ids = _rows(result["input_ids"], "input_ids")
    lengths = _lengths(result.get("attention_mask"), ids)
    columns = {
        name: [row[:n] for row, n in zip(_rows(result[name], name, like=ids), lengths)]
        for name in ("loss_mask", "logprobs")
    }
    rewards = _flat(result["rewards"])
    if len(rewards) != len(ids):
        raise ValueError(f"rewards has {len(rewards)} values for {len(ids)} rows; give one reward per row")
    generated = (
        [v for row, n in zip(_rows(result["versions"], "versions", like=ids), lengths) for v in row[:n] if v >= 0]
        if result.get("versions") is not None
        else []
    )
    return Sample.from_rows(
        token_ids=[row[:n] for row, n in zip(ids, lengths)],
        loss_mask=columns["loss_mask"],
        logprobs=columns["logprobs"],
        rewards=rewards,
        version=int(min(generated)) if generated else version,
    )


def _rows(value: Any, name: str, *, like: list[list[Any]] | None = None) -> list[list[Any]]:
    """A [B, L] value as B lists; a 1-D value is one row."""
    data = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(data, Sequence) or isinstance(data, (str, bytes)) or not data:
        raise ValueError(f"{name} is {type(value).__name__} {data!r:.60}; {_SHAPE}")
    rows = [list(row) for row in data] if isinstance(data[0], Sequence) else [list(data)]
    if like is not None and [len(r) for r in rows] != [len(r) for r in like]:
        raise ValueError(f"{name} has shape {_shape(rows)} but input_ids has {_shape(like)}; {_SHAPE}")
    return rows


def _lengths(mask: Any, ids: list[list[Any]]) -> list[int]:
    """Each row's length: its attention mask's ones, which must come first (right padding)."""
    if mask is None:
        return [len(row) for row in ids]
    lengths = []
    for i, row in enumerate(_rows(mask, "attention_mask", like=ids)):
        n = sum(1 for m in row if m)
        if any(not m for m in row[:n]) or n == 0:
            raise ValueError(f"attention_mask row {i} is not ones then zeros (right padding) with at least one token")
        lengths.append(n)
    return lengths


def _flat(value: Any) -> list[float]:
    data = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(data, Sequence):
        return [float(data)]
    return [float(x) for item in data for x in (item if isinstance(item, Sequence) else [item])]


def _shape(rows: list[list[Any]]) -> list[int]:
    return [len(rows), max((len(r) for r in rows), default=0)]
