"""The host KV tier under tensor parallelism: every rank spills, loads and swaps its half of the
KV heads of the same blocks and slots, so two ranks with a tier give the tokens of one rank
without one (kept apart from ``test_tensor_parallel``: one tensor-parallel engine per process)."""

from pagedkv import LLM, SamplingParams
from pagedkv.engine import RequestLimits
from tests.checkpoints import make_checkpoint
from tests.engine.worker.test_tensor_parallel import _prompts, _tokens

#: Long enough outputs that a preempted sequence holds computed blocks past its cached prefix.
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_two_ranks_move_their_shards_of_the_same_blocks_to_the_host_tier(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    # 16 blocks of 4 tokens: the prompts preempt each other (a request budget above the pool)
    options = dict(
        dtype="float32",
        block_size=4,
        num_kv_blocks=16,
        watermark=0.0,
        decode_headroom=0.0,
        limits=RequestLimits(max_request_tokens=4096),
    )
    expected = _tokens(LLM(str(path), **options).generate(_prompts(), GREEDY, use_tqdm=False))
    tier = dict(kv_offload="host", kv_offload_memory="1MiB", preemption_mode="swap")
    with LLM(str(path), tensor_parallel_size=2, **options, **tier) as two:
        for _ in range(2):  # the second pass loads the prompts' prefixes from the tier
            assert _tokens(two.generate(_prompts(), GREEDY, use_tqdm=False)) == expected
        stats = two.kv_stats()
        assert stats["preemptions_swapped"] > 0 and stats["tier_hits_tokens"] > 0
        assert stats["blocks_used"] == 0 and stats["tier_blocks_swap"] == 0
