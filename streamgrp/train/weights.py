"""Policy weights by version through Redis: trainers publish, rollout workers pick them up.

For small models (the demo's, tests'): a state dict is one orjson header (names, dtypes, shapes)
beside the tensors' raw little-endian bytes, under one key per version; the last few versions are
kept. Large models belong on a weight-transfer path of their own; this module is not that. No pickle.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson
import redis
import torch

from streamgrp.store.keys import RunKeys
from streamgrp.train import dtypes

KEEP_VERSIONS = 4


def weights_key(keys: RunKeys, version: int) -> str:
    return keys.weights(version)


def latest_key(keys: RunKeys) -> str:
    return keys.weights("latest")


def encode_state(state: dict[str, torch.Tensor]) -> bytes:
    header, blobs, offset = [], [], 0
    for name, tensor in state.items():
        if tensor.dtype not in dtypes.NAME_OF:
            raise ValueError(f"weight {name} has dtype {tensor.dtype}; publish one of {', '.join(dtypes.TORCH)}")
        data = bytes(tensor.detach().cpu().contiguous().clone().untyped_storage()) if tensor.numel() else b""
        header.append([name, dtypes.NAME_OF[tensor.dtype], list(tensor.shape), offset, len(data)])
        blobs.append(data)
        offset += len(data)
    head = orjson.dumps(header)
    return len(head).to_bytes(4, "little") + head + b"".join(blobs)


def decode_state(payload: bytes) -> dict[str, torch.Tensor]:
    size = int.from_bytes(payload[:4], "little")
    header = orjson.loads(payload[4:4 + size])
    body = payload[4 + size:]
    state = {}
    for name, dtype, shape, offset, length in header:
        raw = bytearray(body[offset:offset + length])
        tensor = torch.frombuffer(raw, dtype=dtypes.TORCH[dtype]) if raw else torch.zeros(0, dtype=dtypes.TORCH[dtype])
        state[name] = tensor.reshape(shape)
    return state


def publish(client: redis.Redis, keys: RunKeys, version: int, state: dict[str, torch.Tensor]) -> None:
    """Store ``state`` as ``version`` and make it the latest; drop versions older than the last few."""
    pipe = client.pipeline(transaction=True)
    pipe.set(weights_key(keys, version), encode_state(state))
    pipe.set(latest_key(keys), version)
    if version >= KEEP_VERSIONS:
        pipe.delete(weights_key(keys, version - KEEP_VERSIONS))
    pipe.execute()


class WeightCache:
    """A worker's copy of the newest published weights no newer than the version it was asked for."""

    def __init__(self, client: redis.Redis, keys: RunKeys) -> None:
        self.client = client
        self.keys = keys
        self.version: int | None = None
        self.state: dict[str, torch.Tensor] | None = None

    @classmethod
    def from_env(cls) -> WeightCache:
        """In `streamgrp worker`: on the connection the worker lends its rollout code (`streamgrp.store.lent`);
        elsewhere from ``STREAMGRP_REDIS_URL``, ``STREAMGRP_RUN`` and the connection settings' variables
        (``STREAMGRP_PASSWORD`` or ``STREAMGRP_PASSWORD_FILE``, the TLS files)."""
        from streamgrp.store.lent import borrowed

        lent = borrowed()
        if lent is not None:
            return cls(*lent)
        url, run = os.environ.get("STREAMGRP_REDIS_URL"), os.environ.get("STREAMGRP_RUN")
        if not url or not run:
            raise RuntimeError("STREAMGRP_REDIS_URL and STREAMGRP_RUN are unset; run this rollout under `streamgrp worker`")
        from streamgrp.config import ConnectionConfig, load
        from streamgrp.store.connection import connect

        connection = load(ConnectionConfig)
        # A client that rides out outages like the worker's own, so a restarting server does not
        # turn weight loads into failed slots.
        return cls(connect(url, check_settings=False, password=connection.secret(), tls=connection.tls(),
                           cluster=connection.cluster), RunKeys(run))

    def get(self, version: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(version used, state) for the newest published version <= ``version``, or None if none yet."""
        latest = self.client.get(latest_key(self.keys))
        if latest is None:
            return None
        wanted = min(version, int(latest))
        if self.version == wanted and self.state is not None:
            return self.version, self.state
        for candidate in range(wanted, max(-1, wanted - KEEP_VERSIONS), -1):
            payload = self.client.get(weights_key(self.keys, candidate))
            if payload is not None:
                self.version, self.state = candidate, decode_state(payload)
                return self.version, self.state
        return None


# -- weights on disk: one directory per version, safetensors (for inference servers) --------------------------


def version_dir(root: str | os.PathLike[str], version: int) -> Path:
    """``root/v000012``: where version 12's weights live (`streamgrp weight-sync` looks there)."""
    return Path(root) / f"v{version:06d}"


def save_version(root: str | os.PathLike[str], version: int, state: dict[str, torch.Tensor], *,
                 metadata: dict[str, str] | None = None, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write ``state`` as ``root/vNNNNNN/model.safetensors`` (no pickle), atomically: the directory appears
    complete or not at all, so a server told to load it never reads half a file. Returns the directory."""
    final = version_dir(root, version)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_safetensors(partial / "model.safetensors", state, metadata={"version": str(version), **(metadata or {})})
    for name, data in (extra_files or {}).items():
        (partial / name).write_bytes(data)
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    return final


def write_safetensors(path: Path, state: dict[str, torch.Tensor], *, metadata: dict[str, str] | None = None) -> None:
    """The safetensors layout (8-byte header length, JSON header, 8-aligned, raw little-endian bytes)."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    tensors = []
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.dtype not in dtypes.SAFETENSORS_OF:
            raise ValueError(f"weight {name} has dtype {tensor.dtype}, which safetensors cannot hold")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": dtypes.SAFETENSORS_OF[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        tensors.append(tensor)
        offset += size
    head = orjson.dumps(header)
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as handle:
        handle.write(len(head).to_bytes(8, "little") + head)
        for tensor in tensors:
            if tensor.numel():
                handle.write(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.dtype != torch.bool
                             else tensor.to(torch.uint8).numpy().tobytes())
        handle.flush()
        os.fsync(handle.fileno())
