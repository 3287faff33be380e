"""Tensor-parallel ranks keep a GGUF model's quantized weights in their blocks.

A column-parallel projection (q/k/v, gate/up) holds whole rows of the file's blocks; a
row-parallel one (o_proj, down_proj) the blocks of its input columns, where the split falls
between blocks, else it is held dense and the model's description says why. The checkpoint here
has both: Q8_0 blocks of 32 columns, o_proj's 64 input columns split 32 a rank (kept), down_proj's
96 split 48 a rank (a block would straddle the ranks: dense).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from pagedkv import LLM, SamplingParams
from pagedkv.models.linear import PackedLinear
from pagedkv.models.loader import load_model
from pagedkv.models.parallel import QuantizedRowParallelLinear, RowParallelLinear, TensorParallel
from pagedkv.models.quantized import QuantizedLinear
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint
from tests.gguf_files import write_gguf

QTYPE = Q.Q8_0
INTERMEDIATE = 96  # 48 input columns of down_proj a rank: not a multiple of Q8_0's 32
OPTIONS = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-gguf")
    folder = make_checkpoint(tmp, "llama", intermediate_size=INTERMEDIATE)
    return write_gguf(folder, tmp / "q8" / "tiny.gguf", QTYPE)


def _columns(blocks: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """The bytes of input columns ``start .. start + count`` of every row (whole blocks)."""
    block, block_bytes = GGML_QUANT_SIZES[QTYPE]
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
    assert "down_proj Q8_0: blocks of 32 input columns, 48 per rank" in shard.quantization
    assert "o_proj" not in shard.quantization


def _qkv_rows(rank: int) -> list[tuple[int, int]]:
    """Rank ``rank`` of 2's rows of the whole packed q/k/v: half the query heads, half the KV heads."""
    q, kv = 64, 32
    return [(rank * q // 2, q // 2), (q + rank * kv // 2, kv // 2), (q + kv + rank * kv // 2, kv // 2)]


def _run(model: str, ranks: int, **options) -> tuple[list[list[int]], list[list[float]], str]:
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
        weights = llm.engine.executor.runtime["weights"]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[entry.logprob for entry in o.outputs[0].logprobs] for o in outputs]
    return tokens, logprobs, weights


def test_two_ranks_on_blocks_generate_what_one_rank_does(gguf):
    tokens, logprobs, weights = _run(str(gguf), 1)
    tp_tokens, tp_logprobs, tp_weights = _run(str(gguf), 2)
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
