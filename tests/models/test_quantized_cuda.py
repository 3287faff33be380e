"""GGUF blocks on CUDA: a model loaded there keeps its quantized weights in their blocks (the
Triton kernels multiply them in place) and generates what the same file generates on the CPU
(the C kernels). The engine test is marked ``cuda`` (``benchmarks/gpu_check.sh`` runs it); the
moving of the blocks, shared ones once, runs everywhere."""

from __future__ import annotations

import pytest
import torch

from pagedkv.models.quantization.install import blocks_to, keeps_blocks
from pagedkv.models.quantized import QuantizedEmbedding
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf
from tests.models.test_gguf import greedy
from tests.quant_blocks import Q, random_blocks

#: a tiny Llama whose every projection input is a whole number of K-type super-blocks
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def test_blocks_move_once_and_a_tied_head_still_shares_its_embedding_s():
    embedding = QuantizedEmbedding(
        torch.from_numpy(random_blocks(Q.Q8_0, 8, 64, seed=1)), Q.Q8_0, 64, torch.float32
    )
    model = torch.nn.ModuleDict({"embed": embedding, "head": embedding.tied_head()})
    blocks_to(model, torch.device("meta"))
    assert model["embed"].blocks.device.type == "meta"
    assert model["head"].part0 is model["embed"].blocks
    assert keeps_blocks(torch.device("cpu"), whole=False)
    assert not keeps_blocks(torch.device("meta"), whole=True)


@pytest.mark.cuda
@pytest.mark.parametrize("source", ["gguf-q8_0", "on-the-fly-q4_k"])
def test_quantized_weights_on_cuda_keep_their_blocks_and_generate_the_cpu_s_tokens(tmp_path, source):
    """A Q8_0 GGUF file (its embedding and LM head in blocks too), and a checkpoint quantized to
    Q4_K on load: on CUDA the same greedy tokens as on the CPU."""
    from pagedkv.llm import LLM
    from tests.models.test_gguf import OPTIONS

    folder = make_checkpoint(tmp_path, "llama", **SHAPE)
    if source == "gguf-q8_0":
        model, options = str(write_gguf(folder, tmp_path / "llama-q8_0.gguf", Q.Q8_0)), {}
    else:
        model, options = str(folder), {"quantization": "q4_k"}
    with LLM(model, device="cuda", **OPTIONS, **options) as llm:
        assert "kept in GGUF blocks" in llm.engine.describe()
    assert greedy(model, device="cuda", **options) == greedy(model, **options)
