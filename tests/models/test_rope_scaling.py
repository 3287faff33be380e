"""yarn, dynamic NTK and longrope against transformers, in float32.

The frequencies and attention factors equal transformers' ``ROPE_INIT_FUNCTIONS`` float for
float; a Llama checkpoint under each scaling gives transformers' logits (packed prefill and
decode, torch and C backends) and greedy tokens through ``LLM`` (block sizes 1 and 16, chunked
prefill, prefix cache), under the conditions where transformers' per-forward choice equals
pagedkv's per-model one (:mod:`pagedkv.models.rope`): sequences longer than the pretraining
length of 16, and for dynamic NTK a transformers model that has seen the whole context.
"""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedkv.models.config import ModelConfig
from pagedkv.models.rope import RotaryEmbedding, attention_factor, inverse_frequencies
from tests.checkpoints import hf_config, make_checkpoint

from .hf_reference import assert_greedy_tokens_match, assert_packed_logits_match, hf_model

SHORT = [1.0 + 0.1 * i for i in range(8)]  # head_dim 16: eight frequencies
LONG = [1.0 + 1.5 * i for i in range(8)]

#: name -> (config overrides, transformers warm-up length)
CASES = {
    "yarn": (
        {
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 100.0,
                "factor": 4.0,
                "original_max_position_embeddings": 48,
            },
        },
        0,
    ),
    "dynamic": (
        {
            "max_position_embeddings": 16,
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 100.0, "factor": 4.0},
        },
        64,
    ),
    "longrope-long": (
        {
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 100.0,
                "original_max_position_embeddings": 16,
                "short_factor": SHORT,
                "long_factor": LONG,
            },
        },
        0,
    ),
    "longrope-short": (
        {
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 100.0,
                "original_max_position_embeddings": 64,
                "short_factor": SHORT,
                "long_factor": LONG,
                "attention_factor": 1.25,
            },
        },
        0,
    ),
}

YARN_VARIANTS = [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
    {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 8.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "truncate": False,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 5e5,
        "factor": 2.0,
        "original_max_position_embeddings": 8192,
        "attention_factor": 0.9,
    },
]


def _hf_config(**rope):
    hf = hf_config(
        "llama", head_dim=128, hidden_size=512, max_position_embeddings=16384, rope_parameters=rope
    )
    return hf, ModelConfig.from_dict(hf.to_dict())


@pytest.mark.parametrize("rope", YARN_VARIANTS, ids=["plain", "mscale-beta-untruncated", "attention_factor"])
def test_yarn_frequencies_and_attention_factor_equal_transformers(rope):
    hf, cfg = _hf_config(**rope)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert torch.equal(inverse_frequencies(cfg.rope, 128, cfg.max_position_embeddings), want)
    assert attention_factor(cfg.rope) == factor != 1.0


def test_dynamic_ntk_is_computed_for_the_stretched_context():
    hf, cfg = _hf_config(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    assert cfg.max_position_embeddings == 2 * 16384
    assert cfg.rope.params["original_max_position_embeddings"] == 16384
    want, factor = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=torch.tensor(2 * 16384))
    got = inverse_frequencies(cfg.rope, 128, cfg.max_position_embeddings)
    assert torch.equal(got, want)
    assert not torch.equal(got, ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu")[0])  # not plain RoPE
    assert attention_factor(cfg.rope) == factor == 1.0


@pytest.mark.parametrize("max_positions", [4096, 131072])
def test_longrope_picks_its_factors_by_the_models_context(max_positions):
    short, long = [1.0 + 0.01 * i for i in range(64)], [1.0 + 0.5 * i for i in range(64)]
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long}
    hf = hf_config(
        "llama",
        head_dim=128,
        hidden_size=512,
        max_position_embeddings=max_positions,
        rope_parameters={**rope, "original_max_position_embeddings": 4096},
    )
    cfg = ModelConfig.from_dict(hf.to_dict())
    want, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=max_positions)
    assert torch.equal(inverse_frequencies(cfg.rope, 128, cfg.max_position_embeddings), want)
    assert attention_factor(cfg.rope) == factor
    assert (factor > 1.0) == (max_positions > 4096)


def test_the_attention_factor_scales_cos_and_sin():
    _, cfg = _hf_config(**YARN_VARIANTS[0])
    plain = RotaryEmbedding(ModelConfig.from_dict(hf_config("llama").to_dict()).rope, 128, 64)
    scaled = RotaryEmbedding(cfg.rope, 128, 64)
    positions = torch.arange(64)
    cos, sin = scaled.cos_sin(positions, torch.float32)
    scaled.scale = 1.0
    scaled._tables.clear()
    cos1, sin1 = scaled.cos_sin(positions, torch.float32)
    assert torch.equal(cos, cos1 * attention_factor(cfg.rope)) and torch.equal(
        sin, sin1 * attention_factor(cfg.rope)
    )
    assert plain.scale == 1.0


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Per case: checkpoint folder and the warmed transformers model."""
    refs = {}
    for name, (overrides, warmup) in CASES.items():
        path = make_checkpoint(tmp_path_factory.mktemp(name), "llama", **overrides)
        refs[name] = (path, hf_model(path, warmup))
    return refs


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_packed_prefill_and_decode_logits_match_transformers(references, case, backend):
    assert_packed_logits_match(*references[case], backend)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_tokens_equal_transformers(references, case, block_size):
    assert_greedy_tokens_match(*references[case], block_size)


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "mrope", "mrope_section": [2, 2, 4]}, "unsupported RoPE scaling 'mrope'"),
        ({"rope_type": "dynamic"}, "dynamic RoPE scaling needs a 'factor'"),
    ],
)
def test_unsupported_scalings_are_refused_by_name(rope, message):
    raw = hf_config("llama").to_dict() | {"rope_scaling": rope, "rope_parameters": None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)
