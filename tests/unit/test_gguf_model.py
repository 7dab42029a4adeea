"""Reading GGUF without gguf-py's reader (`streamgrp.train.gguf_file`) and loading a plain Llama GGUF without
transformers' GGUF loader (`streamgrp.train.gguf_model`): on tiny models of each storage the LM trainer
meets (F32, Q8_0, Q4_1 as SmolLM2's file; tied and untied output layers) the metadata is gguf-py's, value
for value and type for type, and the model is transformers' own load of the same file, configuration and
every weight bit for bit. A file this loader does not cover goes to transformers; a file that is not GGUF,
or is cut short, is refused with a message that says so."""

from __future__ import annotations

import pytest
import torch
from tiny_lm import Dims, write_tiny_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from streamgrp.consumers.lm_trainer import load_policy  # noqa: E402
from streamgrp.errors import ConfigError  # noqa: E402
from streamgrp.train.gguf_file import GgufFile  # noqa: E402
from streamgrp.train.gguf_model import load_llama  # noqa: E402

#: Rows of 32 and 64 values: whole blocks for every quantization type.
QUANT_DIMS = Dims(hidden=32, ffn=64, heads=4, kv_heads=2, layers=2, vocab=64)
#: What transformers' GGUF loader records about where the model came from, not what the model is.
PROVENANCE = {"_name_or_path", "_model_name_or_path", "quantization_config", "dtype", "torch_dtype"}


def _transformers_load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize(("quant", "tied"), [("F32", True), ("Q8_0", True), ("Q4_1", True), ("Q4_1", False)], ids=str)
def test_a_plain_llama_file_loads_as_transformers_loads_it_bit_for_bit(tmp_path, quant, tied):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=3, dims=QUANT_DIMS, quant=quant, tied=tied)
    ours, theirs = load_llama(path), _transformers_load(path)
    assert ours is not None and type(ours) is type(theirs) and not ours.training
    mine, reference = ours.config.to_dict(), theirs.config.to_dict()
    assert {k: v for k, v in mine.items() if k not in PROVENANCE} == {
        k: v for k, v in reference.items() if k not in PROVENANCE
    }
    state, expected = ours.state_dict(), theirs.state_dict()
    assert list(state) == list(expected)
    assert all(torch.equal(state[name], expected[name]) for name in expected)
    embedding_is_output = ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    assert embedding_is_output == tied
    ids = torch.tensor([[1, 5, 9, 2, 33]])
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


def test_the_metadata_is_gguf_pys_value_for_value(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", dims=QUANT_DIMS, quant="Q8_0")
    reader, ours = gguf.GGUFReader(str(path)), GgufFile(path)
    theirs = {key: field for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.fields) == list(theirs)
    for key, field in theirs.items():
        assert ours.fields[key].value == field.contents(), key
        assert ours.fields[key].vtype == field.types[0], key
    for tensor in reader.tensors:
        mine = ours.float32(tensor.name)
        assert mine.shape == tuple(reversed(tensor.shape.tolist()))
        assert (mine == gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(mine.shape)).all()


def test_a_file_with_settings_this_loader_does_not_read_goes_to_transformers(tmp_path):
    path = write_tiny_gguf(tmp_path / "plain.gguf", dims=QUANT_DIMS)
    scaled = tmp_path / "scaled.gguf"
    _with_extra_key(path, scaled, "llama.rope.scaling.type", "linear")
    assert load_llama(path) is not None and load_llama(scaled) is None
    model = load_policy(scaled)  # transformers' loader, which knows rope scaling
    assert model.config.num_hidden_layers == QUANT_DIMS.layers


def test_a_file_that_is_not_gguf_or_is_cut_short_is_refused_saying_so(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", dims=QUANT_DIMS)
    data = path.read_bytes()
    (tmp_path / "text.gguf").write_bytes(b"not a model\n" * 4)
    with pytest.raises(ConfigError, match="is not a GGUF file"):
        GgufFile(tmp_path / "text.gguf")
    (tmp_path / "header.gguf").write_bytes(data[:200])
    with pytest.raises(ConfigError, match="truncated"):
        GgufFile(tmp_path / "header.gguf")
    (tmp_path / "tensors.gguf").write_bytes(data[: len(data) - 100])
    cut = GgufFile(tmp_path / "tensors.gguf")
    last = max(cut.tensors.values(), key=lambda tensor: tensor.offset).name
    with pytest.raises(ConfigError, match=f"ends inside tensor {last}"):
        cut.float32(last)


def _with_extra_key(source, target, key: str, value: str) -> None:
    """``source`` written again to ``target`` with one more string key."""
    file = GgufFile(source)
    writer = gguf.GGUFWriter(str(target), "llama")
    for field in file.fields.values():
        if field.key != "general.architecture":
            sub_type = None if field.sub_type is None else gguf.GGUFValueType(field.sub_type)
            writer.add_key_value(field.key, field.value, gguf.GGUFValueType(field.vtype), sub_type=sub_type)
    writer.add_string(key, value)
    for name in file.tensors:
        writer.add_tensor(name, file.float32(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
