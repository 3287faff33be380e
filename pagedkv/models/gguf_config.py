"""A GGUF model's architecture as a Hugging Face ``config.json`` dict, read from its metadata.

llama.cpp writes each hyper-parameter under ``{arch}.<key>`` (``llama.block_count``,
``qwen2.attention.head_count_kv``, ...); this module maps them to the names transformers gives
them, so :meth:`pagedkv.models.config.ModelConfig.from_dict` settles defaults and checks once for
both sources. What the metadata does not say, the tensors do: the vocabulary is the embedding's
row count, the output projection is tied when ``output.weight`` is absent, biases exist when
their tensors do, Llama 3.1's RoPE scaling is the divisors in ``rope_freqs.weight``, Phi-3's
longrope the factors in ``rope_factors_long``/``rope_factors_short``; a ``rope.dimension_count``
below the head size is a partial rotary (Phi-4-mini). Every tensor's type is checked here,
before anything is built, so an unsupported type is refused by name at once.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pagedkv.models.gguf_weights import ROPE_FREQS, ROPE_TENSORS, SUPPORTED_TYPES, gguf_weight, type_name
from pagedkv.tokenizer.gguf_file import GGUFError, field, open_gguf

#: architectures whose files may rotate part of each head (Phi-4-mini converts as phi3): their
#: rotation pairs dimension i with i + rotary_dim / 2 as transformers' does, rows unpermuted
#: (llama's files permute whole heads for llama.cpp's interleaved rotation: no partial form)
_PARTIAL_ROTARY = frozenset({"phi3"})

#: ``general.architecture`` -> the transformers architecture it is converted from.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
#: llama.cpp's Gemma layouts: every layer slides but each ``pattern``-th, and the 27B model (known
#: by its layer count) scales queries by ``hidden / heads`` where the others use the head size
_GEMMA_LAYOUTS = {"gemma2": (2, 46), "gemma3": (6, 62)}
#: whether llama.cpp divides the chosen experts' weights by their sum when the file does not
#: say (``{arch}.expert_weights_norm``): Mixtral always, Qwen3-MoE by default, Qwen2-MoE never
_NORM_EXPERT_WEIGHTS = {"llama": True, "qwen2moe": False, "qwen3moe": True}

#: ``general.file_type`` (llama.cpp's ``llama_ftype``) -> the checkpoint dtype it stands for;
#: quantized files dequantize exactly into float32.
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def gguf_config(parts: list[Path]) -> dict[str, Any]:
    """The config.json dict of the GGUF model in ``parts`` (metadata from the first part,
    tensor names, shapes and types from all of them)."""
    first = parts[0]
    reader = open_gguf(first)
    shapes: dict[str, tuple[int, ...]] = {}
    rope_tensors: dict[str, list[float]] = {}
    for part, part_reader in zip(parts, [reader, *map(open_gguf, parts[1:])], strict=True):
        for tensor in part_reader.tensors:
            if tensor.tensor_type not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{part}: tensor {tensor.name} has type {type_name(tensor.tensor_type)}, which pagedkv "
                    f"cannot read; supported: {[type_name(t) for t in sorted(SUPPORTED_TYPES)]}"
                )
            shapes[tensor.name] = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            if tensor.name in ROPE_TENSORS:
                rope_tensors[tensor.name] = [float(f) for f in gguf_weight(tensor).tolist()]
    arch = field(reader, "general.architecture", None)
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{first}: unsupported architecture {arch!r} (general.architecture); "
            f"pagedkv opens GGUF models of {sorted(ARCHITECTURES)}"
        )
    if "token_embd.weight" not in shapes:
        raise GGUFError(f"{first}: no token_embd.weight tensor")

    def key(name: str, default: Any = ...) -> Any:
        value = field(reader, f"{arch}.{name}", None, first)
        if value is None and default is ...:
            raise GGUFError(f"{first} lacks the metadata key {arch}.{name!r}")
        return default if value is None else value

    heads = _uniform(key("attention.head_count"), f"{arch}.attention.head_count", first)
    hidden = key("embedding_length")
    head_dim = key("attention.key_length", None) or hidden // heads  # llama.cpp's default too
    rotary_dim = key("rope.dimension_count", head_dim)
    if rotary_dim != head_dim and arch not in _PARTIAL_ROTARY:
        raise GGUFError(
            f"{first}: partial rotary embeddings ({arch}.rope.dimension_count {rotary_dim} of {head_dim}) "
            f"are supported in {sorted(_PARTIAL_ROTARY)} files only"
        )
    if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
        raise GGUFError(
            f"{first}: {arch}.rope.dimension_count is {rotary_dim}; it must be even and at most the head "
            f"size {head_dim}"
        )
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": _uniform(key("feed_forward_length"), f"{arch}.feed_forward_length", first),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _uniform(key("attention.head_count_kv", heads), "head_count_kv", first),
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": key("context_length"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(key, rope_tensors),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "mlp_bias": "blk.0.ffn_gate.bias" in shapes,
        "torch_dtype": _FILE_DTYPES.get(field(reader, "general.file_type", None), "float32"),
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id", None),
    }
    if rotary_dim < head_dim:  # Phi-4-mini: the first rotary_dim dimensions of a head rotate
        raw["partial_rotary_factor"] = _rotary_factor(rotary_dim, head_dim)
    window = key("attention.sliding_window", None)
    if window is not None and arch == "llama":  # Mistral converts as llama, with its window
        raw |= {"architectures": ["MistralForCausalLM"], "sliding_window": window}
    if window is not None and arch == "phi3":  # every layer slides, as in transformers
        raw["sliding_window"] = window
    if arch == "phi3" and raw["rope_scaling"] and "original_max_position_embeddings" in raw["rope_scaling"]:
        # Phi-3's pretraining length is a top-level field, which wins over the scaling's
        raw["original_max_position_embeddings"] = raw["rope_scaling"]["original_max_position_embeddings"]
    if arch in _GEMMA_LAYOUTS:
        raw |= _gemma(arch, key, raw)
    if key("expert_count", 0):
        raw |= _experts(arch, key, shapes, raw["num_hidden_layers"], first)
    return raw


def _rotary_factor(rotary_dim: int, head_dim: int) -> float:
    """The ``partial_rotary_factor`` from which transformers' ``int(head_dim * factor)`` gives
    back ``rotary_dim`` (``rotary_dim / head_dim`` can round below it: 30 of 44)."""
    factor = rotary_dim / head_dim
    return factor if int(head_dim * factor) == rotary_dim else math.nextafter(factor, 1.0)


def _gemma(arch: str, key: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma's fields as llama.cpp decides them: which layers slide (``sliding_window_pattern``,
    else the family's), the query scale (not in the file), the soft-caps when written (else the
    family's defaults), Gemma 3's sliding layers' RoPE base (``rope.freq_base_swa``, else
    llama.cpp's 10,000)."""
    pattern, layers_27b = _GEMMA_LAYOUTS[arch]
    layers = raw["num_hidden_layers"]
    fields: dict[str, Any] = {
        "query_pre_attn_scalar": raw["hidden_size"] // raw["num_attention_heads"]
        if layers == layers_27b
        else raw["head_dim"],
        "sliding_window": key("attention.sliding_window"),
        "layer_types": _layer_types(key("attention.sliding_window_pattern", pattern), layers),
    }
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if key(cap, None) is not None:
            fields[cap] = key(cap)
    if arch == "gemma3":
        fields["rope_local_base_freq"] = key("rope.freq_base_swa", 10000.0)
    return fields


def _layer_types(pattern: int | list[bool], layers: int) -> list[str]:
    """Which layers slide: llama.cpp's pattern (every layer but each ``pattern``-th) or its list
    of one flag a layer (true: sliding)."""
    sliding = pattern if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(layers)]
    return ["sliding_attention" if flag else "full_attention" for flag in sliding]


def _experts(
    arch: str, key: Any, shapes: dict[str, tuple[int, ...]], layers: int, file: Path
) -> dict[str, Any]:
    """The mixture-of-experts fields of the config of a file with ``{arch}.expert_count``: Mixtral
    (converted as ``llama``, its experts ``feed_forward_length`` rows), Qwen2-MoE and Qwen3-MoE
    (``expert_feed_forward_length`` rows; a layer without a router is dense)."""
    if arch not in _NORM_EXPERT_WEIGHTS:
        raise GGUFError(
            f"{file}: mixture-of-experts GGUF files of {arch!r} ({arch}.expert_count) are not supported"
        )
    experts, used = key("expert_count"), key("expert_used_count")
    if arch == "llama":  # Mixtral converts as llama, with its experts
        size = key("expert_feed_forward_length", None) or key("feed_forward_length")
        return {
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": experts,
            "num_experts_per_tok": used,
            "intermediate_size": size,
        }
    fields = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "norm_topk_prob": bool(key("expert_weights_norm", _NORM_EXPERT_WEIGHTS[arch])),
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes],
    }
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length")
        fields["qkv_bias"] = "blk.0.attn_q.bias" in shapes
    return fields


def _uniform(value: Any, name: str, file: Path) -> int:
    """A per-model count; llama.cpp may write one per layer, which pagedkv runs only when equal."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFError(f"{file}: {name} differs between layers ({sorted(set(value))}); not supported")
        return value[0]
    return value


def _rope_scaling(key: Any, rope_tensors: dict[str, list[float]]) -> dict[str, Any] | None:
    """``rope.scaling.*`` as transformers' ``rope_scaling`` (None: plain RoPE); the divisors of
    a ``rope_freqs.weight`` tensor (llama.cpp's form of Llama 3.1's scaling) as "freq_factors";
    the ``rope_factors_long``/``_short`` tensors (Phi-3's longrope) as longrope's factors, with
    the pretraining length and the attention factor the file gives. yarn keeps llama.cpp's
    defaults, which are transformers' (beta 32 and 1, attention factor ``0.1 ln(factor) + 1``); a
    ``longrope`` type without its factor tensors is refused."""
    if ROPE_FREQS in rope_tensors:
        return {"rope_type": "freq_factors", "factors": rope_tensors[ROPE_FREQS]}
    if "rope_factors_long.weight" in rope_tensors:
        long = rope_tensors["rope_factors_long.weight"]
        scaling = {
            "rope_type": "longrope",
            "long_factor": long,
            "short_factor": rope_tensors.get("rope_factors_short.weight", long),
            "original_max_position_embeddings": key("rope.scaling.original_context_length"),
        }
        attention = key("rope.scaling.attn_factor", None)
        return scaling if attention is None else scaling | {"attention_factor": attention}
    kind = key("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "longrope":
        raise ValueError(
            "RoPE scaling 'longrope' (factors in rope_factors_* tensors) is not supported in GGUF"
        )
    scaling: dict[str, Any] = {"rope_type": kind, "factor": key("rope.scaling.factor", 1.0)}
    original = key("rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling
