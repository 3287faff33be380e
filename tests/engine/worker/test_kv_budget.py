"""The KV pool of a real engine: sized "auto" by default between one full context and what the
batch can fill, from the memory measured once the weights are loaded; explicit sizes as given;
the start-up line says which."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from pagedkv import LLM, SamplingParams
from pagedkv.attention import resolve_backend
from pagedkv.cli import main
from pagedkv.engine import EngineConfig
from pagedkv.engine.worker.executor.kv_budget import request_blocks
from pagedkv.engine.worker.executor.rank import size_rank_pools
from pagedkv.memory.pool_sizing import AUTO_KV_SHARE, PoolSizing
from pagedkv.models import ModelConfig, load_model
from pagedkv.models.weight_bytes import loaded_weight_bytes
from pagedkv.server.replicas import ReplicaSet, split_auto_pool
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf
from tests.quant_checkpoints import Variant, quantized_checkpoint

Q = GGMLQuantizationType

#: the built-in model with limits that make its cap small: 4 sequences of 256 tokens
SMALL = dict(dtype="float32", max_model_len=256, max_num_seqs=4)
CONTEXT_BLOCKS, CAP_BLOCKS = 256 // 16, 4 * 256 // 16


def test_auto_is_the_default():
    assert EngineConfig().kv_cache_memory == "auto"


def test_auto_pool_lies_between_one_context_and_the_batch_it_can_fill():
    with LLM(**SMALL) as llm:
        sizing, stats = llm.engine.kv_sizing, llm.kv_stats()
        assert sizing.source == "auto" and sizing.available > 0
        assert stats["blocks_total"] == sizing.num_blocks
        assert CONTEXT_BLOCKS <= sizing.num_blocks <= CAP_BLOCKS
        if AUTO_KV_SHARE * sizing.available >= CAP_BLOCKS * sizing.block_bytes:  # any machine of today
            assert sizing.num_blocks == CAP_BLOCKS
        assert stats["kv_cache_bytes"] == sizing.num_blocks * sizing.block_bytes
        # every running sequence can reach the full context at once
        prompts = [[5 + i] * 8 for i in range(4)]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=240, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [240] * 4
        assert llm.kv_stats()["preemptions"] == 0
        assert "sized auto from" in repr(llm)


def test_the_default_engine_stays_within_what_its_batch_fills():
    """The built-in model at its own max_model_len and max_num_seqs: no more than 64 full
    contexts, whatever the machine has."""
    with LLM(dtype="float32") as llm:
        sizing = llm.engine.kv_sizing
        cap = EngineConfig.max_num_seqs * llm.engine.max_model_len // sizing.block_size
        assert sizing.source == "auto" and llm.engine.max_model_len // 16 <= sizing.num_blocks <= cap


@pytest.mark.parametrize(("given", "num_bytes"), [("1MiB", 2**20), (3 * 2**20, 3 * 2**20)])
def test_an_explicit_size_is_as_many_blocks_as_it_holds(given, num_bytes):
    with LLM(dtype="float32", kv_cache_memory=given) as llm:
        sizing = llm.engine.kv_sizing
        assert sizing.source == "kv_cache_memory" and sizing.available is None
        assert llm.kv_stats()["blocks_total"] == num_bytes // sizing.block_bytes
        assert sizing.describe().endswith("from --kv-cache-memory")


def test_num_kv_blocks_wins_over_any_memory_size():
    with LLM(dtype="float32", num_kv_blocks=40, kv_cache_memory="1GiB") as llm:
        assert llm.kv_stats()["blocks_total"] == 40 and llm.engine.kv_sizing.source == "num_kv_blocks"


def test_a_size_that_holds_no_block_is_refused():
    with pytest.raises(ValueError, match="holds no block"):
        LLM(dtype="float32", kv_cache_memory="1KiB")


def test_tensor_parallel_ranks_size_their_pools_alike(tmp_path):
    """Two ranks on this machine split its share and agree on one count."""
    path = make_checkpoint(tmp_path, "llama")  # max_position_embeddings 512
    options = dict(dtype="float32", block_size=4, max_model_len=64, max_num_seqs=3, tensor_parallel_size=2)
    with LLM(str(path), **options) as two:
        sizing = two.engine.kv_sizing
        assert sizing.source == "auto" and sizing.ranks == 2
        assert 16 <= sizing.num_blocks <= 3 * 16 and two.kv_stats()["blocks_total"] == sizing.num_blocks
        assert "per rank" in sizing.describe()
        greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        assert len(two.generate([[3, 4, 5]] * 3, greedy, use_tqdm=False)[2].outputs[0].token_ids) == 40


def test_the_cli_prints_the_sizing_at_start_up(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # the line unwrapped
    assert (
        main(["generate", "Hello", "--max-tokens", "3", "--max-model-len", "256", "--max-num-seqs", "4"]) == 0
    )
    out = capsys.readouterr().out
    assert f"KV cache: {CAP_BLOCKS} blocks of 16 tokens (" in out and "sized auto from" in out
    assert main(["generate", "Hello", "--max-tokens", "3", "--kv-cache-memory", "1MiB"]) == 0
    assert "blocks of 16 tokens (1.0 MiB," in capsys.readouterr().out


def test_the_cli_refuses_a_bad_kv_cache_memory(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "Hello", "--kv-cache-memory", "plenty"])
    assert exit_info.value.code == 2 and "cannot parse a byte size" in capsys.readouterr().err


def test_replicas_on_one_machine_share_one_auto_sizing():
    """``--data-parallel-size``: sized once for all replicas, each gets the same block count."""
    engine, sizing = split_auto_pool(EngineConfig(**SMALL), 2)
    assert sizing.source == "auto" and sizing.available > 0
    assert engine.num_kv_blocks == sizing.num_blocks and CONTEXT_BLOCKS <= sizing.num_blocks <= CAP_BLOCKS
    replicas = ReplicaSet(EngineConfig(**SMALL), 2)
    assert replicas.kv_sizing is not None
    assert {spec.engine.num_kv_blocks for spec in replicas.specs} == {replicas.kv_sizing.num_blocks}
    given = ReplicaSet(EngineConfig(**SMALL, kv_cache_memory="1MiB"), 2)
    assert given.kv_sizing is None and {spec.engine.num_kv_blocks for spec in given.specs} == {None}


@pytest.mark.parametrize("bad", ["plenty", "0", -5])
def test_a_bad_kv_cache_memory_is_refused_before_anything_loads(bad):
    with pytest.raises(ValueError):
        EngineConfig(kv_cache_memory=bad)


def _fixed_free_memory(device: str) -> int:
    """What the tests below pretend every device has free: sizings compared side by side must
    start from the same figure, which the machine's own memory (changing by the second) is not."""
    return 4 * 2**30


def _sizing(path, local_ranks: int, **options) -> PoolSizing:
    """An "auto" pool for ``local_ranks`` ranks of the model at ``path``, sized as the executors
    and replicas size it before loading; the cap far above the share, so the share decides."""
    options = dict(dtype="float32", max_model_len=64, max_num_seqs=10**6, **options)
    settings = EngineConfig(model=str(path), **options).resolve()
    config = ModelConfig.from_pretrained(path)
    return size_rank_pools(settings, config, Path(path), local_ranks, free_memory=_fixed_free_memory)


@pytest.mark.parametrize("ranks", [1, 2])
def test_auto_sizing_counts_quantized_weights_by_their_blocks(tmp_path, ranks):
    """A Q8_0 GGUF and its F32 twin, sized with the same free memory before loading (tensor
    parallelism, replicas): the quantized model's weights are counted by their blocks, so its
    pool starts from more bytes, by what the blocks save (each rank its share of it), and holds
    as many more blocks as the auto share of those bytes fills."""
    folder = make_checkpoint(tmp_path, "llama")
    q8, f32 = (write_gguf(folder, tmp_path / f"{q.name}.gguf", q) for q in (Q.Q8_0, Q.F32))
    saved = sum(
        t.n_elements * 4 - t.n_bytes
        for t in GGUFReader(q8).tensors
        if t.tensor_type == Q.Q8_0 and len(t.shape) > 1
    )
    options = dict(tensor_parallel_size=ranks)
    quantized, dense = _sizing(q8, ranks, **options), _sizing(f32, ranks, **options)
    assert quantized.block_bytes == dense.block_bytes and saved > 0
    assert quantized.available - dense.available == ranks * (saved // ranks)
    extra = AUTO_KV_SHARE * ranks * (saved // ranks) / ranks / dense.block_bytes
    assert abs(quantized.num_blocks - dense.num_blocks - extra) <= 1
    # the F32 twin is counted as the Hugging Face folder it was written from
    assert dense.available == _sizing(folder, ranks, **options).available


@pytest.mark.parametrize("source", ["gguf", "on the fly", "gptq", "awq", "compressed-tensors w8"])
def test_the_counted_weights_are_the_loaded_ones(tmp_path, source):
    """What the sizing counts before loading is what the loaded model holds: its parameters and
    its quantized blocks, byte for byte (Q8_0 GGUF; Q4_K on the fly; GPTQ symmetric as Q4_0, AWQ
    with zero points as Q4_1, compressed-tensors 8-bit as Q8_0)."""
    quantization = "q4_k" if source == "on the fly" else None
    if source in ("gguf", "on the fly"):
        folder = make_checkpoint(tmp_path, "llama")
        path = write_gguf(folder, tmp_path / "q.gguf", Q.Q8_0) if source == "gguf" else folder
    else:
        variant = {
            "gptq": Variant("gptq"),
            "awq": Variant("awq", symmetric=False),
            "compressed-tensors w8": Variant("compressed-tensors", bits=8),
        }[source]
        path, _ = quantized_checkpoint(tmp_path, variant)
    model = load_model(path, dtype=torch.float32, quantization=quantization)
    blocks = [b for b in model.buffers() if b.dtype == torch.uint8]  # quantized weights' blocks
    tensors = {t.data_ptr(): t.nbytes for t in [*model.parameters(), *blocks]}  # a tied one once
    config = ModelConfig.from_pretrained(path)
    backend = resolve_backend(None, torch.device("cpu"))
    counted = loaded_weight_bytes(path, config, torch.float32, backend, True, quantization)
    assert counted == sum(tensors.values())
    assert counted < loaded_weight_bytes(path, config, torch.float32, backend, False, quantization)


def test_replicas_of_a_hybrid_model_are_sized_in_the_blocks_they_page_by(tmp_path):
    """Gemma 2 of four layers, two sliding: each replica pages by two KV groups of two layers,
    so a block is two layers deep, and the pool sized for the replicas counts such blocks (not
    blocks of every layer, twice the bytes): the block a replica builds is the one it was
    sized in."""
    layout = dict(sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=4)
    path = make_checkpoint(tmp_path, "gemma2", **layout)
    options = dict(model=str(path), dtype="float32", max_model_len=64, max_num_seqs=2)
    engine, grouped = split_auto_pool(EngineConfig(**options), 2)
    _, flat = split_auto_pool(EngineConfig(**options, disable_hybrid_kv_cache_manager=True), 2)
    assert grouped.source == flat.source == "auto"
    assert flat.block_bytes == 2 * grouped.block_bytes
    with LLM(**{**options, "num_kv_blocks": engine.num_kv_blocks}) as replica:
        assert replica.engine.kv_sizing.block_bytes == grouped.block_bytes
        assert replica.kv_stats()["kv_cache_bytes"] == grouped.nbytes
        assert "2 KV groups of 2 layers" in replica.engine.describe()


def test_a_hybrid_model_sized_auto_holds_its_batch_at_the_full_context(tmp_path):
    """Gemma 2 of four layers, two sliding (window 8): a request at the full context holds a
    table in each KV group (and the pool a null block), so "auto" counts that request, not its
    tokens' blocks once: every sequence of the batch reaches the full context together."""
    layout = dict(sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=4)
    path = make_checkpoint(tmp_path, "gemma2", **layout)
    with LLM(model=str(path), dtype="float32", max_model_len=64, max_num_seqs=2) as llm:
        sizing = llm.engine.kv_sizing
        groups = llm.engine.executor.kv_groups
        assert groups is not None and groups.num_groups == 2
        request = request_blocks(llm.engine.settings, groups, 64)
        assert request == 2 * 64 // 16 + 1  # a prompt computed whole fills the sliding group too
        if AUTO_KV_SHARE * sizing.available >= 2 * request * sizing.block_bytes:  # any machine of today
            assert sizing.num_blocks == 2 * request
        prompts = [[5 + i] * 8 for i in range(2)]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=56, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [56, 56]
        assert llm.kv_stats()["preemptions"] == 0
