"""Our rotary embedding against transformers', bit for bit.

The model rotates with a sign-folded sin table and ``torch.roll`` instead of transformers'
``rotate_half``; the claim is that every float comes out identical, for packed, unsorted
positions, query and key heads rotated together, and half precision.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pagedkv.models import RopeConfig
from pagedkv.models.rope import RotaryEmbedding, apply_rotary, inverse_frequencies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 24, 128])
def test_rotation_is_bit_identical_to_transformers(dtype, head_dim):
    rope = RopeConfig(theta=10000.0, type="default", params={})
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.tensor([7, 0, 3, 1000, 4095, 12, 12])  # packed sequences, repeats allowed
    tokens, q_heads, k_heads = positions.shape[0], 4, 2
    q = torch.randn(tokens, q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, k_heads, head_dim, generator=gen).to(dtype)

    # transformers: [batch, heads, seq, head_dim] with cos/sin [batch, seq, head_dim]
    freqs = positions[:, None].float() * inverse_frequencies(rope, head_dim)
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos().to(dtype), emb.sin().to(dtype)
    )

    cos, sin = RotaryEmbedding(rope, head_dim, 4096).cos_sin(positions, dtype)
    assert cos.dtype == sin.dtype == dtype
    got = apply_rotary(torch.cat((q, k), dim=1), cos, sin)
    assert torch.equal(got[:, :q_heads], want_q[0].transpose(0, 1))
    assert torch.equal(got[:, q_heads:], want_k[0].transpose(0, 1))


def _per_step_formula(rope: RopeConfig, head_dim: int, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sign-folded sin as computed for the step's positions alone (no table)."""
    freqs = positions[:, None].float() * inverse_frequencies(rope, head_dim)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin().to(dtype)
    sin[:, : head_dim // 2].neg_()
    return emb.cos().to(dtype), sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_grow_on_demand_and_equal_the_per_step_formula(dtype):
    rope = RopeConfig(theta=500000.0, type="default", params={})
    rotary = RotaryEmbedding(rope, 64, max_positions=20000)
    for positions in (torch.tensor([3, 0, 4095]), torch.tensor([4096, 9000, 5]), torch.tensor([19999, 1])):
        cos, sin = rotary.cos_sin(positions, dtype)
        want_cos, want_sin = _per_step_formula(rope, 64, positions, dtype)
        assert cos.shape == (positions.shape[0], 1, 64)
        assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)
    # grown in powers of two from 4096, never past the model's positions
    assert rotary.positions_covered(dtype, torch.device("cpu")) == 20000
    with pytest.raises(IndexError):
        rotary.cos_sin(torch.tensor([20000]), dtype)


def test_a_bound_from_the_plan_grows_the_tables_without_reading_the_positions():
    """With ``bound`` (the step's longest context) the growth is decided on the host: the same
    rows as without it, and a bound at the model's limit sizes the tables once for good (what a
    CUDA graph captured afterwards relies on)."""
    rope = RopeConfig(theta=10000.0, type="default", params={})
    rotary = RotaryEmbedding(rope, 32, max_positions=10000)
    positions = torch.tensor([7, 5000, 2])
    cos, sin = rotary.cos_sin(positions, torch.float32, bound=5001)
    want_cos, want_sin = _per_step_formula(rope, 32, positions, torch.float32)
    assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)
    cpu = torch.device("cpu")
    assert rotary.positions_covered(torch.float32, cpu) == 8192
    rotary.cos_sin(torch.tensor([0]), torch.float32, bound=10000)
    assert rotary.positions_covered(torch.float32, cpu) == 10000
    cos, _ = rotary.cos_sin(torch.tensor([9999]), torch.float32, bound=10000)
    assert torch.equal(cos[:, 0], _per_step_formula(rope, 32, torch.tensor([9999]), torch.float32)[0])
