"""A GGUF model that cannot be opened gets one message naming the file and the problem: not a
GGUF file, cut short, a tensor type or architecture or tokenizer pagedkv does not read, a split
model with a part missing, a folder with two models."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFWriter

from pagedkv import LLM
from pagedkv.models import ModelConfig
from pagedkv.tokenizer import engine_tokenizer
from pagedkv.tokenizer.gguf_file import GGUFError
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama written as GGUF, and its checkpoint folder (to write variants from)."""
    root = tmp_path_factory.mktemp("gguf")
    folder = make_checkpoint(root, "llama")
    return write_gguf(folder, root / "tiny.gguf"), folder


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    file = tmp_path / "model.gguf"
    file.write_bytes('{"architectures": ["ä"]}'.encode("latin-1"))
    with pytest.raises(GGUFError, match=rf"{file} is not a GGUF file: it starts with b'{{\"ar'"):
        LLM(str(file))


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_a_truncated_file_is_named(tmp_path, tiny, keep):
    data = tiny[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFError, match=rf"{cut} is truncated or damaged \({int(len(data) * keep)} bytes\)"):
        ModelConfig.from_pretrained(cut)


def test_an_unsupported_tensor_type_is_named(tmp_path):
    file = tmp_path / "ints.gguf"
    writer = GGUFWriter(file, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GGUFError, match=rf"{file}: tensor token_embd.weight has type I32, .* supported: \['F32'"
    ):
        ModelConfig.from_pretrained(file)


def test_an_unknown_architecture_is_named_with_the_supported_ones(tmp_path, tiny):
    file = write_gguf(tiny[1], tmp_path / "gpt2.gguf", **{"general.architecture": "gpt2"})
    supported = "'gemma2', 'gemma3', 'llama', 'phi3', 'qwen2', 'qwen2moe', 'qwen3', 'qwen3moe'"
    expected = rf"{file}: unsupported architecture 'gpt2' .* \[{supported}\]"
    with pytest.raises(GGUFError, match=expected):
        LLM(str(file))


def test_an_unsupported_rope_scaling_names_the_file(tmp_path, tiny):
    file = write_gguf(tiny[1], tmp_path / "longrope.gguf", **{"llama.rope.scaling.type": "longrope"})
    with pytest.raises(GGUFError, match=rf"{file}: RoPE scaling 'longrope' .* not supported"):
        ModelConfig.from_pretrained(file)


def test_partial_rotary_outside_phi3_is_refused(tmp_path, tiny):
    """A llama file's query/key rows are permuted for llama.cpp's interleaved rotation of the
    whole head: a partial rotation has no such form (Phi-4-mini converts as phi3)."""
    file = write_gguf(tiny[1], tmp_path / "partial.gguf", **{"llama.rope.dimension_count": 8})
    with pytest.raises(
        GGUFError, match=rf"{file}: partial rotary embeddings \(llama.rope.dimension_count 8 of 16\) .*'phi3'"
    ):
        ModelConfig.from_pretrained(file)


@pytest.mark.parametrize("count", [9, 18])
def test_a_rotary_dimension_count_that_is_odd_or_over_the_head_is_named(tmp_path, count):
    folder = make_checkpoint(tmp_path, "phi3")
    file = write_gguf(folder, tmp_path / "phi3.gguf", **{"phi3.rope.dimension_count": count})
    with pytest.raises(GGUFError, match=rf"{file}: phi3.rope.dimension_count is {count}; it must be even"):
        ModelConfig.from_pretrained(file)


def test_experts_in_a_family_without_them_are_refused(tmp_path):
    file = write_gguf(make_checkpoint(tmp_path, "qwen3"), tmp_path / "q.gguf", **{"qwen3.expert_count": 8})
    with pytest.raises(GGUFError, match=rf"{file}: mixture-of-experts GGUF files of 'qwen3' .*expert_count"):
        ModelConfig.from_pretrained(file)


def test_yarn_scaling_reads_as_transformers_spells_it(tmp_path, tiny):
    metadata = {
        "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 64,
    }
    rope = ModelConfig.from_pretrained(write_gguf(tiny[1], tmp_path / "yarn.gguf", **metadata)).rope
    assert rope.type == "yarn"
    assert rope.params == {"factor": 4.0, "original_max_position_embeddings": 64}


def test_an_unknown_tokenizer_is_named(tmp_path, tiny):
    file = write_gguf(tiny[1], tmp_path / "bert.gguf", **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(GGUFError, match=rf"{file}: unsupported tokenizer 'bert' .* 'gpt2' and 'llama'"):
        engine_tokenizer(file)


def test_a_split_model_missing_a_part_names_it(tmp_path, tiny):
    first = write_gguf(tiny[1], tmp_path / "split.gguf", split_max_tensors=11)  # 21 tensors
    (tmp_path / "split-00002-of-00002.gguf").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing beside it: \['split-00002-of-00002.gguf'\]"):
        ModelConfig.from_pretrained(first)


def test_a_folder_with_two_models_asks_for_the_file(tmp_path, tiny):
    (tmp_path / "a.gguf").symlink_to(tiny[0])
    (tmp_path / "b.gguf").symlink_to(tiny[0])
    with pytest.raises(GGUFError, match=r"holds 2 GGUF models \['a.gguf', 'b.gguf'\]: name the file"):
        LLM(str(tmp_path))
