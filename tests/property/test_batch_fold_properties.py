"""Any interleaving of the same decisions with version changes and round ends gives steps that hold
the batch fold's invariants and split cleanly over the ranks."""

from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from streamgrp.core.batch_fold import (
    Acked,
    BatchRules,
    BatchState,
    DatasetEnded,
    Decided,
    Discarded,
    RoundEnded,
    StepDue,
    VersionSet,
    run_batch_fold,
)
from streamgrp.core.events import DecidedMember, GroupDecided, GroupStats
from streamgrp.core.manifest import make_manifest
from streamgrp.core.rank_split import check_split_invariants


def _group(task: str, version: int, tokens: int, dropped: bool) -> GroupDecided:
    if dropped:
        return GroupDecided.of(
            task_id=task,
            decision="dropped",
            reason="below_minimum",
            members=(),
            slot_outcomes={},
            stats=GroupStats.of(2, 1, 0),
            closed_by="all_slots",
        )
    members = (
        DecidedMember(slot=0, entry=f"{task}a", rows=1, tokens=tokens, version=version),
        DecidedMember(slot=1, entry=f"{task}b", rows=1, tokens=tokens + 1, version=version + 1),
    )
    return GroupDecided.of(
        task_id=task,
        decision="partial",
        members=members,
        slot_outcomes={},
        stats=GroupStats.of(2, 2, 2),
        closed_by="all_slots",
    )


GROUPS = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 50), st.booleans()), min_size=0, max_size=60)
RULES = st.builds(
    lambda mode, dp, batch, extra, staleness: BatchRules(
        batch_mode=mode,
        dp_size=dp,
        batch_size=max(batch, dp),
        max_batch_size=max(batch, dp) + extra,
        max_staleness=staleness,
        max_empty_rounds=10**6,
        stall_timeout_s=1e12,
    ),
    st.sampled_from(["fixed", "dynamic"]),
    st.integers(1, 4),
    st.integers(1, 8),
    st.integers(0, 6),
    st.integers(0, 2),
)


@settings(max_examples=examples(300), deadline=None)
@given(rules=RULES, groups=GROUPS, data=st.data())
def test_any_interleaving_gives_valid_steps(rules, groups, data):
    decisions = [Decided(f"{i + 1}-0", _group(f"t{i}", *spec)) for i, spec in enumerate(groups)]
    order = data.draw(st.permutations(decisions))
    events, version, now = [], 0, 0.0
    for decision in order:
        if data.draw(st.booleans()):
            version += data.draw(st.integers(0, 1))
            events.append(VersionSet(version))
        events.append(decision)
        if data.draw(st.booleans()):
            now += 1.0
            events.append(RoundEnded(now))
    events.append(DatasetEnded())
    state, outputs = run_batch_fold(BatchState(rules), events)

    steps = [o for o in outputs if isinstance(o, StepDue)]
    discarded = [o for o in outputs if isinstance(o, Discarded)]
    acked = [entry for o in outputs if isinstance(o, Acked) for entry in o.entry_ids]
    trainable = {d.entry_id for d in decisions if d.decision.decision != "dropped"}
    dropped = {d.entry_id for d in decisions} - trainable

    # every decision is accounted for exactly once: in one step, discarded once, or (dropped) acked once
    in_steps = [entry for s in steps for entry, _ in s.groups]
    assert sorted(in_steps + [d.entry_id for d in discarded]) == sorted(trainable)
    assert sorted(acked) == sorted(dropped)
    assert state.outcome == "finished" and state.buffer == []

    assert [s.step for s in steps] == list(range(len(steps)))
    for index, step in enumerate(steps):
        assert rules.dp_size <= len(step.groups) <= rules.max_batch_size
        if rules.batch_mode == "fixed" and index < len(steps) - 1:
            assert len(step.groups) == rules.batch_size
        for _, decision in step.groups:
            assert step.version - decision.version <= rules.max_staleness
        manifest = make_manifest(step.step, step.version, step.groups, rules.dp_size, created_at=0.0)
        weights = [d.valid_tokens for _, d in step.groups]
        by_task = {d.task_id: i for i, (_, d) in enumerate(step.groups)}
        shards = [[by_task[g.task_id] for g in shard.groups] for shard in manifest.shards]
        check_split_invariants(weights, rules.dp_size, shards)
    for stale in (d for d in discarded if d.reason == "stale"):
        assert stale.current_version - stale.decision.version > rules.max_staleness
