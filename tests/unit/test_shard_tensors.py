"""A shard's padded tensors, against a row-by-row reference: ragged rows, samples of several rows,
no padding at all, and samples whose fields come in different dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamgrp.train.shard_tensors import SampleRows, shard_tensors

_NUMPY = {
    "int32": np.int32,
    "int64": np.int64,
    "bool": np.uint8,
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
}


def sample(
    rng, row_lengths, *, tokens="int32", logprobs="float32", version=0, mask_bytes=False
) -> tuple[SampleRows, dict]:
    total = sum(row_lengths)
    arrays = {
        "token_ids": rng.integers(1, 32_000, total).astype(_NUMPY[tokens]),
        "loss_mask": rng.integers(0, 2, total).astype(np.uint8),
        "logprobs": -rng.random(total).astype(np.float32),
    }
    dtypes = {"token_ids": tokens, "loss_mask": "bool", "logprobs": logprobs}
    if logprobs == "bfloat16":  # numpy has none: the bytes are torch's, the reference its float32 values
        wide = torch.from_numpy(arrays["logprobs"]).to(torch.bfloat16)
        raw = wide.view(torch.int16).numpy().tobytes()
        arrays["logprobs"] = wide.to(torch.float32).numpy()
    else:
        arrays["logprobs"] = arrays["logprobs"].astype(_NUMPY[logprobs])
    data = {name: (memoryview(array.tobytes()), dtypes[name]) for name, array in arrays.items()}
    if logprobs == "bfloat16":
        data["logprobs"] = (raw, "bfloat16")
    if mask_bytes:  # any nonzero byte of a mask is set, as torch's bool conversion reads it
        arrays["loss_mask"] = arrays["loss_mask"] * 2
        data["loss_mask"] = (bytearray(arrays["loss_mask"].tobytes()), "uint8")
    rewards = tuple(float(r) for r in rng.random(len(row_lengths)))
    return SampleRows(data, tuple(row_lengths), rewards, version), arrays


def reference(samples: list[tuple[SampleRows, dict]]) -> dict[str, torch.Tensor]:
    rows = [
        (arrays, start, n)
        for rows, arrays in samples
        for start, n in zip(np.cumsum((0, *rows.row_lengths[:-1])), rows.row_lengths)
    ]
    width = max(n for _, _, n in rows)
    out = {
        "token_ids": torch.zeros(len(rows), width, dtype=torch.int64),
        "loss_mask": torch.zeros(len(rows), width, dtype=torch.bool),
        "logprobs": torch.zeros(len(rows), width, dtype=torch.float32),
        "attention_mask": torch.zeros(len(rows), width, dtype=torch.bool),
    }
    for i, (arrays, start, n) in enumerate(rows):
        out["token_ids"][i, :n] = torch.from_numpy(arrays["token_ids"][start : start + n].astype(np.int64))
        out["loss_mask"][i, :n] = torch.from_numpy(arrays["loss_mask"][start : start + n] != 0)
        out["logprobs"][i, :n] = torch.from_numpy(arrays["logprobs"][start : start + n].astype(np.float32))
        out["attention_mask"][i, :n] = True
    out["rewards"] = torch.tensor([r for rows, _ in samples for r in rows.rewards], dtype=torch.float32)
    out["versions"] = torch.tensor([rows.version for rows, _ in samples for _ in rows.row_lengths])
    out["version_spans"] = torch.zeros(len(rows), dtype=torch.int64)
    return out


CASES = {
    "ragged single rows": [{"row_lengths": [n]} for n in (5, 17, 1, 9)],
    "samples of several rows": [{"row_lengths": [3, 8]}, {"row_lengths": [8]}, {"row_lengths": [1, 2, 6]}],
    "no padding": [{"row_lengths": [6]}] * 3 + [{"row_lengths": [6, 6]}],
    "mixed dtypes": [
        {"row_lengths": [4], "tokens": "int64", "logprobs": "float16"},
        {"row_lengths": [7, 2]},
        {"row_lengths": [5], "tokens": "int64"},
    ],
    "bfloat16 and float64 logprobs, unpadded": [
        {"row_lengths": [4, 4], "logprobs": "bfloat16"},
        {"row_lengths": [4], "logprobs": "float64"},
        {"row_lengths": [4]},
    ],
    "bfloat16, padded": [{"row_lengths": [3, 5], "logprobs": "bfloat16"}, {"row_lengths": [2], "logprobs": "bfloat16"}],
    "mask bytes above 1": [{"row_lengths": [3, 6], "mask_bytes": True}, {"row_lengths": [6]}],
    # wide enough that only each row's padding is zeroed, after its bytes are written (shard_tensors._WIDE_ROWS)
    "wide ragged rows": [
        {"row_lengths": [5000]},
        {"row_lengths": [4097, 6000]},
        {"row_lengths": [6000]},
        {"row_lengths": [1], "tokens": "int64", "logprobs": "float16"},
    ],
}


@pytest.mark.parametrize("case", CASES)
def test_shard_tensors_match_rows_copied_one_by_one(case):
    rng = np.random.default_rng(len(case))
    samples = [sample(rng, version=i, **spec) for i, spec in enumerate(CASES[case])]
    got = shard_tensors([rows for rows, _ in samples])
    want = reference(samples)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_shard_of_no_samples_is_empty():
    got = shard_tensors([])
    assert got["token_ids"].shape == got["attention_mask"].shape == (0, 0)
    assert got["rewards"].shape == (0,)
