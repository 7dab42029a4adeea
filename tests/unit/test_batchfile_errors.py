"""Batch files that are not valid: each malformation raises `BatchFileError` naming the file and the problem,
and no byte flip or truncation of a valid file raises anything but a `StreamgrpError`. No server."""

from __future__ import annotations

import random
import struct

import orjson
import pytest
import torch

from streamgrp.errors import StreamgrpError
from streamgrp.train.batch import Batch
from streamgrp.train.batchfile import BatchFileError, load_batch, save_batch

MISSING = object()  # a metadata key left out


def _batch() -> Batch:
    """A small batch of two rows by four tokens, built directly (no fold, no server)."""
    return Batch(
        step=3,
        rank=1,
        world_size=2,
        version=5,
        task_ids=["t0", "t1"],
        token_ids=torch.arange(8, dtype=torch.int64).reshape(2, 4),
        loss_mask=torch.tensor([[False, True, True, False], [False, True, False, False]]),
        logprobs=torch.linspace(-2.0, -0.5, 8, dtype=torch.float32).reshape(2, 4),
        attention_mask=torch.tensor([[True, True, True, False], [True, True, False, False]]),
        rewards=torch.tensor([1.0, 0.0]),
        versions=torch.tensor([5, 4], dtype=torch.int64),
        group_sizes=torch.tensor([1, 1], dtype=torch.int64),
        step_loss_tokens=3,
        digest="ab" * 16,
        run="r1",
    )


@pytest.fixture
def saved(tmp_path):
    return save_batch(_batch(), tmp_path / "b.safetensors")


def _parts(path) -> tuple[dict, dict, bytes]:
    """A saved file's header (without metadata), its streamgrp identity, and its tensor bytes."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = orjson.loads(raw[8 : 8 + size])
    meta = orjson.loads(header.pop("__metadata__")["streamgrp"])
    return header, meta, raw[8 + size :]


def _write_header(path, header_bytes: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)


def _rewrite(path, *, header=None, meta=None, metadata=None) -> None:
    """Rewrite ``path`` with a changed tensor header, identity, or whole ``__metadata__`` (None: as saved)."""
    saved_header, saved_meta, data = _parts(path)
    header = saved_header if header is None else header
    meta = saved_meta if meta is None else meta
    if metadata is None:
        metadata = {"format": "streamgrp.batch/1", "streamgrp": orjson.dumps(meta).decode()}
    _write_header(path, orjson.dumps({**header, "__metadata__": metadata}), data)


def _refused(path, *phrases: str) -> None:
    with pytest.raises(BatchFileError) as info:
        load_batch(path)
    message = str(info.value)
    assert str(path) in message and "is not a streamgrp batch file" in message, message
    for phrase in phrases:
        assert phrase in message, message


def test_a_valid_file_loads_and_the_error_is_a_streamgrp_error(saved):
    loaded = load_batch(saved)
    assert (loaded.step, loaded.rank, loaded.world_size, loaded.task_ids, loaded.run) == (3, 1, 2, ["t0", "t1"], "r1")
    assert loaded.logprobs.equal(_batch().logprobs)
    assert issubclass(BatchFileError, StreamgrpError)


# -- the file and its header ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, phrase",
    [
        pytest.param(b"", "only 0 bytes", id="empty"),
        pytest.param(b"\x01\x02\x03", "only 3 bytes", id="shorter-than-the-length"),
        pytest.param(struct.pack("<Q", 10**6) + b"{}", "header length 1000000 does not fit", id="length-past-the-end"),
        pytest.param(struct.pack("<Q", 2**64 - 1) + b"{}", "does not fit", id="length-u64-max"),
        pytest.param(struct.pack("<Q", 4) + b"{no}", "the header is not JSON", id="not-json"),
        pytest.param(struct.pack("<Q", 4) + b"\xff\xfe{}", "the header is not JSON", id="not-utf8"),
        pytest.param(struct.pack("<Q", 2) + b"[]", "the header is a JSON list, not an object", id="a-list"),
        pytest.param(struct.pack("<Q", 7) + b'"a str"', "the header is a JSON str", id="a-string"),
        pytest.param(struct.pack("<Q", 2) + b"17", "the header is a JSON int", id="a-number"),
        pytest.param(
            struct.pack("<Q", 4000) + b"[" * 2000 + b"]" * 2000, "the header is not JSON", id="nested-too-deep"
        ),
        pytest.param(struct.pack("<Q", 2) + b"{}", "__metadata__ is missing", id="no-metadata"),
    ],
)
def test_a_file_that_is_no_batch_header_is_refused(tmp_path, content, phrase):
    path = tmp_path / "not-a-batch"
    path.write_bytes(content)
    _refused(path, phrase)


# -- the metadata -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata, phrase",
    [
        ([1, 2], "__metadata__ is missing or not an object"),
        ("streamgrp", "__metadata__ is missing or not an object"),
        ({"format": "streamgrp.batch/0", "streamgrp": "{}"}, "format 'streamgrp.batch/0'"),
        ({"format": ["streamgrp.batch/1"], "streamgrp": "{}"}, "format ['streamgrp.batch/1']"),
        ({"format": "streamgrp.batch/1"}, "no streamgrp string"),
        ({"format": "streamgrp.batch/1", "streamgrp": {"step": 3}}, "no streamgrp string"),
        ({"format": "streamgrp.batch/1", "streamgrp": "{step: 3"}, "streamgrp is not JSON"),
        ({"format": "streamgrp.batch/1", "streamgrp": "[3, 1, 2]"}, "streamgrp is a JSON list, not an object"),
    ],
)
def test_metadata_that_is_not_a_streamgrp_identity_is_refused(saved, metadata, phrase):
    _rewrite(saved, metadata=metadata)
    _refused(saved, phrase)


@pytest.mark.parametrize(
    "change, phrase",
    [
        ({"step": MISSING}, "metadata step is None, expected an int >= 0"),
        ({"step": -1}, "metadata step is -1"),
        ({"step": "3"}, "metadata step is '3'"),
        ({"step": 3.0}, "metadata step is 3.0"),
        ({"rank": True}, "metadata rank is True"),
        ({"world_size": 0}, "metadata world_size is 0, expected an int >= 1"),
        ({"rank": 2}, "metadata rank 2 is not below world_size 2"),
        ({"version": [5]}, "metadata version is [5], expected int"),
        ({"step_loss_tokens": {}}, "metadata step_loss_tokens"),
        ({"digest": 12}, "metadata digest is 12, expected str"),
        ({"run": None}, "metadata run is None, expected str"),
        ({"task_ids": "t0,t1"}, "metadata task_ids is 't0,t1', expected list"),
        ({"task_ids": ["t0", 1]}, "task_ids holds a value that is not a string"),
    ],
)
def test_an_identity_with_a_missing_or_wrong_value_is_refused(saved, change, phrase):
    _, meta, _ = _parts(saved)
    meta.update(change)
    _rewrite(saved, meta={key: value for key, value in meta.items() if value is not MISSING})
    _refused(saved, phrase)


def test_an_identity_without_a_run_still_loads(saved):
    _, meta, _ = _parts(saved)
    del meta["run"]  # files written before the run was recorded
    _rewrite(saved, meta=meta)
    assert load_batch(saved).run == ""


# -- the tensors ------------------------------------------------------------------------------------


def _set(spec_change):
    def change(header):
        if spec_change is None:
            del header["rewards"]
        elif callable(spec_change):
            header["rewards"] = spec_change(header["rewards"])
        else:
            header["rewards"] = {**header["rewards"], **spec_change}
        return header

    return change


@pytest.mark.parametrize(
    "change, phrase",
    [
        (_set(None), "tensor rewards is missing, or its entry is not an object"),
        (_set(lambda spec: [spec["dtype"], spec["shape"], spec["data_offsets"]]), "tensor rewards is missing, or its"),
        (_set(lambda spec: "F32"), "its entry is not an object"),
        (_set({"dtype": "F128"}), "tensor rewards has dtype 'F128', not one of"),
        (_set({"dtype": ["F32"]}), "tensor rewards has dtype ['F32']"),
        (_set({"shape": "2"}), "tensor rewards has shape '2', not a list of sizes"),
        (_set({"shape": [-2]}), "tensor rewards has shape [-2]"),
        (_set({"shape": ["2"]}), "tensor rewards has shape ['2']"),
        (_set({"shape": [True, 2]}), "tensor rewards has shape [True, 2]"),
        (_set({"shape": [0, 2**64 - 1]}), "not a list of sizes"),  # an empty tensor whose size overflows int64
        (_set({"shape": [2, 2]}), "tensor rewards [2, 2] does not match its byte range"),
        (_set({"data_offsets": None}), "tensor rewards has data_offsets None"),
        (_set({"data_offsets": [0]}), "tensor rewards has data_offsets [0], not [start, end] within"),
        (_set({"data_offsets": [0, 8, 16]}), "not [start, end]"),
        (_set({"data_offsets": ["0", "8"]}), "not [start, end]"),
        (_set({"data_offsets": [-8, 0]}), "not [start, end]"),
        (_set({"data_offsets": [2**40, 2**40 + 8]}), "not [start, end] within the"),
        (_set(lambda spec: {**spec, "data_offsets": spec["data_offsets"][::-1]}), "does not match its byte range"),
    ],
)
def test_a_tensor_entry_that_does_not_describe_its_bytes_is_refused(saved, change, phrase):
    header, _, _ = _parts(saved)
    _rewrite(saved, header=change(header))
    _refused(saved, phrase)


def test_tensor_bytes_cut_short_are_refused(saved):
    saved.write_bytes(saved.read_bytes()[:-4])  # the last tensor's range now runs past the data
    _refused(saved, "not [start, end] within")


# -- anything a damaged copy can hold ---------------------------------------------------------------


def test_no_byte_flip_or_truncation_of_a_valid_file_raises_anything_but_a_streamgrp_error(saved):
    raw = saved.read_bytes()
    rng = random.Random(8)
    outcomes = {"loaded": 0, "refused": 0}
    for attempt in range(3000):
        damaged = bytearray(raw)
        if attempt % 4 == 0:
            del damaged[rng.randrange(len(raw)) :]
        else:
            damaged[rng.randrange(len(raw))] ^= rng.randrange(1, 256)
        saved.write_bytes(bytes(damaged))
        try:
            load_batch(saved)
        except StreamgrpError as exc:
            assert str(saved) in str(exc)
            outcomes["refused"] += 1
        else:
            outcomes["loaded"] += 1  # a flip inside tensor bytes, or padding a JSON parser skips
    assert outcomes["loaded"] > 100 and outcomes["refused"] > 1000, outcomes
