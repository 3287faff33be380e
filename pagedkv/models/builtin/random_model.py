"""Seeded random-weight Llama checkpoints, for tests and benchmarks that need a model of a given
shape rather than a trained one.

:func:`random_model_path` writes (once, into the cache) a 4-layer Llama of hidden 256 with seeded
N(0, 0.02) weights and the tokenizer trained on :data:`~pagedkv.models.builtin.corpus.CORPUS`;
:func:`random_llama_weights` gives the weights of any Llama config; :func:`write_tokenizer` gives
test checkpoints of any vocabulary size a real tokenizer. Every file is a pure function of the
recipe here: two builds are byte for byte the same.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from pagedkv.models.builtin.corpus import CORPUS
from pagedkv.models.builtin.hf_folder import cached_checkpoint, default_cache_dir, write_json
from pagedkv.tokenizer.bpe import BOS_ID, EOS_TOKEN_IDS, train_bpe, write_tokenizer_files

#: Cache folder name of the random-weight model; bump when its recipe changes.
RANDOM_MODEL_NAME = "builtin-tiny-llama-v1"
RANDOM_MODEL_SEED = 0

#: Vocabulary of the tokenizer trained on :data:`CORPUS`.
VOCAB_SIZE = 2048

#: The random-weight model's config.json, as transformers 4.x writes a LlamaConfig.
RANDOM_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_TOKEN_IDS,
    "use_cache": True,
}


@functools.lru_cache(maxsize=4)
def _corpus_tokenizer_json(vocab_size: int) -> str:
    return train_bpe([CORPUS], vocab_size).to_str()


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE of exactly ``vocab_size`` tokens (special tokens 0..3) trained on
    :data:`CORPUS`, the same on every run."""
    return Tokenizer.from_str(_corpus_tokenizer_json(vocab_size))


def write_tokenizer(folder: str | Path, vocab_size: int = VOCAB_SIZE) -> None:
    """The :data:`CORPUS` tokenizer's tokenizer.json and tokenizer_config.json into ``folder``."""
    write_tokenizer_files(folder, train_tokenizer(vocab_size), RANDOM_MODEL_CONFIG["max_position_embeddings"])


def random_llama_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded N(0, initializer_range) matrices and unit norms, named as transformers names them."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    std = config["initializer_range"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        weights[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(config["vocab_size"], hidden)
    return weights


def write_random_model(folder: str | Path) -> None:
    """Write the complete random-weight checkpoint into an existing, empty ``folder``."""
    folder = Path(folder)
    save_file(
        random_llama_weights(RANDOM_MODEL_CONFIG, RANDOM_MODEL_SEED),
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    write_json(folder / "config.json", RANDOM_MODEL_CONFIG)
    write_json(folder / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": EOS_TOKEN_IDS})
    write_tokenizer(folder, VOCAB_SIZE)


def random_model_path(cache_dir: str | Path | None = None) -> Path:
    """The random-weight model's folder, created on first use (see
    :func:`~pagedkv.models.builtin.hf_folder.cached_checkpoint`)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cached_checkpoint(root, RANDOM_MODEL_NAME, write_random_model)
