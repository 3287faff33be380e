"""The fused C layer ops against their torch reference (:class:`TorchOps`), and the fallback.

float32: within 1e-6 relative (the RMSNorm mean of squares sums in another order, silu's exp is
another ~1 ulp approximation). bfloat16 and float16: rotary and the KV write are bit-exact
(the same multiplies and adds, rounded at the same points); silu * up is within one ulp of the
storage dtype and RMSNorm within two: the float32 scale or exp may differ in its last bit, which
moves a rounding only when it sits on a tie, and RMSNorm rounds twice (the cast back, then the
weight multiply), so a tie flipped at the first rounding can end two ulps away. Ties are rare:
greedy agreement with transformers is unchanged. The model-level agreement with transformers is in
test_model_exactness.py, test_engine_exactness.py and test_bf16_agreement.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.attention import AttentionMetadata, LayerKV
from pagedkv.kernels import library
from pagedkv.models import layer_ops, load_model
from pagedkv.models.config import RopeConfig
from pagedkv.models.layer_ops import TORCH_OPS, NativeOps, QKVLayout, TorchOps
from pagedkv.models.rope import RotaryEmbedding
from tests.checkpoints import make_checkpoint
from tests.kernels.no_compiler import run_without_compiler
from tests.models.test_model_exactness import PROMPT_LENS, prompts

from .paging import PagedBatch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


WITHOUT_COMPILER = """
import torch
from pagedkv.models import layer_ops, load_model
from tests.models.paging import PagedBatch
from tests.models.test_model_exactness import PROMPT_LENS, prompts

assert layer_ops.select(torch.empty(0)) is layer_ops.TORCH_OPS
model = load_model({model!r}, dtype=torch.float32)
seqs = prompts()
torch.save(PagedBatch(model, max(PROMPT_LENS) + 1, len(seqs)).step(seqs), {saved!r})
"""


def native(dtype: torch.dtype) -> NativeOps:
    ops = layer_ops.select(torch.empty(0, dtype=dtype))
    assert isinstance(ops, NativeOps), library.why_unavailable()  # CI has a C compiler
    return ops


def assert_close_in(dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor, ulps: int) -> None:
    """float32 within 1e-6 relative; half types within ``ulps`` units in the last place."""
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    bits_got, bits_want = got.view(torch.int16).int(), want.view(torch.int16).int()
    same_sign = (got >= 0) == (want >= 0)
    assert bool(((bits_got - bits_want).abs() <= ulps)[same_sign].all()), (got - want).abs().max()
    assert bool((got == want)[~same_sign].all())  # across zero only an exact zero may differ


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


sizes = st.integers(1, 300)  # hidden sizes not a multiple of the vector width among them


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), size=sizes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_rms_norm_and_fused_add_match_torch(rows, size, dtype, seed):
    ops = native(dtype)
    x, residual = randn(rows, size, dtype=dtype, seed=seed), randn(rows, size, dtype=dtype, seed=seed + 1) * 4
    weight = randn(size, dtype=dtype, seed=seed + 2)
    assert_close_in(dtype, ops.rms_norm(x, weight, 1e-6), TORCH_OPS.rms_norm(x, weight, 1e-6), ulps=2)

    want_x, want_residual = TORCH_OPS.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    got_x, got_residual = ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    assert torch.equal(got_residual, want_residual)  # one add, rounded once: exact
    assert_close_in(dtype, got_x, want_x, ulps=2)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), size=sizes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_silu_and_mul_matches_torch(rows, size, dtype, seed):
    gate_up = randn(rows, 2 * size, dtype=dtype, seed=seed) * 6
    gate_up[0, 0] = -200.0  # exp(200) overflows: silu is -0, as in torch
    got = native(dtype).silu_and_mul(gate_up)
    assert_close_in(dtype, got, TORCH_OPS.silu_and_mul(gate_up), ulps=1)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), size=sizes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_gemma_offset_norm_and_gelu_tanh_match_torch(rows, size, dtype, seed):
    """Gemma's ``rmsnorm(x) * (1 + w)`` rounds once (so within one ulp). GeGLU's tanh is libm's
    where torch's is Sleef's, each within an ulp; where ``1 + tanh`` cancels (gate below about
    -4) that ulp is the whole of a tiny result, so there it agrees within 1e-5 absolute."""
    ops = native(dtype)
    x, weight = randn(rows, size, dtype=dtype, seed=seed), randn(size, dtype=dtype, seed=seed + 1)
    want = TORCH_OPS.offset_rms_norm(x, weight, 1e-6)
    assert_close_in(dtype, ops.offset_rms_norm(x, weight, 1e-6), want, ulps=1)
    gate_up = randn(rows, 2 * size, dtype=dtype, seed=seed + 2) * 6
    gate_up[0, 0] = -200.0  # tanh saturates: gelu is -0, as in torch
    got, want = ops.gelu_tanh_and_mul(gate_up), TORCH_OPS.gelu_tanh_and_mul(gate_up)
    assert got.dtype == dtype and got.shape == want.shape
    rtol = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-5)


def _writing(slots: torch.Tensor) -> AttentionMetadata:
    """Metadata for a step that writes ``slots`` (the attention part is not used here)."""
    tables = torch.zeros(1, 1, dtype=torch.int32)
    return AttentionMetadata(slots, tables, torch.ones(1, dtype=torch.int32), torch.tensor([0, 1]), 1)


def _kv_layer(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> LayerKV:
    """A pool filled with NaN: a slot the write should not touch stays NaN."""
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return LayerKV(torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "qk_norm", "offset"),
    [(24, True, False), (32, False, False), (64, True, False), (128, False, False), (64, True, True)],
)
def test_rotary_and_kv_write_match_torch(dtype, head_dim, qk_norm, offset):
    """``offset``: Gemma 3's ``1 + weight`` q/k norms."""
    heads, kv_heads, tokens = 6, 2, 7
    gen = torch.Generator().manual_seed(head_dim)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=head_dim) * 3
    norms = {}
    if qk_norm:
        norms = {
            "q_norm": randn(head_dim, dtype=dtype, seed=1),
            "k_norm": randn(head_dim, dtype=dtype, seed=2),
        }
    layout = QKVLayout(heads, kv_heads, head_dim, **norms, eps=1e-6, offset=offset)
    positions = torch.randint(0, 5000, (tokens,), generator=gen)
    cos, sin = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 5000).cos_sin(positions, dtype)
    slots = torch.randperm(40, generator=gen)[:tokens]
    slots[2] = -1  # padding: written nowhere

    want_layer, got_layer = (_kv_layer(10, 4, kv_heads, head_dim, dtype) for _ in range(2))
    want_q = TORCH_OPS.rotary_write_kv(qkv, layout, cos, sin, want_layer, _writing(slots))
    got_q = native(dtype).rotary_write_kv(qkv, layout, cos, sin, got_layer, _writing(slots))
    ulps = 2 if qk_norm else 0  # the norm's float32 scale may differ in its last bit
    assert_close_in(dtype, got_q, want_q.contiguous(), ulps)
    written = slots[slots >= 0]
    for got, want in ((got_layer.key, want_layer.key), (got_layer.value, want_layer.value)):
        flat_got, flat_want = got.view(-1, kv_heads, head_dim), want.view(-1, kv_heads, head_dim)
        assert_close_in(dtype, flat_got[written], flat_want[written], ulps)
        assert torch.equal(flat_got.isnan(), flat_want.isnan())  # no other slot was written


def test_quantized_cache_writes_through_torch():
    """fp8/int8 pools keep the torch write (quantize + scales); the rotation is the same."""
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 3
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.float32, seed=5)
    cos, sin = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 4096).cos_sin(
        torch.arange(tokens), torch.float32
    )
    shape = (2, 4, kv_heads, head_dim)
    layers = [
        LayerKV(
            *(torch.zeros(shape, dtype=torch.int8) for _ in range(2)),
            *(torch.zeros(shape[:3]) for _ in range(2)),
        )
        for _ in range(2)
    ]
    layout, slots = QKVLayout(heads, kv_heads, head_dim), torch.tensor([0, 5, 6])
    want_q = TORCH_OPS.rotary_write_kv(qkv, layout, cos, sin, layers[0], _writing(slots))
    got_q = native(torch.float32).rotary_write_kv(qkv, layout, cos, sin, layers[1], _writing(slots))
    assert torch.equal(got_q, want_q)
    for field in ("key", "value", "key_scale", "value_scale"):
        assert torch.equal(getattr(layers[1], field), getattr(layers[0], field))


def test_without_the_library_the_model_runs_on_torch_ops(tmp_path):
    """No compiler: the torch ops are taken (with one warning) and give the same logits as the
    compiled ones, to float32 rounding."""
    path = make_checkpoint(tmp_path, "qwen3", head_dim=24)
    model = load_model(path, dtype=torch.float32)
    seqs = prompts()
    fused_logits = PagedBatch(model, max(PROMPT_LENS) + 1, len(seqs)).step(seqs)
    saved = tmp_path / "logits.pt"
    done = run_without_compiler(WITHOUT_COMPILER.format(model=str(path), saved=str(saved)), tmp_path)
    assert done.stderr.count("fused CPU layer ops unavailable, using torch ops: no C compiler found") == 1
    for got, want in zip(torch.load(saved), fused_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_takes_every_fused_op_on_the_cpu(tmp_path, monkeypatch, dtype):
    """No per-call fallback to the torch ops (a guard that always failed would pass every
    agreement test while fusing nothing)."""
    path = make_checkpoint(tmp_path, "qwen3", head_dim=24)
    model = load_model(path, dtype=dtype)

    def refuse(*args, **kwargs):
        raise AssertionError("fell back to the torch op")

    for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_write_kv"):
        monkeypatch.setattr(TorchOps, name, refuse)
    seqs = prompts()
    batch = PagedBatch(model, max(PROMPT_LENS) + 1, len(seqs))
    batch.step(seqs)
    batch.step([[5]] * len(seqs))  # and a decode step
