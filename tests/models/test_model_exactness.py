"""Our paged, packed forward pass against transformers' own model, in float32.

Each tiny checkpoint is built and saved by transformers; we load the folder with our loader,
run several prompts of different lengths packed into one prefill step over a paged KV cache,
then one packed decode step, and compare with transformers running each prompt alone.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedkv.models import load_model
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint, to_v4_config

from .paging import PagedBatch

TOL = 1e-4
PROMPT_LENS = (11, 3, 7)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}

CASES = {
    # GQA everywhere (4 query heads, 2 KV heads); head_dim 24 != hidden/heads = 16 where set.
    "llama-untied-head_dim24": ("llama", {"head_dim": 24}),
    "llama-tied-llama3-rope": ("llama", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope-biases": (
        "llama",
        {
            "rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "mistral-sliding5": ("mistral", {"sliding_window": 5}),
    "qwen2-tied-qkv-bias": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qknorm-head_dim24-sharded": ("qwen3", {"head_dim": 24, "max_shard_size": "60KB"}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
}


def prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, TEST_VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_cache():
    """transformers models by folder, so each is loaded once per module."""
    return {}


def reference(hf_cache: dict, path, token_ids: list[int]) -> torch.Tensor:
    if path not in hf_cache:
        hf_cache[path] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    with torch.no_grad():
        return hf_cache[path](torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_packed_prefill_and_decode_match_transformers(tmp_path, hf_cache, case, backend):
    arch, overrides = CASES[case]
    path = make_checkpoint(tmp_path, arch, **overrides)
    if "max_shard_size" in overrides:
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    model = load_model(path, dtype=torch.float32, attention_backend=backend)
    batch = PagedBatch(model, max_len=max(PROMPT_LENS) + 1, num_seqs=len(PROMPT_LENS))
    seqs = prompts()

    ours = batch.step(seqs)
    for seq, got in zip(seqs, ours, strict=True):
        want = reference(hf_cache, path, seq)
        assert got.shape == want.shape == (len(seq), TEST_VOCAB_SIZE)
        assert (got - want).abs().max().item() < TOL

    # One decode step: each sequence appends its greedy token; the new logits must equal the
    # reference's last row for the whole sequence (exercises reading the paged cache back).
    next_tokens = [[int(logits[-1].argmax())] for logits in ours]
    decoded = batch.step(next_tokens)
    for seq, nxt, got in zip(seqs, next_tokens, decoded, strict=True):
        want = reference(hf_cache, path, seq + nxt)[-1:]
        assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transformers_4x_config_gives_identical_logits(tmp_path, arch):
    """The same weights under a 4.x-style config.json (rope_theta/rope_scaling/torch_dtype)."""
    overrides = (
        {"rope_parameters": LLAMA3_ROPE} if arch == "llama" else {"rope_parameters": {"rope_theta": 1e6}}
    )
    path = make_checkpoint(tmp_path, arch, **overrides)
    v5 = load_model(path, attention_backend="torch")
    raw = to_v4_config(path)
    assert "rope_parameters" not in raw and "dtype" not in raw and raw["torch_dtype"] == "float32"
    v4 = load_model(path, attention_backend="torch")
    assert v4.config == v5.config
    seqs = prompts(seed=2)
    a = PagedBatch(v5, max(PROMPT_LENS), len(seqs)).step(seqs)
    b = PagedBatch(v4, max(PROMPT_LENS), len(seqs)).step(seqs)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_tracks_float32(tmp_path, dtype):
    path = make_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)
    full = load_model(path, dtype="float32", attention_backend="torch")
    half = load_model(path, dtype=dtype, attention_backend="torch")
    assert half.model.layers[0].self_attn.qkv_proj.weight.dtype == dtype
    seqs = prompts(seed=3)
    want = PagedBatch(full, max(PROMPT_LENS), len(seqs)).step(seqs)
    got = PagedBatch(half, max(PROMPT_LENS), len(seqs)).step(seqs)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
        # half precision drifts, but stays close relative to the logits' spread
        assert (g - w).abs().max().item() < 0.05 * w.std().item() * 10
