"""Linear layers on packed weights (pagedkv's tiled float32 kernel, oneDNN): the same numbers as
F.linear, nothing held twice, tied heads left plain, and the kernel chosen for the device and
dtype (or refused with a reason)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pagedkv import cbuild
from pagedkv.kernels import library, tiled_gemm
from pagedkv.kernels.library import KernelLibrary
from pagedkv.kernels.tiled_gemm import (
    BF16_DOT,
    bf16_loop,
    from_paired_tiles,
    from_tiles,
    tiled_gate_up,
    tiled_linear,
    tiled_rows,
    to_paired_tiles,
    to_tiles,
)
from pagedkv.models import load_model
from pagedkv.models.layer_ops import native_ops
from pagedkv.models.linear import (
    BUFFER_ROWS,
    ONEDNN,
    TILED,
    TORCH,
    Linear,
    OutputBuffer,
    choose_linear_kernel,
)
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint

from .paging import PagedBatch


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(4, TEST_VOCAB_SIZE, (n,), generator=gen).tolist() for n in (9, 1, 4)]


BF16_TILES = tiled_gemm.why_unavailable(torch.bfloat16) is None  # AVX512-BF16, or AVX2 with FMA
# oneDNN multiplies bfloat16 natively from AVX-512 on; an AVX2-only host
# refuses it, and the tests below then check the refusal instead of the product.
ONEDNN_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize(
    ("dtype", "kernel", "name"),
    [("float32", "tiled", TILED), ("float32", "onednn", ONEDNN), ("bfloat16", "onednn", ONEDNN)]
    + ([("bfloat16", "tiled", TILED)] if BF16_TILES else []),
)
def test_packed_model_computes_what_f_linear_computes(tmp_path, dtype, kernel, name):
    if (dtype, kernel) == ("bfloat16", "onednn") and not ONEDNN_BF16:
        with pytest.raises(ValueError, match="'onednn' cannot run here: oneDNN has no native bfloat16"):
            choose_linear_kernel("onednn", torch.device("cpu"), torch.bfloat16)
        return
    path = make_checkpoint(tmp_path, "llama", attention_bias=True, mlp_bias=True)  # biases packed too
    plain = load_model(path, dtype=dtype, linear_kernel="torch")
    packed = load_model(path, dtype=dtype, linear_kernel=kernel)
    assert plain.linear_kernel.name == TORCH and packed.linear_kernel.name == name
    linears = {name: m for name, m in packed.named_modules() if isinstance(m, Linear)}
    assert linears and all(m.is_packed for m in linears.values())
    plain_linears = dict(plain.named_modules())
    for name, module in linears.items():  # reordering is lossless
        assert torch.equal(module.dense_weight(), plain_linears[name].weight)
    want = PagedBatch(plain, 16, 3).step(_prompts())
    got = PagedBatch(packed, 16, 3).step(_prompts())
    for g, w in zip(got, want, strict=True):
        # float32: oneDNN and the tiled kernel may sum K in another order than MKL: at these
        # shapes the error against transformers is the same with each kernel (1.7e-6 to 1.5e-5
        # over the cases of test_model_exactness.py); at hidden 512 they differ by ~1e-4.
        # bfloat16: both round each product's output to bfloat16.
        tol = 1e-4 if dtype == "float32" else 0.05 * w.std().item()
        assert (g - w).abs().max().item() < tol


@pytest.mark.parametrize("kernel", [TILED, ONEDNN])
def test_packing_replaces_the_weight_instead_of_copying_it(tmp_path, kernel):
    path = make_checkpoint(tmp_path, "llama")
    model = load_model(path, linear_kernel="torch")
    layer = model.model.layers[0].mlp.gate_up_proj
    dense = weakref.ref(layer.weight)
    size = layer.weight.numel()
    layer.pack(kernel, batch_hint=64)
    gc.collect()
    assert dense() is None, "the plain weight must be freed once packed"
    (weight,) = layer.parameters()
    assert layer.is_packed and (weight.is_mkldnn if kernel == ONEDNN else weight.numel() == size)


@pytest.mark.parametrize(("out_features", "in_features"), [(128, 64), (200, 48), (7, 33), (64, 1100)])
def test_tiled_kernel_matches_float64_and_ignores_the_batch(out_features, in_features):
    """Full tiles, a last narrower tile, fewer columns than one tile, and k longer than one
    pass (1024): within float32 rounding of the float64 product, and a row's result is the same
    bits whatever rows share its call (sums run over k in order)."""
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    tiles = to_tiles(weight)
    assert tiles.shape == (weight.numel(),) and torch.equal(from_tiles(tiles, in_features), weight)
    ids = torch.tensor([[out_features - 1, 0], [out_features // 2, out_features - 1]])
    assert torch.equal(tiled_rows(tiles, ids, in_features), weight[ids])  # an embedding lookup
    every = torch.randperm(out_features, generator=gen)
    assert torch.equal(tiled_rows(tiles, every, in_features), weight[every])
    for outside in (out_features, -1):
        with pytest.raises(IndexError, match=f"outside the vocabulary of {out_features}"):
            tiled_rows(tiles, torch.tensor([0, outside]), in_features)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 40):  # every register block shape
        x = torch.randn(rows, in_features, generator=gen)
        got = tiled_linear(x, tiles, bias)
        want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        bound = 8 * in_features * torch.finfo(torch.float32).eps * (x.abs() @ weight.abs().T + bias.abs())
        assert ((got.double() - want).abs() <= bound.double()).all()
        assert torch.equal(tiled_linear(x[rows // 2 :][:1], tiles, bias), got[rows // 2 :][:1])
    assert tiled_linear(torch.empty(0, in_features), tiles, None).shape == (0, out_features)


def _pairwise_bf16_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What vdpbf16ps sums, written out: k in pairs (an odd ``in`` pairs its last k with zero),
    each pair's odd product added before its even one, in float32 (a product of two bfloat16
    values is exact there, so each add rounds as a fused multiply-add does); then the bias,
    and one rounding to bfloat16."""
    x, weight = x.float(), weight.float()
    if x.shape[1] % 2:
        x, weight = torch.nn.functional.pad(x, (0, 1)), torch.nn.functional.pad(weight, (0, 1))
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for p in range(x.shape[1] // 2):
        acc = acc + x[:, 2 * p + 1, None] * weight[None, :, 2 * p + 1]
        acc = acc + x[:, 2 * p, None] * weight[None, :, 2 * p]
    return (acc + (0.0 if bias is None else bias.float())).bfloat16()


@pytest.mark.parametrize(("out_features", "in_features"), [(128, 64), (200, 47), (7, 33), (64, 1100)])
def test_tiled_bfloat16_sums_pairs_as_vdpbf16ps_does(out_features, in_features):
    """bfloat16 runs AVX512-BF16's dot products of pairs in k order where the CPU has them, as
    oneDNN does for a few rows, so there it must give ``F.linear``'s bits (oneDNN's); on AVX2 the
    pairs are widened to float32 and summed in vdpbf16ps' order, which must give the written-out
    pairwise sums' bits. Every register block shape, full and narrow tiles, odd ``in`` (paired
    with zero); a row's bits do not depend on its batch. (From 32 rows with k >= 1024 oneDNN sums
    in another order and ~1 output in 10,000 differs in its last bit: not tested here.)"""
    if not BF16_TILES:
        with pytest.raises(ValueError, match="'tiled' cannot run here: the tiled bfloat16 kernel needs"):
            choose_linear_kernel("tiled", torch.device("cpu"), torch.bfloat16)
        return
    dot = bf16_loop() == BF16_DOT
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    tiles = to_tiles(weight)
    assert torch.equal(from_tiles(tiles, in_features), weight)
    ids = torch.randperm(out_features, generator=gen)
    assert torch.equal(tiled_rows(tiles, ids, in_features), weight[ids])
    for rows in (1, 2, 3, 4, 5, 6, 7, 13) if dot else (1, 2, 3, 4, 5, 6, 7, 13, 40):
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        for b in (bias, None):
            got = tiled_linear(x, tiles, b)
            want = (torch.nn.functional.linear if dot else _pairwise_bf16_product)(x, weight, b)
            assert torch.equal(got, want)
        assert torch.equal(tiled_linear(x[rows // 2 :][:1], tiles, None), got[rows // 2 :][:1])


def test_a_layer_function_reads_the_current_weight_at_each_call(tmp_path):
    """The step program holds ``as_function()``s made before the loader packs the weights; they
    must run on the packed weight, and keep no reference to the plain one."""
    path = make_checkpoint(tmp_path, "llama", mlp_bias=True)
    model = load_model(path, linear_kernel="torch")
    layer = model.model.layers[0].mlp.down_proj
    project = layer.as_function()
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(project(x), layer(x))
    layer.pack(TILED)
    assert layer.is_packed and torch.equal(project(x), layer(x))
    layer.weight = torch.nn.Parameter(torch.zeros(layer.out_features, layer.in_features), requires_grad=False)
    assert torch.equal(project(x), layer.bias.expand(3, -1))


def test_a_head_tied_to_the_embedding_stays_plain_and_shared_on_onednn(tmp_path):
    """oneDNN's layout is opaque: the embedding could not read its rows, so the head stays plain."""
    path = make_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)
    model = load_model(path, dtype="float32", linear_kernel="onednn")
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.is_packed
    assert model.model.layers[0].self_attn.qkv_proj.is_packed
    assert any("lm_head" in layer for layer in model.linear_kernel.kept_plain)
    assert "F.linear for lm_head" in model.linear_kernel.describe()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tied_head_is_tiled_and_the_embedding_reads_the_same_tiles(tmp_path, dtype):
    """The tiled head keeps one tensor for both: the embedding gathers its rows from the tiles,
    and the model's logits match the plain model's."""
    if dtype == "bfloat16" and not BF16_TILES:
        with pytest.raises(ValueError, match="'tiled' cannot run here"):
            choose_linear_kernel("tiled", torch.device("cpu"), torch.bfloat16)
        return
    path = make_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)
    plain = load_model(path, dtype=dtype, linear_kernel="torch")
    model = load_model(path, dtype=dtype, linear_kernel="tiled")
    head, embedding = model.lm_head, model.model.embed_tokens
    assert head.weight is embedding.weight and head.is_packed and head.weight.dim() == 1
    assert model.linear_kernel.kept_plain == ()
    ids = torch.arange(TEST_VOCAB_SIZE)
    assert torch.equal(embedding(ids), plain.model.embed_tokens.weight)
    assert torch.equal(head.dense_weight(), plain.lm_head.weight)
    want = PagedBatch(plain, 16, 3).step(_prompts())
    got = PagedBatch(model, 16, 3).step(_prompts())
    for g, w in zip(got, want, strict=True):
        tol = 1e-4 if dtype == "float32" else 0.05 * w.std().item()
        assert (g - w).abs().max().item() < tol


def test_kernel_choice_follows_device_and_request():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_linear_kernel("auto", cpu, torch.float32).name == TILED
    assert choose_linear_kernel("onednn", cpu, torch.float32).name == ONEDNN
    bf16_kernel = TILED if BF16_TILES else ONEDNN if ONEDNN_BF16 else TORCH
    assert choose_linear_kernel("auto", cpu, torch.bfloat16).name == bf16_kernel
    assert choose_linear_kernel("auto", cpu, torch.float16).name in (ONEDNN, TORCH)
    assert choose_linear_kernel("torch", cpu, torch.float32).name == TORCH
    with pytest.raises(ValueError, match="'tiled' cannot run here: the tiled kernel has no float16"):
        choose_linear_kernel("tiled", cpu, torch.float16)
    on_cuda = choose_linear_kernel("auto", cuda, torch.bfloat16)
    assert on_cuda.name == TORCH and "cuda" in on_cuda.reason
    with pytest.raises(ValueError, match="'onednn' cannot run here: cuda"):
        choose_linear_kernel("onednn", cuda, torch.float32)
    with pytest.raises(ValueError, match="unknown linear kernel 'mkl'"):
        choose_linear_kernel("mkl", cpu, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if BF16_TILES else []))
@pytest.mark.parametrize(("intermediate", "in_features"), [(128, 64), (172, 48), (100, 33), (20, 70)])
def test_fused_gate_up_is_the_product_then_silu_and_mul_bit_for_bit(dtype, intermediate, in_features):
    """The paired layout with whole runs of a tile, a last run between half a tile and a tile
    (172 = 2 x 64 + 44, 100), one under half a tile (20), odd k: the plain product has the
    ordinary tiled kernel's bits, and the fused one silu_and_mul's bits of that product."""
    gen = torch.Generator().manual_seed(intermediate)
    weight = torch.randn(2 * intermediate, in_features, generator=gen).to(dtype)
    paired, tiles = to_paired_tiles(weight), to_tiles(weight)
    assert paired.shape == tiles.shape and torch.equal(from_paired_tiles(paired, in_features), weight)
    ops = native_ops(dtype)
    assert ops is not None
    for rows in (1, 6, 13, 70):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        plain = tiled_linear(x, tiles, None)
        assert torch.equal(tiled_gate_up(x, paired, False), plain)
        assert torch.equal(tiled_gate_up(x, paired, True), ops.silu_and_mul(plain))


def test_the_mlp_runs_fused_when_tiled_and_reads_its_weight_back(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    plain = load_model(path, linear_kernel="torch").model.layers[0].mlp.gate_up_proj
    tiled = load_model(path, linear_kernel="tiled").model.layers[0].mlp.gate_up_proj
    assert tiled.paired and not plain.paired
    assert torch.equal(tiled.dense_weight(), plain.weight)
    x = torch.randn(5, plain.in_features)
    product = tiled(x)
    torch.testing.assert_close(product, plain(x), atol=1e-5, rtol=1e-5)
    ops = native_ops(torch.float32)
    assert torch.equal(tiled.act_function()(x, ops), ops.silu_and_mul(product))


def test_portable_build_of_the_tiled_kernel_gives_the_same_bits():
    """Without -march=native (no AVX-512: a machine this build cannot assume) the kernel's
    portable loop runs the same fused multiply-adds in the same order, so it must agree with
    the vectorised build bit for bit. Built by the same builder from the library's own sources
    (the GEMM and the layer ops its fused gate/up calls), with the same signatures."""
    sources = [library.CSRC / "tiled_gemm.c", library.CSRC / "layer_ops.c"]
    path = cbuild.build_library("tiled_gemm_portable", sources, flag_sets=[("-O2", "-fopenmp")])
    portable = KernelLibrary(path)
    assert portable.entry("tiled_gemm_bf16_loop")() == 0 and portable.entry("decode_stack_f32") is None
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(150, 40, generator=gen), torch.randn(150, generator=gen)
    x = torch.randn(9, 40, generator=gen)
    tiles = to_tiles(weight)
    out = torch.empty(9, 150)
    linear = portable.entry("tiled_linear_f32")
    assert linear(x.data_ptr(), tiles.data_ptr(), bias.data_ptr(), out.data_ptr(), 9, 40, 150) == 0
    assert torch.equal(out, tiled_linear(x, tiles, bias))
    paired, product, fused = to_paired_tiles(weight), torch.empty(9, 150), torch.empty(9, 75)
    gate_up = portable.entry("tiled_gate_up_f32")
    assert gate_up(x.data_ptr(), paired.data_ptr(), product.data_ptr(), 9, 40, 75, 0) == 0
    assert torch.equal(product, tiled_linear(x, tiles, None))
    assert gate_up(x.data_ptr(), paired.data_ptr(), fused.data_ptr(), 9, 40, 75, 1) == 0
    assert torch.equal(fused, tiled_gate_up(x, paired, True))
    # bfloat16: the portable loop sums the pairs in vdpbf16ps' order too (odd ``in``: 41)
    weight, bias = torch.randn(150, 41, generator=gen).bfloat16(), bias.bfloat16()
    x = torch.randn(9, 41, generator=gen).bfloat16()
    out, tiles = torch.empty(9, 150, dtype=torch.bfloat16), to_tiles(weight)
    args = (x.data_ptr(), tiles.data_ptr(), bias.data_ptr(), out.data_ptr(), 9, 41, 150)
    assert portable.entry("tiled_linear_bf16")(*args) == 0
    assert torch.equal(out, _pairwise_bf16_product(x, weight, bias))


def test_a_kept_output_takes_the_same_bits_and_a_wrong_one_is_refused():
    gen = torch.Generator().manual_seed(9)
    weight, x = torch.randn(200, 48, generator=gen), torch.randn(5, 48, generator=gen)
    tiles, paired = to_tiles(weight), to_paired_tiles(weight)
    out = torch.full((5, 200), float("nan"))
    assert tiled_linear(x, tiles, None, out) is out and torch.equal(out, tiled_linear(x, tiles, None))
    half = torch.full((5, 100), float("nan"))
    assert tiled_gate_up(x, paired, True, half) is half
    assert torch.equal(half, tiled_gate_up(x, paired, True))
    for wrong in (torch.empty(4, 200), torch.empty(5, 200, dtype=torch.float64), torch.empty(200, 5).t()):
        with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 \[5, 200\]"):
            tiled_linear(x, tiles, None, wrong)


def test_an_output_buffer_is_kept_for_small_batches_only():
    buffer = OutputBuffer()
    first = buffer.get(3, 7, torch.float32)
    assert first.shape == (3, 7) and buffer.get(3, 7, torch.float32) is first  # kept, not remade
    assert buffer.get(5, 7, torch.float32).data_ptr() == first.data_ptr()  # one buffer, row views
    assert buffer.get(BUFFER_ROWS + 1, 7, torch.float32) is None  # a prefill gets a new tensor
    assert buffer.get(3, 7, torch.bfloat16).dtype == torch.bfloat16  # a cast model: a new buffer


def test_buffers_that_share_write_into_one_tensor_and_sharing_joins_whole_groups():
    a, b, c, d = (OutputBuffer() for _ in range(4))
    own = c.get(2, 7, torch.float32)  # held here, so its memory is not handed out again
    b.share(a)
    c.share(d)  # c's own tensor is dropped
    c.share(b)  # c and d join a and b
    ptrs = {buffer.get(2, 7, torch.float32).data_ptr() for buffer in (a, b, c, d)}
    assert len(ptrs) == 1 and own.data_ptr() not in ptrs
    assert a.get(2, 9, torch.float32).data_ptr() == d.get(2, 9, torch.float32).data_ptr()  # every width
    assert a.get(2, 9, torch.float32).data_ptr() not in ptrs  # a width of its own


def test_a_forward_pass_leaves_the_previous_ones_hidden_states_alone(tmp_path):
    """The step program's projections write small batches into kept buffers (OutputBuffer); what
    a forward pass returns must not be one of them, or the next pass would overwrite it."""
    model = load_model(make_checkpoint(tmp_path, "llama"), dtype=torch.float32, linear_kernel="tiled")
    hidden, _ = PagedBatch(model, 16, 3).forward(_prompts())
    kept = hidden.clone()
    other, _ = PagedBatch(model, 16, 3).forward([[7, 8], [9], [10, 11, 12]])  # rewrites the buffers
    assert not torch.equal(other[: hidden.shape[0]], kept)  # other tokens, other states
    assert torch.equal(hidden, kept)
