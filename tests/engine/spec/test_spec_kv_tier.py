"""Speculative decoding over a pool with a second KV tier: drafts, rollbacks, spills, loads and
swaps in the same steps change no token, and every block comes back to the pool and the tier."""

from __future__ import annotations

import pytest

from pagedkv import LLM
from tests.checkpoints import make_checkpoint
from tests.engine.spec.test_engine_spec import GREEDY, NGRAM, _assert_speculated_and_clean, _tokens
from tests.engine.test_engine_exactness import _prompts

#: A pool of 20 blocks of 4 tokens for six prompts of up to 60: blocks leave it all the time.
TIGHT = dict(dtype="float32", block_size=4, num_kv_blocks=20, watermark=0.0, decode_headroom=0.0)


@pytest.mark.parametrize("preemption_mode", [None, "swap"])
def test_speculation_with_a_host_tier_gives_plain_greedy_tokens(tmp_path, preemption_mode):
    path = str(make_checkpoint(tmp_path, "llama"))
    with LLM(path, **TIGHT) as plain:
        expected = _tokens(plain, _prompts(), GREEDY)
    tier = dict(kv_offload="host", kv_offload_memory="1MiB", preemption_mode=preemption_mode)
    with LLM(path, **TIGHT, **tier, speculative_config=NGRAM) as llm:
        assert _tokens(llm, _prompts(), GREEDY) == expected
        assert _tokens(llm, _prompts(), GREEDY) == expected  # prefixes back from the tier
        _assert_speculated_and_clean(llm)
        stats = llm.kv_stats()
        assert stats["preemptions"] > 0 and stats["tier_hits_tokens"] > 0
        assert stats["tier_blocks_swap"] == 0
