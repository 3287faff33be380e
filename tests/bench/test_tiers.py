"""``pagedkv bench tiers`` on the built-in model, scaled down: the accounting and the report.

Timings are the benchmark's business, not a test's; what must hold at any size is the token
arithmetic -- every prompt token is computed, loaded from the tier or served by the pool; a host
tier that holds the working set turns recomputation into loads; a restarted disk tier finds the
last turn's history -- and that every mode gives the same greedy replies.
"""

import io
import json

from rich.console import Console

from pagedkv.bench.commands import TIERS
from pagedkv.bench.driver import EngineOptions, finish
from pagedkv.bench.tiers import TiersConfig, run_tiers
from pagedkv.bench.tiers_report import print_tiers
from pagedkv.cli_report import ReportOptions


def test_the_tiers_bench_accounts_for_every_prompt_token(tmp_path):
    config = TiersConfig(
        conversations=5,
        turns=2,
        concurrency=5,
        system_len=16,
        user_len=24,
        reply_len=2,
        engine=EngineOptions(block_size=8, dtype="float32"),  # where identical replies are a target
        out=tmp_path,
    )
    assert config.pool_blocks < config.working_set_blocks  # the pool cannot hold the chats
    result = run_tiers(config)
    assert result.same_replies and set(result.runs) == {"off", "host", "disk", "restart"}
    for run in result.runs.values():
        assert run.prompt_tokens == run.computed_tokens + run.tier_hit_tokens + run.pool_hit_tokens
        assert run.computed_tokens >= run.new_tokens
        assert len(run.ttft) == config.conversations * config.turns
    off, host, disk, restart = (result.runs[m] for m in ("off", "host", "disk", "restart"))
    assert off.tier_hit_tokens == 0 and off.bytes_out == 0
    assert host.tier_hit_tokens > 0 and host.bytes_in > 0
    assert host.recomputed_tokens < off.recomputed_tokens
    # a disk tier's spill is readable once its file is written, however long that takes: how
    # much the warm disk run loads depends on the disk; a restart finds every file written
    assert disk.recomputed_tokens <= off.recomputed_tokens
    assert restart.last_turn_hits > 0 and restart.tier_hit_tokens > 0
    buffer = io.StringIO()
    print_tiers(result, Console(file=buffer, width=120))
    assert "restarted disk tier: last turn's hit rate" in buffer.getvalue()
    finish(ReportOptions(tmp_path, json=True), TIERS, result, {})
    document = json.loads((tmp_path / "tiers.json").read_text())
    assert document["runs"]["host"]["tier_hit_tokens"] == host.tier_hit_tokens
    assert document["dtype"] == "float32" and document["same_replies"]
    labels = {check["check"].split(":")[0] for check in document["checks"]}
    assert labels >= {"host tier", "greedy replies identical in every mode"}
