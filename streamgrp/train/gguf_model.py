"""A Llama-architecture GGUF as a transformers model: SmolLM2-135M in 4.5 s on two CPU cores where transformers'
own GGUF loader takes 16 s (`bench/bench_gguf_load.py`; it parses the file twice with gguf-py and builds gguf's
tensor-name map once per tensor).

Owns the plain Llama case only: the configuration from the file's ``llama.*`` keys, the weights through
`streamgrp.train.gguf_export.GgufTemplate.read_state` (gguf-py's de-quantization, the query and key
projections un-permuted as transformers does), the output embedding tied when the file has none. A file
with anything else (another architecture, rope scaling, experts, a head size other than the hidden size
over the heads) is not this module's: `load_llama` returns None and the caller asks transformers.
``tests/integration/test_gguf_model.py`` checks that both give the same configuration and the same
weights, bit for bit.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from streamgrp.train.gguf_file import GgufFile

__all__ = ["load_llama"]

#: The ``llama.*`` keys this loader reads; a file with any other ``llama.*`` key goes to transformers.
_KNOWN_KEYS = frozenset(
    {
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.layer_norm_rms_epsilon",
        "rope.freq_base",
        "rope.dimension_count",
        "vocab_size",
    }
)
#: Token ids transformers copies from the tokenizer's keys into the model's configuration.
_TOKEN_IDS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "padding_token_id",
    "unk_token_id": "unknown_token_id",
}


def load_llama(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32) -> Any | None:
    """The GGUF at ``path`` as a ``LlamaForCausalLM`` in ``dtype``, or None when it is not a plain Llama file."""
    from transformers import LlamaForCausalLM

    from streamgrp.train.gguf_export import GgufTemplate

    file = GgufFile(path)
    config = _config(file)
    if config is None:
        return None
    with _no_init_weights():
        model: Any = LlamaForCausalLM(config)
    template = GgufTemplate.of(file)
    names = [name for name in model.state_dict() if not name.endswith("rotary_emb.inv_freq")]
    state = template.read_state(file, names)
    expected = {name for name in names if not (config.tie_word_embeddings and name == "lm_head.weight")}
    if set(state) != expected:
        return None  # tensors this loader cannot place: transformers' loader knows more layouts
    model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()  # as transformers' from_pretrained returns it


def _config(file: GgufFile):
    from transformers import LlamaConfig

    if file.value("general.architecture") != "llama":
        return None
    keys = {key.removeprefix("llama.") for key in file.fields if key.startswith("llama.")}
    if not keys <= _KNOWN_KEYS:
        return None

    def number(key: str) -> Any:
        return file.value(f"llama.{key}")

    hidden, heads = number("embedding_length"), number("attention.head_count")
    tokens = file.value("tokenizer.ggml.tokens")
    vocab_size = number("vocab_size") or (len(tokens) if tokens else None)
    required = (number("block_count"), hidden, heads, number("feed_forward_length"), vocab_size)
    if any(not value for value in required) or number("rope.dimension_count") not in (None, hidden // heads):
        return None
    settings: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": number("feed_forward_length"),
        "num_hidden_layers": number("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": number("attention.head_count_kv") or heads,
        "max_position_embeddings": number("context_length") or 2048,
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon") or 1e-6,
        "rope_theta": number("rope.freq_base") or 10000.0,  # transformers 5 files it under rope_parameters
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
    for name, key in _TOKEN_IDS.items():
        if file.value(f"tokenizer.ggml.{key}") is not None:
            settings[name] = file.value(f"tokenizer.ggml.{key}")
    return LlamaConfig(**settings)


def _no_init_weights() -> Any:
    """transformers' switch that skips random initialization (every weight is loaded right after)."""
    import importlib

    for module in ("transformers.initialization", "transformers.modeling_utils"):  # transformers 5, then 4
        switch = getattr(importlib.import_module(module), "no_init_weights", None)
        if switch is not None:
            return switch()
    return contextlib.nullcontext()  # initialized, then overwritten: slower, the same model
