"""Writing trained weights as GGUF (`streamgrp.train.gguf_export`), on a tiny Llama-layout model: the file
is the source with other tensors (same metadata and tokenizer, the file type changed), an F32 file
reads back bit for bit, an F16 one within half precision, and a state dict that is not the source's
model is refused. That llama.cpp computes with what is written the way torch does is the llama test's
(tests/integration/test_llama_trained_policy.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_lm import Dims, finish, llama_writer

gguf = pytest.importorskip("gguf")

from streamgrp.errors import ConfigError  # noqa: E402
from streamgrp.train.gguf_export import GgufTemplate, write_gguf  # noqa: E402

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 16, 24, 4, 2, 2, 32


def _state() -> dict[str, torch.Tensor]:
    """A tiny Llama's state dict under transformers' names, lm_head tied (so absent from the GGUF)."""
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    head = HIDDEN // HEADS
    state = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        state |= {
            prefix + "self_attn.q_proj.weight": rand(HIDDEN, HIDDEN),
            prefix + "self_attn.k_proj.weight": rand(KV_HEADS * head, HIDDEN),
            prefix + "self_attn.v_proj.weight": rand(KV_HEADS * head, HIDDEN),
            prefix + "self_attn.o_proj.weight": rand(HIDDEN, HIDDEN),
            prefix + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            prefix + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            prefix + "mlp.down_proj.weight": rand(HIDDEN, FFN),
            prefix + "input_layernorm.weight": rand(HIDDEN),
            prefix + "post_attention_layernorm.weight": rand(HIDDEN),
        }
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


@pytest.fixture
def source(tmp_path):
    """A quantized-looking source GGUF of the tiny model: its metadata and shapes are what matter."""
    path = tmp_path / "source.gguf"
    writer = llama_writer(path, gguf.LlamaFileType.MOSTLY_Q8_0, Dims(HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS)
    for name, tensor in _state().items():
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if name != "lm_head.weight":
            writer.add_tensor(mapped, torch.zeros_like(tensor).numpy())
    finish(writer)
    return path


def _fields(path) -> dict[str, object]:
    reader = gguf.GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def test_an_f32_file_is_the_source_model_with_the_trained_tensors_bit_for_bit(source, tmp_path):
    state = _state()
    out = write_gguf(tmp_path / "model.gguf", state, source=source, outtype="f32")
    written, original = _fields(out), _fields(source)
    assert written.pop("general.file_type") == gguf.LlamaFileType.ALL_F32
    original.pop("general.file_type")
    assert written == original  # architecture, hyper-parameters and tokenizer, copied
    back = GgufTemplate.read(source).read_state(out, list(state))
    assert set(back) == set(state) - {"lm_head.weight"}  # tied: stored once, as the embedding
    assert all(torch.equal(back[name], state[name]) for name in back)
    stored = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    assert not torch.equal(
        torch.from_numpy(stored["blk.0.attn_q.weight"].data.copy()), state["model.layers.0.self_attn.q_proj.weight"]
    )  # llama.cpp's rotary layout


def test_an_f16_file_keeps_norms_in_f32_and_the_rest_within_half_precision(source, tmp_path):
    state = _state()
    out = write_gguf(tmp_path / "model.gguf", state, source=source, outtype="f16")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert types["token_embd.weight"] == types["blk.1.ffn_down.weight"] == gguf.GGMLQuantizationType.F16
    back = GgufTemplate.read(source).read_state(out, list(state))
    assert all(torch.allclose(back[name], state[name], rtol=1e-3, atol=1e-4) for name in back)
    assert torch.equal(back["model.norm.weight"], state["model.norm.weight"])


def test_a_state_dict_of_another_model_is_refused(source, tmp_path):
    template = GgufTemplate.read(source)
    state = _state()
    with pytest.raises(ConfigError, match="lacks 1 tensors"):
        template.write(tmp_path / "a.gguf", {k: v for k, v in state.items() if k != "model.norm.weight"})
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(FFN + 1, HIDDEN)
    with pytest.raises(ConfigError, match="not the model the template was read from"):
        template.write(tmp_path / "b.gguf", state)
