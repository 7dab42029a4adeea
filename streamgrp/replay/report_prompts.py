"""The bias monitor by prompt: what a run trained of what it generated for each prompt. Pure.

The length buckets of `streamgrp.replay.report_series` say whether long generations train less than
short ones; this says which prompts: the hard prompts are the ones whose generations run long, time out
or go stale, and a run that never trains them learns from the easy ones only. A Prometheus label per
prompt would be unbounded, so the figures live here, computed from the run's events by `streamgrp report`.

A prompt is its task's ``prompt`` as issued (`TaskIssued`): its ``id`` when it has one, else the digest
of its JSON, so tasks issued for the same prompt (epochs, repeats) count together. Per prompt, over the
whole run:

- *generated*: the generations (members of trainable decisions: complete or partial) decided for it;
- *trained*: those in groups a step placed;
- *stale*: those in groups the batcher discarded as stale;
- *timed out*: its slots that timed out (in any decision, dropped ones included): generations that
  never made it to a decision at all;
- *trained share*: trained / generated (None: nothing generated).

`prompt_rows` sorts the prompts trained least first (a prompt with nothing generated last); `share_counts`
counts the prompts by trained share, the run's distribution in one line. A task whose `TaskIssued` is no
longer readable (retention trimmed its queue and no archive holds it) counts under its task id.
Deliberately ignored: rewards and the order in which prompts were issued.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from streamgrp.core.events import GroupDecided, GroupDiscarded, StepManifest

__all__ = ["SHARE_BUCKETS", "PromptRow", "prompt_key", "prompt_rows", "share_counts"]

#: Trained-share buckets of `share_counts`: (label, upper bound, inclusive), in order.
SHARE_BUCKETS = (
    ("none", 0.0),
    ("up to 25%", 0.25),
    ("up to 50%", 0.5),
    ("up to 75%", 0.75),
    ("below all", 0.99999),
    ("all", 1.0),
)
_PREVIEW_CHARS = 60


@dataclass(frozen=True)
class PromptRow:
    """One prompt's figures (see the module docstring)."""

    key: str
    preview: str
    tasks: int
    generated: int
    trained: int
    stale: int
    timed_out: int
    mean_tokens: float | None

    @property
    def trained_share(self) -> float | None:
        return self.trained / self.generated if self.generated else None


def prompt_key(prompt: Mapping[str, Any]) -> str:
    """A prompt's identity: ``id <its id>`` when it has an ``id``, else ``sha <12 hex digits>`` of its JSON."""
    ident = prompt.get("id")
    if isinstance(ident, (str, int)) and not isinstance(ident, bool):
        return f"id {ident}"
    return "sha " + hashlib.blake2b(orjson.dumps(dict(prompt), option=orjson.OPT_SORT_KEYS), digest_size=6).hexdigest()


def preview(prompt: Mapping[str, Any]) -> str:
    """A short line to recognise a prompt by: its text, its last message, or its first token ids."""
    text: Any = prompt.get("text")
    if text is None and isinstance(prompt.get("messages"), list) and prompt["messages"]:
        last = prompt["messages"][-1]
        text = last.get("content") if isinstance(last, dict) else last
    if text is None:
        ids = prompt.get("prompt_ids", prompt.get("input_ids"))
        text = f"ids {ids[:8]}" if isinstance(ids, list) else ""
    line = " ".join(str(text).split())
    return line if len(line) <= _PREVIEW_CHARS else line[: _PREVIEW_CHARS - 3] + "..."


def prompt_rows(
    *,
    prompts: Mapping[str, Mapping[str, Any]],
    decisions: Sequence[GroupDecided],
    discards: Sequence[GroupDiscarded],
    manifests: Sequence[StepManifest],
) -> list[PromptRow]:
    """Per prompt (``prompts``: task id -> its issued prompt), trained least first."""
    by_task = {decision.task_id: decision for decision in decisions}
    placed = {group.task_id for manifest in manifests for shard in manifest.shards for group in shard.groups}
    stale = {discard.task_id for discard in discards if discard.reason == "stale"}
    keys: dict[str, str] = {}
    previews: dict[str, str] = {}
    counts: dict[str, dict[str, int]] = {}
    for task_id, decision in by_task.items():
        prompt = prompts.get(task_id)
        key = prompt_key(prompt) if prompt is not None else f"task {task_id}"
        keys[task_id] = key
        if key not in previews:
            previews[key] = preview(prompt) if prompt is not None else "(its task is no longer recorded)"
        tally = counts.setdefault(
            key, dict.fromkeys(("tasks", "generated", "trained", "stale", "timed_out", "tokens"), 0)
        )
        tally["tasks"] += 1
        tally["timed_out"] += sum(outcome == "timeout" for outcome in decision.slot_outcomes.values())
        if decision.decision == "dropped":
            continue
        members = decision.members
        tally["generated"] += len(members)
        tally["tokens"] += sum(member.tokens for member in members)
        if task_id in placed:
            tally["trained"] += len(members)
        elif task_id in stale:
            tally["stale"] += len(members)
    rows = [
        PromptRow(
            key=key,
            preview=previews[key],
            tasks=c["tasks"],
            generated=c["generated"],
            trained=c["trained"],
            stale=c["stale"],
            timed_out=c["timed_out"],
            mean_tokens=c["tokens"] / c["generated"] if c["generated"] else None,
        )
        for key, c in counts.items()
    ]
    return sorted(rows, key=lambda row: (row.trained_share is None, row.trained_share or 0.0, -row.generated, row.key))


def share_counts(rows: Sequence[PromptRow]) -> dict[str, int]:
    """How many prompts trained each share of their generations (`SHARE_BUCKETS`); prompts with none generated
    are left out."""
    out = dict.fromkeys((label for label, _ in SHARE_BUCKETS), 0)
    for row in rows:
        share = row.trained_share
        if share is None:
            continue
        out[next(label for label, bound in SHARE_BUCKETS if share <= bound)] += 1
    return out
