"""GGUF files of the mixture-of-experts, Gemma and Phi-3 families, written as llama.cpp's
converter writes them (each layer's experts stacked into one ``ffn_*_exps`` tensor per
projection, the router as ``ffn_gate_inp``, Qwen2-MoE's shared expert as ``ffn_*_shexp``,
Mixtral as ``llama`` with ``expert_count``; Gemma's norms stored as ``1 + weight``, its sliding
layers by llama.cpp's pattern; Phi-3's fused ``attn_qkv`` and ``ffn_up``), open as models: an
F32 file gives the config and the greedy tokens of the same checkpoint's Hugging Face folder, a
Q8_0 file the tokens of transformers' GGUF loader (which reads neither Gemma's soft-caps nor its
query scale, so Gemma is checked against the folder)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from pagedkv.models import ModelConfig
from pagedkv.models.rope import attention_factor
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf

from .test_gguf import greedy, prompts
from .test_phi3 import LONGROPE

MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2}
#: a shared expert and a dense layer (no router) between two sparse ones
QWEN2MOE = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 3,
    "mlp_only_layers": [1],
}
#: llama.cpp renormalises Qwen3-MoE's chosen weights, as its released configs ask
QWEN3MOE = {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": True}
#: the query scale llama.cpp uses (the head size), windows shorter than the prompts
GEMMA2 = {
    "sliding_window": 5,
    "query_pre_attn_scalar": 16,
    "attn_logit_softcapping": 2.0,
    "final_logit_softcapping": 3.0,
    "tie_word_embeddings": True,
    "num_hidden_layers": 3,
}
#: six layers: five sliding, the sixth full, with its own RoPE base
GEMMA3 = {"sliding_window": 5, "query_pre_attn_scalar": 16, "num_hidden_layers": 6}
CASES = {
    "mixtral": MIXTRAL,
    "qwen2moe": QWEN2MOE,
    "qwen3moe": QWEN3MOE,
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
    "phi3": {"sliding_window": 5},  # fused qkv and gate/up, every layer sliding
}


@pytest.mark.parametrize("arch", list(CASES))
def test_an_f32_gguf_of_the_family_runs_as_its_hugging_face_folder(tmp_path, arch):
    folder = make_checkpoint(tmp_path, arch, **CASES[arch])
    gguf = write_gguf(folder, tmp_path / f"{arch}.gguf")
    hf_config, gguf_config = ModelConfig.from_pretrained(folder), ModelConfig.from_pretrained(gguf)
    assert gguf_config.architecture == hf_config.architecture
    assert gguf_config == dataclasses.replace(hf_config, eos_token_id=1)
    assert greedy(str(gguf)) == greedy(str(folder))


def test_phi3_longrope_reads_its_factors_from_the_files_tensors(tmp_path):
    folder = make_checkpoint(tmp_path, "phi3", **{**LONGROPE, "max_position_embeddings": 256})
    gguf = write_gguf(folder, tmp_path / "phi3-longrope.gguf")
    hf_rope, gguf_rope = ModelConfig.from_pretrained(folder).rope, ModelConfig.from_pretrained(gguf).rope
    assert gguf_rope.type == "longrope"
    for name in ("long_factor", "short_factor", "original_max_position_embeddings"):
        assert gguf_rope.params[name] == pytest.approx(hf_rope.params[name])
    # the converter writes the attention factor transformers computes, rounded to float32
    assert attention_factor(gguf_rope) == pytest.approx(attention_factor(hf_rope)) != 1.0
    assert greedy(str(gguf)) == greedy(str(folder))


#: Phi-4-mini's shape: 12 of each head's 16 dimensions rotate (``phi3.rope.dimension_count``)
PHI4_MINI = {"partial_rotary_factor": 0.75}


def test_a_partial_rotary_phi3_file_runs_as_its_hugging_face_folder(tmp_path):
    folder = make_checkpoint(tmp_path, "phi3", **PHI4_MINI)
    gguf = write_gguf(folder, tmp_path / "phi4-mini.gguf")
    hf_config, gguf_config = ModelConfig.from_pretrained(folder), ModelConfig.from_pretrained(gguf)
    assert gguf_config.rotary_dim == hf_config.rotary_dim == 12
    assert gguf_config == dataclasses.replace(hf_config, eos_token_id=1)
    assert greedy(str(gguf)) == greedy(str(folder))


def test_a_quantized_partial_rotary_file_moves_its_rows_of_blocks(tmp_path):
    """Query/key rows are reordered for the partial rotation as rows of Q8_0 blocks: the file
    gives transformers' tokens on a folder holding its dequantized weights (transformers' GGUF
    loader reads no ``rope.dimension_count``, so it cannot be the reference here)."""
    folder = make_checkpoint(tmp_path, "phi3", **PHI4_MINI)
    gguf = write_gguf(folder, tmp_path / "phi4-mini-q8_0.gguf", Q.Q8_0)
    weights = load_file(folder / "model.safetensors")
    for name, tensor in weights.items():
        if tensor.ndim == 2:  # what the file holds: Q8_0 blocks of every matrix, vectors in F32
            weights[name] = torch.from_numpy(dequantize(quantize(tensor.numpy(), Q.Q8_0), Q.Q8_0).copy())
    save_file(weights, folder / "model.safetensors")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = []
    for ids in prompts():
        prompt = torch.tensor([ids])
        tokens = reference.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        expected.append(tokens[0, prompt.shape[1] :].tolist())
    assert greedy(str(gguf)) == expected


#: the sizes transformers' GGUF loader assumes, which reads neither expert rows nor dense layers
#: from the file; Qwen3-MoE's head size is written, and read, as ``attention.key_length``
TRANSFORMERS_READABLE = {
    "qwen2moe": {"num_experts": 8, "num_experts_per_tok": 2},
    "qwen3moe": {"num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": True},
    "phi3": {},  # its fused projections' rows split from the quantized blocks
}
#: Phi3Config's padding id (32,000) lies outside the tiny vocabulary: the file names its own
METADATA = {"phi3": {"tokenizer.ggml.padding_token_id": 2}}


@pytest.mark.parametrize("arch", list(TRANSFORMERS_READABLE))
def test_a_q8_0_gguf_of_the_family_gives_the_tokens_of_transformers_gguf_loader(tmp_path, arch):
    folder = make_checkpoint(tmp_path, arch, **TRANSFORMERS_READABLE[arch])
    gguf = write_gguf(folder, tmp_path / f"{arch}-q8_0.gguf", Q.Q8_0, **METADATA.get(arch, {}))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    expected = []
    for ids in prompts():
        prompt = torch.tensor([ids])
        tokens = reference.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        expected.append(tokens[0, prompt.shape[1] :].tolist())
    assert greedy(str(gguf)) == expected


def test_two_tensor_parallel_ranks_read_their_rows_of_a_quantized_mixture_of_experts_gguf(tmp_path):
    folder = make_checkpoint(tmp_path, "qwen2moe", **QWEN2MOE)
    gguf = write_gguf(folder, tmp_path / "qwen2moe-q8_0.gguf", Q.Q8_0)
    assert greedy(str(gguf), tensor_parallel_size=2) == greedy(str(gguf))


def test_an_older_mixtral_file_with_a_tensor_per_expert_runs_as_its_folder(tmp_path):
    """llama.cpp wrote each expert's projection as its own tensor (``blk.N.ffn_up.E.weight``)
    before it stacked them: such a file is the same model."""
    folder = make_checkpoint(tmp_path, "mixtral", **MIXTRAL)
    older = write_gguf(folder, tmp_path / "mixtral-per-expert.gguf", stack_experts=False)
    assert greedy(str(older)) == greedy(str(folder))
