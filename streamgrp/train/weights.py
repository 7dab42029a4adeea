"""Policy weights by version through Redis: trainers publish, rollout workers pick them up.

For small models (the demo's, tests'): a state dict is one orjson header (names, dtypes, shapes)
beside the tensors' raw little-endian bytes, under one key per version; the last few versions are
kept. Large models belong on a weight-transfer path of their own; this module is not that. No pickle.

A version names one weight state, in Redis and on disk: publishing the same state again under a
version is a no-op (a restarted trainer may), publishing a different one raises `WeightsConflict`,
since samples already drawn from the first would be attributed to the second.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import orjson
import redis
import torch

from streamgrp.errors import ConfigError, WeightsConflict
from streamgrp.store.keys import RunKeys
from streamgrp.train import dtypes

KEEP_VERSIONS = 4
#: The file in a version directory that says which weight state the directory holds.
STATE_FILE = "state.json"


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
    header = orjson.loads(payload[4 : 4 + size])
    body = payload[4 + size :]
    state = {}
    for name, dtype, shape, offset, length in header:
        raw = bytearray(body[offset : offset + length])
        tensor = torch.frombuffer(raw, dtype=dtypes.TORCH[dtype]) if raw else torch.zeros(0, dtype=dtypes.TORCH[dtype])
        state[name] = tensor.reshape(shape)
    return state


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of a state dict's names, dtypes, shapes and bytes: equal exactly when the weights are."""
    digest = hashlib.sha256()
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(orjson.dumps([name, str(tensor.dtype), list(tensor.shape)]))
        if tensor.numel():
            # .data: the array's bytes as a memoryview (numpy declares its buffer protocol only from Python 3.12)
            digest.update(
                tensor.view(-1).view(torch.uint8).numpy().data
                if tensor.dtype != torch.bool
                else tensor.to(torch.uint8).numpy().data
            )
    return digest.hexdigest()


def publish(client: redis.Redis, keys: RunKeys, version: int, state: dict[str, torch.Tensor]) -> bool:
    """Store ``state`` as ``version`` and make it the latest; drop versions older than the last few. Returns
    False when nothing was written: ``version`` already holds exactly this state, or it is older than the
    latest and no longer kept. Raises `WeightsConflict` when it holds another state."""
    payload = encode_state(state)
    latest = client.get(latest_key(keys))
    if latest is not None and version < int(latest):
        # A trainer that resumed from a checkpoint trains steps again: the same state is a no-op; one whose
        # version was already dropped (older than the last few) is not written either, since it would never
        # be served again.
        existing = client.get(weights_key(keys, version))
        if existing is None or existing == payload:
            return False
        raise WeightsConflict(
            f"weights version {version} already names another weight state (the latest published "
            f"is {int(latest)}); a version is one state: publish these weights under a new version"
        )
    # SET NX GET: written only if the version is new, and the existing state returned if not, in one command.
    held = client.set(weights_key(keys, version), payload, nx=True, get=True)
    if held is not None:
        if held == payload:
            return False
        raise WeightsConflict(
            f"weights version {version} already names another weight state; a version is one "
            "state (samples drawn from it say so): publish these weights under the next version"
        )
    pipe = client.pipeline(transaction=True)
    pipe.set(latest_key(keys), version)
    if version >= KEEP_VERSIONS:
        pipe.delete(weights_key(keys, version - KEEP_VERSIONS))
    pipe.execute()
    return True


def reserve_versions(client: redis.Redis, keys: RunKeys, version: int) -> bool:
    """Record that weights up to ``version`` were written outside Redis (a version directory on disk that
    inference servers may have served): the run's newest-published mark rises to it, so a trainer group's
    next attempt publishes above it (`streamgrp.train.attempt`) and never reuses a version a lost attempt
    wrote. Returns whether the mark rose."""
    latest = client.get(latest_key(keys))
    if latest is not None and int(latest) >= version:
        return False
    client.set(latest_key(keys), version)
    return True


def newest_version_on_disk(root: str | os.PathLike[str]) -> int | None:
    """The highest version ``root`` holds a directory of (`version_dir`), None when it holds none."""
    found = [int(path.name[1:]) for path in Path(root).glob("v[0-9][0-9][0-9][0-9][0-9][0-9]") if path.is_dir()]
    return max(found, default=None)


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
            raise RuntimeError(
                "STREAMGRP_REDIS_URL and STREAMGRP_RUN are unset; run this rollout under `streamgrp worker`"
            )
        from streamgrp.config import ConnectionConfig, load
        from streamgrp.store.connection import connect

        connection = load(ConnectionConfig)
        # A client that rides out outages like the worker's own, so a restarting server does not
        # turn weight loads into failed slots.
        return cls(
            connect(
                url,
                check_settings=False,
                password=connection.secret(),
                tls=connection.tls(),
                cluster=connection.cluster,
            ),
            RunKeys(run),
        )

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
            if isinstance(payload, str):
                raise ConfigError(
                    "weights read back as text: this client decodes responses; give WeightCache "
                    "a client that does not (decode_responses=False, as streamgrp's connect makes)"
                )
            if payload is not None:
                self.version, self.state = candidate, decode_state(payload)
                return self.version, self.state
        return None


# -- weights on disk: one directory per version, safetensors (for inference servers) --------------------------


def version_dir(root: str | os.PathLike[str], version: int) -> Path:
    """``root/v000012``: where version 12's weights live (`streamgrp weight-sync` looks there)."""
    return Path(root) / f"v{version:06d}"


def save_version(
    root: str | os.PathLike[str],
    version: int,
    state: dict[str, torch.Tensor],
    *,
    metadata: dict[str, str] | None = None,
    extra_files: dict[str, bytes] | None = None,
    writers: Mapping[str, Callable[[Path], None]] | None = None,
    safetensors: bool = True,
) -> Path:
    """Write ``state`` as ``root/vNNNNNN/model.safetensors`` (no pickle), atomically: the directory appears
    complete or not at all, so a server told to load it never reads half a file. Returns the directory.

    ``writers`` add files in other formats (name -> function writing that path, e.g. a GGUF for llama.cpp);
    ``safetensors=False`` leaves the safetensors file out. ``state.json`` records the state's digest: saving
    the same state again returns the directory untouched, saving another raises `WeightsConflict`."""
    final = version_dir(root, version)
    digest = state_digest(state)
    if final.exists():
        if saved_digest(final) == digest:
            return final
        raise WeightsConflict(
            f"{final} already holds another weight state (or one of unknown digest); a version "
            "is one state: save these weights under the next version"
        )
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    if safetensors:
        write_safetensors(partial / "model.safetensors", state, metadata={"version": str(version), **(metadata or {})})
    for name, data in (extra_files or {}).items():
        (partial / name).write_bytes(data)
    for name, write in (writers or {}).items():
        write(partial / name)
    (partial / STATE_FILE).write_bytes(orjson.dumps({"version": version, "sha256": digest}))
    os.replace(partial, final)
    return final


def saved_digest(directory: str | os.PathLike[str]) -> str | None:
    """The state digest a version directory records (None: none recorded, not written by `save_version`)."""
    try:
        return orjson.loads((Path(directory) / STATE_FILE).read_bytes()).get("sha256")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return None


def prune_versions(root: str | os.PathLike[str], *, below: int) -> list[Path]:
    """Remove the version directories of ``root`` older than ``below``; returns what was removed."""
    removed = []
    for path in sorted(Path(root).glob("v[0-9][0-9][0-9][0-9][0-9][0-9]")):
        if path.is_dir() and not path.is_symlink() and int(path.name[1:]) < below:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


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
        header[name] = {
            "dtype": dtypes.SAFETENSORS_OF[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        tensors.append(tensor)
        offset += size
    head = orjson.dumps(header)
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as handle:
        handle.write(len(head).to_bytes(8, "little") + head)
        for tensor in tensors:
            if tensor.numel():
                handle.write(
                    tensor.view(-1).view(torch.uint8).numpy().tobytes()
                    if tensor.dtype != torch.bool
                    else tensor.to(torch.uint8).numpy().tobytes()
                )
        handle.flush()
        os.fsync(handle.fileno())
