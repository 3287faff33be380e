"""On-the-fly quantization: the Q4_K quantizer's blocks decode (with the ``gguf`` package's
reference) close to its input, each type's error stays in its bound, and a model quantized when
it loads generates: with q8_0 the same greedy tokens as the float model, and a trained model's
perplexity barely moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagedkv import LLM, SamplingParams
from pagedkv.engine.perplexity import perplexity
from pagedkv.models import load_model
from pagedkv.models.builtin.train import stdlib_text
from pagedkv.models.quantization.k_quants import quantize_q4_k
from pagedkv.models.quantization.on_the_fly import quantize_weight
from tests.checkpoints import make_checkpoint
from tests.quant_checkpoints import dense_weights

Q = GGMLQuantizationType
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["def add(a, b):", "hello world", "the quick brown fox"]
#: Rows a multiple of 256 wide, so Q4_K applies to every projection.
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def _rows(seed: int, shape=(16, 1024)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal(shape).astype(np.float32) * 0.05
    rows[:, ::97] *= 8  # outliers, as real weight rows have
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q4_k_blocks_decode_within_a_step_of_their_super_block(seed):
    """A Q4_K weight is off by half a step of its sub-block's grid, plus what the 6-bit scales and
    mins lose against the super-block's largest (``15 / 126`` of its step): every weight within one
    step of the super-block's coarsest sub-block grid (range / 15). Overall closer than the
    reference Q4_1 quantizer (5 bits a weight against 4.5) and Q4_0."""
    rows = _rows(seed)
    blocks = quantize_q4_k(rows)
    assert blocks.shape == (16, 1024 // 256 * 144) and blocks.dtype == np.uint8
    decoded = dequantize(blocks, Q.Q4_K)
    sub = rows.reshape(-1, 8, 32)
    coarsest = (np.maximum(sub.max(2), 0) - np.minimum(sub.min(2), 0)).max(1) / 15
    error = np.abs(decoded - rows).reshape(-1, 256).max(1)
    assert np.all(error <= coarsest)
    rms = float(np.sqrt(np.mean((decoded - rows) ** 2)))
    for reference in (Q.Q4_1, Q.Q4_0):
        assert rms <= float(np.sqrt(np.mean((dequantize(quantize(rows, reference), reference) - rows) ** 2)))
    assert rms <= 0.1 * float(np.sqrt(np.mean(rows**2)))


def test_q4_k_handles_constant_and_one_signed_sub_blocks():
    rows = np.zeros((2, 256), dtype=np.float32)
    rows[0, 32:64] = -0.5  # a constant negative sub-block: all of it is the min
    rows[1] = np.linspace(0.1, 2.0, 256)  # all positive: the min clamps to 0
    decoded = dequantize(quantize_q4_k(rows), Q.Q4_K)
    assert np.all(decoded[0, :32] == 0) and np.allclose(decoded[0, 32:64], -0.5, rtol=1e-2)
    assert np.abs(decoded[1] - rows[1]).max() <= 2.0 / 15


@pytest.mark.parametrize(
    ("qtype", "step", "steps"), [(Q.Q8_0, 127, 0.5), (Q.Q4_0, 8, 1.0), (Q.Q5_0, 16, 1.0)]
)
def test_symmetric_types_stay_within_their_step(qtype, step, steps):
    """``w = d * q`` with ``d = amax / step`` rounded to f16: Q8_0 rounds each weight to half a
    step; Q4_0 and Q5_0 put the block's extreme at code 0, so the other end clips at one step
    from ``-amax``. Plus the f16 rounding of ``d`` over the largest code."""
    rows = _rows(3)
    weight = quantize_weight(torch.from_numpy(rows), qtype)
    assert weight.qtype == qtype and weight.shape == rows.shape
    decoded = dequantize(weight.raw, qtype).reshape(-1, 32)
    amax = np.abs(rows.reshape(-1, 32)).max(1, keepdims=True)
    d = amax / step
    assert np.all(np.abs(decoded - rows.reshape(-1, 32)) <= d * (steps + step * 2**-11) + 1e-7)


def test_q4_k_falls_back_to_q5_0_for_rows_it_does_not_divide():
    weight = quantize_weight(torch.from_numpy(_rows(4, (8, 96))), Q.Q4_K)
    assert weight.qtype == Q.Q5_0
    with pytest.raises(ValueError, match="do not split into Q8_0 blocks of 32"):
        quantize_weight(torch.zeros(4, 40), Q.Q8_0, "layers.0.mlp.down_proj")


def _greedy(folder, **options) -> list[list[int]]:
    with LLM(str(folder), dtype="float32", num_kv_blocks=64, **options) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_q8_0_generates_the_float_models_greedy_tokens(tmp_path):
    folder = make_checkpoint(tmp_path, "llama", **WIDE)
    with LLM(str(folder), dtype="float32", num_kv_blocks=64, quantization="q8_0") as llm:
        assert "weights q8_0 on load, kept in GGUF blocks" in llm.engine.describe()
        quantized = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert quantized == _greedy(folder)


@pytest.mark.parametrize(("name", "qtype", "relative"), [("q4_0", Q.Q4_0, 0.12), ("q4_k", Q.Q4_K, 0.12)])
def test_4_bit_models_load_quantized_and_generate(tmp_path, name, qtype, relative):
    folder = make_checkpoint(tmp_path, "qwen2", **WIDE)
    plain = load_model(folder, dtype="float32", linear_kernel="torch")
    quantized = load_model(folder, dtype="float32", linear_kernel="torch", quantization=name)
    assert plain.quantization is None and quantized.quantization.startswith(f"{name} on load")
    after_load = dense_weights(quantized)
    for key, before in dense_weights(plain).items():
        after = after_load[key]
        projection = key.startswith("model.layers.") and key.endswith("proj.weight")
        if not projection:  # embedding, norms, biases, LM head: as in the checkpoint
            assert torch.equal(before, after), key
            continue
        want = torch.from_numpy(dequantize(quantize_weight(before, qtype).raw, qtype))
        assert torch.equal(after, want), key  # the blocks' own values, not a re-rounding
        assert (after - before).norm() <= relative * before.norm(), key
    tokens = _greedy(folder, quantization=name)
    assert [len(t) for t in tokens] == [GREEDY.max_tokens] * len(PROMPTS)


@pytest.fixture(scope="module")
def heldout() -> list[list[int]]:
    """Three held-out stdlib files (the built-in model never trained on them), 3,000 characters each."""
    _, files = stdlib_text.split_files()
    with LLM(dtype="float32", num_kv_blocks=8) as llm:
        eos = llm.engine.model_config.eos_token_ids[0]
        return [llm.tokenizer.encode(text[:3_000]) + [eos] for text in stdlib_text.read_sources(files[:3])]


def _perplexity(documents, quantization: str | None) -> float:
    with LLM(dtype="float32", max_model_len=129, num_kv_blocks=256, quantization=quantization) as llm:
        return perplexity(llm.engine, documents, window=128).perplexity


@pytest.mark.parametrize(("name", "within"), [("q8_0", 0.001), ("q4_0", 0.01), ("q4_k", 0.01)])
def test_the_trained_models_perplexity_barely_moves(heldout, name, within):
    """The built-in trained Llama on held-out text: q8_0 within 0.1 % of float32's perplexity,
    4-bit types within 1 % (its rows of 128 and 320 weights make q4_k fall back to Q5_0)."""
    reference = _perplexity(heldout, None)
    assert _perplexity(heldout, name) == pytest.approx(reference, rel=within)


def test_the_real_models_q4_1_weights_are_those_of_its_gguf_file(real_model):
    """SmolLM2's folder is its Q4_1 GGUF file dequantized (every projection Q4_1). ggml's Q4_1
    quantizer maps a block's min and max to codes 0 and 15, so it finds the file's blocks again:
    quantized to q4_1 on load, every projection is the float folder's bit for bit; q8_0 moves
    each by under 1 %."""
    plain = dense_weights(load_model(real_model, dtype="float32", linear_kernel="torch"))
    for name, exact in (("q4_1", True), ("q8_0", False)):
        quantized = load_model(real_model, dtype="float32", linear_kernel="torch", quantization=name)
        weights = dense_weights(quantized)
        projections = [k for k in plain if k.startswith("model.layers.") and k.endswith("proj.weight")]
        assert len(projections) == 30 * 7  # q, k, v, o, gate, up, down
        for key in projections:
            if exact:
                assert torch.equal(weights[key], plain[key]), key
            else:
                assert 0 < (weights[key] - plain[key]).norm() <= 0.01 * plain[key].norm(), key
