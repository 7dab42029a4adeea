"""The per-step vote of a trainer group (`streamgrp.train.agreement`): ranks in step go on together, ranks
apart all raise the same error. Two ranks stand as the element-wise maximum over their two vote vectors."""

from __future__ import annotations

import pytest

from streamgrp.errors import TrainerGroupError
from streamgrp.train.agreement import GroupVote


def pair(other: list[int]):
    """``reduce_max`` of a rank whose one peer votes ``other``."""
    return lambda mine: [max(a, b) for a, b in zip(mine, other)]


def peer_vote(*, leaving=False, attempt=2, step=5, digest=77) -> list[int]:
    return [int(leaving), attempt, -attempt, step, -step, digest, -digest]


def test_ranks_in_step_train_together_and_leave_together():
    assert GroupVote(pair(peer_vote()), 0).step(leaving=False, attempt=2, step=5, digest=77) is False
    assert GroupVote(pair(peer_vote(leaving=True, digest=0)), 0).step(leaving=False, attempt=2, step=5, digest=77)


@pytest.mark.parametrize(
    ("peer", "names"),
    [
        (peer_vote(step=6), "steps 5 to 6"),
        (peer_vote(attempt=1), "attempts 1 to 2"),
        (peer_vote(digest=78), "the manifest of step 5"),
    ],
)
def test_ranks_apart_both_raise_the_same_error(peer, names):
    mine = peer_vote()
    messages = []
    for vote, their in ((mine, peer), (peer, mine)):
        with pytest.raises(TrainerGroupError, match=names) as raised:
            GroupVote(pair(their), 0).step(leaving=False, attempt=vote[1], step=vote[3], digest=vote[5])
        messages.append(str(raised.value))
    assert messages[0] == messages[1]


def test_ranks_leaving_at_different_steps_still_raise():
    with pytest.raises(TrainerGroupError, match="steps 5 to 6"):
        GroupVote(pair(peer_vote(leaving=True, step=6)), 0).step(leaving=False, attempt=2, step=5, digest=77)


def test_the_plan_takes_the_lowest_first_step_unless_ranks_were_told_different_ones():
    assert GroupVote(pair([9, 4, -4, 0]), 0).plan(token=3, first=6, explicit=False) == (9, 4)
    with pytest.raises(TrainerGroupError, match="resume at different steps"):
        GroupVote(pair([9, 4, -4, 1]), 0).plan(token=3, first=6, explicit=True)


def test_a_peer_lost_in_the_vote_is_a_group_error():
    def broken(values):
        raise RuntimeError("[gloo] Connection closed by peer")

    with pytest.raises(TrainerGroupError, match="rank 1 lost its trainer group.*Connection closed by peer"):
        GroupVote(broken, 1).step(leaving=False, attempt=1, step=0, digest=1)
