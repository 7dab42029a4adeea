"""Trained torch weights as a GGUF file llama.cpp serves: what `streamgrp weight-sync --dialect llamacpp`
restarts llama-server on, so the served policy is the trained one.

Owns turning a Llama-architecture state dict (transformers' names, as `AutoModelForCausalLM` loads a
GGUF) back into the GGUF layout llama.cpp's ``convert_hf_to_gguf.py`` writes for such a model: tensor
names through gguf's own name map, the query and key projections permuted back to llama.cpp's rotary
layout (transformers un-permutes them on load), one-dimensional tensors and norms in F32, the rest
in F16 (``mostly_f16``) or F32 (``all_f32``). Everything else, architecture, hyper-parameters and the
tokenizer, is copied from the GGUF the model was first loaded from (`GgufTemplate`), so the written
file is that model with other weights, and every tensor the source has must be in the state dict
with the source's shape (a tied output embedding, absent from the source, is left out here too).

Deliberately ignores quantization (llama.cpp's ``llama-quantize`` does that; F16 serves a 135M model
fast enough on a CPU) and every other architecture: those need llama.cpp's converter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from streamgrp.errors import ConfigError
from streamgrp.train.gguf_file import GgufField, GgufFile, gguf_package

__all__ = ["GgufTemplate", "OutType", "write_gguf"]

OutType = Literal["f16", "f32"]
#: Keys the writer sets itself, or that describe the source's quantization rather than the model.
_NOT_COPIED = ("GGUF.", "general.architecture", "general.file_type", "general.quantization_version")


@dataclass(frozen=True)
class GgufTemplate:
    """The source GGUF's metadata and tensor shapes (GGUF names, numpy order), read once per trainer
    (`GgufFile`: values as gguf's writer takes them back)."""

    architecture: str
    fields: tuple[GgufField, ...]
    shapes: dict[str, tuple[int, ...]]
    n_head: int
    n_head_kv: int
    block_count: int

    @classmethod
    def read(cls, source: str | os.PathLike[str]) -> GgufTemplate:
        return cls.of(GgufFile(source))

    @classmethod
    def of(cls, source: GgufFile) -> GgufTemplate:
        architecture = source.value("general.architecture")
        if architecture != "llama":
            raise ConfigError(
                f"{source.path} is a {architecture!r} model; streamgrp writes GGUF for Llama-architecture "
                "models only (SmolLM2, Llama): convert others with llama.cpp's convert_hf_to_gguf.py"
            )
        fields = tuple(field for key, field in source.fields.items() if not key.startswith(_NOT_COPIED))
        shapes = {name: tensor.shape for name, tensor in source.tensors.items()}

        def number(name: str) -> int:
            return int(source.value(f"{architecture}.{name}"))

        return cls(
            architecture,
            fields,
            shapes,
            number("attention.head_count"),
            number("attention.head_count_kv"),
            number("block_count"),
        )

    def tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` under GGUF names, in llama.cpp's layout; raises `ConfigError` when it is not this model."""
        gguf = gguf_package()
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, self.block_count)
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a buffer transformers computes, not a weight
            mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if mapped is None:
                raise ConfigError(f"weight {name} has no GGUF name in llama.cpp's Llama layout")
            if mapped not in self.shapes:
                continue  # lm_head tied to the embedding: the source stores it once, as token_embd
            tensor = tensor.detach().to("cpu", torch.float32)
            if name.endswith("q_proj.weight"):
                tensor = _permute(tensor, self.n_head)
            elif name.endswith("k_proj.weight"):
                tensor = _permute(tensor, self.n_head_kv)
            if tuple(tensor.shape) != self.shapes[mapped]:
                raise ConfigError(
                    f"weight {name} has shape {tuple(tensor.shape)} but the source GGUF's {mapped} has "
                    f"{self.shapes[mapped]}: not the model the template was read from"
                )
            out[mapped] = tensor
        missing = sorted(set(self.shapes) - set(out))
        if missing:
            raise ConfigError(f"the state dict lacks {len(missing)} tensors the source GGUF has (first: {missing[:3]})")
        return out

    def read_state(self, path: str | os.PathLike[str] | GgufFile, names: list[str]) -> dict[str, torch.Tensor]:
        """A GGUF of this model read back as float32 tensors under transformers' ``names`` (the inverse of
        `tensors`: an F32 file gives back exactly what was written). Names with no tensor in the file (a tied
        output embedding) are left out."""
        gguf = gguf_package()
        mapping = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, self.block_count)
        stored = path if isinstance(path, GgufFile) else GgufFile(path)
        out: dict[str, torch.Tensor] = {}
        for name in names:
            mapped = mapping.get_name(name, try_suffixes=(".weight", ".bias"))
            if mapped is None or mapped not in stored.tensors:
                continue
            data = stored.float32(mapped).reshape(self.shapes[mapped])
            # An F32 tensor is a view of the file's read-only map: copied; a de-quantized one is already new.
            weights = torch.from_numpy(data if data.flags.writeable else data.copy())
            if name.endswith("q_proj.weight"):
                weights = _unpermute(weights, self.n_head)
            elif name.endswith("k_proj.weight"):
                weights = _unpermute(weights, self.n_head_kv)
            out[name] = weights
        return out

    def write(self, path: str | os.PathLike[str], state: dict[str, torch.Tensor], *, outtype: OutType = "f16") -> None:
        """Write ``state`` to ``path`` as this template's model in ``outtype``, and fsync it."""
        gguf = gguf_package()
        if outtype not in ("f16", "f32"):
            raise ConfigError(f"GGUF outtype {outtype!r}: write f16 or f32")
        tensors = self.tensors(state)
        writer = gguf.GGUFWriter(str(path), self.architecture, use_temp_file=False)
        for field in self.fields:
            sub_type = None if field.sub_type is None else gguf.GGUFValueType(field.sub_type)
            writer.add_key_value(field.key, field.value, gguf.GGUFValueType(field.vtype), sub_type=sub_type)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if outtype == "f16" else gguf.LlamaFileType.ALL_F32)
        for name, tensor in tensors.items():
            # As llama.cpp's converter: norms and other 1-D tensors stay F32 whatever the file type.
            half = outtype == "f16" and tensor.dim() > 1 and not name.endswith("_norm.weight")
            writer.add_tensor(name, (tensor.to(torch.float16) if half else tensor).numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(path, "rb+") as handle:
            os.fsync(handle.fileno())


def _permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's rotary layout of a query or key projection (``LlamaModel.permute`` in its converter)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _unpermute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `_permute` (transformers' ``_reverse_permute_weights``)."""
    return (
        weights.reshape(heads, weights.shape[0] // heads // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    path: str | os.PathLike[str],
    state: dict[str, torch.Tensor],
    *,
    source: str | os.PathLike[str],
    outtype: OutType = "f16",
) -> Path:
    """One-off: ``state`` as the model of the GGUF at ``source``, written to ``path`` (see `GgufTemplate`)."""
    GgufTemplate.read(source).write(path, state, outtype=outtype)
    return Path(path)
