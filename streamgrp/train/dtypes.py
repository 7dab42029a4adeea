"""Torch dtypes for the names of `streamgrp.core.values.DTYPES`, the one dtype table.

Event tensors, published weights and batch files all name dtypes by that table; this module only
maps its names to torch and its safetensors codes back to names.
"""

from __future__ import annotations

import torch

from streamgrp.core.values import DTYPES

#: dtype name -> torch dtype
TORCH: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
#: torch dtype -> dtype name
NAME_OF: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH.items()}
#: safetensors code -> torch dtype, and back
TORCH_OF_SAFETENSORS: dict[str, torch.dtype] = {DTYPES[name][2]: dtype for name, dtype in TORCH.items()}
SAFETENSORS_OF: dict[torch.dtype, str] = {dtype: code for code, dtype in TORCH_OF_SAFETENSORS.items()}
#: dtype name -> the numpy dtype that reads its little-endian bytes on any host. numpy has no bfloat16: its
#: values are read as their bits (``<u2``, the high half of a float32); a bool as its byte (0 or 1), compared,
#: never reinterpreted.
NUMPY: dict[str, str] = {
    "bool": "u1",
    "uint8": "u1",
    "int32": "<i4",
    "int64": "<i8",
    "float16": "<f2",
    "bfloat16": "<u2",
    "float32": "<f4",
    "float64": "<f8",
}
