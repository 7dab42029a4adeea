"""Any order and any duplication of a group's slot events give the same decision."""

from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from streamgrp import GroupPolicy, NormSpec
from streamgrp.core import codec
from streamgrp.core.events import SlotResult, TaskIssued
from streamgrp.core.group_fold import Closed, run_fold
from streamgrp.services.synthetic import make_sample

OUTCOMES = st.sampled_from(["sample", "sample", "multi", "rejected", "failed"])
POLICIES = st.sampled_from(
    [
        GroupPolicy(n_samples=4, reward_norm=NormSpec("group", "group")),
        GroupPolicy(n_samples=4, reward_norm=NormSpec("batch", "batch")),
        GroupPolicy(n_samples=4, drop_incomplete_group=True),
        GroupPolicy(n_samples=4, min_usable_group_size=3),
    ]
)


def _result(slot, outcome):
    if outcome == "rejected":
        return SlotResult(task_id="t", slot=slot, outcome="rejected")
    if outcome == "failed":
        return SlotResult(task_id="t", slot=slot, outcome="failed", error="x")
    rows = 2 if outcome == "multi" else 1
    return codec.sample_result("t", slot, make_sample(tokens=3 + slot, rows=rows))[0]


@settings(max_examples=examples(300), deadline=None)
@given(policy=POLICIES, outcomes=st.lists(OUTCOMES, min_size=4, max_size=4), data=st.data())
def test_order_and_duplication_do_not_change_the_decision(policy, outcomes, data):
    firsts = [(f"s{slot}", _result(slot, outcome)) for slot, outcome in enumerate(outcomes)]
    baseline = _decide(policy, firsts)

    order = data.draw(st.permutations(range(4)))
    copies = data.draw(st.lists(st.integers(0, 3), max_size=6))
    stream = []
    for slot in order:
        stream.append(firsts[slot])
        # duplicates of a slot that already has its first result: a different outcome must not win
        stream.extend((f"d{slot}-{n}", _result(slot, "rejected")) for n, s in enumerate(copies) if s == slot)
    decision = _decide(policy, stream)
    assert decision == baseline


def _decide(policy, slot_events):
    _, outputs = run_fold(policy, [("task", TaskIssued(task_id="t", issued_at=0.0)), *slot_events])
    [closed] = [o for o in outputs if isinstance(o, Closed)]
    d = closed.decision
    return d.decision, d.reason, d.slots, [m.entry for m in d.members], [m.tokens for m in d.members], d.stats
