"""Tiny Hugging Face checkpoints for tests, built with transformers (a test-only dependency).

``make_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)`` returns a folder that looks
like a real model download: config.json and safetensors written by ``save_pretrained`` (sharded
with an index when ``max_shard_size`` is given), generation_config.json, and a byte-level BPE
tokenizer with a chat template. Weights are seeded and deliberately larger than transformers'
init (std ~ 1/sqrt(hidden), norms around 1) so attention patterns are sharp and a wrong rotary,
mask or bias shows up in the logits. Each distinct checkpoint is built once per session and
copied into the caller's ``tmp_path``, so a test may edit its copy freely.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pagedkv.models.builtin.random_model import write_tokenizer

#: arch short name -> (transformers config class name, architecture)
ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}

#: arch short name -> config fields whose transformers defaults do not fit the tiny vocabulary
_ARCH_OVERRIDES: dict[str, dict[str, Any]] = {"phi3": {"pad_token_id": 2}}

#: Tokenizer (and model) vocabulary of the test checkpoints.
TEST_VOCAB_SIZE = 512

BASE_CONFIG: dict[str, Any] = {
    "vocab_size": TEST_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": [1, 3],
}

_SESSION_DIR: Path | None = None
_BUILT: dict[str, Path] = {}


def _session_dir() -> Path:
    global _SESSION_DIR
    if _SESSION_DIR is None:
        _SESSION_DIR = Path(tempfile.mkdtemp(prefix="pagedkv-checkpoints-"))
        atexit.register(shutil.rmtree, _SESSION_DIR, True)
    return _SESSION_DIR


def hf_config(arch: str = "llama", **overrides: Any) -> Any:
    """The transformers config object of a tiny ``arch`` model (overrides win)."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown test arch {arch!r}; choose one of {list(ARCHS)}")
    config_class, architecture = ARCHS[arch]
    kwargs = {**BASE_CONFIG, **_ARCH_OVERRIDES.get(arch, {}), **overrides}
    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [architecture]
    return config


def randomize_(model: Any, seed: int) -> None:
    """Overwrite every parameter with seeded values large enough to make mistakes visible."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


def _build(
    folder: Path, arch: str, seed: int, max_shard_size: str | None, dtype: str, overrides: dict[str, Any]
) -> None:
    import torch
    import transformers

    config = hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    write_tokenizer(folder, TEST_VOCAB_SIZE)


def make_checkpoint(
    tmp_path: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """A tiny ``arch`` checkpoint folder inside ``tmp_path``, weights saved in ``dtype``;
    ``overrides`` are config fields (e.g. ``tie_word_embeddings=True``, ``head_dim=24``,
    ``sliding_window=5``); ``max_shard_size`` (e.g. "60KB") saves shards plus an index."""
    key = json.dumps([arch, seed, max_shard_size, dtype, overrides], sort_keys=True, default=str)
    if key not in _BUILT:
        folder = _session_dir() / f"ckpt-{len(_BUILT)}"
        folder.mkdir()
        _build(folder, arch, seed, max_shard_size, dtype, overrides)
        _BUILT[key] = folder
    dest = Path(tmp_path) / f"{arch}-{len(list(Path(tmp_path).glob(f'{arch}-*')))}"
    shutil.copytree(_BUILT[key], dest)
    return dest


def to_v4_config(folder: Path) -> dict[str, Any]:
    """Rewrite ``folder/config.json`` as transformers 4.x wrote it (``rope_theta`` +
    ``rope_scaling``, ``torch_dtype``; no ``layer_types``) and return the new dict."""
    file = Path(folder) / "config.json"
    raw = json.loads(file.read_text())
    rope = dict(raw.pop("rope_parameters", None) or {})
    raw["rope_theta"] = rope.pop("rope_theta", 10000.0)
    rope_type = rope.pop("rope_type", "default")
    raw["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **rope}
    if "dtype" in raw:
        raw["torch_dtype"] = raw.pop("dtype")
    raw.pop("layer_types", None)
    file.write_text(json.dumps(raw, indent=2))
    return raw
