"""config.json -> ModelConfig: both transformers generations, per-architecture rules, errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagedkv.memory.kv_bytes import KVSpec
from pagedkv.models import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from pagedkv.models.rope import inverse_frequencies
from tests.checkpoints import hf_config, make_checkpoint, to_v4_config

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def config(**changes) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **changes})


def test_defaults_follow_transformers():
    cfg = config()
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16
    assert cfg.rope == RopeConfig(theta=10000.0, type="default", params={})
    assert cfg.dtype == torch.float32 and not cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.layer_types == ("full_attention", "full_attention")
    # Qwen3's config class defaults head_dim to 128, not hidden / heads
    assert config(architectures=["Qwen3ForCausalLM"]).head_dim == 128


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_reads_what_transformers_writes_in_both_styles(tmp_path, arch):
    path = make_checkpoint(tmp_path, arch, head_dim=24, tie_word_embeddings=True, dtype="bfloat16")
    v5 = ModelConfig.from_pretrained(path)
    assert "rope_parameters" in json.loads((path / "config.json").read_text())
    assert v5.architecture == SUPPORTED_ARCHITECTURES[["llama", "mistral", "qwen2", "qwen3"].index(arch)]
    assert (v5.num_layers, v5.num_heads, v5.num_kv_heads, v5.head_dim) == (2, 4, 2, 24)
    assert v5.tie_word_embeddings and v5.dtype == torch.bfloat16
    assert v5.attention_bias == (arch == "qwen2") and v5.qk_norm == (arch == "qwen3")
    assert v5.o_proj_bias is False
    assert v5.eos_token_ids == (1, 3) and v5.bos_token_id == 0
    to_v4_config(path)
    assert ModelConfig.from_pretrained(path) == v5


def test_v4_rope_scaling_and_v5_rope_parameters_agree():
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    v4 = config(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **scaling}, torch_dtype="float16")
    v4_old_key = config(
        rope_theta=500000.0, rope_scaling={"type": "llama3", **scaling}, torch_dtype="float16"
    )
    v5 = config(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling}, dtype="float16")
    assert v4 == v4_old_key == v5
    assert v5.rope == RopeConfig(theta=500000.0, type="llama3", params=scaling)
    assert v5.dtype == torch.float16


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_inverse_frequencies_equal_transformers(rope):
    hf = hf_config(
        "llama", head_dim=128, hidden_size=512, rope_parameters=dict(rope), max_position_embeddings=131072
    )
    fn = ROPE_INIT_FUNCTIONS.get(rope["rope_type"], LlamaRotaryEmbedding.compute_default_rope_parameters)
    want, scaling = fn(hf)
    got = inverse_frequencies(ModelConfig.from_dict(hf.to_dict()).rope, 128)
    assert scaling == 1.0 and got.dtype == torch.float32
    assert torch.equal(got, want)


def test_llama3_scaling_moves_low_frequencies_only():
    rope = RopeConfig(
        500000.0,
        "llama3",
        {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    base = inverse_frequencies(RopeConfig(500000.0), 128)
    scaled = inverse_frequencies(rope, 128)
    assert torch.equal(scaled[:8], base[:8])  # short wavelengths untouched
    assert torch.allclose(scaled[-8:], base[-8:] / 8.0)  # long wavelengths divided by the factor
    assert 2 * math.pi / base[-1] > 8192


def test_sliding_window_rules_per_architecture():
    # Mistral: every layer slides when a window is set; v0.2+ configs set it to null
    mistral = config(architectures=["MistralForCausalLM"], sliding_window=4096)
    assert [mistral.layer_sliding_window(i) for i in range(2)] == [4096, 4096]
    assert config(architectures=["MistralForCausalLM"], sliding_window=None).layer_sliding_window(0) is None
    # Qwen2 as 4.x saved it: a window value, but use_sliding_window false -> full attention
    qwen = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32768, "max_window_layers": 1}
    assert config(**qwen, use_sliding_window=False).sliding_window is None
    on = config(**qwen, use_sliding_window=True)
    assert [on.layer_sliding_window(i) for i in range(2)] == [None, 32768]  # layers >= max_window_layers
    # Llama has no sliding window whatever the config says
    assert config(sliding_window=16).sliding_window is None


def test_kv_spec_uses_model_dtype_unless_overridden():
    cfg = config(num_key_value_heads=2, head_dim=24, torch_dtype="bfloat16")
    assert cfg.kv_spec() == KVSpec(num_layers=2, num_kv_heads=2, head_dim=24, dtype="bfloat16")
    assert cfg.kv_spec(torch.float32).dtype == "float32"
    assert cfg.kv_spec("float16").dtype == "float16"


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        config(architectures=["GPT2LMHeadModel"])
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": []}, "exactly one architecture"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "multiple of"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "mrope", "mrope_section": [2, 2, 4]}}, "mrope"),
        ({"torch_dtype": "int8"}, "int8"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor gives"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window"),
    ],
)
def test_bad_configs_raise_clear_errors(changes, message):
    raw = {**BASE, **changes}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
