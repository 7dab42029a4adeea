"""Values that cannot train are refused where a sample is built, published or read (SPEC section 5).

Each refusal test builds a sample the way a rollout does (`Sample.from_rows`, or raw tensor bytes for
dtypes Python lists cannot make), so it fails where a sample with that value is accepted."""

from __future__ import annotations

import math
import struct

import msgspec
import pytest
from msgspec import UNSET

from streamgrp.config import RunConfig
from streamgrp.core import codec
from streamgrp.core.events import RawArray, Sample, SamplePayload
from streamgrp.core.value_checks import LOGPROB_TOLERANCE
from streamgrp.errors import DecodeError
from streamgrp.services.synthetic import make_sample


def sample(*, tokens=(5, 6, 7), mask=(0, 1, 1), logprobs=(-0.5, -1.0, -2.0), rewards=(1.0,)) -> Sample:
    return Sample.from_rows(
        token_ids=[list(tokens)], loss_mask=[list(mask)], logprobs=[list(logprobs)], rewards=list(rewards), version=0
    )


def raw_sample(**tensors: RawArray) -> Sample:
    """A one-row sample of three tokens, with the given tensors in place of the plain ones."""
    plain = sample()
    return Sample(
        **{
            "token_ids": plain.token_ids,
            "loss_mask": plain.loss_mask,
            "logprobs": plain.logprobs,
            "row_lengths": (3,),
            "rewards": (1.0,),
            "version": 0,
            **tensors,
        }
    )


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.5, 2 * LOGPROB_TOLERANCE, 3e38])
def test_a_logprob_that_is_not_finite_or_above_zero_is_refused_naming_its_position(value):
    with pytest.raises(ValueError, match=r"logprobs\[1\] is .*: log-probabilities must be finite and at most"):
        sample(logprobs=(-0.5, value, -2.0))


@pytest.mark.parametrize(
    ("dtype", "fmt", "bad"),
    [
        ("float64", "<3d", (-1.0, math.nan, 0.0)),
        ("float64", "<3d", (-1.0, -math.inf, 0.0)),
        ("float64", "<3d", (-1.0, 1e300, 0.0)),
        ("float16", "<3e", (-1.0, math.inf, 0.0)),
        ("float16", "<3e", (-1.0, 0.5, 0.0)),
    ],
)
def test_every_logprob_dtype_is_checked(dtype, fmt, bad):
    with pytest.raises(ValueError, match=r"logprobs\[1\]"):
        raw_sample(logprobs=RawArray(dtype=dtype, shape=(3,), data=struct.pack(fmt, *bad)))


def test_bfloat16_nan_and_positive_logprobs_are_refused():
    def bf16(*values: float) -> RawArray:  # the high half of each float32
        data = struct.pack(f"<{len(values)}f", *values)
        high = b"".join(data[at + 2 : at + 4] for at in range(0, len(data), 4))
        return RawArray(dtype="bfloat16", shape=(len(values),), data=high)

    raw_sample(logprobs=bf16(-1.0, -0.0, -3e38))
    for bad in (math.nan, -math.inf, 1.0):
        with pytest.raises(ValueError, match=r"logprobs\[1\]"):
            raw_sample(logprobs=bf16(-1.0, bad, 0.0))


@pytest.mark.parametrize("value", [0.0, -0.0, LOGPROB_TOLERANCE / 2, LOGPROB_TOLERANCE, -1e30, -5e-324])
def test_logprobs_at_most_the_tolerance_train(value):
    assert sample(logprobs=(-0.5, value, -2.0)).value_problem() is None


@pytest.mark.parametrize(("dtype", "fmt"), [("int32", "<3i"), ("int64", "<3q")])
def test_a_negative_token_id_is_refused(dtype, fmt):
    with pytest.raises(ValueError, match=r"token_ids\[2\] is -1: token ids are at least 0"):
        raw_sample(token_ids=RawArray(dtype=dtype, shape=(3,), data=struct.pack(fmt, 0, 2**31 - 1, -1)))


@pytest.mark.parametrize(("dtype", "fmt"), [("int32", "<3i"), ("int64", "<3q")])
def test_a_token_id_at_or_above_the_vocabulary_is_refused_when_the_vocabulary_is_known(dtype, fmt):
    def ids(*values: int) -> Sample:
        return raw_sample(token_ids=RawArray(dtype=dtype, shape=(3,), data=struct.pack(fmt, *values)))

    assert ids(0, 99, 5).value_problem(vocab_size=100) is None
    assert ids(0, 100, 5).value_problem() is None  # no vocabulary recorded: only the sign is known
    problem = ids(0, 100, 5).value_problem(vocab_size=100)
    assert problem is not None and problem.startswith("token_ids[1] is 100, not below the run's vocab_size 100")
    assert ids(0, 5, 2**31 - 1).value_problem(vocab_size=100).startswith("token_ids[2]")


def test_a_loss_mask_value_other_than_0_or_1_is_refused():
    with pytest.raises(ValueError, match=r"loss_mask\[1\] is 2: a loss mask holds 0 .* or 1"):
        raw_sample(loss_mask=RawArray(dtype="uint8", shape=(3,), data=b"\x01\x02\x01"))
    with pytest.raises(ValueError, match=r"loss_mask\[0\] is 255"):
        raw_sample(loss_mask=RawArray(dtype="bool", shape=(3,), data=b"\xff\x01\x01"))


def test_a_loss_mask_that_trains_no_token_is_refused():
    with pytest.raises(ValueError, match="the loss mask is 0 everywhere"):
        sample(mask=(0, 0, 0))
    with pytest.raises(ValueError, match="the loss mask is 0 everywhere"):
        make_sample(tokens=4, prompt_tokens=4)
    assert sample(mask=(0, 0, 1)).valid_tokens == 1


def test_a_non_finite_reward_is_refused():
    # the field type refuses it too; value_problem says the same of a sample built without validation
    with pytest.raises(ValueError, match="finite"):
        sample(rewards=(math.nan,))
    unchecked = sample()
    msgspec.structs.force_setattr(unchecked, "rewards", (math.inf,))  # built without its checks
    assert unchecked.value_problem() == "rewards[0] is inf: rewards must be finite; check the reward function"


def test_a_payload_with_an_untrainable_value_does_not_decode_and_says_which():
    fields = codec.encode(SamplePayload(task_id="t", slot=0, sample=sample()))
    blob = fields[codec.BLOB]
    nan = blob[:-4] + struct.pack("<f", math.nan)  # the last logprob
    with pytest.raises(DecodeError, match=r"logprobs\[2\] is nan") as refused:
        codec.decode({codec.HEADER: fields[codec.HEADER], codec.BLOB: nan})
    assert refused.value.reason == "invalid_value"


# -- a payload against its slot result (what the assembler asks of every sample) --------------------------


def published(value: Sample, *, task_id: str = "t", slot: int = 1):
    result, payload = codec.sample_result(task_id, slot, value, producer="w", seq=3)
    return result, payload


def forged(blob_edit):
    """A payload whose bytes were written by hand (a foreign writer), with a slot result whose digest matches."""
    result, payload = published(sample())
    fields = {codec.HEADER: payload[codec.HEADER], codec.BLOB: blob_edit(payload[codec.BLOB])}
    summary = result.sample.replace(digest=codec.entry_digest(fields))
    return result.replace(sample=summary), fields


def test_a_payload_as_the_worker_writes_it_can_train():
    assert codec.payload_problem(*reversed(published(sample()))) is None
    assert codec.payload_problem(*reversed(published(sample())), vocab_size=8) is None


def test_a_foreign_payload_with_a_nan_logprob_is_refused():
    result, fields = forged(blob_edit=lambda blob: blob[:-4] + struct.pack("<f", math.nan))
    problem = codec.payload_problem(fields, result)
    assert problem is not None and "does not decode (invalid_value)" in problem and "logprobs[2] is nan" in problem


def test_a_foreign_payload_with_a_token_id_beyond_the_vocabulary_is_refused():
    result, fields = forged(blob_edit=lambda blob: struct.pack("<i", 1_000_000) + blob[4:])
    assert codec.payload_problem(fields, result) is None
    assert codec.payload_problem(fields, result, vocab_size=1000).startswith(
        "token_ids[0] is 1000000, not below the run's vocab_size 1000"
    )


def test_a_payload_that_disagrees_with_its_slot_result_is_refused():
    result, payload = published(sample())
    more_tokens = result.replace(sample=result.sample.replace(tokens=10**12))
    assert "says rows, tokens, version [1, 1000000000000, 0] but its payload holds [1, 2, 0]" in codec.payload_problem(
        payload, more_tokens
    )
    other_reward = result.replace(sample=result.sample.replace(reward=5.0))
    assert "reward 5.0" in codec.payload_problem(payload, other_reward)
    other_digest = result.replace(sample=result.sample.replace(digest="sha256:00"))
    assert (
        codec.payload_problem(payload, other_digest)
        == "its payload does not hash to the digest its slot result recorded"
    )
    other_slot = result.replace(slot=2)
    assert codec.payload_problem(payload, other_slot).startswith("the payloads entry at its id is slot 1 of task")
    assert codec.payload_problem(None, result).startswith("its payload entry is not in the payloads stream")
    assert codec.payload_problem(codec.encode(result), result).startswith(
        "the payloads entry at its id is a slot_result event"
    )


def test_a_slot_result_that_misstates_its_token_versions_is_refused():
    # the batch fold reads a summary's token versions under --staleness mask: a publisher that claims fresher
    # tokens than its payload holds would have a group kept that trains nothing
    spanning = sample().replace(meta={"token_versions": [[0, 1], [2, 1]]})
    result, payload = published(spanning)
    assert result.sample.newest == 2 and codec.payload_problem(payload, result) is None
    fresher = result.replace(sample=result.sample.replace(whole_version=2, fresh_tokens=((0, 2), (2, 2))))
    assert "says token versions {'newest': 2, 'whole_version': 2" in codec.payload_problem(payload, fresher)
    plain_result, _ = published(sample())
    unclaimed = plain_result.replace(
        sample=result.sample.replace(newest=UNSET, whole_version=UNSET, fresh_tokens=UNSET)
    )
    assert "says token versions {'newest': None" in codec.payload_problem(payload, unclaimed)


# -- the run's vocabulary ---------------------------------------------------------------------------------


def test_a_run_without_a_vocabulary_records_what_runs_recorded_before():
    assert "vocab_size" not in RunConfig().model_dump(mode="json")
    assert RunConfig(vocab_size=151_936).model_dump(mode="json")["vocab_size"] == 151_936
    before = RunConfig().model_dump(mode="json")  # an old run's settings: no such key
    assert RunConfig(**before).vocab_size is None


@pytest.mark.parametrize("value", [0, -5, 2**31])
def test_a_vocabulary_size_out_of_range_is_refused(value):
    assert RunConfig(vocab_size=2**31 - 1).vocab_size == 2**31 - 1
    with pytest.raises(ValueError, match=r"vocab_size\s+Input should be (greater|less) than or equal to"):
        RunConfig(vocab_size=value)
