"""Batches on disk: the tensors a rank consumed, in the safetensors layout, with the step's identity.

The layout is safetensors' (an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, padding to 8 bytes, then the raw little-endian bytes), so the
safetensors library and other tools read these files without streamgrp, and no pickle is involved.
It is written here with orjson rather than through the safetensors package, which streamgrp does not
depend on. The step's identity (run, step, rank, world size, version, shard digest, task ids, group
sizes, the step's loss tokens) is one JSON string under ``__metadata__["streamgrp"]``.

`load_batch` trusts nothing in the file: every header, metadata and tensor entry is checked for type
and range before use, and a file that is not a valid batch raises `BatchFileError` (a
`StreamgrpError`) naming the file and what is wrong, never a bare KeyError or TypeError.
"""

from __future__ import annotations

import math
import os
import struct
import sys
from pathlib import Path
from typing import Any

import orjson
import torch

from streamgrp.errors import BatchFileError, StreamgrpError
from streamgrp.train import dtypes
from streamgrp.train.batch import Batch

__all__ = ["BATCH_FORMAT", "TENSOR_FIELDS", "BatchFileError", "load_batch", "save_batch"]

BATCH_FORMAT = "streamgrp.batch/1"
TENSOR_FIELDS = ("token_ids", "loss_mask", "logprobs", "attention_mask", "rewards", "versions", "group_sizes")
#: Written when the batch has them, read when the file does (files written before they existed lack them).
OPTIONAL_FIELDS = ("token_versions", "version_spans")
_ST_DTYPES = dtypes.SAFETENSORS_OF
_TORCH_OF = dtypes.TORCH_OF_SAFETENSORS
_MAX_HEADER = 100 * 1024 * 1024
_MAX_DIM = 2**63 - 1  # torch sizes are int64


def save_batch(batch: Batch, path: str | os.PathLike[str]) -> Path:
    """Write ``batch`` in the safetensors layout (no pickle), with its identity as metadata; returns the path.

    The metadata holds run, step, rank, world size, version, shard digest, task ids, group sizes and
    the step's loss tokens, as one JSON string under ``__metadata__["streamgrp"]``.
    """
    if sys.byteorder != "little":
        raise StreamgrpError("saving batches needs a little-endian machine")
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for name in (
        *TENSOR_FIELDS,
        *(f for f in OPTIONAL_FIELDS if f == "token_versions" or getattr(batch, f) is not None),
    ):
        tensor = getattr(batch, name).detach().cpu().clone(memory_format=torch.contiguous_format)
        if tensor.dtype not in _ST_DTYPES:
            raise StreamgrpError(f"batch tensor {name} has dtype {tensor.dtype}, which the batch format cannot hold")
        data = bytes(tensor.untyped_storage()) if tensor.numel() else b""
        header[name] = {
            "dtype": _ST_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    meta = {
        "run": batch.run,
        "step": batch.step,
        "rank": batch.rank,
        "world_size": batch.world_size,
        "version": batch.version,
        "digest": batch.digest,
        "task_ids": list(batch.task_ids),
        "group_sizes": [int(size) for size in batch.group_sizes.tolist()],
        "step_loss_tokens": batch.step_loss_tokens,
        "stale_masked_tokens": batch.stale_masked_tokens,
    }
    header["__metadata__"] = {"format": BATCH_FORMAT, "streamgrp": orjson.dumps(meta).decode()}
    raw = orjson.dumps(header)
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header so tensor data starts 8-byte aligned
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        for data in blobs:
            handle.write(data)
    os.replace(partial, target)
    return target


def load_batch(path: str | os.PathLike[str]) -> Batch:
    """Read a batch written by `save_batch` (read-only: commit and fail raise `ReadOnlyBatch`).

    A file that is not one raises `BatchFileError` saying what is wrong with it.
    """
    blob = Path(path).read_bytes()
    where = f"{path} is not a streamgrp batch file"
    header, data = _split(blob, where)
    meta = _identity(header.pop("__metadata__", None), where)
    tensors: dict[str, Any] = {name: _tensor(name, header.get(name), data, where) for name in TENSOR_FIELDS}
    if "token_versions" in header:
        tensors["_token_versions"] = _tensor("token_versions", header["token_versions"], data, where)
    if "version_spans" in header:
        tensors["version_spans"] = _tensor("version_spans", header["version_spans"], data, where)
    return Batch(
        step=meta["step"],
        rank=meta["rank"],
        world_size=meta["world_size"],
        version=meta["version"],
        task_ids=meta["task_ids"],
        step_loss_tokens=meta["step_loss_tokens"],
        digest=meta["digest"],
        run=meta["run"],
        stale_masked_tokens=meta["stale_masked_tokens"],
        **tensors,
    )


def _split(blob: bytes, where: str) -> tuple[dict[str, Any], bytes]:
    """The JSON header (an object) and the tensor bytes after it."""
    if len(blob) < 8:
        raise BatchFileError(f"{where}: only {len(blob)} bytes")
    (size,) = struct.unpack("<Q", blob[:8])
    if size > min(_MAX_HEADER, len(blob) - 8):
        raise BatchFileError(f"{where}: header length {size} does not fit the file")
    try:
        header = orjson.loads(blob[8 : 8 + size])
    except orjson.JSONDecodeError as exc:
        raise BatchFileError(f"{where}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise BatchFileError(f"{where}: the header is a JSON {type(header).__name__}, not an object")
    return header, blob[8 + size :]


#: The step's identity in ``__metadata__["streamgrp"]``: key -> (type, lowest value allowed, for ints).
_IDENTITY: dict[str, tuple[type, int | None]] = {
    "step": (int, 0),
    "rank": (int, 0),
    "world_size": (int, 1),
    "version": (int, None),
    "step_loss_tokens": (int, 0),
    "digest": (str, None),
    "run": (str, None),
    "task_ids": (list, None),
}


def _identity(metadata: Any, where: str) -> dict[str, Any]:
    """The step's identity from ``__metadata__``, each value of the type `Batch` needs."""
    if not isinstance(metadata, dict):
        raise BatchFileError(f"{where}: __metadata__ is missing or not an object")
    if metadata.get("format") != BATCH_FORMAT:
        raise BatchFileError(f"{where}: format {metadata.get('format')!r:.80}, this build reads {BATCH_FORMAT!r}")
    raw = metadata.get("streamgrp")
    if not isinstance(raw, str):
        raise BatchFileError(f"{where}: __metadata__ has no streamgrp string")
    try:
        meta = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BatchFileError(f"{where}: __metadata__ streamgrp is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise BatchFileError(f"{where}: __metadata__ streamgrp is a JSON {type(meta).__name__}, not an object")
    meta.setdefault("run", "")  # files from before the run was recorded
    for key, (kind, low) in _IDENTITY.items():
        value = meta.get(key)
        too_low = low is not None and isinstance(value, int) and value < low  # low: only int fields have one
        if not isinstance(value, kind) or isinstance(value, bool) or too_low:
            wanted = kind.__name__ if low is None else f"an {kind.__name__} >= {low}"
            raise BatchFileError(f"{where}: metadata {key} is {value!r:.80}, expected {wanted}")
    if not all(isinstance(task_id, str) for task_id in meta["task_ids"]):
        raise BatchFileError(f"{where}: metadata task_ids holds a value that is not a string")
    masked = meta.setdefault("stale_masked_tokens", 0)  # files from before the staleness mask
    if not isinstance(masked, int) or isinstance(masked, bool) or masked < 0:
        raise BatchFileError(f"{where}: metadata stale_masked_tokens is {masked!r:.80}, expected an int >= 0")
    if meta["rank"] >= meta["world_size"]:
        raise BatchFileError(f"{where}: metadata rank {meta['rank']} is not below world_size {meta['world_size']}")
    return meta


def _tensor(name: str, spec: Any, data: bytes, where: str) -> torch.Tensor:
    """Tensor ``name`` from its header entry: a known dtype, a shape, and a byte range of ``data`` that fits both."""
    if not isinstance(spec, dict):
        raise BatchFileError(f"{where}: tensor {name} is missing, or its entry is not an object")
    kind, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(kind, str) or kind not in _TORCH_OF:
        raise BatchFileError(f"{where}: tensor {name} has dtype {kind!r:.80}, not one of {', '.join(_TORCH_OF)}")
    if not (isinstance(shape, list) and all(_is_size(dim, _MAX_DIM) for dim in shape)):
        raise BatchFileError(f"{where}: tensor {name} has shape {shape!r:.80}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(at, len(data)) for at in offsets)):
        raise BatchFileError(
            f"{where}: tensor {name} has data_offsets {offsets!r:.80}, not [start, end] within "
            f"the {len(data)} data bytes"
        )
    (start, end), dtype = offsets, _TORCH_OF[kind]
    if start > end or (end - start) != math.prod(shape) * dtype.itemsize:
        raise BatchFileError(f"{where}: tensor {name} {shape} does not match its byte range [{start}, {end})")
    if end == start:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data[start:end]), dtype=dtype).reshape(shape)


def _is_size(value: Any, most: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most
