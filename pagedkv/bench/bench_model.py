"""The model of ``pagedkv bench throughput`` and ``parallel``: a Llama as an ordinary Hugging Face folder.

Hidden 512, 6 layers, 8 query / 4 KV heads, intermediate 1376, vocabulary 32,000, seeded random
weights -- big enough that its matrix multiplies, not Python, dominate a step, small enough for
2 cores. config.json is what transformers' ``LlamaConfig.save_pretrained`` writes, so vLLM,
transformers and llama.cpp's converter read it as a real checkpoint; the weights come from
:func:`pagedkv.models.builtin.random_model.random_llama_weights` (no transformers needed).

``--model-shape`` names a real model's shape instead (:data:`MODEL_SHAPES`: Llama-3.2-1B's,
Llama-3.1-8B's): its folder holds only config.json, and every engine draws seeded random weights
on its device (``load_format="dummy"``), so a model of billions of parameters needs neither a
download nor gigabytes of safetensors on disk.

pagedkv still loads a tokenizer with every model, so the folder carries a word-level
``tokenizer.json`` of exactly the model's vocabulary (token ``i`` is the word ``w<i>``): prompts
are token ids, so it only ever detokenizes. llama.cpp's converter needs a SentencePiece
``tokenizer.model`` instead; its worker builds that in its own folder (see rivals/llamacpp_worker.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers

#: Bump when the recipe changes, so an old cached copy is not reused.
BENCH_MODEL_NAME = "llama-h512-l6-v32000-v1"
BENCH_MODEL_SEED = 0
UNK, BOS, EOS = "<unk>", "<s>", "</s>"

#: config.json as transformers 4.x writes a LlamaConfig with these sizes.
BENCH_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": True,
}


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """Ids 0-2 are <unk>, <s>, </s>; id i >= 3 is the word ``w<i>``."""
    vocab = {UNK: 0, BOS: 1, EOS: 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def write_bench_model(folder: Path, config: dict[str, Any] = BENCH_MODEL_CONFIG) -> None:
    """config.json, generation_config.json, model.safetensors and the word-level tokenizer."""
    from safetensors.torch import save_file

    from pagedkv.models.builtin.random_model import random_llama_weights

    weights = random_llama_weights(config, BENCH_MODEL_SEED)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}
    for name, data in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tokenizer_config),
    ):
        (folder / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    word_tokenizer(config["vocab_size"]).save(str(folder / "tokenizer.json"))


def _llama3(
    hidden: int, intermediate: int, layers: int, head_dim: int, rope_factor: float, tied: bool
) -> dict:
    """config.json of a Llama 3 model (32 query / 8 KV heads, 128k vocabulary and positions)."""
    return BENCH_MODEL_CONFIG | {
        "vocab_size": 128256,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": head_dim,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": rope_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }


#: The shapes ``--model-shape`` names, as their config.json files say.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": _llama3(2048, 8192, 16, 64, 32.0, tied=True),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 128, 8.0, tied=False),
}


def shape_model_path(cache_dir: Path, name: str) -> Path:
    """The folder of the :data:`MODEL_SHAPES` entry ``name`` under ``cache_dir``: its config.json
    and generation_config.json only (load it with ``load_format="dummy"``)."""
    config = MODEL_SHAPES[name]

    def write(folder: Path) -> None:
        generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
        for file, data in (("config.json", config), ("generation_config.json", generation)):
            (folder / file).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")

    from pagedkv.models.builtin.hf_folder import cached_checkpoint

    return cached_checkpoint(cache_dir, f"{name}-config-v1", write)


def bench_model_path(cache_dir: Path) -> Path:
    """The bench model under ``cache_dir``, written on first use (atomically)."""
    from pagedkv.models.builtin.hf_folder import cached_checkpoint

    return cached_checkpoint(cache_dir, BENCH_MODEL_NAME, write_bench_model)
