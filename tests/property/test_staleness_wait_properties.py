"""``staleness="wait"`` in a simulated run: a feeder issuing within the window, generations of any
lengths finishing in any order, a trainer committing one step at a time, the batch fold deciding
steps. Whatever the lengths, nothing is discarded as stale, every decided group is trained, and the
run ends (the hold never deadlocks); under ``drop`` the same runs do discard stale groups."""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from streamgrp.core.batch_fold import (
    BatchRules,
    BatchState,
    DatasetEnded,
    Decided,
    Discarded,
    Finished,
    RoundEnded,
    StepDue,
    VersionSet,
    WindowSet,
    feeder_capacity,
    fold,
    may_issue,
)
from streamgrp.core.events import DecidedMember, GroupDecided, GroupStats


def _group(task: str, version: int) -> GroupDecided:
    members = (DecidedMember(slot=0, entry=f"{task}a", rows=1, tokens=4, version=version),)
    return GroupDecided.of(
        task_id=task,
        decision="complete",
        members=members,
        slot_outcomes={},
        stats=GroupStats.of(1, 1, 1),
        closed_by="all_slots",
    )


def simulate(
    staleness: str, durations: list[int], batch_size: int, max_staleness: int, step_time: int, batch_mode: str = "fixed"
) -> dict:
    """Integer time; the feeder issues as the batcher's does (the count window, and `may_issue`); a task
    generates at the version it was issued at (workers keep up) for its duration; the trainer trains
    written steps in order, ``step_time`` each, each commit raising the version by one."""
    rules = BatchRules(
        batch_mode=batch_mode,
        batch_size=batch_size,
        max_batch_size=batch_size,
        dp_size=1,
        max_staleness=max_staleness,
        max_empty_rounds=10**9,
        stall_timeout_s=1e18,
        staleness=staleness,
    )
    state = BatchState(rules)
    version, committed, now = 0, -1, 0
    cursor = 0
    in_flight: dict[int, int] = {}  # task position -> issue version
    finishing: list[tuple[int, int]] = []  # (time, task position)
    steps: list[StepDue] = []
    stale: list[str] = []
    trainer_free_at = 0
    training: int | None = None
    outputs: list = []

    def apply(event) -> None:
        nonlocal state
        state, produced = fold(state, event)
        outputs.extend(produced)
        for output in produced:
            if isinstance(output, StepDue):
                steps.append(output)
            elif isinstance(output, Discarded) and output.reason == "stale":
                stale.append(output.decision.task_id)

    def window() -> None:
        apply(VersionSet(version))
        apply(WindowSet(min(in_flight.values()) if in_flight else None, committed))
        if batch_mode == "dynamic":  # a round ends at every turn of the simulation
            apply(RoundEnded(float(now)))

    for _ in range(100_000):
        # the feeder: issue while the window has room (nothing is dropped here, so issued = outstanding)
        while (
            cursor < len(durations)
            and cursor < feeder_capacity(version, max_staleness, batch_size) + len(stale)
            and may_issue(state)
        ):
            in_flight[cursor] = version
            heapq.heappush(finishing, (now + durations[cursor], cursor))
            cursor += 1
        window()
        # the trainer
        if training is None and len(steps) > committed + 1:
            training, trainer_free_at = committed + 1, now + step_time
        if training is not None and now >= trainer_free_at:
            committed, training = training, None
            version += 1
            window()
            continue
        if finishing and finishing[0][0] <= now:
            _, position = heapq.heappop(finishing)
            issued = in_flight.pop(position)
            apply(Decided(f"{position + 1}-0", _group(f"t{position}", issued)))
            window()
            continue
        if cursor == len(durations) and not in_flight:
            apply(DatasetEnded())
            break
        now = min([t for t, _ in finishing[:1]] + ([trainer_free_at] if training is not None else []) + [now + 1])
    else:
        raise AssertionError("the simulated run did not end")
    trained = [decision.task_id for step in steps for _, decision in step.groups]
    return {
        "stale": stale,
        "trained": trained,
        "finished": any(isinstance(o, Finished) for o in outputs),
        "steps": steps,
    }


RUNS = st.tuples(
    st.lists(st.sampled_from([1, 1, 1, 2, 3, 20, 60]), min_size=4, max_size=80),
    st.integers(1, 4),
    st.integers(0, 2),
    st.integers(1, 10),
    st.sampled_from(["fixed", "dynamic"]),
)


@settings(max_examples=examples(200), deadline=None)
@given(RUNS)
def test_wait_discards_nothing_as_stale_trains_every_group_and_ends(run):
    durations, batch_size, max_staleness, step_time, mode = run
    result = simulate("wait", durations, batch_size, max_staleness, step_time, mode)
    assert result["stale"] == []
    assert sorted(result["trained"], key=lambda t: int(t[1:])) == [f"t{i}" for i in range(len(durations))]
    assert result["finished"]
    for step in result["steps"]:  # and no step holds a group beyond the window (the fold's invariant)
        assert all(step.version - decision.version <= max_staleness for _, decision in step.groups)


def test_drop_discards_the_long_ones_in_the_same_kind_of_run():
    durations = [40 if i % 5 == 0 else 1 for i in range(60)]
    dropped = simulate("drop", durations, 4, 1, 2)
    waited = simulate("wait", durations, 4, 1, 2)
    assert dropped["stale"] and all(int(task[1:]) % 5 == 0 for task in dropped["stale"])
    assert waited["stale"] == [] and len(waited["trained"]) == 60
