"""The random-weight model of tests and benchmarks: created once, atomically, deterministic, and
a valid Hugging Face checkpoint that transformers loads and agrees with."""

from __future__ import annotations

import threading

import torch
import transformers

from pagedkv.models import ModelConfig, load_model
from pagedkv.models.builtin.random_model import RANDOM_MODEL_NAME, random_model_path
from pagedkv.tokenizer import load_tokenizer

from ..paging import PagedBatch


def test_created_once_in_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path))
    path = random_model_path()
    assert path == tmp_path / RANDOM_MODEL_NAME
    files = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert random_model_path() == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == files  # not rewritten
    assert [p.name for p in tmp_path.iterdir()] == [RANDOM_MODEL_NAME]  # no temporary folders left
    assert (path / "model.safetensors").stat().st_size < 20 * 2**20


def test_concurrent_first_use_yields_one_complete_model(tmp_path):
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(random_model_path(tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / RANDOM_MODEL_NAME] * 3
    assert [p.name for p in tmp_path.iterdir()] == [RANDOM_MODEL_NAME]
    load_model(results[0])  # complete: every weight present


def test_deterministic_across_builds(tmp_path):
    a = random_model_path(tmp_path / "a")
    b = random_model_path(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_config_fits_the_contract(tmp_path):
    cfg = ModelConfig.from_pretrained(random_model_path(tmp_path))
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        "LlamaForCausalLM",
        256,
        4,
        8,
        2,
    )
    assert cfg.max_position_embeddings == 4096
    assert cfg.vocab_size == load_tokenizer(random_model_path(tmp_path)).vocab_size


def test_transformers_loads_it_and_agrees(tmp_path):
    path = random_model_path(tmp_path)
    ours = load_model(path, attention_backend="torch")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    tok = load_tokenizer(path)
    prompts = [tok.encode("Paged attention splits the cache into blocks."), tok.encode("Hello")]
    got = PagedBatch(ours, max_len=16, num_seqs=2, block_size=16).step(prompts)
    for ids, logits in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        assert (logits - want).abs().max().item() < 1e-4
