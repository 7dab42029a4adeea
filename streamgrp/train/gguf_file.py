"""A GGUF file's metadata and tensors, read in milliseconds: what the LM trainer loads its policy from and
what the GGUF export copies its template from.

Owns parsing the GGUF container (llama.cpp's ``gguf.md``: a header, typed key-value pairs, tensor
descriptors, then aligned tensor data) into plain values, and handing each tensor out as float32.
gguf-py's ``GGUFReader`` makes a numpy view per value, so SmolLM2's 49,152-token vocabulary and its
merges took 4.6 s to read, twice per transformers load; this reads the same file with one `struct`
call per value (about 0.1 s). De-quantizing stays gguf-py's (`gguf.quants.dequantize`), so every
quantization type it knows is read, and read exactly as transformers reads it.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamgrp.errors import ConfigError

__all__ = ["GgufField", "GgufFile", "GgufTensor", "gguf_package"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
#: GGUF value types (``gguf.GGUFValueType``) with a fixed size: their `struct` format.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensor:
    """One tensor's descriptor: its name, its shape in numpy order (outermost first), its ggml type and
    where its bytes start, relative to the data section."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GgufField:
    """One metadata pair: the value as Python values (lists for arrays, `str` for strings), its GGUF value
    type and, for an array, its items' type (what `gguf.GGUFWriter.add_key_value` takes back)."""

    key: str
    value: Any
    vtype: int
    sub_type: int | None


class GgufFile:
    """The metadata and tensor descriptors of one GGUF file; tensors are read from disk when asked for."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as handle:
            # mapped, not read: the header is parsed from it, and tensors are views of it until de-quantized
            self._mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.fields, self.tensors, self._data_start = _Cursor(self._mapped, self.path).parse()

    def value(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.value

    def float32(self, name: str) -> np.ndarray:
        """The tensor ``name``, de-quantized to float32, in numpy order."""
        gguf = gguf_package()
        tensor = self.tensors[name]
        quant = gguf.GGMLQuantizationType(tensor.ggml_type)
        byte_shape = gguf.quants.quant_shape_to_byte_shape(tensor.shape, quant)
        start, size = self._data_start + tensor.offset, int(np.prod(byte_shape))
        if start + size > len(self._mapped):
            raise ConfigError(f"{self.path} ends inside tensor {name}: the file is truncated")
        raw = np.frombuffer(self._mapped, np.uint8, size, start).reshape(byte_shape)
        return gguf.quants.dequantize(raw, quant).astype(np.float32, copy=False).reshape(tensor.shape)


class _Cursor:
    """Reads GGUF's little-endian values front to back out of the file's first bytes."""

    def __init__(self, data: mmap.mmap, path: str) -> None:
        self.data, self.path, self.at = data, path, 0

    def parse(self) -> tuple[dict[str, GgufField], dict[str, GgufTensor], int]:
        if self.data[:4] != _MAGIC:
            raise ConfigError(f"{self.path} is not a GGUF file (it does not start with 'GGUF')")
        self.at = 4
        version, n_tensors, n_fields = self.unpack("<IQQ")
        if version not in _VERSIONS:
            raise ConfigError(f"{self.path} is GGUF version {version}; streamgrp reads versions 2 and 3")
        fields: dict[str, GgufField] = {}
        for _ in range(n_fields):
            key = self.string()
            (vtype,) = self.unpack("<I")
            if vtype == _ARRAY:
                sub_type, count = self.unpack("<IQ")
                fields[key] = GgufField(key, self.array(sub_type, count), vtype, sub_type)
            else:
                fields[key] = GgufField(key, self.scalar(vtype), vtype, None)
        tensors: dict[str, GgufTensor] = {}
        for _ in range(n_tensors):
            name = self.string()
            (n_dims,) = self.unpack("<I")
            dims = self.unpack(f"<{n_dims}Q")
            ggml_type, offset = self.unpack("<IQ")
            tensors[name] = GgufTensor(name, tuple(int(d) for d in reversed(dims)), ggml_type, offset)
        alignment = int(fields["general.alignment"].value) if "general.alignment" in fields else _DEFAULT_ALIGNMENT
        return fields, tensors, -(-self.at // alignment) * alignment

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from(fmt, self.data, self.at)
        except struct.error:
            raise ConfigError(f"{self.path} ends inside its GGUF header: the file is truncated") from None
        self.at += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        raw = self.data[self.at : self.at + length]
        if len(raw) != length:
            raise ConfigError(f"{self.path} ends inside its GGUF header: the file is truncated")
        self.at += length
        return raw.decode("utf-8")

    def scalar(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype not in _SCALARS:
            raise ConfigError(f"{self.path} holds a GGUF value of unknown type {vtype}")
        (value,) = self.unpack("<" + _SCALARS[vtype])
        return value

    def array(self, sub_type: int, count: int) -> list[Any]:
        if sub_type == _STRING:
            return [self.string() for _ in range(count)]
        if sub_type == _ARRAY:
            nested = []
            for _ in range(count):
                inner, inner_count = self.unpack("<IQ")
                nested.append(self.array(inner, inner_count))
            return nested
        if sub_type not in _SCALARS:
            raise ConfigError(f"{self.path} holds a GGUF array of unknown type {sub_type}")
        return list(self.unpack(f"<{count}{_SCALARS[sub_type]}"))


def gguf_package():
    """gguf-py (the ``llm`` extra), imported when a tensor is read or a file written."""
    try:
        import gguf
    except ImportError as exc:
        raise ConfigError(f"GGUF tensors need the gguf package ({exc}); pip install 'streamgrp[llm]'") from None
    return gguf
