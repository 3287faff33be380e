"""``pagedkv bench parallel`` on a test checkpoint: both engines run every workload, agree on
the tokens, and rank 0's collectives are counted (what the README's figures come from; the
speed itself is the benchmark's to report, never a test's)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.checkpoints import make_checkpoint


def test_bench_parallel_reports_both_engines_and_the_collectives(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    command = [sys.executable, "-m", "pagedkv.cli", "bench", "parallel", "--model", str(path), "--json"]
    shape = ["--repeats", "1", "--prefill", "2", "24", "1", "--decode", "2", "4", "3", "--out", str(tmp_path)]
    done = subprocess.run([*command, *shape], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [w["name"] for w in report["workloads"]] == ["prefill", "decode"]
    for workload in report["workloads"]:
        assert workload["same_tokens"] is True
        assert workload["single_tokens_per_s"] > 0 and workload["parallel_tokens_per_s"] > 0
        # 2 layers: 2 all-reduces each, the embedding's, the logits' gather
        assert workload["collectives_per_step"] == 6
    # decode: a prefill step, then two decode steps for the 3 tokens of each request
    assert report["workloads"][1]["steps"] == 3
