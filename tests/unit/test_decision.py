import pytest

from streamgrp import GroupPolicy, NormSpec, decide_group

GROUP = NormSpec("group", "group")


def test_partial_group_keeps_usable_members_with_two_thirds_yield():
    decision = decide_group(GroupPolicy(n_samples=3, reward_norm=GROUP), [1, None, 1])
    assert decision.decision == "partial"
    assert decision.reason is None
    assert decision.members == (0, 2)
    assert decision.stats.pre_filter_usable_slot_yield == pytest.approx(2 / 3)
    assert decision.stats.pre_filter_trainable_slot_yield == pytest.approx(2 / 3)
    assert decision.stats.trainable_slot_count == 2


def test_complete_group():
    decision = decide_group(GroupPolicy(n_samples=3), [1, 1, 1])
    assert (decision.decision, decision.reason, decision.members) == ("complete", None, (0, 1, 2))
    assert decision.stats.pre_filter_trainable_slot_yield == 1.0


def test_all_unusable_is_dropped_and_fully_masked():
    decision = decide_group(GroupPolicy(n_samples=3), [None, None, None])
    assert (decision.decision, decision.reason) == ("dropped", "all_unusable")
    assert decision.stats.fully_masked_group is True
    assert decision.stats.usable_slot_count == 0
    assert decision.stats.pre_filter_usable_slot_yield == 0.0


def test_one_survivor_under_minimum_two_is_dropped_singleton():
    decision = decide_group(GroupPolicy(n_samples=3, reward_norm=GROUP), [None, 1, None])
    assert (decision.decision, decision.reason) == ("dropped", "below_minimum")
    assert decision.stats.singleton_slot_group is True
    assert decision.stats.usable_slot_count == 1
    assert decision.stats.trainable_slot_count == 0
    assert decision.stats.pre_filter_usable_slot_yield == pytest.approx(1 / 3)
    assert decision.stats.pre_filter_trainable_slot_yield == 0.0


def test_minimum_one_keeps_a_singleton():
    decision = decide_group(GroupPolicy(n_samples=3, reward_norm=NormSpec("batch", "batch")), [None, 1, None])
    assert (decision.decision, decision.members) == ("partial", (1,))
    assert decision.stats.singleton_slot_group is True
    assert decision.stats.trainable_slot_count == 1


def test_drop_incomplete_group_drops_before_minimum():
    policy = GroupPolicy(n_samples=3, drop_incomplete_group=True, reward_norm=GROUP)
    assert decide_group(policy, [1, 1, None]).reason == "incomplete"
    assert decide_group(policy, [None, None, None]).reason == "all_unusable"
    assert decide_group(policy, [1, 1, 1]).decision == "complete"


def test_multi_row_slot_under_minimum_two_is_a_contract_violation():
    decision = decide_group(GroupPolicy(n_samples=2, reward_norm=GROUP), [2, 1])
    assert (decision.decision, decision.reason) == ("dropped", "contract_violation")
    assert "slot sizes [2, 1]" in decision.error
    assert "one sample" in decision.error and "batch-level" in decision.error
    assert decision.stats.trainable_slot_count == 0


def test_multi_row_slot_is_fine_when_contract_not_armed():
    decision = decide_group(GroupPolicy(n_samples=2, reward_norm=NormSpec("batch", "batch")), [2, 1])
    assert decision.decision == "complete"
    assert decision.error is None


def test_explicit_minimum_arms_contract_under_batch_statistics():
    policy = GroupPolicy(n_samples=3, min_usable_group_size=2, reward_norm=NormSpec("batch", "batch"))
    assert decide_group(policy, [3, None, 1]).reason == "contract_violation"


def test_below_minimum_wins_over_contract():
    # SPEC order: the minimum is checked before the contract.
    assert decide_group(GroupPolicy(n_samples=3, reward_norm=GROUP), [2, None, None]).reason == "below_minimum"


def test_stats_are_recorded_for_every_decision_kind():
    policy = GroupPolicy(n_samples=2, reward_norm=GROUP)
    for counts in ([1, 1], [None, None], [1, None], [2, 1]):
        assert set(decide_group(policy, counts).stats.to_builtins()) == {
            "target_slot_count",
            "usable_slot_count",
            "trainable_slot_count",
            "fully_masked_group",
            "singleton_slot_group",
            "pre_filter_usable_slot_yield",
            "pre_filter_trainable_slot_yield",
        }


def test_wrong_number_of_slots_is_an_error():
    with pytest.raises(ValueError, match="expected 3 slot row counts"):
        decide_group(GroupPolicy(n_samples=3), [1, 1])
    with pytest.raises(ValueError, match="at least one row"):
        decide_group(GroupPolicy(n_samples=2), [0, 1])
