"""The built-in model: a tiny Llama with seeded random weights, so the demo needs no download.

It is written once to a cache folder as an ordinary Hugging Face checkpoint (config.json,
model.safetensors in HF weight names, tokenizer.json, tokenizer_config.json with a chat
template) and then loaded through the same loader as any real model, so the demo exercises the
real path end to end. transformers is not needed: weights come from torch, the tokenizer is a
byte-level BPE trained with the ``tokenizers`` library on :data:`pagedkv.models.corpus.CORPUS`.
Its weights are random: it produces fluent-looking gibberish, never meaningful text.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pagedkv.models.corpus import CORPUS

#: Bump when the recipe changes, so an old cached copy is not reused.
BUILTIN_NAME = "builtin-tiny-llama-v1"
BUILTIN_SEED = 0

#: What to tell users whenever the built-in model is in use.
BUILTIN_NOTE = (
    "built-in tiny Llama (4 layers, hidden 256) with RANDOM weights: its text is gibberish; "
    "pass --model PATH for a real Hugging Face checkpoint"
)

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]  # ids 0..3, in this order

#: ChatML turns; like Llama 3's template it starts with the BOS token itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

VOCAB_SIZE = 2048

#: The built-in model's config.json, as transformers 4.x writes a LlamaConfig.
BUILTIN_CONFIG: dict[str, Any] = {
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
    "bos_token_id": 0,
    "eos_token_id": [1, 3],
    "use_cache": True,
    "pagedkv_note": BUILTIN_NOTE,
}


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus yields only {tok.get_vocab_size()} tokens, fewer than {vocab_size}")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, 0)]
            ),
        ]
    )
    return tok.to_str()


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE of exactly ``vocab_size`` tokens (special tokens 0..3), the same on
    every run: BPE training on fixed text is deterministic."""
    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size))


def write_tokenizer(folder: str | Path, vocab_size: int = VOCAB_SIZE) -> None:
    """tokenizer.json and tokenizer_config.json (special tokens, chat template) into ``folder``."""
    folder = Path(folder)
    (folder / "tokenizer.json").write_text(_trained_tokenizer_json(vocab_size), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": BUILTIN_CONFIG["max_position_embeddings"],
    }
    _write_json(folder / "tokenizer_config.json", config)


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


def write_builtin(folder: str | Path) -> None:
    """Write the complete built-in checkpoint into an existing, empty ``folder``."""
    folder = Path(folder)
    save_file(
        random_llama_weights(BUILTIN_CONFIG, BUILTIN_SEED),
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    _write_json(folder / "config.json", BUILTIN_CONFIG)
    _write_json(
        folder / "generation_config.json",
        {"bos_token_id": BUILTIN_CONFIG["bos_token_id"], "eos_token_id": BUILTIN_CONFIG["eos_token_id"]},
    )
    write_tokenizer(folder, BUILTIN_CONFIG["vocab_size"])


def default_cache_dir() -> Path:
    """``$PAGEDKV_CACHE``, else ``~/.cache/pagedkv``."""
    env = os.environ.get("PAGEDKV_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pagedkv"


def builtin_model_path(cache_dir: str | Path | None = None) -> Path:
    """The built-in model's folder, created on first use (see :func:`cached_checkpoint`)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cached_checkpoint(root, BUILTIN_NAME, write_builtin)


def cached_checkpoint(root: Path, name: str, write: Callable[[Path], None]) -> Path:
    """``root/name``, made by ``write(folder)`` on first use.

    Creation is atomic: the files are written to a temporary folder beside the target, which is
    then renamed into place, so a crash or a concurrent first use never leaves a half-written
    model behind (the loser of a race simply discards its copy).
    """
    target = root / name
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        os.chmod(tmp, 0o755)
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
