"""Hypothesis properties of streamgrp.core.rank_split: the module docstring's invariants on random inputs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from streamgrp.core.rank_split import (
    balanced_partition,
    check_split_invariants,
    greedy_split,
    max_load,
)

SETTINGS = settings(max_examples=examples(200), deadline=None)

int_weights = st.integers(min_value=1, max_value=10_000)
float_weights = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)
# token counts repeat a lot (same prompt length, clipped responses): duplicates and zeros stress ties
tie_weights = st.sampled_from([0, 1, 50, 50, 100, 4096, 8000])


@st.composite
def instances(draw, weights=int_weights):
    k = draw(st.integers(min_value=1, max_value=16))
    n = draw(st.integers(min_value=k, max_value=200))
    return draw(st.lists(weights, min_size=n, max_size=n)), k


@SETTINGS
@given(instances())
def test_invariants_hold_for_int_weights(case):
    weights, k = case
    check_split_invariants(weights, k, balanced_partition(weights, k))


@SETTINGS
@given(instances(float_weights))
def test_invariants_hold_for_float_weights(case):
    weights, k = case
    check_split_invariants(weights, k, balanced_partition(weights, k))


@SETTINGS
@given(instances(tie_weights))
def test_invariants_hold_with_ties_and_zeros(case):
    weights, k = case
    check_split_invariants(weights, k, balanced_partition(weights, k))


@SETTINGS
@given(instances(st.one_of(int_weights, float_weights)))
def test_never_worse_than_greedy_and_a_permutation(case):
    weights, k = case
    shards = balanced_partition(weights, k)
    assert max_load(weights, shards) <= max_load(weights, greedy_split(weights, k))
    assert sorted(i for s in shards for i in s) == list(range(len(weights)))
    q, r = divmod(len(weights), k)
    assert sorted(len(s) for s in shards) == [q] * (k - r) + [q + 1] * r


@SETTINGS
@given(instances())
def test_greedy_reference_keeps_the_cardinality_rule(case):
    weights, k = case
    check_split_invariants(weights, k, greedy_split(weights, k), produced_by=greedy_split)


@SETTINGS
@given(instances())
def test_max_load_is_at_least_the_average(case):
    weights, k = case
    # the bound holds for any split; a failure means loads are miscounted or indices dropped
    assert max_load(weights, balanced_partition(weights, k)) * k >= sum(weights)
