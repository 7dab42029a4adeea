"""A tiny Llama-layout language model as a GGUF file, for `streamgrp.consumers.lm_trainer` tests that need
no real model: random F32 weights (seeded), a byte-sized vocabulary, the output layer tied to the
embedding as SmolLM2's is. transformers loads it as it loads SmolLM2's GGUF; llama-server is not asked to.
The GGUF export's unit tests write tiny models of their own sizes with `llama_writer`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 16, 32, 4, 2, 1, 64


@dataclass(frozen=True)
class Dims:
    """A tiny Llama's sizes."""

    hidden: int = HIDDEN
    ffn: int = FFN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    layers: int = LAYERS
    vocab: int = VOCAB


def llama_writer(path: Path, file_type: Any, dims: Dims = Dims()) -> Any:
    """A `gguf.GGUFWriter` for ``path`` holding a tiny Llama's metadata and byte-sized tokenizer; the caller
    adds the tensors and calls `finish`."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(dims.layers)
    writer.add_context_length(64)
    writer.add_embedding_length(dims.hidden)
    writer.add_feed_forward_length(dims.ffn)
    writer.add_head_count(dims.heads)
    writer.add_head_count_kv(dims.kv_heads)
    writer.add_rope_dimension_count(dims.hidden // dims.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(file_type)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(dims.vocab)])
    writer.add_token_types([1] * dims.vocab)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer


def finish(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_gguf(path: Path, *, seed: int = 0, dims: Dims = Dims(), quant: str = "F32", tied: bool = True) -> Path:
    """A tiny Llama with seeded random weights; ``quant`` names the ggml type of its matrices (norms stay F32,
    as llama.cpp's converter keeps them); ``tied=False`` adds an output layer of its own."""
    import gguf

    generator = torch.Generator().manual_seed(seed)
    head = dims.hidden // dims.heads
    shapes = {"token_embd.weight": (dims.vocab, dims.hidden), "output_norm.weight": (dims.hidden,)}
    if not tied:
        shapes["output.weight"] = (dims.vocab, dims.hidden)
    for layer in range(dims.layers):
        shapes |= {
            f"blk.{layer}.attn_q.weight": (dims.hidden, dims.hidden),
            f"blk.{layer}.attn_k.weight": (dims.kv_heads * head, dims.hidden),
            f"blk.{layer}.attn_v.weight": (dims.kv_heads * head, dims.hidden),
            f"blk.{layer}.attn_output.weight": (dims.hidden, dims.hidden),
            f"blk.{layer}.ffn_gate.weight": (dims.ffn, dims.hidden),
            f"blk.{layer}.ffn_up.weight": (dims.ffn, dims.hidden),
            f"blk.{layer}.ffn_down.weight": (dims.hidden, dims.ffn),
            f"blk.{layer}.attn_norm.weight": (dims.hidden,),
            f"blk.{layer}.ffn_norm.weight": (dims.hidden,),
        }
    qtype = gguf.GGMLQuantizationType[quant]
    file_type = gguf.LlamaFileType.ALL_F32 if quant == "F32" else gguf.LlamaFileType[f"MOSTLY_{quant}"]
    writer = llama_writer(path, file_type, dims)
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            writer.add_tensor(name, torch.ones(shape).numpy())
            continue
        tensor = (torch.randn(*shape, generator=generator) * 0.2).numpy()
        writer.add_tensor(name, gguf.quants.quantize(tensor, qtype), raw_dtype=None if quant == "F32" else qtype)
    finish(writer)
    return path
