"""A session's turns as a sample's rows (`streamgrp.core.session_rows`): turns that continue each other share
one row with loss mask 1 on generated tokens only; others are rows of their own; the one-row contract."""

from __future__ import annotations

import pytest

from streamgrp.core.policy import GroupPolicy, NormSpec
from streamgrp.core.session_rows import Turn, contract_problem, session_rows, session_sample


def test_a_turn_that_continues_the_last_prompt_and_completion_joins_its_row():
    first = Turn([1, 2, 3], [10, 11], [-0.5, -0.25], version=3)
    second = Turn([1, 2, 3, 10, 11, 20, 21], [12], [-1.0], version=2)  # a tool message (20, 21) in between
    [row] = session_rows([first, second])
    assert row.token_ids == [1, 2, 3, 10, 11, 20, 21, 12]
    assert row.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert row.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0]
    assert row.turns == [1, 2]
    sample = session_sample([first, second], 1.5, meta={"session": "s"})
    assert sample.row_lengths == (8,) and sample.rewards == (1.5,) and sample.version == 2  # the oldest turn's
    assert sample.meta == {"session": "s", "turns": 2, "row_turns": [[1, 2]]}
    assert sample.loss_mask.to_list() == row.loss_mask and sample.valid_tokens == 3


def test_a_turn_that_does_not_continue_starts_a_row_and_may_continue_an_older_one_later():
    a1 = Turn([1, 2], [3], [-1.0], 0)
    b1 = Turn([7, 8], [9], [-1.0], 0)  # a side conversation: its own row
    a2 = Turn([1, 2, 3, 4], [5], [-1.0], 0)  # back to the first: extends row 1, not row 2
    off = Turn([1, 2, 99], [6], [-1.0], 0)  # edits history (3 -> 99): a new row, its prompt all masked
    rows = session_rows([a1, b1, a2, off])
    assert [r.turns for r in rows] == [[1, 3], [2], [4]]
    assert rows[0].token_ids == [1, 2, 3, 4, 5] and rows[0].loss_mask == [0, 0, 1, 0, 1]
    assert rows[2].token_ids == [1, 2, 99, 6] and rows[2].loss_mask == [0, 0, 0, 1]
    # every generated token is in exactly one row, once
    assert sum(sum(r.loss_mask) for r in rows) == 4
    sample = session_sample([a1, b1, a2, off], 0.5)
    assert sample.row_lengths == (5, 3, 4) and sample.rewards == (0.5, 0.5, 0.5)


def test_an_exact_repeat_of_a_row_as_prompt_continues_it():
    rows = session_rows([Turn([1], [2], [-0.1], 0), Turn([1, 2], [3], [-0.2], 0)])
    assert [r.token_ids for r in rows] == [[1, 2, 3]] and rows[0].loss_mask == [0, 1, 1]


def test_a_session_without_turns_or_with_an_empty_completion_has_nothing_to_train():
    with pytest.raises(ValueError, match="recorded no turn"):
        session_sample([], 1.0)
    with pytest.raises(ValueError, match="at least one token"):
        session_rows([Turn([1], [], [], 0)])


def test_the_one_row_contract_refuses_several_rows_only_where_it_is_armed():
    armed = GroupPolicy(n_samples=4, reward_norm=NormSpec("group", "group"))
    assert contract_problem(armed, 1) is None
    problem = contract_problem(armed, 3)
    assert problem is not None and "3 rows" in problem and "append-only" in problem and "batch-level" in problem
    assert contract_problem(GroupPolicy(n_samples=4), 3) is None  # no group statistics: every row trains
    assert contract_problem(GroupPolicy(n_samples=4, min_usable_group_size=2), 2) is not None  # explicit minimum
    assert contract_problem(GroupPolicy(n_samples=1), 2) is None  # a group of one has no peers to count
