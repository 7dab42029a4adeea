"""The batch fold's rules (SPEC section 4), without a server."""

from __future__ import annotations

import pytest

from streamgrp.core.batch_fold import (
    Acked,
    BatchRules,
    BatchState,
    DatasetEnded,
    Decided,
    Discarded,
    Failed,
    Finished,
    RoundEnded,
    Stalling,
    StepDue,
    VersionSet,
    feeder_capacity,
    fold,
    run_batch_fold,
)
from streamgrp.core.events import DecidedMember, GroupDecided, GroupStats


def group(
    task: str, *, version: int = 0, tokens: int = 4, decision: str = "complete", members: int = 2, reward: float = 1.0
) -> GroupDecided:
    if decision == "dropped":
        return GroupDecided.of(
            task_id=task,
            decision="dropped",
            reason="all_unusable",
            members=(),
            slot_outcomes={},
            stats=GroupStats.of(2, 0, 0),
            closed_by="all_slots",
        )
    return GroupDecided.of(
        task_id=task,
        decision=decision,
        members=tuple(
            DecidedMember(slot=i, entry=f"{task}-s{i}", rows=1, tokens=tokens, version=version, reward=reward)
            for i in range(members)
        ),
        slot_outcomes={},
        stats=GroupStats.of(members, members, members),
        closed_by="all_slots",
    )


def decided(n: int, start: int = 0, **kwargs) -> list[Decided]:
    return [Decided(f"{i + 1}-0", group(f"t{i}", **kwargs)) for i in range(start, start + n)]


def steps(outputs) -> list[StepDue]:
    return [o for o in outputs if isinstance(o, StepDue)]


def tasks(step: StepDue) -> list[str]:
    return [d.task_id for _, d in step.groups]


def state(**rules) -> BatchState:
    return BatchState(BatchRules(**{"batch_size": 4, "dp_size": 2, **rules}))


# -- fixed mode ------------------------------------------------------------------------------------


def test_fixed_mode_emits_exactly_batch_size_groups_in_arrival_order():
    _, outputs = run_batch_fold(state(), decided(10))
    assert [tasks(s) for s in steps(outputs)] == [["t0", "t1", "t2", "t3"], ["t4", "t5", "t6", "t7"]]
    assert [s.step for s in steps(outputs)] == [0, 1]


def test_fixed_mode_holds_the_rest_until_the_dataset_ends_then_a_smaller_final_step():
    s, outputs = run_batch_fold(state(), decided(7))
    assert len(steps(outputs)) == 1 and len(s.buffer) == 3
    s, outputs = fold(s, DatasetEnded())
    [final] = steps(outputs)
    assert tasks(final) == ["t4", "t5", "t6"] and final.step == 1
    assert outputs[-1] == Finished(2) and s.outcome == "finished"


def test_leftovers_fewer_than_dp_size_are_discarded_when_the_dataset_ends():
    s, outputs = run_batch_fold(state(dp_size=2), decided(5))
    s, outputs = fold(s, DatasetEnded())
    assert steps(outputs) == []
    [leftover] = [o for o in outputs if isinstance(o, Discarded)]
    assert (leftover.decision.task_id, leftover.reason) == ("t4", "leftover")
    assert outputs[-1] == Finished(1)


def test_a_dropped_decision_is_only_acknowledged():
    _, outputs = run_batch_fold(state(), [Decided("1-0", group("t0", decision="dropped")), Decided("2-0", None)])
    assert outputs == [Acked(("1-0",)), Acked(("2-0",))]


# -- dynamic mode ----------------------------------------------------------------------------------


def test_dynamic_mode_takes_whatever_a_round_produced_at_least_dp_size():
    s = state(batch_mode="dynamic", dp_size=3)
    s, outputs = run_batch_fold(s, [*decided(2), RoundEnded(1.0)])
    assert steps(outputs) == [] and len(s.buffer) == 2  # fewer than dp_size: the batcher waits
    s, outputs = run_batch_fold(s, [*decided(5, start=2), RoundEnded(2.0)])
    [step] = steps(outputs)
    assert tasks(step) == [f"t{i}" for i in range(7)] and s.buffer == []


def test_no_step_takes_more_than_max_batch_size():
    s = state(batch_mode="dynamic", dp_size=2, max_batch_size=4)
    _, outputs = run_batch_fold(s, [*decided(9), RoundEnded(1.0)])
    assert [len(x.groups) for x in steps(outputs)] == [4, 4]  # the ninth waits: one alone is under dp_size


def test_max_steps_finishes_the_run():
    s, outputs = run_batch_fold(state(max_steps=2), decided(20))
    assert len(steps(outputs)) == 2 and outputs[-1] == Finished(2)
    assert fold(s, decided(1, start=30)[0]) == (s, [])  # a finished run ignores what follows


# -- staleness -------------------------------------------------------------------------------------


def test_a_group_older_than_max_staleness_is_discarded_and_never_trained():
    s = state(max_staleness=1)
    s, outputs = run_batch_fold(s, [VersionSet(3), *decided(2, version=1), *decided(4, start=2, version=2)])
    stale = [o for o in outputs if isinstance(o, Discarded)]
    assert [(o.decision.task_id, o.reason, o.current_version) for o in stale] == [
        ("t0", "stale", 3),
        ("t1", "stale", 3),
    ]
    [step] = steps(outputs)
    assert tasks(step) == ["t2", "t3", "t4", "t5"] and step.version == 3


def test_staleness_is_judged_at_batching_time_not_at_arrival():
    s = state(batch_mode="dynamic", max_staleness=0)
    s, _ = run_batch_fold(s, decided(2, version=0))
    s, outputs = run_batch_fold(s, [VersionSet(1), RoundEnded(1.0)])
    assert steps(outputs) == [] and {o.reason for o in outputs if isinstance(o, Discarded)} == {"stale"}


def test_the_feeder_window_is_max_staleness_plus_version_plus_one_batches():
    assert feeder_capacity(current_version=2, max_staleness=1, batch_size=8) == 32


# -- the user's filter -----------------------------------------------------------------------------


def test_filtered_groups_are_discarded_with_the_reason_and_a_raising_filter_does_not_stop_the_fold():
    def keep(decision):
        if decision.task_id == "t1":
            raise RuntimeError("bad reward")
        return decision.task_id != "t2"

    s = BatchState(BatchRules(batch_size=2, dp_size=1), group_filter=keep)
    _, outputs = run_batch_fold(s, decided(4))
    filtered = [(o.decision.task_id, o.detail) for o in outputs if isinstance(o, Discarded)]
    assert filtered == [
        ("t1", "the group filter raised RuntimeError: bad reward"),
        ("t2", "the group filter returned False"),
    ]
    [step] = steps(outputs)
    assert tasks(step) == ["t0", "t3"]


# -- the stall bound -------------------------------------------------------------------------------


def test_the_run_fails_only_when_both_bounds_are_reached():
    s = state(max_empty_rounds=3, stall_timeout_s=10.0)
    s, outputs = run_batch_fold(s, [RoundEnded(float(t)) for t in range(0, 40, 1)][:5])
    assert s.outcome == "running"  # 4 empty rounds but only 4 s
    s, outputs = fold(s, RoundEnded(10.0))
    assert outputs[-1] == Failed("stall", "", 0) and s.outcome == "failed"


def test_many_fast_empty_rounds_do_not_fail_the_run():
    s, _ = run_batch_fold(state(max_empty_rounds=3, stall_timeout_s=10.0), [RoundEnded(0.01 * i) for i in range(500)])
    assert s.outcome == "running" and s.stall.empty_rounds == 500


def test_a_round_with_a_trainable_group_restarts_the_streak():
    s = state(max_empty_rounds=2, stall_timeout_s=1.0)
    s, _ = run_batch_fold(s, [RoundEnded(0.0), RoundEnded(0.5)])
    assert s.stall.empty_rounds == 2
    s, _ = run_batch_fold(s, [*decided(1), RoundEnded(6.0)])
    assert s.stall.empty_rounds == 0 and s.outcome == "running"


def test_rounds_waiting_for_trainers_are_not_empty():
    s = state(max_empty_rounds=2, stall_timeout_s=1.0)
    s, _ = run_batch_fold(s, [*decided(4), RoundEnded(0.0)])  # step 0 written
    waiting = [RoundEnded(float(t), window_full=True, lowest_committed=-1) for t in range(1, 100)]
    s, _ = run_batch_fold(s, waiting)
    assert s.outcome == "running" and s.stall.trainer_wait_rounds == 99 and s.stall.empty_rounds == 0
    # once the trainers have committed the last step, a full window is no excuse
    s, outputs = run_batch_fold(s, [RoundEnded(100.0 + t, window_full=True, lowest_committed=0) for t in range(3)])
    assert s.outcome == "failed" and isinstance(outputs[-1], Failed)


def test_time_without_the_server_is_not_stall_time():
    s = state(max_empty_rounds=2, stall_timeout_s=10.0)
    s, _ = run_batch_fold(s, [RoundEnded(0.0), RoundEnded(1.0)])
    s, _ = fold(s, RoundEnded(61.0, server_away=True, duration=60.0))
    s, outputs = fold(s, RoundEnded(62.0))
    assert s.outcome == "running"  # 62 s passed, 60 of them without the server
    s, outputs = fold(s, RoundEnded(72.0))
    assert s.outcome == "failed"


def test_progress_warnings_are_rate_limited_to_one_a_minute():
    s = state(max_empty_rounds=1000, stall_timeout_s=1e9)
    _, outputs = run_batch_fold(s, [RoundEnded(float(t)) for t in range(0, 181)])
    warnings = [o for o in outputs if isinstance(o, Stalling)]
    assert [w.empty_rounds for w in warnings] == [1, 61, 121, 181]


def test_a_contract_violation_decision_fails_the_run_at_the_next_step():
    s, _ = run_batch_fold(state(), decided(4))
    violation = group("bad", decision="dropped").replace(reason="contract_violation", error="slot sizes [2, 1]")
    s, outputs = fold(s, Decided("9-0", violation))
    assert outputs == [Acked(("9-0",)), Failed("contract_violation", "slot sizes [2, 1]", 1)]
    assert s.outcome == "failed"
    s, outputs = run_batch_fold(s, decided(4))
    assert outputs == []  # a failed run ignores everything after


def test_an_unknown_event_is_a_type_error():
    with pytest.raises(TypeError, match="batch fold takes"):
        fold(state(), "decided")
