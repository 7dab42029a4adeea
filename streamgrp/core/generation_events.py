"""Events of generation in progress: agent sessions' turns (the sessions stream) and slots' segments
(the segments stream). Re-exported by `streamgrp.core.events`, which registers them; pure, no I/O.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from streamgrp.core import wire
from streamgrp.core.value_checks import logprob_problem, token_id_problem
from streamgrp.core.values import RawArray
from streamgrp.core.wire import WireEvent, check_free_form

_IDS = ("int32", "int64")


def check_token_arrays(event: object, *names: str) -> None:
    """Each of ``names`` but the last is a non-empty 1-D array of token ids, the last (log-probabilities)
    a float32 array as long as the one before it: one finite value at most 0 per generated token."""
    *id_names, logprob_name = names
    for name, allowed in ((name, _IDS) for name in id_names):
        tensor: RawArray = getattr(event, name)
        if tensor.dtype not in allowed or len(tensor.shape) != 1 or not tensor.shape[0]:
            raise ValueError(
                f"{name} must be a non-empty 1-D {' or '.join(allowed)} array, got {tensor.dtype} {list(tensor.shape)}"
            )
        problem = token_id_problem(tensor.dtype, tensor.data)
        if problem is not None:
            raise ValueError(problem)
    generated: RawArray = getattr(event, id_names[-1])
    logprobs: RawArray = getattr(event, logprob_name)
    if logprobs.dtype != "float32" or logprobs.shape != generated.shape:
        raise ValueError(
            f"{logprob_name} must be a float32 array with one value per generated token "
            f"({generated.shape[0]}), got {logprobs.dtype} {list(logprobs.shape)}"
        )
    problem = logprob_problem(logprobs.dtype, logprobs.data)
    if problem is not None:
        raise ValueError(problem)


# -- agent sessions (streamgrp.services.gateway): the events of the sessions stream ----------------------

#: Session ids are made by `streamgrp.store.sessions` (``p<partition>-<16 hex digits>``).
SessionId = Annotated[str, Meta(min_length=1, max_length=64)]
TaskId = Annotated[str, Meta(min_length=1, max_length=256)]


class SessionOpened(WireEvent, frozen=True, kw_only=True):
    """An agent session was opened: one slot of a task, whose turns the gateway records.

    ``deadline`` is the task's group deadline in the server's clock (None when the run has none): a
    session still open then is ended as ``timeout`` and publishes nothing, so the assembler times its
    slot out as it does any slot without a result."""

    kind: Literal["session_opened"] = "session_opened"
    session: SessionId
    task_id: TaskId
    slot: wire.NonNegInt
    deadline: wire.Float | None = None
    version: wire.NonNegInt = 0


class TurnRecorded(WireEvent, frozen=True, kw_only=True):
    """One turn of a session, token-exact: the prompt ids the inference server was given, the ids it
    generated and its log-probability of each, and the policy version that generated them. Recorded
    before the turn is answered; ``meta`` holds what the answer was built from (the completion's text,
    the model, the endpoint) and how the next turn's prompt may extend this one (`streamgrp.services.gateway`)."""

    kind: Literal["session_turn"] = "session_turn"
    session: SessionId
    task_id: TaskId
    slot: wire.NonNegInt
    turn: wire.PosInt
    prompt_ids: RawArray
    completion_ids: RawArray
    logprobs: RawArray
    version: wire.NonNegInt
    finish: Literal["stop", "length"]
    meta: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_token_arrays(self, "prompt_ids", "completion_ids", "logprobs")
        check_free_form(self.meta, "meta")


class SessionEnded(WireEvent, frozen=True, kw_only=True):
    """A session ended: with the slot result it published (``sample``, ``rejected``, ``failed``), or
    with none (``timeout``: its group's deadline passed first). ``turns`` is how many turns the result
    was built from, ``rows`` the sample's rows (turns that extend each other share one)."""

    kind: Literal["session_ended"] = "session_ended"
    session: SessionId
    task_id: TaskId
    slot: wire.NonNegInt
    outcome: Literal["sample", "rejected", "failed", "timeout"]
    turns: wire.NonNegInt
    rows: wire.NonNegInt = 0
    reward: wire.Float | None = None
    error: str | None = None


# -- partial rollouts: the events of the segments stream -------------------------------------------------------


class SlotSegment(WireEvent, frozen=True, kw_only=True):
    """Part of one slot's generation, durable before the slot's result: ``token_ids`` generated after the
    slot's first ``start`` generated tokens (the prompt not included), the log-probability of each, and the
    policy version that generated them. Written by the worker that holds the task (`streamgrp.store.segments`)
    every ``segment_tokens`` tokens and at every abort; a worker that takes the task over continues the slot
    from its segments, and a sample built on them is exactly their concatenation (SPEC section 8).

    ``index`` counts the slot's segments from 0; ``cause`` says why the segment ended: ``chunk`` (the
    token budget of a segment), ``abort`` (the server aborted; the rest is resubmitted) or ``stop`` /
    ``length`` (the generation's end: no segment of the slot follows it)."""

    kind: Literal["slot_segment"] = "slot_segment"
    task_id: TaskId
    slot: wire.NonNegInt
    index: wire.NonNegInt
    start: wire.NonNegInt
    token_ids: RawArray
    logprobs: RawArray
    version: wire.NonNegInt
    cause: Literal["chunk", "abort", "stop", "length"]

    def __post_init__(self) -> None:
        check_token_arrays(self, "token_ids", "logprobs")

    @property
    def tokens(self) -> int:
        return self.token_ids.shape[0]
