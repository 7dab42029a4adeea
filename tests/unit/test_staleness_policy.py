"""The staleness policies of the batch fold (SPEC section 4): ``drop`` discards a stale group, ``mask``
keeps it for the loader to mask, ``wait`` holds steps while pending work could turn stale."""

from __future__ import annotations

from test_batch_fold import decided, group, state, steps, tasks

from streamgrp.core.batch_fold import (
    DatasetEnded,
    Decided,
    Discarded,
    RoundEnded,
    VersionSet,
    WindowSet,
    fold,
    may_issue,
    run_batch_fold,
    window_allows,
)


def _spanning(task: str, oldest: int, newest: int) -> Decided:
    """A group whose samples were generated across versions ``oldest`` .. ``newest`` (continued generations)."""
    return Decided(f"{task}-0", group(task, version=oldest).replace(newest_token_version=newest))


def test_drop_discards_a_stale_group_and_mask_keeps_it_while_some_of_its_tokens_are_inside_the_window():
    events = [VersionSet(3), _spanning("t0", 1, 3), *decided(3, start=1, version=3)]
    _, dropped = run_batch_fold(state(staleness="drop", max_staleness=1), events)
    assert [(o.decision.task_id, o.reason) for o in dropped if isinstance(o, Discarded)] == [("t0", "stale")]
    assert steps(dropped) == []  # three fresh groups: not a step of four
    _, masked = run_batch_fold(state(staleness="mask", max_staleness=1), events)
    assert not [o for o in masked if isinstance(o, Discarded)]
    assert [tasks(s) for s in steps(masked)] == [["t0", "t1", "t2", "t3"]]


def test_mask_discards_a_group_whose_every_token_is_stale_instead_of_giving_it_a_steps_place():
    # t0: one version, 1 (all its tokens 2 behind); t1: continued from 0 to 1 (its newest token 2 behind): under
    # mask the loader would clear every loss token of both, so they are discarded as stale, as drop would
    events = [
        VersionSet(3),
        *decided(1, version=1),
        _spanning("t1", 0, 1),
        _spanning("t2", 1, 2),
        *decided(4, start=3, version=3),
    ]
    _, masked = run_batch_fold(state(staleness="mask", max_staleness=1), events)
    discarded = [o for o in masked if isinstance(o, Discarded)]
    assert [(o.decision.task_id, o.reason) for o in discarded] == [("t0", "stale"), ("t1", "stale")]
    assert "no row trains under mask: newest token version 1, at most 0 loss tokens" in discarded[1].detail
    assert [tasks(s) for s in steps(masked)] == [["t2", "t3", "t4", "t5"]]  # t2's version-2 tokens train


def test_mask_discards_a_group_whose_rows_the_mask_cuts_below_mask_min_tokens():
    # Versions 1..3, window from 2: t0's best row keeps 3 loss tokens of versions 2 and 3, t1's keeps 5.
    def cut(task: str, fresh_at_2: int) -> Decided:
        fresh = ((1, 8), (2, fresh_at_2), (3, 2))
        spanning = group(task, version=1, tokens=8).replace(newest_token_version=3, whole_version=1, fresh_tokens=fresh)
        return Decided(f"{task}-0", spanning)

    events = [VersionSet(3), cut("t0", 3), cut("t1", 5), *decided(3, start=2, version=3)]
    _, four = run_batch_fold(state(staleness="mask", max_staleness=1, mask_min_tokens=4), events)
    discarded = [o for o in four if isinstance(o, Discarded)]
    assert [(o.decision.task_id, o.reason) for o in discarded] == [("t0", "stale")]
    assert "at most 3 loss tokens of one row at version 2 or newer (mask_min_tokens 4)" in discarded[0].detail
    assert [tasks(s) for s in steps(four)] == [["t1", "t2", "t3", "t4"]]
    _, three = run_batch_fold(state(staleness="mask", max_staleness=1, mask_min_tokens=3), events)
    assert not [o for o in three if isinstance(o, Discarded)]  # 3 left in t0's row: enough


def test_wait_holds_a_step_while_an_in_flight_task_would_turn_stale():
    # version 1, nothing committed yet but step 0 written: step 1 would let the version reach 3, while a
    # task issued at version 1 is still in flight (3 - 1 > max_staleness 1).
    s = state(staleness="wait", max_staleness=1, batch_size=2, dp_size=1)
    s, _ = fold(s, VersionSet(1))
    s, out = fold(s, WindowSet(oldest_in_flight=1, lowest_committed=-1))
    s, out = run_batch_fold(s, decided(2, version=1))
    assert [st.step for st in steps(out)] == [0]  # 1 + 0 uncommitted + 1 step - 1 = 1: allowed
    s, out = run_batch_fold(s, decided(2, start=2, version=1))
    assert steps(out) == [] and len(s.buffer) == 2  # held: 1 + 1 + 1 - 1 = 2 > 1
    s, out = fold(s, WindowSet(oldest_in_flight=None, lowest_committed=-1))  # the long task was decided
    assert [tasks(st) for st in steps(out)] == [["t2", "t3"]] and s.buffer == []


def test_wait_lets_a_step_through_once_trainers_committed_and_the_window_moved():
    s = state(staleness="wait", max_staleness=1, batch_size=2, dp_size=1)
    s, _ = run_batch_fold(s, [WindowSet(0), *decided(2)])
    assert s.next_step == 1
    s, out = run_batch_fold(s, decided(2, start=2))  # task issued at 0 in flight, step 0 not committed: hold
    assert steps(out) == []
    s, out = run_batch_fold(s, [VersionSet(1), WindowSet(oldest_in_flight=1, lowest_committed=0)])
    assert [st.step for st in steps(out)] == [1]  # 1 + 0 + 1 - 1 = 1


def test_wait_counts_the_groups_a_step_leaves_in_the_buffer():
    s = state(staleness="wait", max_staleness=1, batch_size=2, dp_size=1)
    s, _ = fold(s, VersionSet(2))
    s, out = run_batch_fold(s, [Decided("1-0", group("old", version=1)), *decided(2, start=1, version=2)])
    # one step of the first two; "t2" (version 2) stays: 2 + 0 + 1 - 2 = 1, allowed
    assert [tasks(st) for st in steps(out)] == [["old", "t1"]]
    s = state(staleness="wait", max_staleness=1, batch_size=2, dp_size=1)
    s, _ = run_batch_fold(s, [VersionSet(2), WindowSet(1), *decided(2, version=2)])
    assert s.next_step == 0  # the task issued at 1 is in flight: 2 + 0 + 1 - 1 = 2 > 1
    s, out = run_batch_fold(s, [Decided("9-0", group("old", version=1)), WindowSet(None)])
    assert steps(out) == []  # now decided, but "old" would stay behind at version 1: 2 + 1 - 1 = 2 > 1
    assert not window_allows(s, 1, s.buffer[2:])
    s, out = run_batch_fold(s, decided(1, start=5, version=2))
    assert [tasks(st) for st in steps(out)] == [["t0", "t1"], ["old", "t5"]]  # nothing left behind


def test_wait_in_dynamic_mode_holds_the_round_until_the_in_flight_task_is_decided():
    s = state(staleness="wait", max_staleness=1, batch_mode="dynamic", dp_size=1)
    # a task issued at version 0 is in flight at version 1: a step now, once trained, makes it 2 behind
    s, _ = run_batch_fold(s, [VersionSet(1), WindowSet(0, lowest_committed=-1), *decided(3, version=1)])
    s, out = fold(s, RoundEnded(1.0))
    assert steps(out) == [] and len(s.buffer) == 3
    s, _ = run_batch_fold(s, [Decided("9-0", group("long", version=0)), WindowSet(None, lowest_committed=-1)])
    s, out = fold(s, RoundEnded(2.0))
    [step] = steps(out)
    assert tasks(step) == ["t0", "t1", "t2", "long"]  # the long one trained, not stale-dropped


def test_the_same_decisions_give_the_same_steps_with_or_without_the_hold():
    """What `verify` relies on: a held fixed-mode step is the groups it would have been, only later."""
    events = [VersionSet(0), *decided(8)]
    _, free = run_batch_fold(state(staleness="drop"), events)
    held = state(staleness="wait")
    held, first = run_batch_fold(held, [WindowSet(0), *events])
    assert len(steps(first)) == 1  # step 1 waits for the task issued at 0
    held, rest = fold(held, WindowSet(None))
    assert [tasks(st) for st in steps(free)] == [tasks(st) for st in steps(first + rest)] and len(steps(free)) == 2


def test_wait_issues_tasks_only_while_at_most_max_staleness_steps_are_uncommitted():
    s = state(staleness="wait", max_staleness=1, batch_size=2, dp_size=1)
    s, _ = run_batch_fold(s, [WindowSet(None), *decided(4)])
    assert s.next_step == 2 and not may_issue(s)  # a task issued now is 2 behind once both are trained
    s, _ = fold(s, WindowSet(None, lowest_committed=0))
    assert may_issue(s)
    assert may_issue(state(staleness="drop"))


def test_at_the_dataset_end_every_held_step_is_written_none_left_over():
    s = state(staleness="wait", max_staleness=0, batch_size=2, dp_size=1)
    s, out = run_batch_fold(s, [WindowSet(0), *decided(5)])
    assert steps(out) == [] and len(s.buffer) == 5
    s, out = fold(s, DatasetEnded())
    assert [tasks(st) for st in steps(out)] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert not [o for o in out if isinstance(o, Discarded)]


def test_a_round_that_holds_a_step_for_a_generation_in_flight_is_not_an_empty_round():
    s = state(staleness="wait", max_staleness=1, batch_size=2, dp_size=1, max_empty_rounds=2, stall_timeout_s=0)
    s, _ = run_batch_fold(s, [VersionSet(1), WindowSet(0), *decided(2, version=1)])
    assert s.next_step == 0  # held for the task issued at 0
    for now in range(1, 6):  # a long generation: rounds without a new group, the run does not fail
        s, out = fold(s, RoundEnded(float(now)))
        assert s.outcome == "running", out
    assert s.stall.held_rounds == 4 and s.stall.empty_rounds == 0  # the first round added the two groups
    s, out = fold(s, WindowSet(None))
    assert len(steps(out)) == 1
    s, _ = run_batch_fold(s, [RoundEnded(6.0), RoundEnded(7.0)])  # nothing held, nothing added: empty rounds
    assert s.outcome == "failed"


def test_a_samples_newest_token_version_travels_from_its_result_to_its_decision_only_when_it_spans_versions():
    from streamgrp import GroupPolicy
    from streamgrp.core import codec
    from streamgrp.core.events import SlotResult, TaskIssued
    from streamgrp.core.fresh_tokens import Freshness
    from streamgrp.core.group_fold import run_fold
    from streamgrp.services.synthetic import make_sample

    def result(slot: int, runs: list[list[int]] | None) -> SlotResult:
        sample = make_sample(tokens=4, rows=1, version=1)
        if runs is not None:
            sample = sample.replace(meta={"token_versions": runs})
        header = codec.decode(codec.encode(codec.sample_result("t1", slot, sample)[0]))
        assert isinstance(header, SlotResult) and header.sample is not None
        return header

    assert "newest" not in codec.encode(result(0, [[1, 4]]))[codec.HEADER].decode()  # one version: as before
    spanning = result(1, [[1, 2], [3, 2]])
    assert spanning.sample is not None and spanning.sample.newest == 3
    _, [closed] = run_fold(
        GroupPolicy(n_samples=2),
        [("1-0", TaskIssued(task_id="t1", issued_at=1.0)), ("2-0", result(0, [[1, 4]])), ("3-0", spanning)],
    )
    decision = codec.decode(codec.encode(closed.decision))
    assert (decision.version, decision.newest_version, decision.newest_token_version) == (1, 3, 3)
    # its freshness with it: the spanning member's one row keeps 2 loss tokens of version 3, the plain one 4
    assert decision.freshness == Freshness(1, ((1, 4), (3, 2)))
    _, [plain] = run_fold(
        GroupPolicy(n_samples=2),
        [("1-0", TaskIssued(task_id="t1", issued_at=1.0)), ("2-0", result(0, None)), ("3-0", result(1, [[1, 4]]))],
    )
    assert "newest" not in codec.encode(plain.decision)[codec.HEADER].decode()
    assert "fresh" not in codec.encode(plain.decision)[codec.HEADER].decode()
