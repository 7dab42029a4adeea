"""Batches on disk: the tensors a rank consumed, in the safetensors layout, with the step's identity.

The layout is safetensors' (an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, padding to 8 bytes, then the raw little-endian bytes), so the
safetensors library and other tools read these files without streamgrp, and no pickle is involved.
It is written here with orjson rather than through the safetensors package, which streamgrp does not
depend on. The step's identity (run, step, rank, world size, version, shard digest, task ids, group
sizes, the step's loss tokens) is one JSON string under ``__metadata__["streamgrp"]``.
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

from streamgrp.errors import StreamgrpError
from streamgrp.trainer import Batch

__all__ = ["BATCH_FORMAT", "TENSOR_FIELDS", "load_batch", "save_batch"]

BATCH_FORMAT = "streamgrp.batch/1"
TENSOR_FIELDS = ("token_ids", "loss_mask", "logprobs", "attention_mask", "rewards", "versions", "group_sizes")
_ST_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64",
              torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}
_TORCH_OF = {name: dtype for dtype, name in _ST_DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def save_batch(batch: Batch, path: str | os.PathLike[str]) -> Path:
    """Write ``batch`` in the safetensors layout (no pickle), with its identity as metadata; returns the path.

    The metadata holds run, step, rank, world size, version, shard digest, task ids, group sizes and
    the step's loss tokens, as one JSON string under ``__metadata__["streamgrp"]``.
    """
    if sys.byteorder != "little":
        raise StreamgrpError("saving batches needs a little-endian machine")
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for name in TENSOR_FIELDS:
        tensor = getattr(batch, name).detach().cpu().clone(memory_format=torch.contiguous_format)
        if tensor.dtype not in _ST_DTYPES:
            raise StreamgrpError(f"batch tensor {name} has dtype {tensor.dtype}, which the batch format cannot hold")
        data = bytes(tensor.untyped_storage()) if tensor.numel() else b""
        header[name] = {"dtype": _ST_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    meta = {"run": batch.run, "step": batch.step, "rank": batch.rank, "world_size": batch.world_size,
            "version": batch.version, "digest": batch.digest, "task_ids": list(batch.task_ids),
            "group_sizes": [int(size) for size in batch.group_sizes.tolist()],
            "step_loss_tokens": batch.step_loss_tokens}
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
    """Read a batch written by `save_batch` (read-only: commit and fail raise `ReadOnlyBatch`)."""
    blob = Path(path).read_bytes()
    where = f"{path} is not a streamgrp batch file"
    if len(blob) < 8:
        raise StreamgrpError(f"{where}: only {len(blob)} bytes")
    (size,) = struct.unpack("<Q", blob[:8])
    if size > min(_MAX_HEADER, len(blob) - 8):
        raise StreamgrpError(f"{where}: header length {size} does not fit the file")
    try:
        header = orjson.loads(blob[8:8 + size])
        metadata = header.pop("__metadata__")
        if metadata.get("format") != BATCH_FORMAT:
            raise StreamgrpError(f"{where}: format {metadata.get('format')!r}, this build reads {BATCH_FORMAT!r}")
        meta = orjson.loads(metadata["streamgrp"])
    except (orjson.JSONDecodeError, KeyError, AttributeError, TypeError) as exc:
        raise StreamgrpError(f"{where}: bad header ({type(exc).__name__}: {exc})") from None
    data = blob[8 + size:]
    tensors = {}
    for name in TENSOR_FIELDS:
        spec = header.get(name)
        if spec is None or spec.get("dtype") not in _TORCH_OF:
            raise StreamgrpError(f"{where}: tensor {name} is missing or has an unknown dtype")
        start, end = spec["data_offsets"]
        dtype, shape = _TORCH_OF[spec["dtype"]], tuple(spec["shape"])
        if not 0 <= start <= end <= len(data) or (end - start) != math.prod(shape) * dtype.itemsize:
            raise StreamgrpError(f"{where}: tensor {name} {list(shape)} does not match its byte range [{start}, {end})")
        if end == start:
            tensors[name] = torch.zeros(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(bytearray(data[start:end]), dtype=dtype).reshape(shape)
    return Batch(step=meta["step"], rank=meta["rank"], world_size=meta["world_size"], version=meta["version"],
                 task_ids=list(meta["task_ids"]), step_loss_tokens=meta["step_loss_tokens"], digest=meta["digest"],
                 run=meta.get("run", ""), **tensors)
