"""GGUF files for tests, written with ``gguf.GGUFWriter`` from the tiny Hugging Face checkpoints
(:mod:`tests.checkpoints`) the way llama.cpp's ``convert_hf_to_gguf.py`` writes them: llama.cpp's
tensor names, the Llama query/key rows permuted for its rotary layout, 2-D weights in the asked
type (quantized with ``gguf.quants``, the reference), norms and biases in F32, the
hyper-parameters under ``{arch}.*`` and the byte-level BPE tokenizer with its chat template.

The name table and the permutation are written out here on their own, from llama.cpp's
converter, so a test checks pagedkv's reading against an independent statement of the format.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.quants import quantize
from safetensors.numpy import load_file

Q = GGMLQuantizationType
#: transformers' architecture -> llama.cpp's (Mistral converts as llama, with its sliding window).
ARCH_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
_FILE_TYPES = {
    Q.F32: LlamaFileType.ALL_F32,
    Q.F16: LlamaFileType.MOSTLY_F16,
    Q.Q8_0: LlamaFileType.MOSTLY_Q8_0,
}

#: transformers' tensor names -> llama.cpp's (convert_hf_to_gguf's tensor map).
_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
#: one expert's projection (Qwen's and Mixtral's name) -> llama.cpp's stacked tensor of them all
_EXPERTS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}
#: Gemma's sandwich norms (its ``ffn_norm`` is the norm before the MLP)
_GEMMA_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str, gemma: bool = False) -> str:
    stem, _, param = hf_name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{param}"
    _, _, layer, leaf = stem.split(".", 3)
    return f"blk.{layer}.{(_GEMMA_NAMES if gemma else {}).get(leaf) or _NAMES[leaf]}.{param}"


def gguf_tensors(
    weights: dict[str, np.ndarray], gemma: bool = False, stack_experts: bool = True
) -> dict[str, np.ndarray]:
    """Checkpoint tensors under llama.cpp's names, each layer's experts stacked into one
    ``[experts, rows, columns]`` tensor per projection (convert_hf_to_gguf's ``*_exps``; without
    ``stack_experts``, one tensor per expert as older Mixtral files hold them, ``ffn_up.E``);
    Gemma's norms as the converter writes them, ``1 + weight``."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, array in weights.items():
        parts = name.split(".")
        if "experts" in parts:  # model.layers.L.<block>.experts.E.<proj>.weight
            layer, expert, proj = parts[2], int(parts[5]), parts[6]
            if not stack_experts:
                out[f"blk.{layer}.{_EXPERTS[proj].removesuffix('_exps')}.{expert}.{parts[-1]}"] = array
                continue
            stacks.setdefault(f"blk.{layer}.{_EXPERTS[proj]}.{parts[-1]}", {})[expert] = array
        else:
            out[gguf_name(name, gemma)] = array + 1 if gemma and name.endswith("norm.weight") else array
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return out


def llama_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute``: each head's rotary halves interleaved."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def write_gguf(
    folder: Path,
    out: Path,
    qtype: GGMLQuantizationType = Q.F32,
    split_max_tensors: int = 0,
    vocabulary: Callable[[GGUFWriter, Path], None] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    stack_experts: bool = True,
    **keys: Any,
) -> Path:
    """``folder`` (a tiny checkpoint) written as GGUF ``out`` (split every ``split_max_tensors``
    tensors when given), its tokenizer written by ``vocabulary`` (default: the folder's byte-level
    BPE); ``extra_tensors`` are written as they are; experts stacked unless ``stack_experts`` is
    false (:func:`gguf_tensors`); ``keys`` add or override metadata
    (``{"general.architecture": "gpt2"}``). Returns the first file."""
    config = json.loads((folder / "config.json").read_text())
    arch = ARCH_NAMES[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the full layers' (the sliding ones' is 10,000)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    rotary = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if rotary != 1.0:  # Phi3MiniModel's rope_dims (Phi-4-mini: 96 of 128)
        writer.add_rope_dimension_count(int(rotary * config["hidden_size"]) // heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("sliding_window") is not None:
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    _add_experts(writer, config)
    writer.add_file_type(_FILE_TYPES[qtype])
    (vocabulary or add_bpe_vocabulary)(writer, folder)
    for key, value in keys.items():
        writer.add_key_value(key, value, *_value_type(value))
    weights = load_file(folder / "model.safetensors")
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, config["head_dim"]))
    if rope.get("rope_type") == "longrope":  # Phi3MiniModel's factor tensors and attention factor
        original = config.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    for name, array in sorted((extra_tensors or {}).items()):
        writer.add_tensor(name, array.astype(np.float32))
    for name, array in sorted(gguf_tensors(weights, arch.startswith("gemma"), stack_experts).items()):
        array = array.astype(np.float32).squeeze()  # the converter squeezes: a (1, n) gate is a vector
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            array = llama_permute(array, heads if ".attn_q." in name else kv_heads)
        _add_tensor(writer, name, array, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(out)[0]


def _add_experts(writer: GGUFWriter, config: dict[str, Any]) -> None:
    """convert_hf_to_gguf's mixture-of-experts keys (none for a dense model)."""
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts is None:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:  # Qwen; Mixtral's experts are intermediate_size rows
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in config:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's ``rope_freqs``: Llama 3.1's scaling as one divisor per frequency."""
    inv_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / rope["low_freq_factor"], old_len / rope["high_freq_factor"]
    factors = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_tensor(writer: GGUFWriter, name: str, array: np.ndarray, qtype: GGMLQuantizationType) -> None:
    if array.ndim == 1 or qtype == Q.F32:
        writer.add_tensor(name, array)
    elif qtype == Q.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)


def _value_type(value: Any) -> tuple[Any, ...]:
    from gguf import GGUFValueType

    if isinstance(value, str):
        return (GGUFValueType.STRING,)
    if isinstance(value, bool):
        return (GGUFValueType.BOOL,)
    if isinstance(value, int):
        return (GGUFValueType.UINT32,)
    return (GGUFValueType.FLOAT32,)


def add_bpe_vocabulary(writer: GGUFWriter, folder: Path) -> None:
    """The checkpoint's byte-level BPE as llama.cpp's ``gpt2`` vocabulary."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {added["content"] for added in spec["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_uint32("tokenizer.ggml.eot_token_id", vocab["<|im_end|>"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(tokenizer_config["chat_template"])
