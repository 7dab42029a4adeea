import warnings

import pytest

from streamgrp import GroupPolicy, NormSpec

GROUP = NormSpec("group", "group")
BATCH = NormSpec("batch", "batch")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"n_samples": 4}, 1),
        ({"n_samples": 4, "reward_norm": BATCH, "adv_norm": BATCH}, 1),
        ({"n_samples": 4, "reward_norm": GROUP}, 2),
        ({"n_samples": 4, "adv_norm": NormSpec("batch", "group")}, 2),
        ({"n_samples": 4, "adv_norm": NormSpec(None, "group")}, 2),
        ({"n_samples": 4, "reward_norm": GROUP, "min_usable_group_size": 3}, 3),
        ({"n_samples": 4, "reward_norm": BATCH, "min_usable_group_size": 1}, 1),
        ({"n_samples": 4, "min_usable_group_size": 4}, 4),
        ({"n_samples": 1, "reward_norm": NormSpec(None, "group")}, 1),
    ],
)
def test_resolved_minimum(kwargs, expected):
    assert GroupPolicy(**kwargs).minimum_usable_group_size == expected


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"n_samples": 0}, "n_samples must be >= 1"),
        ({"n_samples": 4, "min_usable_group_size": 0}, "must be >= 1"),
        ({"n_samples": 4, "min_usable_group_size": 5}, "larger than n_samples"),
        ({"n_samples": 4, "min_usable_group_size": 1, "reward_norm": GROUP}, "no group peers to normalize against"),
        ({"n_samples": 4, "min_usable_group_size": 1, "adv_norm": NormSpec("batch", "group")}, "leave it unset"),
    ],
)
def test_invalid_configurations_say_what_to_change(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        GroupPolicy(**kwargs)


def test_singleton_group_mean_warns_but_is_allowed():
    with pytest.warns(UserWarning, match="erases the reward"):
        policy = GroupPolicy(n_samples=1, reward_norm=NormSpec("group", "group"))
    assert policy.minimum_usable_group_size == 1


def test_singleton_group_std_only_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GroupPolicy(n_samples=1, reward_norm=NormSpec("batch", "group"))


def test_contract_armed_only_with_minimum_two_and_several_samples():
    assert GroupPolicy(n_samples=4, reward_norm=GROUP).one_sample_per_slot
    assert GroupPolicy(n_samples=4, min_usable_group_size=2).one_sample_per_slot
    assert not GroupPolicy(n_samples=4, reward_norm=BATCH).one_sample_per_slot
    with pytest.warns(UserWarning):
        assert not GroupPolicy(n_samples=1, reward_norm=GROUP).one_sample_per_slot


def test_normspec_positional_and_keyword_forms_agree():
    assert NormSpec("group", None, True, False, 0.0) == NormSpec(
        mean_level="group", std_level=None, leave_one_out=True, unbiased=False, eps=0.0
    )
    with pytest.raises(ValueError):
        NormSpec("token", "group")
    with pytest.raises(TypeError):
        NormSpec("group", "group", mean_level="batch")


def test_policy_is_frozen_and_lists_differences():
    a = GroupPolicy(n_samples=4, reward_norm=GROUP)
    b = GroupPolicy(n_samples=8, reward_norm=NormSpec("group", "batch"))
    with pytest.raises(ValueError):
        a.n_samples = 3  # type: ignore[misc]
    assert a.differences(b) == ["n_samples", "reward_norm.std_level"]
    assert a.differences(a) == []
