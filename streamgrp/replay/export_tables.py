"""The export's tables (`streamgrp.replay.export`): `TABLES`, each table's columns with their Arrow types and
meanings (which the Parquet fields carry as their descriptions), and the rows of the tables built from a
decision (`decision_row`) and from a step (`step_row`), their values in the columns' order.

Owns what a row holds; reading the run and writing the files are `streamgrp.replay.export`'s and
`streamgrp.replay.export_follow`'s. Imports no pyarrow: `arrow_type` is given the module.
"""

from __future__ import annotations

from typing import Any

from streamgrp.core.events import GroupDecided, StepManifest
from streamgrp.core.manifest import decision_ref

#: Table -> (what one row is, its columns as (name, Arrow type, meaning)), in the order they are written.
TABLES: dict[str, tuple[str, tuple[tuple[str, str, str], ...]]] = {
    "decisions": (
        "one group decision (one per decided task)",
        (
            ("run", "string", "the run's name"),
            (
                "entry_id",
                "string",
                (
                    "the decision's entry id in the decisions stream (ID@P in partition P of a "
                    "partitioned run, as every entry id here)"
                ),
            ),
            ("task_id", "string", "the task (prompt) the group sampled"),
            ("decision", "string", "complete, partial or dropped"),
            (
                "reason",
                "string",
                ("why it was dropped (all_unusable, incomplete, below_minimum, contract_violation); null when kept"),
            ),
            ("closed_by", "string", "all_slots (every slot had a result) or deadline"),
            ("issued_at", "float64", "server time the task was issued (seconds since the epoch)"),
            ("decided_at", "float64", "server time of the decision"),
            ("target_slot_count", "int64", "slots asked for (n_samples)"),
            ("usable_slot_count", "int64", "slots with a sample"),
            ("trainable_slot_count", "int64", "usable slots if the group was kept, else 0"),
            ("fully_masked_group", "bool", "no usable slot"),
            ("singleton_slot_group", "bool", "exactly one usable slot"),
            ("pre_filter_usable_slot_yield", "float64", "usable / target slots"),
            ("pre_filter_trainable_slot_yield", "float64", "trainable / target slots"),
            ("version", "int64", "the group's policy version: the oldest of its members' (null without members)"),
            ("rows", "int64", "rows of its members"),
            ("tokens", "int64", "valid loss tokens of its members"),
            ("reward_mean", "float64", "mean of its members' mean rewards (null when none is recorded)"),
            ("member_slots", "list<int64>", "slot indices of its members (its usable slots), in slot order"),
            ("slot_outcomes", "list<string>", "each slot's outcome by slot index: sample, rejected, failed or timeout"),
            ("error", "string", "the contract violation's text; null otherwise"),
            ("step", "int64", "the step that trained it; null when none did (yet)"),
            ("rank", "int64", "the DP rank whose shard held it at that step"),
            ("discarded", "string", "why the batcher did not train it (stale, filtered, leftover); null otherwise"),
            ("producer", "string", "the assembler that wrote the decision"),
        ),
    ),
    "slots": (
        "one slot result as a worker published it (duplicates and late results included)",
        (
            ("run", "string", "the run's name"),
            ("entry_id", "string", "the result's entry id in the slot log"),
            ("task_id", "string", "its task"),
            ("slot", "int64", "its slot index"),
            ("outcome", "string", "sample, rejected or failed"),
            ("error", "string", "a failed slot's exception text; null otherwise"),
            ("rows", "int64", "a sample's rows; null otherwise"),
            ("tokens", "int64", "a sample's valid loss tokens"),
            ("version", "int64", "the policy version that generated the sample"),
            ("reward", "float64", "the sample's mean reward over its rows"),
            ("digest", "string", "digest of the sample's payload entry"),
            ("producer", "string", "the publishing worker's identity"),
            ("seq", "int64", "that worker's sequence number"),
            ("issued_at", "float64", "server time its task was issued; null when the log no longer holds the issue"),
            ("published_at", "float64", "server time the result was appended to the slot log (from its entry id)"),
            ("member", "bool", "its group's decision lists this entry among its members (a sample that was folded)"),
            (
                "text",
                "string",
                (
                    "the completion's text as the worker recorded it (an inference rollout with keep_text, "
                    "the default); null when it recorded none or the payload is gone"
                ),
            ),
        ),
    ),
    "steps": (
        "one optimizer step",
        (
            ("run", "string", "the run's name"),
            ("step", "int64", "the step number"),
            ("version", "int64", "the policy version it was batched at"),
            ("created_at", "float64", "server time the batcher wrote it"),
            ("imbalance", "float64", "the largest shard's tokens over the mean shard's (1 is balanced)"),
            ("ranks", "int64", "shards, one per DP rank"),
            ("groups", "int64", "groups in the step"),
            ("rows", "int64", "rows in the step"),
            ("tokens", "int64", "valid loss tokens in the step"),
            ("shard_groups", "list<int64>", "groups per rank"),
            ("shard_rows", "list<int64>", "rows per rank"),
            ("shard_tokens", "list<int64>", "valid loss tokens per rank"),
            ("complete_groups", "int64", "its groups that were complete"),
            ("partial_groups", "int64", "its groups that were partial"),
            ("reward_mean", "float64", "mean reward of its samples (null when none is recorded)"),
            ("rank_states", "list<string>", "each rank's status: committed, failed, in_progress or pending"),
            ("failures", "int64", "failed attempts over every rank (a rank that failed then committed counts)"),
            ("error", "string", "the last exception text of the first rank that failed and has not committed"),
            ("committed_at", "float64", "server time the last rank committed; null until every rank has"),
            ("trainer_metrics", "string", "the reference trainer's metrics for the step, as JSON; null if none"),
        ),
    ),
    "step_members": (
        "one member slot of a group in a rank's shard of a step",
        (
            ("run", "string", "the run's name"),
            ("step", "int64", "the step"),
            ("rank", "int64", "the DP rank that trained it"),
            ("task_id", "string", "its group's task"),
            ("decision_entry", "string", "its group's decision entry id (decisions.entry_id)"),
            ("slot", "int64", "its slot index"),
            ("entry_id", "string", "its slot result's entry id (slots.entry_id)"),
            ("rows", "int64", "its rows"),
            ("tokens", "int64", "its valid loss tokens"),
            ("version", "int64", "the policy version that generated it"),
        ),
    ),
}


def columns(table: str) -> list[str]:
    """The column names of ``table``, in order."""
    return [name for name, _, _ in TABLES[table][1]]


def decision_row(
    run: str, entry_id: str, d: GroupDecided, step: int | None, rank: int | None, discarded: str | None
) -> tuple:
    """A ``decisions`` row: the decision at ``entry_id``, the step and rank that trained it (None: none did)
    and why the batcher discarded it (None: it did not)."""
    stats = d.stats
    rewards = [m.reward for m in d.members if m.reward is not None]
    # Slot keys are decimal strings: ordering by (length, text) is numeric order without parsing them.
    outcomes = [outcome for _, outcome in sorted(d.slot_outcomes.items(), key=lambda kv: (len(kv[0]), kv[0]))]
    return (
        run,
        entry_id,
        d.task_id,
        d.decision,
        d.reason,
        d.closed_by,
        d.issued_at,
        d.decided_at,
        stats.target_slot_count,
        stats.usable_slot_count,
        stats.trainable_slot_count,
        stats.fully_masked_group,
        stats.singleton_slot_group,
        stats.pre_filter_usable_slot_yield,
        stats.pre_filter_trainable_slot_yield,
        d.version,
        sum(m.rows for m in d.members),
        d.valid_tokens,
        sum(rewards) / len(rewards) if rewards else None,
        list(d.slots),
        outcomes,
        d.error,
        step,
        rank,
        discarded,
        d.producer,
    )


def step_row(
    run: str, manifest: StepManifest, status, decisions: dict[str, GroupDecided], metrics: str | None
) -> tuple:
    """A ``steps`` row: the manifest, its ranks' status (`streamgrp.replay.steps.StepStatus`, None when not
    listed), the run's decisions by entry (for its groups' kinds and rewards) and the trainer's metrics (JSON)."""
    shards = manifest.shards
    groups = [g for s in shards for g in s.groups]
    used = [decisions[ref] for g in groups if (ref := decision_ref(g.partition, g.decision_entry)) in decisions]
    kinds = [decision.decision for decision in used]
    rewards = [m.reward for decision in used for m in decision.members if m.reward is not None]
    ranks = status.ranks if status is not None else ()
    failed = [r for r in ranks if r.state == "failed"]
    commits = [r.at for r in ranks]
    done = bool(ranks) and all(r.state == "committed" for r in ranks) and None not in commits
    return (
        run,
        manifest.step,
        manifest.version,
        manifest.created_at,
        manifest.imbalance,
        len(shards),
        len(groups),
        sum(g.rows for g in groups),
        sum(s.tokens for s in shards),
        [len(s.groups) for s in shards],
        [sum(g.rows for g in s.groups) for s in shards],
        [s.tokens for s in shards],
        kinds.count("complete"),
        kinds.count("partial"),
        sum(rewards) / len(rewards) if rewards else None,
        [r.state for r in ranks],
        sum(r.failures for r in ranks),
        failed[0].error if failed else None,
        max(commits) if done else None,
        metrics,
    )


def arrow_type(pyarrow: Any, kind: str) -> Any:
    """The Arrow type a column's ``kind`` in `TABLES` names (``pyarrow`` is the module, imported by the caller)."""
    if kind.startswith("list<"):
        return pyarrow.list_(arrow_type(pyarrow, kind[5:-1]))
    return {
        "string": pyarrow.string(),
        "int64": pyarrow.int64(),
        "float64": pyarrow.float64(),
        "bool": pyarrow.bool_(),
    }[kind]
