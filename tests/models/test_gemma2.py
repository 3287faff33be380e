"""Gemma 2 and Gemma 3 (their module, :mod:`pagedkv.models.gemma2`) against transformers' own models.

Every Gemma 2 switch is on in the tiny checkpoints and set to bite: a sliding window shorter
than the prompts on the even layers, attention scaled by ``query_pre_attn_scalar`` (not
``head_dim``), score and logit soft-caps small enough to flatten the random logits, tied
embeddings, the ``1 + weight`` norms, the ``sqrt(hidden)`` embedding scale and the GeGLU.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedkv import LLM, SamplingParams
from pagedkv.models import load_model
from pagedkv.models.config import ModelConfig
from pagedkv.models.gemma2 import Gemma2ForCausalLM
from pagedkv.models.layer_ops import TORCH_OPS
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint, to_v4_config

from .paging import PagedBatch
from .test_model_exactness import PROMPT_LENS, TOL, prompts, reference

GEMMA2 = {
    "sliding_window": 5,
    "query_pre_attn_scalar": 24,
    "attn_logit_softcapping": 2.0,
    "final_logit_softcapping": 3.0,
    "tie_word_embeddings": True,
    "num_hidden_layers": 3,
}
#: Gemma 3's switches: q/k norms, its own sliding pattern, the default RoPE bases (1e6 full, 1e4 sliding)
GEMMA3 = {
    "sliding_window": 5,
    "query_pre_attn_scalar": 24,
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
}


@pytest.fixture(scope="module")
def hf_cache():
    return {}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_packed_prefill_and_decode_logits_match_transformers(tmp_path, hf_cache, backend):
    path = make_checkpoint(tmp_path, "gemma2", **GEMMA2)
    model = load_model(path, dtype=torch.float32, attention_backend=backend)
    assert isinstance(model, Gemma2ForCausalLM)
    assert model.config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    batch = PagedBatch(model, max_len=max(PROMPT_LENS) + 1, num_seqs=len(PROMPT_LENS))
    seqs = prompts()
    ours = batch.step(seqs)
    for seq, got in zip(seqs, ours, strict=True):
        want = reference(hf_cache, path, seq)
        assert got.shape == want.shape == (len(seq), TEST_VOCAB_SIZE)
        assert (got - want).abs().max().item() < TOL
        assert want.abs().max().item() <= GEMMA2["final_logit_softcapping"]  # the cap binds
    next_tokens = [[int(logits[-1].argmax())] for logits in ours]
    decoded = batch.step(next_tokens)
    for seq, nxt, got in zip(seqs, next_tokens, decoded, strict=True):
        want = reference(hf_cache, path, seq + nxt)[-1:]
        assert (got - want).abs().max().item() < TOL


def test_each_switch_changes_the_logits(tmp_path, hf_cache):
    """The reference differs when a soft-cap or the attention scale is dropped from the config:
    the exactness test above would catch a model that ignored any of them."""
    seq = prompts()[0]
    base = reference(hf_cache, make_checkpoint(tmp_path, "gemma2", **GEMMA2), seq)
    for key, value in (("attn_logit_softcapping", None), ("query_pre_attn_scalar", 16)):
        other = reference(hf_cache, make_checkpoint(tmp_path, "gemma2", **{**GEMMA2, key: value}), seq)
        assert (other - base).abs().max().item() > 100 * TOL, key


MAX_NEW = 10


def _engine_prompts() -> list[list[int]]:
    """Mixed lengths, two sharing a 24-token prefix (longer than the window and one block)."""
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(4, TEST_VOCAB_SIZE, (24,), generator=gen).tolist()
    own = [torch.randint(4, TEST_VOCAB_SIZE, (n,), generator=gen).tolist() for n in (3, 19, 30)]
    return [*own, shared + [5, 6, 7], shared + [9]]


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def engine_reference(request, tmp_path_factory):
    arch = request.param
    overrides = {**(GEMMA2 if arch == "gemma2" else GEMMA3), "sliding_window": 8}
    path = make_checkpoint(tmp_path_factory.mktemp(arch), arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for prompt in _engine_prompts():
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, max_new_tokens=MAX_NEW, do_sample=False, attention_mask=torch.ones_like(ids)
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return path, outs


@pytest.mark.parametrize("block_size", [1, 16])
def test_engine_greedy_tokens_equal_transformers(engine_reference, block_size):
    """Chunked prefill (a 12-token budget) interleaved with decodes (on the C decode stack),
    prefix-cache hits."""
    path, expected = engine_reference
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=block_size,
        num_kv_blocks=1024 // block_size,
        max_num_batched_tokens=12,
    )
    assert llm.engine.executor.runtime["decode layers"] == "C stack"
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(_engine_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.kv_stats()
    assert stats["prefix_cache_hits_tokens"] > 0
    assert stats["blocks_used"] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_offset_norm_rounds_as_transformers(dtype):
    """``rmsnorm(x) * (1 + w)`` rounded once, bit for bit transformers' Gemma2RMSNorm; in
    bfloat16 that differs from folding ``1 + w`` into a Llama-style norm (weight after the cast)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen).to(dtype)
    norm = Gemma2RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
        want = norm(x)
    got = TORCH_OPS.offset_rms_norm(x, norm.weight.detach(), 1e-6)
    assert got.dtype == dtype and torch.equal(got, want)
    if dtype == torch.bfloat16:
        folded = TORCH_OPS.rms_norm(x, (1.0 + norm.weight.detach().float()).to(dtype), 1e-6)
        assert not torch.equal(folded, want)


def test_config_defaults_and_4x_layer_types(tmp_path):
    """Without ``layer_types`` (transformers 4.x) the even layers slide, as Gemma2Config says."""
    path = make_checkpoint(tmp_path, "gemma2", **GEMMA2)
    v5 = ModelConfig.from_pretrained(path)
    to_v4_config(path)
    v4 = ModelConfig.from_pretrained(path)
    assert v4 == v5
    assert v5.attention_scale == 24**-0.5
    assert (v5.attn_logit_softcapping, v5.final_logit_softcapping) == (2.0, 3.0)
    assert v5.tie_word_embeddings
    raw = {
        "architectures": ["Gemma2ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 1,
    }
    cfg = ModelConfig.from_dict(raw)  # transformers' Gemma2Config defaults fill the rest
    assert (cfg.head_dim, cfg.sliding_window, cfg.query_pre_attn_scalar) == (256, 4096, 256)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    with pytest.raises(ValueError, match="Gemma2ForCausalLM uses 'gelu_pytorch_tanh'"):
        ModelConfig.from_dict({**raw, "hidden_activation": "silu"})
    with pytest.raises(ValueError, match="Gemma2ForCausalLM"):
        ModelConfig.from_dict({**raw, "architectures": ["FalconForCausalLM"]})


def test_bfloat16_tracks_float32(tmp_path):
    path = make_checkpoint(tmp_path, "gemma2", **GEMMA2)
    full = load_model(path, dtype="float32", attention_backend="torch")
    half = load_model(path, dtype="bfloat16", attention_backend="torch")
    seqs = prompts(seed=3)
    want = PagedBatch(full, max(PROMPT_LENS), len(seqs)).step(seqs)
    got = PagedBatch(half, max(PROMPT_LENS), len(seqs)).step(seqs)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
        assert (g - w).abs().max().item() < 0.5 * w.std().item()


def test_q8_0_on_load_tracks_the_float_model(tmp_path):
    """The projections kept in Q8_0 blocks (the GeGLU's packed gate/up among them) on the CPU.
    Uncapped: the test caps, small enough to saturate, magnify any error of the weights."""
    uncapped = {**GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": None}
    path = make_checkpoint(tmp_path, "gemma2", **uncapped)
    full = load_model(path, dtype="float32")
    q8 = load_model(path, dtype="float32", quantization="q8_0")
    assert q8.quantization.startswith("q8_0 on load")
    seqs = prompts(seed=4)
    want = PagedBatch(full, max(PROMPT_LENS), len(seqs)).step(seqs)
    got = PagedBatch(q8, max(PROMPT_LENS), len(seqs)).step(seqs)
    for g, w in zip(got, want, strict=True):
        assert 0 < (g - w).abs().max().item() < 0.05 * w.std().item()


# -- Gemma 3 (text): the same module with q/k norms, no caps, a local RoPE base ------------------


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_gemma3_logits_match_transformers(tmp_path, hf_cache, backend):
    path = make_checkpoint(tmp_path, "gemma3", **GEMMA3)
    model = load_model(path, dtype=torch.float32, attention_backend=backend)
    cfg = model.config
    assert isinstance(model, Gemma2ForCausalLM) and cfg.qk_norm and cfg.final_logit_softcapping is None
    assert (cfg.rope.theta, cfg.local_rope.theta) == (1e6, 10000.0)  # two tables, both used
    batch = PagedBatch(model, max_len=max(PROMPT_LENS) + 1, num_seqs=len(PROMPT_LENS))
    seqs = prompts()
    ours = batch.step(seqs)
    for seq, got in zip(seqs, ours, strict=True):
        assert (got - reference(hf_cache, path, seq)).abs().max().item() < TOL
    next_tokens = [[int(logits[-1].argmax())] for logits in ours]
    for seq, nxt, got in zip(seqs, next_tokens, batch.step(next_tokens), strict=True):
        assert (got - reference(hf_cache, path, seq + nxt)[-1:]).abs().max().item() < TOL


def test_gemma3_layer_types_default_to_five_sliding_to_one_full():
    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 7,
        "num_attention_heads": 1,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
    }
    cfg = ModelConfig.from_dict(raw)  # a transformers 4.x config.json
    assert [t == "full_attention" for t in cfg.layer_types] == [False] * 5 + [True, False]
    assert (cfg.rope.theta, cfg.local_rope.theta) == (1e6, 1e4)
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
