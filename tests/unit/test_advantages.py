"""Unit tests of streamgrp.train.advantages: normalization over actual group sizes, the loss, group metrics."""

from __future__ import annotations

import math
import random
import threading

import pytest
import torch

from streamgrp.core.policy import NormSpec
from streamgrp.train.advantages import (
    group_metrics,
    normalize,
    token_weighted_policy_loss,
)

EPS = 1e-5


def t(*rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype)


def assert_exact(actual: torch.Tensor, expected: list) -> None:
    assert actual.dtype == torch.float32
    assert actual.tolist() == pytest.approx(expected, abs=0, rel=0), actual.tolist()


def reference_normalize_1d(xs: list[float], sizes: list[int] | None, spec: NormSpec) -> list[float]:
    """A loop-by-loop restatement of SPEC section 3 for [R] values without a mask."""
    groups = [list(range(len(xs)))] if sizes is None else []
    if sizes is not None:
        start = 0
        for size in sizes:
            groups.append(list(range(start, start + size)))
            start += size
    everything = [list(range(len(xs)))]

    def members(level, i):
        pool = groups if level == "group" else everything
        return next(g for g in pool if i in g)

    centered = []
    for i, x in enumerate(xs):
        if spec.mean_level is None:
            centered.append(x)
            continue
        peers = members(spec.mean_level, i)
        if spec.leave_one_out:
            if len(peers) == 1:
                centered.append(0.0)
            else:
                centered.append(x - (sum(xs[j] for j in peers) - x) / (len(peers) - 1))
        else:
            centered.append(x - sum(xs[j] for j in peers) / len(peers))
    if spec.std_level is None:
        return centered
    out = []
    for i, c in enumerate(centered):
        peers = members(spec.std_level, i)
        sq = sum(centered[j] ** 2 for j in peers)
        if spec.unbiased:
            std = 1.0 if len(peers) == 1 else math.sqrt(sq / (len(peers) - 1))
        else:
            std = math.sqrt(sq / len(peers))
        out.append(0.0 if c == 0 else c / (std + spec.eps))
    return out


# ---------------------------------------------------------------------------------------------------
# SPEC reference values


def test_groups_3_2_3_each_have_zero_mean_after_group_centering():
    values = t(1.0, 5.0, 9.0, -2.0, 4.0, 0.5, 0.25, 8.25)
    out = normalize(values, [3, 2, 3], NormSpec("group", None))
    assert_exact(out, [-4.0, 0.0, 4.0, -3.0, 3.0, -2.5, -2.75, 5.25])
    for group in out.split([3, 2, 3]):
        assert group.double().sum().item() == 0.0
    # A fixed stride of 3 would have centered rows 3..5 together: the sizes matter.
    assert out[3].item() != (values[3] - values[3:6].mean()).item()


def test_leave_one_out_reference_vector():
    out = normalize(t(1.0, 3.0, 10.0, 20.0, 30.0), [2, 3], NormSpec("group", None, leave_one_out=True))
    assert_exact(out, [-2.0, 2.0, -15.0, 0.0, 15.0])


def test_leave_one_out_singleton_is_zero():
    out = normalize(t(7.0, 1.0, 3.0), [1, 2], NormSpec("group", None, leave_one_out=True))
    assert_exact(out, [0.0, -2.0, 2.0])


# ---------------------------------------------------------------------------------------------------
# zero variance, singletons, std variants


@pytest.mark.parametrize("eps", [0.0, EPS])
@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("unbiased", [False, True])
def test_zero_variance_group_gives_exact_zero(eps, leave_one_out, unbiased):
    values = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 3.0], dtype=torch.float64)
    naive = values[:3] - values[:3].sum() / 3
    assert naive.abs().max().item() > 0, "precondition: the naive float64 mean is off by rounding"
    spec = NormSpec("group", "group", leave_one_out=leave_one_out, unbiased=unbiased, eps=eps)
    out = normalize(values, [3, 3, 2], spec)
    assert out[:6].tolist() == [0.0] * 6
    assert torch.isfinite(out).all()
    assert out[6].item() < 0 < out[7].item()


def test_zero_variance_batch_gives_exact_zero():
    values = torch.full((5,), 0.7, dtype=torch.float64)
    out = normalize(values, None, NormSpec("batch", "batch", eps=0.0))
    assert out.tolist() == [0.0] * 5


def test_singleton_group_normalizes_to_zero_under_group_mean():
    out = normalize(t(5.0, 1.0, 3.0), [1, 2], NormSpec("group", "group"))
    assert out[0].item() == 0.0
    assert out[1:].tolist() == pytest.approx([-1 / (math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS)], rel=1e-6)


def test_unbiased_singleton_std_is_one():
    # mean_level None: nothing is centered, so the singleton's std of 1 shows: x / (1 + eps).
    out = normalize(t(3.0, 1.0, 3.0), [1, 2], NormSpec(None, "group"))
    assert out[0].item() == pytest.approx(3.0 / (1.0 + EPS), rel=1e-7)
    assert out[0].item() != 3.0
    # The pair's std is the root mean square of its uncentered values with Bessel: sqrt((1 + 9) / 1).
    assert out[1:].tolist() == pytest.approx([1 / (math.sqrt(10) + EPS), 3 / (math.sqrt(10) + EPS)], rel=1e-6)


def test_unbiased_vs_population_std():
    values = t(1.0, 3.0, 10.0, 30.0)
    unbiased = normalize(values, [2, 2], NormSpec("group", "group"))
    population = normalize(values, [2, 2], NormSpec("group", "group", unbiased=False))
    s2 = math.sqrt(2)
    expected_unbiased = [-1 / (s2 + EPS), 1 / (s2 + EPS), -10 / (10 * s2 + EPS), 10 / (10 * s2 + EPS)]
    assert unbiased.tolist() == pytest.approx(expected_unbiased, rel=1e-6)
    expected_population = [-1 / (1 + EPS), 1 / (1 + EPS), -10 / (10 + EPS), 10 / (10 + EPS)]
    assert population.tolist() == pytest.approx(expected_population, rel=1e-6)


def test_population_singleton_under_group_mean_is_zero():
    out = normalize(t(4.0, 1.0, 3.0), [1, 2], NormSpec("group", "group", unbiased=False, eps=0.0))
    assert_exact(out, [0.0, -1.0, 1.0])


def test_std_level_none_means_std_one_and_eps_zero():
    out = normalize(t(1.0, 2.0, 6.0), [3], NormSpec("group", None, eps=0.5))
    assert_exact(out, [-2.0, -1.0, 3.0])


def test_both_levels_none_returns_values_unchanged_as_float32():
    values = torch.tensor([1.5, -2.0, 0.25], dtype=torch.float64)
    out = normalize(values, None, NormSpec(None, None))
    assert_exact(out, [1.5, -2.0, 0.25])


def test_batch_level():
    values = t(1.0, 2.0, 3.0, 4.0)
    out = normalize(values, None, NormSpec("batch", "batch"))
    std = math.sqrt(5 / 3)  # centered [-1.5, -0.5, 0.5, 1.5], Bessel over 4 entries
    assert out.tolist() == pytest.approx([c / (std + EPS) for c in (-1.5, -0.5, 0.5, 1.5)], rel=1e-6)
    population = normalize(values, None, NormSpec("batch", "batch", unbiased=False))
    std = math.sqrt(5 / 4)
    assert population.tolist() == pytest.approx([c / (std + EPS) for c in (-1.5, -0.5, 0.5, 1.5)], rel=1e-6)


def test_group_mean_with_batch_std_scales_by_spread_of_centered_values():
    out = normalize(t(1.0, 3.0, 10.0, 30.0), [2, 2], NormSpec("group", "batch"))
    std = math.sqrt((1 + 1 + 100 + 100) / 3)
    assert out.tolist() == pytest.approx([c / (std + EPS) for c in (-1.0, 1.0, -10.0, 10.0)], rel=1e-6)


def test_batch_mean_with_group_std():
    out = normalize(t(1.0, 3.0, 5.0, 7.0), [2, 2], NormSpec("batch", "group", eps=0.0))
    # batch mean 4 -> centered [-3, -1, 1, 3]; group stds sqrt(10/1) each
    s = math.sqrt(10)
    assert out.tolist() == pytest.approx([-3 / s, -1 / s, 1 / s, 3 / s], rel=1e-6)


def test_batch_leave_one_out():
    out = normalize(t(1.0, 2.0, 6.0), None, NormSpec("batch", None, leave_one_out=True))
    assert_exact(out, [1 - 4.0, 2 - 3.5, 6 - 1.5])


@pytest.mark.parametrize(
    "spec",
    [
        NormSpec("group", "group"),
        NormSpec("group", "group", leave_one_out=True),
        NormSpec("group", "group", unbiased=False),
        NormSpec("group", "batch"),
        NormSpec("batch", "group", leave_one_out=True),
        NormSpec("batch", "batch"),
        NormSpec(None, "group"),
        NormSpec("group", None, leave_one_out=True),
    ],
    ids=str,
)
@pytest.mark.parametrize("seed", range(5))
def test_matches_loop_reference_on_random_ragged_groups(spec, seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 5) for _ in range(rng.randint(1, 6))]
    xs = [float(rng.randint(-20, 20)) / 4 for _ in range(sum(sizes))]
    out = normalize(torch.tensor(xs, dtype=torch.float64), sizes, spec)
    assert out.tolist() == pytest.approx(reference_normalize_1d(xs, sizes, spec), rel=1e-6, abs=1e-6)


# ---------------------------------------------------------------------------------------------------
# masks and per-token values


def masked_tokens():
    nan = float("nan")
    values = t(
        [1.0, 2.0, 9.0],  # group A, row 0: last token is padding
        [3.0, 99.0, 99.0],  # group A, row 1: one valid token
        [4.0, 6.0, 8.0],  # group B, row 2: all valid
        [nan, nan, nan],  # group B, row 3: fully masked, garbage padding
    )
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    return values, mask


def test_masked_per_token_group_normalization():
    values, mask = masked_tokens()
    out = normalize(values, [2, 2], NormSpec("group", "group", eps=0.0), mask)
    # A: valid entries 1, 2, 3 -> mean 2, centered -1, 0, 1, unbiased std sqrt(2 / 2) = 1.
    # B: one member (row 3 has no valid token) -> unbiased singleton std 1; mean 6 -> -2, 0, 2.
    assert out.shape == (4, 3)
    assert_exact(out.flatten(), [-1.0, 0.0, 0.0, 1.0, 0.0, 0.0, -2.0, 0.0, 2.0, 0.0, 0.0, 0.0])


def test_masked_per_token_population_std_counts_entries():
    values, mask = masked_tokens()
    out = normalize(values, [2, 2], NormSpec("group", "group", unbiased=False, eps=0.0), mask)
    a = math.sqrt(2 / 3)  # sum of squares 2 over 3 entries
    b = math.sqrt(8 / 3)
    expected = [-1 / a, 0.0, 0.0, 1 / a, 0.0, 0.0, -2 / b, 0.0, 2 / b, 0.0, 0.0, 0.0]
    assert out.flatten().tolist() == pytest.approx(expected, rel=1e-6)


def test_masked_per_token_leave_one_row_out():
    values, mask = masked_tokens()
    out = normalize(values, [2, 2], NormSpec("group", None, leave_one_out=True), mask)
    # Row 0's baseline is row 1's tokens: (6 - 3) / (3 - 2) = 3 -> [1 - 3, 2 - 3].
    # Row 1's baseline is row 0's tokens: (6 - 3) / (3 - 1) = 1.5 -> [3 - 1.5].
    # Row 2 has no other member in group B -> baseline is itself -> 0.
    assert_exact(out.flatten(), [-2.0, -1.0, 0.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])


def test_masked_rows_of_1d_values_are_left_out_of_statistics():
    values = t(1.0, 1000.0, 3.0, 5.0)
    mask = torch.tensor([1, 0, 1, 1])
    out = normalize(values, [2, 2], NormSpec("group", None), mask)
    assert_exact(out, [0.0, 0.0, -1.0, 1.0])


def test_mask_of_weights_is_rejected():
    with pytest.raises(ValueError, match="only 0 and 1"):
        normalize(t(1.0, 2.0), [2], NormSpec("group", None), torch.tensor([0.5, 1.0]))


def test_mask_shape_must_match():
    with pytest.raises(ValueError, match=r"same shape as values"):
        normalize(t(1.0, 2.0), [2], NormSpec("group", None), torch.tensor([[1, 1]]))


def test_values_must_be_1d_or_2d():
    with pytest.raises(ValueError, match=r"\[rows\] or \[rows, tokens\]"):
        normalize(torch.zeros(2, 2, 2), [2], NormSpec("group", None))


# ---------------------------------------------------------------------------------------------------
# precision


def test_computed_in_float64_returned_float32():
    values = torch.tensor([16777216.0, 16777218.0], dtype=torch.float32)  # 2**24 and 2**24 + 2
    float32_compute = values - values.mean()
    assert float32_compute.tolist() != [-1.0, 1.0], "precondition: float32 arithmetic rounds the mean"
    out = normalize(values, [2], NormSpec("group", None))
    assert_exact(out, [-1.0, 1.0])


def test_float64_input_also_returns_float32():
    out = normalize(torch.tensor([1.0, 2.0], dtype=torch.float64), [2], NormSpec("group", "group"))
    assert out.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# group_sizes validation


def test_group_sizes_must_sum_to_rows():
    with pytest.raises(ValueError, match=r"group_sizes sum to 7 but values has 8 rows.*never truncated"):
        normalize(torch.ones(8), [3, 2, 2], NormSpec("group", "group"))


def test_group_sizes_must_sum_to_rows_even_without_group_level():
    with pytest.raises(ValueError, match="sum to 9 but values has 8 rows"):
        normalize(torch.ones(8), [3, 3, 3], NormSpec("batch", "batch"))


@pytest.mark.parametrize("sizes", [[3, 0, 5], [4, -1, 5]])
def test_group_sizes_must_be_positive(sizes):
    with pytest.raises(ValueError, match=r"must all be positive.*group 1 has size"):
        normalize(torch.ones(8), sizes, NormSpec("group", "group"))


def test_group_sizes_none_with_group_level_asks_for_actual_sizes():
    with pytest.raises(ValueError, match=r"std_level='group'.*pass the actual group sizes"):
        normalize(torch.ones(8), None, NormSpec("batch", "group"))


def test_group_sizes_none_is_fine_without_group_level():
    out = normalize(t(1.0, 3.0), None, NormSpec("batch", None))
    assert_exact(out, [-1.0, 1.0])


def test_group_sizes_as_tensor():
    out = normalize(t(1.0, 3.0, 10.0), torch.tensor([2, 1]), NormSpec("group", None))
    assert_exact(out, [-1.0, 1.0, 0.0])


def test_group_sizes_must_be_integers():
    with pytest.raises(ValueError, match="must be integers"):
        normalize(t(1.0, 3.0), [1.5, 0.5], NormSpec("group", None))


# ---------------------------------------------------------------------------------------------------
# batch statistics across DP ranks


class FakeDP:
    """In-process all-reduce for ``world`` threads; a rank that calls it a different number of times breaks it."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=10)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.calls = [0] * world
        self.shapes: list[list[tuple[int, ...]]] = [[] for _ in range(world)]

    def reduce_for(self, rank: int):
        def reduce(partial: torch.Tensor) -> torch.Tensor:
            assert partial.dtype == torch.float64
            self.calls[rank] += 1
            self.shapes[rank].append(tuple(partial.shape))
            self.slots[rank] = partial.clone()
            self.barrier.wait()
            total = torch.stack(self.slots).sum(0)
            self.barrier.wait()
            return total

        return reduce


def run_ranks(shards, spec):
    dp = FakeDP(len(shards))
    outputs: list[torch.Tensor | None] = [None] * len(shards)
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        values, sizes, mask = shards[rank]
        try:
            outputs[rank] = normalize(values, sizes, spec, mask, batch_reduce=dp.reduce_for(rank))
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)
            dp.barrier.abort()

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(len(shards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return outputs, dp


@pytest.mark.parametrize(
    ("spec", "expected_calls"),
    [
        (NormSpec("batch", "batch"), 3),
        (NormSpec("batch", "batch", leave_one_out=True, unbiased=False), 3),
        (NormSpec("batch", None), 2),
        (NormSpec("group", "batch"), 1),
        (NormSpec(None, "batch"), 1),
        (NormSpec("batch", "group"), 2),
        (NormSpec("group", "group"), 0),
    ],
    ids=str,
)
def test_batch_reduce_spans_ranks_like_the_concatenated_batch(spec, expected_calls):
    a_values = t(1.0, 4.0, 2.0, 8.0, 3.0)
    b_values = t(10.0, -2.0, 0.5)
    shards = [(a_values, [2, 3], None), (b_values, [1, 2], None)]
    outputs, dp = run_ranks(shards, spec)
    assert dp.calls == [expected_calls, expected_calls]
    assert dp.shapes[0] == dp.shapes[1]
    whole = normalize(torch.cat([a_values, b_values]), [2, 3, 1, 2], spec)
    assert torch.cat(outputs).tolist() == pytest.approx(whole.tolist(), rel=1e-6, abs=1e-7)
    if spec.mean_level == "batch" or spec.std_level == "batch":
        alone = normalize(a_values, [2, 3], spec)
        assert alone.tolist() != pytest.approx(outputs[0].tolist(), rel=1e-6), "the reduce must be used"


def test_batch_reduce_with_an_empty_shard_and_masked_tokens():
    values, mask = masked_tokens()
    empty = (torch.zeros(0, 3), [], torch.zeros(0, 3, dtype=torch.bool))
    spec = NormSpec("batch", "batch")
    outputs, dp = run_ranks([(values, [2, 2], mask), empty], spec)
    assert dp.calls == [3, 3]
    assert outputs[1].shape == (0, 3)
    # valid entries 1, 2, 3, 4, 6, 8: mean 4, centered -3, -2, -1, 0, 2, 4, unbiased std sqrt(34 / 5)
    std = math.sqrt(34 / 5) + EPS
    expected = [-3 / std, -2 / std, 0.0, -1 / std, 0.0, 0.0, 0.0, 2 / std, 4 / std, 0.0, 0.0, 0.0]
    assert outputs[0].flatten().tolist() == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(outputs[0], normalize(values, [2, 2], spec, mask))


def test_batch_reduce_zero_variance_across_ranks_is_exact_zero():
    spec = NormSpec("batch", "batch", eps=0.0)
    shards = [(torch.full((n,), 0.1, dtype=torch.float64), None, None) for n in (3, 4)]
    outputs, _ = run_ranks(shards, spec)
    assert torch.cat(outputs).tolist() == [0.0] * 7


def test_batch_reduce_must_return_same_shape():
    with pytest.raises(ValueError, match="batch_reduce must return a tensor of the shape"):
        normalize(t(1.0, 2.0), None, NormSpec("batch", None), batch_reduce=lambda x: x.sum())


# ---------------------------------------------------------------------------------------------------
# token-weighted policy loss


def test_loss_is_token_weighted_not_group_averaged():
    advantages = t([1.0], [1.0], [3.0], [3.0], [3.0])  # groups [1, 1 | 3, 3, 3], one token per row
    zeros = torch.zeros(5, 1)
    loss = token_weighted_policy_loss(zeros, zeros, advantages, torch.ones(5, 1, dtype=torch.bool))
    assert loss.item() == pytest.approx(-2.2, rel=1e-6)
    per_group_mean = -(1.0 + 3.0) / 2
    assert loss.item() != pytest.approx(per_group_mean)


def test_loss_divides_by_global_tokens_across_shards():
    advantages = t([1.0, 2.0], [1.0, 0.0], [3.0, 3.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=torch.bool)
    logprobs = torch.tensor([[-1.0, -0.5], [-2.0, -9.0], [-0.3, -0.2]])
    old = logprobs - 0.05
    whole = token_weighted_policy_loss(logprobs, old, advantages, mask)
    total = int(mask.sum())
    shards = [slice(0, 1), slice(1, 3)]
    parts = [
        token_weighted_policy_loss(logprobs[s], old[s], advantages[s], mask[s], total_loss_tokens=total) for s in shards
    ]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-6)
    local_mean = [token_weighted_policy_loss(logprobs[s], old[s], advantages[s], mask[s]).item() for s in shards]
    assert sum(local_mean) / 2 != pytest.approx(whole.item(), rel=1e-3)


@pytest.mark.parametrize(
    ("advantage", "ratio", "expected", "has_gradient"),
    [
        (1.0, 1.5, -1.2, False),  # positive advantage, ratio above 1 + eps: clipped
        (1.0, 0.5, -0.5, True),  # positive advantage, ratio below 1 - eps: not clipped (pessimistic)
        (-1.0, 0.5, 0.8, False),  # negative advantage, ratio below 1 - eps: clipped
        (-1.0, 1.5, 1.5, True),  # negative advantage, ratio above 1 + eps: not clipped (pessimistic)
        (2.0, 1.1, -2.2, True),  # inside the trust region
    ],
)
def test_clipping(advantage, ratio, expected, has_gradient):
    old = torch.tensor([[-1.0]])
    logprobs = (old + math.log(ratio)).requires_grad_()
    loss = token_weighted_policy_loss(logprobs, old, torch.tensor([[advantage]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert (logprobs.grad.abs().item() > 0) is has_gradient


def test_clip_eps_changes_the_clip_range():
    old = torch.tensor([[0.0]])
    logprobs = old + math.log(1.5)
    loss = token_weighted_policy_loss(logprobs, old, torch.tensor([[1.0]]), torch.ones(1, 1), clip_eps=0.4)
    assert loss.item() == pytest.approx(-1.4, rel=1e-5)


def test_loss_ignores_masked_padding_including_infinite_logprobs():
    logprobs = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    old = torch.tensor([[-1.0, float("-inf")]])
    advantages = torch.tensor([[2.0, float("nan")]])
    loss = token_weighted_policy_loss(logprobs, old, advantages, torch.tensor([[1, 0]]), total_loss_tokens=4)
    assert loss.item() == pytest.approx(-0.5)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 1].item() == 0.0


def test_loss_shape_mismatch():
    with pytest.raises(ValueError, match="must have one shape"):
        token_weighted_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))


@pytest.mark.parametrize("total", [0, -3, torch.tensor(0.0)])
def test_loss_total_tokens_must_be_positive(total):
    with pytest.raises(ValueError, match="total_loss_tokens must be > 0.*all DP ranks"):
        token_weighted_policy_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), total_loss_tokens=total
        )


def test_loss_without_valid_tokens_asks_for_global_count():
    with pytest.raises(ValueError, match="pass total_loss_tokens"):
        token_weighted_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2))


def test_loss_of_empty_shard_with_global_count_is_zero():
    empty = torch.zeros(0, 4)
    loss = token_weighted_policy_loss(empty, empty, empty, empty.bool(), total_loss_tokens=10)
    assert loss.item() == 0.0


# ---------------------------------------------------------------------------------------------------
# group metrics


def test_group_metrics_on_3_2_3():
    metrics = group_metrics([3, 2, 3], [30, 10, 50])
    assert metrics == {
        "usable_group_size/avg": pytest.approx(8 / 3),
        "usable_group_size/min": 2.0,
        "usable_group_size/max": 3.0,
        "group_loss_weight/avg": 30.0,
        "group_loss_weight/min": 10.0,
        "group_loss_weight/max": 50.0,
        "n_groups_size_2": 1.0,
        "n_groups_size_3": 2.0,
        "group_loss_weight_size_2": 10.0,
        "group_loss_weight_size_3": 40.0,
    }
    assert all(type(value) is float for value in metrics.values())


def test_group_metrics_accept_tensors():
    metrics = group_metrics(torch.tensor([4, 4]), torch.tensor([7, 9]))
    assert metrics["n_groups_size_4"] == 2.0
    assert metrics["group_loss_weight_size_4"] == 8.0
    assert "n_groups_size_3" not in metrics


def test_group_metrics_empty_is_an_error():
    with pytest.raises(ValueError, match="at least one group"):
        group_metrics([], [])


def test_group_metrics_length_mismatch():
    with pytest.raises(ValueError, match="one valid-token count per group"):
        group_metrics([3, 2], [10])


def test_group_metrics_rejects_nonpositive_sizes():
    with pytest.raises(ValueError, match="positive integers"):
        group_metrics([3, 0], [10, 0])
