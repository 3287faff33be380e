"""Tensor-parallel ranks keep quantized weights in their blocks: a GGUF file's, a GPTQ, AWQ or
compressed-tensors checkpoint's (repacked as blocks), and those quantized on load.

A column-parallel projection (q/k/v, gate/up) holds whole rows of the file's blocks; a
row-parallel one (o_proj, down_proj) the blocks of its input columns, where the split falls
between blocks, else it is held dense and the model's description says why; the embedding and
the LM head their vocabulary rows. The GGUF checkpoint here has all three: Q8_0 blocks of 32
columns, o_proj's 64 input columns split 32 a rank (kept), down_proj's 96 split 48 a rank (a block
would straddle the ranks: dense), 512 vocabulary rows split 256 a rank (kept).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from pagedkv import LLM, SamplingParams
from pagedkv.models.linear import PackedLinear
from pagedkv.models.loader import load_model
from pagedkv.models.parallel import QuantizedRowParallelLinear, RowParallelLinear, TensorParallel
from pagedkv.models.quantization.blocks import QuantizedWeight
from pagedkv.models.quantized import QuantizedLinear
from pagedkv.models.tensor_slice import TensorSlice
from pagedkv.models.vocab_parallel import QuantizedParallelLMHead, QuantizedVocabParallelEmbedding
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint
from tests.gguf_files import write_gguf
from tests.quant_checkpoints import Variant, quantized_checkpoint

QTYPE = Q.Q8_0
INTERMEDIATE = 96  # 48 input columns of down_proj a rank: not a multiple of Q8_0's 32
OPTIONS = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-gguf")
    folder = make_checkpoint(tmp, "llama", intermediate_size=INTERMEDIATE)
    return write_gguf(folder, tmp / "q8" / "tiny.gguf", QTYPE)


def _columns(blocks: torch.Tensor, start: int, count: int, qtype: Q = QTYPE) -> torch.Tensor:
    """The bytes of input columns ``start .. start + count`` of every row (whole blocks)."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    return blocks[:, start // block * block_bytes : (start + count) // block * block_bytes]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_the_file_blocks_of_its_slice(gguf, rank):
    whole = load_model(gguf, "float32")
    shard = load_model(gguf, "float32", tensor_parallel=TensorParallel(rank, 2))
    for one, part in zip(whole.model.layers, shard.model.layers, strict=True):
        qkv, shard_qkv = one.self_attn.qkv_proj, part.self_attn.qkv_proj
        assert type(shard_qkv) is QuantizedLinear  # column-parallel: rows of blocks
        ours = torch.cat([qkv.part0[start : start + count] for start, count in _qkv_rows(rank)])
        assert torch.equal(shard_qkv.part0, ours)

        gate_up = part.mlp.gate_up_proj
        assert type(gate_up) is QuantizedLinear and gate_up.out_features == INTERMEDIATE
        half = INTERMEDIATE // 2
        gate, up = one.mlp.gate_up_proj.part0.split(INTERMEDIATE)
        expected = torch.cat([gate[rank * half : (rank + 1) * half], up[rank * half : (rank + 1) * half]])
        assert torch.equal(gate_up.part0, expected)

        o_proj = part.self_attn.o_proj  # row-parallel, 32 columns a rank: the file's blocks
        assert isinstance(o_proj, QuantizedRowParallelLinear) and o_proj.in_features == 32
        assert torch.equal(o_proj.part0, _columns(one.self_attn.o_proj.part0, 32 * rank, 32))

        down = part.mlp.down_proj  # 48 columns a rank would cut a block: dense, the same values
        assert type(down) is RowParallelLinear
        dense = one.mlp.down_proj.dense_weight()[:, rank * half : (rank + 1) * half]
        assert torch.equal(down.dense_weight(), dense)
    vocab = slice(rank * TEST_VOCAB_SIZE // 2, (rank + 1) * TEST_VOCAB_SIZE // 2)
    embedding, head = shard.model.embed_tokens, shard.lm_head  # the file's bytes of its vocabulary rows
    assert isinstance(embedding, QuantizedVocabParallelEmbedding)
    assert torch.equal(embedding.blocks, whole.model.embed_tokens.blocks[vocab])
    assert isinstance(head, QuantizedParallelLMHead) and torch.equal(head.part0, whole.lm_head.part0[vocab])
    assert "down_proj Q8_0: blocks of 32 input columns, 48 per rank" in shard.quantization
    assert "o_proj" not in shard.quantization


def _qkv_rows(rank: int) -> list[tuple[int, int]]:
    """Rank ``rank`` of 2's rows of the whole packed q/k/v: half the query heads, half the KV heads."""
    q, kv = 64, 32
    return [(rank * q // 2, q // 2), (q + rank * kv // 2, kv // 2), (q + kv + rank * kv // 2, kv // 2)]


def _run(
    model: str, ranks: int, vocab_quantized: bool = False, **options
) -> tuple[list[list[int]], list[list[float]], str]:
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, TEST_VOCAB_SIZE, (n,), generator=gen).tolist() for n in (11, 3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    with LLM(model, tensor_parallel_size=ranks, **OPTIONS, **options) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runner_model = llm.engine.executor.runner.model
        if ranks > 1:  # rank 0, in this process, holds blocks
            assert isinstance(runner_model.model.layers[0].self_attn.o_proj, QuantizedRowParallelLinear)
            assert isinstance(runner_model.model.layers[0].mlp.gate_up_proj, QuantizedLinear)
            assert not isinstance(runner_model.model.layers[0].mlp.gate_up_proj, PackedLinear)
            assert isinstance(runner_model.lm_head, QuantizedParallelLMHead) == vocab_quantized
            assert isinstance(runner_model.model.embed_tokens, QuantizedVocabParallelEmbedding) == (
                vocab_quantized
            )
        weights = llm.engine.executor.runtime["weights"]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[entry.logprob for entry in o.outputs[0].logprobs] for o in outputs]
    return tokens, logprobs, weights


def test_two_ranks_on_blocks_generate_what_one_rank_does(gguf):
    tokens, logprobs, weights = _run(str(gguf), 1)
    tp_tokens, tp_logprobs, tp_weights = _run(str(gguf), 2, vocab_quantized=True)
    assert tp_tokens == tokens
    assert torch.allclose(torch.tensor(tp_logprobs), torch.tensor(logprobs), atol=1e-4)
    assert weights == "GGUF, kept in GGUF blocks"
    assert tp_weights.startswith("GGUF, kept in GGUF blocks; dense on the 2 ranks")
    assert "down_proj Q8_0" in tp_weights


def test_two_ranks_quantizing_on_load_hold_blocks_and_generate_what_one_rank_does(tmp_path):
    """Each rank quantizes its own shard: rows, and input columns split between blocks (64 and
    128 columns, 32 and 64 a rank), so its blocks are those one rank makes of the same columns."""
    folder = str(make_checkpoint(tmp_path, "llama"))
    tokens, logprobs, weights = _run(folder, 1, quantization="q8_0")
    tp_tokens, tp_logprobs, tp_weights = _run(folder, 2, quantization="q8_0")
    assert tp_tokens == tokens
    assert torch.allclose(torch.tensor(tp_logprobs), torch.tensor(logprobs), atol=1e-4)
    assert weights == tp_weights == "q8_0 on load, kept in GGUF blocks"


def test_a_tied_head_multiplies_by_the_ranks_embedding_blocks(tmp_path):
    folder = make_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    gguf = write_gguf(folder, tmp_path / "tied" / "tiny.gguf", QTYPE)
    whole = load_model(gguf, "float32")
    for rank in range(2):
        shard = load_model(gguf, "float32", tensor_parallel=TensorParallel(rank, 2))
        embedding, head = shard.model.embed_tokens, shard.lm_head
        assert isinstance(embedding, QuantizedVocabParallelEmbedding)
        assert isinstance(head, QuantizedParallelLMHead) and head.vocab_size == TEST_VOCAB_SIZE
        assert head.part0.data_ptr() == embedding.blocks.data_ptr()  # held once
        rows = whole.model.embed_tokens.blocks[rank * 256 : (rank + 1) * 256]
        assert torch.equal(embedding.blocks, rows)


def test_the_last_ranks_padding_rows_are_zero_blocks():
    """5 rows over 2 ranks: 3 and 2, the second padded with one row of zero bytes, which reads
    as zeros."""
    values = torch.randn(5, 64).numpy()
    weight = QuantizedWeight(quantize(values, QTYPE), QTYPE, (5, 64))
    first = TensorSlice(0, 0, 3, 3, blocks=True).blocks_of(weight)
    last = TensorSlice(0, 3, 2, 3, blocks=True).blocks_of(weight)
    assert first.shape == last.shape == (3, 64)
    assert (first.raw == weight.raw[:3]).all() and (last.raw[:2] == weight.raw[3:]).all()
    assert (dequantize(last.raw, QTYPE)[2] == 0).all()


#: GPTQ symmetric (Q4_0 blocks), GPTQ and AWQ with zero points (Q4_1), compressed-tensors W8A16
#: (Q8_0); groups of 128 columns, o_proj's 128 input columns split 64 a rank: each rank holds
#: half of every group, its blocks of 32 each carrying the group's scale
HF_VARIANTS = {
    "gptq": Variant("gptq"),
    "gptq-zero-point": Variant("gptq", symmetric=False),
    "awq": Variant("awq", symmetric=False),
    "ct-w8a16": Variant("compressed-tensors", bits=8),
}


@pytest.mark.parametrize("key", ["gptq-zero-point", "awq"])
def test_each_rank_holds_its_slice_of_a_quantized_checkpoints_blocks(tmp_path, key):
    folder, _ = quantized_checkpoint(tmp_path, HF_VARIANTS[key])
    whole = load_model(folder, "float32").model.layers[0]
    for rank in range(2):
        shard = load_model(folder, "float32", tensor_parallel=TensorParallel(rank, 2))
        layer = shard.model.layers[0]
        o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
        assert isinstance(o_proj, QuantizedRowParallelLinear) and isinstance(down, QuantizedRowParallelLinear)
        assert torch.equal(o_proj.part0, _columns(whole.self_attn.o_proj.part0, 64 * rank, 64, Q.Q4_1))
        assert torch.equal(down.part0, _columns(whole.mlp.down_proj.part0, 128 * rank, 128, Q.Q4_1))
        gate, up = whole.mlp.gate_up_proj.part0.split(256)
        mine = slice(128 * rank, 128 * (rank + 1))
        assert torch.equal(layer.mlp.gate_up_proj.part0, torch.cat([gate[mine], up[mine]]))
        assert shard.quantization == f"{HF_VARIANTS[key].method} int4, kept in GGUF blocks"


def test_a_quantized_checkpoints_split_that_would_cut_a_block_is_held_dense(tmp_path):
    """Groups of 32 over 96 intermediate rows: down_proj's 48 input columns a rank would cut a
    block, so every rank holds its columns dense, the values one rank's blocks hold."""
    v = Variant("gptq", symmetric=False, group_size=32)
    folder, _ = quantized_checkpoint(tmp_path, v, intermediate_size=96)
    whole = load_model(folder, "float32").model.layers[1].mlp.down_proj.dense_weight()
    for rank in range(2):
        shard = load_model(folder, "float32", tensor_parallel=TensorParallel(rank, 2))
        down = shard.model.layers[1].mlp.down_proj
        assert type(down) is RowParallelLinear
        assert torch.equal(down.dense_weight(), whole[:, 48 * rank : 48 * (rank + 1)])
        assert isinstance(shard.model.layers[1].self_attn.o_proj, QuantizedRowParallelLinear)
        assert shard.quantization == (
            "gptq int4, kept in GGUF blocks; dense on the 2 ranks, a block would straddle two: "
            "down_proj Q4_1: blocks of 32 input columns, 48 per rank"
        )


@pytest.mark.parametrize("key", HF_VARIANTS)
def test_two_ranks_on_a_quantized_checkpoint_generate_what_one_rank_does(tmp_path, key):
    v = HF_VARIANTS[key]
    folder, _ = quantized_checkpoint(tmp_path, v)
    tokens, logprobs, weights = _run(str(folder), 1)
    tp_tokens, tp_logprobs, tp_weights = _run(str(folder), 2)
    assert tp_tokens == tokens
    assert torch.allclose(torch.tensor(tp_logprobs), torch.tensor(logprobs), atol=1e-4)
    assert (
        weights == tp_weights == f"{HF_VARIANTS[key].method} int{HF_VARIANTS[key].bits}, kept in GGUF blocks"
    )
