"""The paged engine gives the tokens transformers gives, on real checkpoints.

Greedy decoding is deterministic, so any difference -- a wrong slot, a block table that points
at someone else's block, a missed copy-on-write, a chunk boundary off by one -- shows up as a
different token. The engine runs on ``PAGEDKV_TEST_DEVICE`` (the CPU unless it says otherwise;
on CUDA with its decode graphs), transformers on the CPU.
"""

import random

import pytest
import torch

from pagedkv import LLM, SamplingParams
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint
from tests.devices import TEST_DEVICE

MAX_NEW = 12
CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied-headdim24": ("llama", {"tie_word_embeddings": True, "head_dim": 24}),
    "mistral-window": ("mistral", {"sliding_window": 24}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm-tied": ("qwen3", {"tie_word_embeddings": True}),
}


def _prompts(seed: int = 0) -> list[list[int]]:
    """Mixed lengths, two of them sharing a 40-token prefix so the prefix cache hits."""
    rng = random.Random(seed)
    shared = [rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(40)]
    lengths = [3, 17, 33, 48]
    prompts = [[rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)] for n in lengths]
    prompts.append(shared + [5, 6, 7])
    prompts.append(shared + [9])
    return prompts


def _transformers_greedy(path, prompts, max_new):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones_like(ids)
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Checkpoint folder and transformers' greedy tokens for every case, built once."""
    refs = {}
    for name, (arch, overrides) in CASES.items():
        path = make_checkpoint(tmp_path_factory.mktemp(name), arch, **overrides)
        refs[name] = (path, _transformers_greedy(path, _prompts(), MAX_NEW))
    return refs


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_tokens_equal_transformers(references, case, block_size):
    path, expected = references[case]
    # A small token budget forces chunked prefill of the longer prompts, interleaved with decodes.
    llm = LLM(
        str(path),
        dtype="float32",
        device=TEST_DEVICE,
        block_size=block_size,
        num_kv_blocks=2048 // block_size,
        max_num_batched_tokens=20,
    )
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.kv_stats()
    assert stats["prefix_cache_hits_tokens"] > 0, "the shared prefix should have hit the cache"
    assert stats["blocks_used"] == 0


def test_preemption_under_a_tiny_pool_changes_nothing(references):
    path, expected = references["llama-gqa-untied"]
    # 16 blocks of 4 tokens = 64 slots for six prompts of up to 60 tokens: preemption must happen.
    llm = LLM(
        str(path),
        dtype="float32",
        device=TEST_DEVICE,
        block_size=4,
        num_kv_blocks=16,
        watermark=0.0,
        decode_headroom=0.0,
    )
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.kv_stats()
    assert stats["preemptions"] > 0
    assert stats["blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


def test_prefix_caching_off_gives_the_same_tokens(references):
    path, expected = references["qwen2-bias"]
    llm = LLM(
        str(path),
        dtype="float32",
        device=TEST_DEVICE,
        block_size=8,
        num_kv_blocks=256,
        enable_prefix_caching=False,
    )
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.kv_stats()["prefix_cache_hits_tokens"] == 0


# -- the second KV tier: spills, loads, swaps and a warm restart move bits, never change them ----
#: A pool of 16 blocks of 4 tokens for six prompts of up to 60: blocks leave it all the time.
TIGHT = dict(dtype="float32", block_size=4, num_kv_blocks=16, watermark=0.0, decode_headroom=0.0)


def _greedy(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("preemption_mode", [None, "swap"])
def test_the_host_tier_changes_no_token(references, preemption_mode):
    path, expected = references["llama-gqa-untied"]
    llm = LLM(
        str(path), kv_offload="host", kv_offload_memory="1MiB", preemption_mode=preemption_mode, **TIGHT
    )
    assert _greedy(llm) == expected
    assert _greedy(llm) == expected  # again: the prompts' prefixes come back from the tier
    stats = llm.kv_stats()
    assert stats["tier_medium"] == "CPU" and stats["tier_blocks_stored"] > 0
    assert stats["tier_hits_tokens"] > 0 and stats["tier_blocks_loaded"] > 0
    assert stats["preemptions"] > 0
    if preemption_mode == "swap":  # (one whose computed blocks are all cached has nothing to swap)
        assert stats["preemptions_swapped"] > 0
    assert stats["blocks_used"] == 0 and stats["tier_blocks_swap"] == 0


def test_a_restarted_disk_tier_gives_the_same_tokens(references, tmp_path, caplog):
    path, expected = references["qwen3-qknorm-tied"]
    options = TIGHT | dict(kv_offload="disk", kv_offload_memory="2MiB", kv_offload_dir=tmp_path / "kv")
    with LLM(str(path), **options) as first:
        assert _greedy(first) == expected
        assert first.kv_stats()["tier_blocks_stored"] > 0
    with LLM(str(path), **options) as restarted:
        assert restarted.kv_stats()["tier_blocks_cached"] > 0  # yesterday's prefixes, indexed
        assert _greedy(restarted) == expected
        stats = restarted.kv_stats()
        assert stats["tier_hits_tokens"] > 0 and stats["tier_load_failures"] == 0
    # a damaged file is found by its checksum when loaded: the sequence recomputes instead
    files = sorted((tmp_path / "kv").glob("*.kvblock"))
    for file in files:
        data = bytearray(file.read_bytes())
        data[-1] ^= 0xFF
        file.write_bytes(bytes(data))
    with LLM(str(path), **options) as damaged:
        assert _greedy(damaged) == expected
        assert damaged.kv_stats()["tier_load_failures"] > 0
    # another model's files are never read: its layout names other weights
    other, _ = references["llama-tied-headdim24"]
    with caplog.at_level("WARNING"), LLM(str(other), **options) as stranger:
        assert stranger.kv_stats()["tier_blocks_cached"] == 0
    assert "written for another KV layout" in caplog.text
    # a smaller tier indexes the newest blocks it holds, and deletes the other files
    block_bytes = stats["bytes_per_token"] * TIGHT["block_size"]
    with LLM(str(path), **options | {"kv_offload_memory": 3 * block_bytes}) as smaller:
        assert smaller.kv_stats()["tier_blocks_cached"] == 3
    assert len(list((tmp_path / "kv").glob("*.kvblock"))) == 3
