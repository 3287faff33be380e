"""``pagedkv bench capacity-hybrid`` at a small scale: the live engines hold more sequences with
hybrid paging at the same KV budget, and every block comes back."""

from pagedkv.bench.hybrid_capacity import HybridCapacityConfig, run_hybrid_capacity


def test_hybrid_paging_holds_more_sequences_at_one_budget():
    config = HybridCapacityConfig(scale=256, budget_contexts=4, block_size=4)
    result = run_hybrid_capacity(config)
    assert result.ok
    runs = {run.shape: run for run in result.runs}
    for run in runs.values():
        assert run.context == 128 and run.finished == {"hybrid": 32, "full": 32}
        # the same bytes: blocks one group deep are more blocks (less the null block)
        assert run.pool_blocks["full"] == 4 * 128 // 4
        assert run.peak_running["full"] == 4
    assert runs["gemma2"].pool_blocks["hybrid"] == 2 * 128 - 1
    assert runs["gemma3"].pool_blocks["hybrid"] == 6 * 128 - 1
    assert runs["gemma2"].ratio > 1.3
    assert runs["gemma3"].ratio > 2.5
