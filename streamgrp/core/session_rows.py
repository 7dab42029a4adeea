"""A session's turns as a sample's rows (SPEC section 8): turns that extend each other share one row.

A turn is the prompt ids an inference server was given and the ids it generated (with their
log-probabilities and the policy version). Folding a session's turns in order (`add_turn`):

- a turn whose prompt starts with every token of an open row (that row's last prompt and completion,
  exactly, id for id) extends that row: the new prompt tokens (a tool's answer, the next user message,
  the chat template's markers) join it with loss mask 0 and log-probability 0, then the completion with
  loss mask 1 and the server's log-probabilities. Of several rows it extends, the newest takes it;
- any other turn starts a row of its own (its prompt masked, its completion not).

So a loss mask is 1 exactly on generated tokens, each generated token is in exactly one row once, and
a multi-turn conversation whose history the agent only appends to is one row, however many turns.

What the usable-size rule's one-row contract (SPEC section 2) does with a session of several rows is
`contract_problem`'s choice: when the run's policy arms the contract (group statistics with groups of
two or more), such a session is refused where it enters, published as a *failed* slot whose error says
why and what to change; the group goes on without it (partial, or dropped below the minimum), and the
run is never failed by one agent that edited its history. Without the contract every row is trained,
each with the session's reward.

Pure: no I/O, no clock. Token lists are Python lists here; `streamgrp.core.values.Sample` packs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamgrp.core.policy import GroupPolicy
from streamgrp.core.values import Sample


@dataclass(frozen=True, slots=True)
class Turn:
    """One recorded turn: what the server was given and what it generated."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    version: int


@dataclass(slots=True)
class Row:
    """One row being built: its tokens so far and the turns (1-based) it holds."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)

    def extended_by(self, prompt_ids: Sequence[int]) -> bool:
        n = len(self.token_ids)
        return len(prompt_ids) >= n and list(prompt_ids[:n]) == self.token_ids


def add_turn(rows: list[Row], turn: Turn, number: int) -> list[Row]:
    """Fold turn ``number`` into ``rows`` (mutated and returned): into the newest row it extends, else a new row."""
    if len(turn.completion_ids) != len(turn.logprobs) or not turn.completion_ids:
        raise ValueError(
            f"turn {number} has {len(turn.completion_ids)} completion ids and {len(turn.logprobs)} "
            "log-probabilities; a turn generates at least one token, each with its log-probability"
        )
    row = next((row for row in reversed(rows) if row.extended_by(turn.prompt_ids)), None)
    if row is None:
        row = Row()
        rows.append(row)
    new = list(turn.prompt_ids[len(row.token_ids) :])
    row.token_ids += new
    row.loss_mask += [0] * len(new)
    row.logprobs += [0.0] * len(new)
    row.token_ids += turn.completion_ids
    row.loss_mask += [1] * len(turn.completion_ids)
    row.logprobs += turn.logprobs
    row.turns.append(number)
    return rows


def session_rows(turns: Iterable[Turn]) -> list[Row]:
    """Every turn folded in order (turn numbers from 1)."""
    rows: list[Row] = []
    for number, turn in enumerate(turns, start=1):
        add_turn(rows, turn, number)
    return rows


def contract_problem(policy: GroupPolicy, rows: int) -> str | None:
    """Why a session of ``rows`` rows may not be published as a sample under ``policy``, or None when it may."""
    if rows <= 1 or not policy.one_sample_per_slot:
        return None
    return (
        f"the session's turns make {rows} rows (a turn's prompt did not continue an earlier turn's prompt and "
        f"completion token for token), and this run's policy (n_samples={policy.n_samples}, resolved "
        f"min_usable_group_size={policy.minimum_usable_group_size}) arms the one-sample-per-slot contract: group "
        "statistics would count each row as a group member, so the session is published as a failed slot. "
        "Keep the conversation append-only (send each assistant message back as the gateway returned it), or "
        "use batch-level mean_level/std_level and leave min_usable_group_size unset"
    )


def session_sample(turns: Sequence[Turn], reward: float, *, meta: dict[str, Any] | None = None) -> Sample:
    """The sample of a session: its rows (`session_rows`), each with the session's ``reward``; its version is
    the oldest any turn was generated with (staleness is never understated)."""
    if not turns:
        raise ValueError("the session recorded no turn, so there is nothing to train on")
    rows = session_rows(turns)
    return Sample.from_rows(
        token_ids=[row.token_ids for row in rows],
        loss_mask=[row.loss_mask for row in rows],
        logprobs=[row.logprobs for row in rows],
        rewards=[reward] * len(rows),
        version=min(turn.version for turn in turns),
        meta={**(meta or {}), "turns": len(turns), "row_turns": [row.turns for row in rows]},
    )
