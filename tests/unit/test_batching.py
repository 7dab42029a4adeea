"""Unit tests of streamgrp.core.manifest: manifests (shards, whole groups, digests), staleness, the window."""

from __future__ import annotations

import hashlib
import random
from collections import Counter

import pytest

from streamgrp.core.batch_fold import feeder_capacity, is_stale
from streamgrp.core.codec import combine_digests
from streamgrp.core.events import GroupDecided, GroupStats, Shard
from streamgrp.core.manifest import imbalance, make_manifest
from streamgrp.core.rank_split import greedy_split, max_load


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def decision(
    task: int, tokens: list[int], versions: list[int] | None = None, rows: list[int] | None = None
) -> tuple[str, GroupDecided]:
    """A trainable group of ``len(tokens)`` members and the decision-entry id it would have."""
    n = len(tokens)
    members = tuple(range(n))
    return f"{1000 + task}-0", GroupDecided(
        task_id=f"task-{task}",
        decision="complete",
        slots=members,
        member_entries=tuple(f"{task}-{m}" for m in members),
        member_digests=tuple(_digest(f"{task}:{m}") for m in members),
        member_rows=tuple(rows or [1] * n),
        member_tokens=tuple(tokens),
        member_versions=tuple(versions or [0] * n),
        slot_outcomes={str(m): "sample" for m in members},
        stats=GroupStats.of(n, n, n),
        closed_by="all_slots",
    )


def random_groups(rng: random.Random, n: int) -> list[tuple[str, GroupDecided]]:
    return [decision(t, [rng.randint(1, 300) for _ in range(rng.randint(1, 4))]) for t in range(n)]


def assert_manifest_invariants(manifest, groups, dp_size):
    """The batching invariants: k shards, ragged by at most one, whole groups, each exactly once, digests."""
    by_task = {d.task_id: (entry, d) for entry, d in groups}
    assert [s.rank for s in manifest.shards] == list(range(dp_size))
    sizes = [len(s.groups) for s in manifest.shards]
    assert max(sizes) - min(sizes) <= 1
    placed = Counter(g.task_id for s in manifest.shards for g in s.groups)
    assert placed == Counter(list(by_task))  # every group exactly once
    for shard in manifest.shards:
        for group in shard.groups:
            entry, source = by_task[group.task_id]
            # whole: the shard carries every member of the group, nothing from another group
            assert group.decision_entry == entry
            assert [(m.slot, m.entry, m.rows, m.tokens, m.version) for m in group.members] == [
                (m.slot, m.entry, m.rows, m.tokens, m.version) for m in source.members
            ]
            assert group.digest == combine_digests(m.digest for m in source.members)
        assert shard.digest == combine_digests(g.digest for g in shard.groups)
        assert shard.tokens == sum(g.valid_tokens for g in shard.groups)
    entries = [m.entry for s in manifest.shards for g in s.groups for m in g.members]
    assert len(entries) == len(set(entries))


@pytest.mark.parametrize("n_groups, dp_size", [(1, 1), (2, 2), (5, 2), (7, 3), (8, 4), (9, 4), (31, 8), (64, 8)])
def test_manifest_invariants_on_random_inputs(n_groups, dp_size):
    rng = random.Random(n_groups * 100 + dp_size)
    for _ in range(20):
        groups = random_groups(rng, n_groups)
        manifest = make_manifest(7, 3, groups, dp_size, 123.5)
        assert (manifest.step, manifest.version, manifest.created_at) == (7, 3, 123.5)
        assert_manifest_invariants(manifest, groups, dp_size)
        sizes = sorted(len(s.groups) for s in manifest.shards)
        assert sizes == sorted([n_groups // dp_size + (1 if r < n_groups % dp_size else 0) for r in range(dp_size)])
        # the split is over valid tokens and no worse than greedy longest-first
        weights = [d.valid_tokens for _, d in groups]
        assert max(s.tokens for s in manifest.shards) <= max_load(weights, greedy_split(weights, dp_size))


def test_fewer_groups_than_ranks_is_an_error():
    groups = [decision(0, [4]), decision(1, [5])]
    with pytest.raises(ValueError, match="at least dp_size=3 groups, got 2"):
        make_manifest(0, 0, groups, 3, 0.0)
    with pytest.raises(ValueError):
        make_manifest(0, 0, [], 1, 0.0)


def test_groups_stay_whole_even_when_splitting_would_balance_better():
    # one huge group of 4 members and three small ones over 2 ranks: the huge one is not split
    groups = [decision(0, [100, 100, 100, 100]), decision(1, [10]), decision(2, [10]), decision(3, [10])]
    manifest = make_manifest(0, 0, groups, 2, 0.0)
    assert_manifest_invariants(manifest, groups, 2)
    heavy = next(s for s in manifest.shards if any(g.task_id == "task-0" for g in s.groups))
    assert heavy.tokens in (400, 410)
    assert sorted(s.tokens for s in manifest.shards) == [20, 410]
    assert manifest.imbalance == pytest.approx(410 * 2 / 430)


def test_shard_digest_depends_on_member_digests_and_order():
    groups = [decision(0, [3]), decision(1, [3])]
    one = make_manifest(0, 0, groups, 1, 0.0).shards[0]
    assert one.digest == combine_digests(
        [
            combine_digests(m.digest for m in groups[0][1].members),
            combine_digests(m.digest for m in groups[1][1].members),
        ]
    )
    other_member = groups[1][1].members[0].replace(digest=_digest("other"))
    changed = [groups[0], (groups[1][0], groups[1][1].with_members((other_member,)))]
    assert make_manifest(0, 0, changed, 1, 0.0).shards[0].digest != one.digest


def test_manifest_is_deterministic():
    rng = random.Random(5)
    groups = random_groups(rng, 23)
    assert make_manifest(1, 1, groups, 4, 1.0) == make_manifest(1, 1, groups, 4, 1.0)


def test_imbalance():
    def shard(rank, tokens):
        return Shard(rank=rank, groups=(), tokens=tokens, digest="")

    assert imbalance([shard(0, 10), shard(1, 10)]) == 1.0
    assert imbalance([shard(0, 30), shard(1, 10)]) == pytest.approx(1.5)  # 30 over a mean of 20
    assert imbalance([shard(0, 9), shard(1, 0), shard(2, 0)]) == pytest.approx(3.0)
    assert imbalance([shard(0, 0), shard(1, 0)]) == 1.0  # no tokens at all: nothing to balance


def test_manifest_imbalance_matches_its_shards():
    groups = random_groups(random.Random(9), 13)
    manifest = make_manifest(0, 0, groups, 3, 0.0)
    loads = [s.tokens for s in manifest.shards]
    assert manifest.imbalance == pytest.approx(max(loads) * 3 / sum(loads))
    assert manifest.imbalance >= 1.0


@pytest.mark.parametrize("max_staleness", [0, 1, 4])
def test_staleness_boundary(max_staleness):
    current = 10
    exactly = decision(0, [5], versions=[current - max_staleness])[1]
    one_more = decision(1, [5], versions=[current - max_staleness - 1])[1]
    assert not is_stale(exactly, current, max_staleness)
    assert is_stale(one_more, current, max_staleness)
    assert not is_stale(decision(2, [5], versions=[current])[1], current, max_staleness)


def test_group_version_is_its_oldest_member():
    group = decision(0, [5, 5, 5], versions=[9, 7, 10])[1]
    assert group.version == 7
    assert not is_stale(group, 8, 1)
    assert is_stale(group, 9, 1)  # one member is 2 behind, so the whole group is


def test_feeder_capacity_formula():
    assert feeder_capacity(0, 0, 8) == 8
    assert feeder_capacity(0, 1, 8) == 16
    assert feeder_capacity(3, 1, 8) == 40
    assert feeder_capacity(5, 2, 4) == (2 + 5 + 1) * 4
    for version in range(5):
        assert feeder_capacity(version + 1, 2, 3) - feeder_capacity(version, 2, 3) == 3  # one batch per version
