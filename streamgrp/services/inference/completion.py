"""A slot's completion over every part it took, and the rules that say when it is done.

`Completion` accumulates the parts of one slot's generation (each request's or stream's tokens, their
log-probabilities, versions and servers); `finished_or_resubmit` is the one rule for an aborted part
(resubmit with the tokens so far, bounded, or fail), shared by the worker's adapter and the gateway;
`regenerate` bounds generating a segment again after a weight sync came between generating and scoring it.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamgrp.services.inference.dialect import Generation
from streamgrp.services.inference.http import InferenceError

#: Segments of one slot generated again because the server's weights changed before every token of
#: the segment was scored (a bound, so a server whose model name keeps changing still ends the slot).
MAX_REGENERATIONS = 4


class GenerationFailed(InferenceError):
    """Every attempt at a request failed in transport, or an aborted generation could not be finished."""


class WeightsChanged(InferenceError):
    """The server that generated a segment answered its scoring with another model (a weight sync in
    between): the segment's tokens and the scores cannot be of one policy, so it is generated again."""

    def __init__(self, where: str, generated_by: str, scored_by: str) -> None:
        super().__init__(
            f"{where}: the server changed models between generating ({generated_by!r}) and scoring "
            f"the token again ({scored_by!r})"
        )
        self.generated_by, self.scored_by = generated_by, scored_by


@dataclass
class Completion:
    """The whole completion of one slot, over every segment it took."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    versions: list[int | None] = field(default_factory=list)
    servers: list[str] = field(default_factory=list)
    finish: str = "stop"
    reason: str = ""
    resubmits: int = 0
    attempts: int = 0
    rescored: int = 0
    #: Segments generated again because a weight sync came between generating and scoring them.
    regenerated: int = 0
    model: str = ""
    #: Streamed requests; of them, broken after some tokens (kept); parts asked for unstreamed after a stream
    #: lost tokens it cannot carry.
    streams: int = 0
    interrupted: int = 0
    unstreamed: int = 0

    def add(self, generation: Generation, server: str, attempts: int) -> None:
        self.token_ids += generation.token_ids
        self.logprobs += generation.logprobs
        self.text += generation.text
        self.versions.append(generation.weight_version)
        self.servers.append(server)
        self.finish, self.reason, self.model = generation.finish, generation.reason, generation.model
        self.attempts += attempts
        self.rescored += len(generation.unscored)


def regenerate(completion: Completion, changed: WeightsChanged, attempts: int) -> None:
    """After ``changed``: count one more generation of the segment, or `GenerationFailed` once
    `MAX_REGENERATIONS` are spent. The segment's tokens were never added to ``completion``, so none of
    its values, of either model, is recorded."""
    if completion.regenerated >= MAX_REGENERATIONS:
        raise GenerationFailed(
            f"{changed}, after {completion.regenerated} generations again already for the same "
            "reason; the slot fails rather than mix two policies' log-probabilities. Is the "
            "server's model name changing without a weight sync?"
        ) from None
    completion.regenerated += 1
    completion.attempts += attempts


def finished_or_resubmit(
    completion: Completion,
    generation: Generation,
    server: str,
    dialect: str,
    max_tokens: int,
    on_abort: str,
    max_resubmits: int,
) -> bool:
    """After ``generation`` was added to ``completion``: True when the completion is done (the server stopped
    by itself, or aborted exactly at the token budget), False to resubmit an abort with the tokens so far
    (counted); `GenerationFailed` when ``on_abort`` is ``fail`` or ``max_resubmits`` are spent. The one rule
    of the worker's adapter and the gateway's."""
    if generation.finish != "abort":
        return True
    if len(completion.token_ids) >= max_tokens:
        completion.finish = "length"  # aborted exactly at the budget: nothing left to resubmit
        return True
    where = (
        f"the {dialect} server at {server} aborted the generation after "
        f"{len(completion.token_ids)} tokens ({generation.reason or 'no reason given'})"
    )
    if on_abort == "fail":
        raise GenerationFailed(f"{where}; --on-abort resubmit would continue it")
    if completion.resubmits >= max_resubmits:
        raise GenerationFailed(
            f"{where}, after {completion.resubmits} resubmissions already; raise "
            "--max-resubmits or find what keeps aborting it"
        )
    completion.resubmits += 1
    return False
