"""``pagedkv bench lora`` with tiny sizes: the table's rows and columns, unified paging holding at
least what fixed slots hold at one budget (more requests with few adapters active, more adapters
resident and fewer read again with short contexts), and every block back at the end."""

from rich.console import Console

from pagedkv.bench.lora import LoraBenchConfig, print_lora_bench, run_lora_bench


def test_the_lora_bench_compares_unified_paging_with_slots():
    config = LoraBenchConfig(
        max_loras=2,
        max_lora_rank=4,
        kv_blocks=12,
        active_adapters=1,
        requests=8,
        context=40,
        many_adapters=3,
        batch=4,
        adapters=2,
        prompt_len=6,
        max_tokens=3,
        rounds=1,
        cold_loads=1,
    )
    result = run_lora_bench(config)
    assert result.ok and result.blocks_after == {"unified": 0, "slots": 0}
    reserve_blocks = 2 * result.slot_bytes // result.block_bytes
    assert result.pool_blocks == {"unified": 12 + reserve_blocks, "slots": 12}
    assert result.adapter_pages > 0
    assert result.held_requests["unified"] > result.held_requests["slots"] > 0
    assert result.resident_adapters["slots"] == 2  # every slot, no more
    assert result.resident_adapters["unified"] == 3  # all of them, beyond the slots
    assert result.second_pass_reads["unified"] == 0 < result.second_pass_reads["slots"]
    assert result.lora_tokens_per_s > 0 and result.base_tokens_per_s > 0
    console = Console(record=True, width=200)
    print_lora_bench(result, console)
    text = console.export_text()
    for row in ("pool blocks", "requests held", "adapters resident", "read again", "LoRA tok/s", "ratio"):
        assert row in text
    assert "unified paging" in text and "fixed slots" in text and "closed form" in text
    bound = result.to_json()["closed_form"]["held_requests"]
    assert result.held_requests["slots"] <= bound["slots"]
    assert result.held_requests["unified"] <= bound["unified"]
