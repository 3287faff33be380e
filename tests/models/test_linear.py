"""Linear layers on oneDNN with packed weights: the same numbers as F.linear, nothing held twice,
tied heads left plain, and the kernel chosen for the device and dtype (or refused with a reason)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pagedkv.models import load_model
from pagedkv.models.linear import ONEDNN, TORCH, Linear, choose_linear_kernel
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint

from .paging import PagedBatch


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(4, TEST_VOCAB_SIZE, (n,), generator=gen).tolist() for n in (9, 1, 4)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_model_computes_what_f_linear_computes(tmp_path, dtype):
    path = make_checkpoint(tmp_path, "llama", attention_bias=True, mlp_bias=True)  # biases packed too
    plain = load_model(path, dtype=dtype, linear_kernel="torch")
    packed = load_model(path, dtype=dtype, linear_kernel="onednn")
    assert plain.linear_kernel.name == TORCH and packed.linear_kernel.name == ONEDNN
    linears = {name: m for name, m in packed.named_modules() if isinstance(m, Linear)}
    assert linears and all(m.is_packed for m in linears.values())
    plain_linears = dict(plain.named_modules())
    for name, module in linears.items():  # reordering is lossless
        assert torch.equal(module.dense_weight(), plain_linears[name].weight)
    want = PagedBatch(plain, 16, 3).step(_prompts())
    got = PagedBatch(packed, 16, 3).step(_prompts())
    for g, w in zip(got, want, strict=True):
        # float32: oneDNN may sum K in another order than MKL: at these shapes the error against
        # transformers is the same with either kernel (1.7e-6 to 1.5e-5 over the cases of
        # test_model_exactness.py); at hidden 512 the two differ by ~1e-4 (see the perf notes).
        # bfloat16: both round each product's output to bfloat16.
        tol = 1e-4 if dtype == "float32" else 0.05 * w.std().item()
        assert (g - w).abs().max().item() < tol


def test_packing_replaces_the_weight_instead_of_copying_it(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    model = load_model(path, linear_kernel="torch")
    layer = model.model.layers[0].mlp.gate_up_proj
    dense = weakref.ref(layer.weight)
    layer.pack(batch_hint=64)
    gc.collect()
    assert dense() is None, "the plain weight must be freed once packed"
    assert [p.is_mkldnn for p in layer.parameters()] == [True]


def test_a_layer_function_reads_the_current_weight_at_each_call(tmp_path):
    """The step program holds ``as_function()``s made before the loader packs the weights; they
    must run on the packed weight, and keep no reference to the plain one."""
    path = make_checkpoint(tmp_path, "llama", mlp_bias=True)
    model = load_model(path, linear_kernel="torch")
    layer = model.model.layers[0].mlp.down_proj
    project = layer.as_function()
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(project(x), layer(x))
    layer.pack(batch_hint=64)
    assert layer.is_packed and torch.equal(project(x), layer(x))
    layer.weight = torch.nn.Parameter(torch.zeros(layer.out_features, layer.in_features), requires_grad=False)
    assert torch.equal(project(x), layer.bias.expand(3, -1))


def test_a_head_tied_to_the_embedding_stays_plain_and_shared(tmp_path):
    path = make_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)
    model = load_model(path, dtype="float32", linear_kernel="onednn")
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.is_packed
    assert model.model.layers[0].self_attn.qkv_proj.is_packed
    assert any("lm_head" in layer for layer in model.linear_kernel.kept_plain)
    assert "F.linear for lm_head" in model.linear_kernel.describe()


def test_kernel_choice_follows_device_and_request():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_linear_kernel("auto", cpu, torch.float32).name == ONEDNN
    assert choose_linear_kernel("torch", cpu, torch.float32).name == TORCH
    on_cuda = choose_linear_kernel("auto", cuda, torch.bfloat16)
    assert on_cuda.name == TORCH and "cuda" in on_cuda.reason
    with pytest.raises(ValueError, match="'onednn' cannot run here: cuda"):
        choose_linear_kernel("onednn", cuda, torch.float32)
    with pytest.raises(ValueError, match="unknown linear kernel 'mkl'"):
        choose_linear_kernel("mkl", cpu, torch.float32)
