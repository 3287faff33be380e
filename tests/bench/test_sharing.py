"""``pagedkv bench sharing`` on the built-in model: prefix-cache arithmetic, exactness, the report.

The second identical request must compute only the tokens after the last fully cached block
(the prompt's last token is always recomputed, since its logits are needed); prefix caching must
not change greedy outputs; and a scaled-down run must show what the full one shows: sharing
saves blocks, beams more than parallel samples.
"""

import argparse
import dataclasses
import io
import json

import numpy as np
import pytest
from rich.console import Console

from pagedkv.bench.commands import SHARING
from pagedkv.bench.driver import EngineOptions, MeasuredEngine, add_bench
from pagedkv.bench.sharing import SharingConfig, run_prefix_point, run_sharing
from pagedkv.bench.sharing_report import parallel_saving_once_done, print_sharing, write_sharing_plots
from pagedkv.engine import SamplingParams

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _engine() -> MeasuredEngine:
    options = EngineOptions()
    return MeasuredEngine.start(
        options.engine_config(num_kv_blocks=32, max_model_len=128, max_num_seqs=4, enable_prefix_caching=True)
    )


# prompt length -> tokens the second identical request computes with 16-token blocks
SECOND_REQUEST_COMPUTES = {1: 1, 15: 15, 16: 16, 17: 1, 40: 8, 48: 16}


@pytest.mark.parametrize("prompt_len", sorted(SECOND_REQUEST_COMPUTES))
def test_second_identical_request_computes_only_the_tokens_after_the_last_cached_block(prompt_len):
    engine = _engine()
    prompt = np.random.default_rng(prompt_len).integers(4, 2048, prompt_len).tolist()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.submit("first", prompt, params)
    engine.drain()
    assert sum(s.prefill_tokens for s in engine.steps) == prompt_len  # nothing was cached yet
    mark = len(engine.steps)

    engine.submit("second", prompt, params)
    engine.drain()

    expected = SECOND_REQUEST_COMPUTES[prompt_len]
    second = engine.steps[mark:]
    assert sum(s.prefill_tokens for s in second) == expected
    assert sum(s.prefix_cache_queries for s in second) - sum(s.prefix_cache_hits for s in second) == expected
    assert engine.cached_tokens["second"] == prompt_len - expected
    assert engine.outputs["second"] == engine.outputs["first"]
    assert engine.engine.stats().kv.used_blocks == 0


@pytest.mark.parametrize("warm", [False, True])
def test_greedy_outputs_are_identical_with_prefix_caching_on_and_off(warm):
    # two whole prompts per step: a cold first wave
    engine = EngineOptions(max_num_batched_tokens=144)
    config = SharingConfig(
        prefix_lens=(64,), num_requests=(6,), user_len=8, output_len=6, warm=warm, engine=engine
    )
    point = run_prefix_point(config, 64, 6)

    assert point.outputs_identical
    assert len(point.on.outputs) == 6 and all(len(o[0]) == 6 for o in point.on.outputs.values())
    on, off = point.on, point.off
    assert off.prefill_computed == off.prompt_tokens == 6 * 72 and off.prefill_skipped == 0
    assert on.prefill_skipped == on.prefix_hit_tokens > 0
    assert on.peak_blocks < off.peak_blocks
    # Cold, the first step's two requests compute the prefix; warm, none of the measured ones does.
    assert point.cold_requests == (0 if warm else 2)
    assert on.prefill_computed == point.cold_requests * 64 + 6 * 8


@pytest.fixture(scope="module")
def scaled_run():
    """The whole benchmark at 1/4 scale: 4-token blocks, prefixes of 32 tokens."""
    config = SharingConfig(prefix_lens=(128,), num_requests=(1, 16), num_prompts=4, widths=(2, 4))
    return run_sharing(dataclasses.replace(config, engine=EngineOptions(scale=4)))


def test_scaled_run_shares_blocks_and_beams_share_more(scaled_run):
    assert scaled_run.ok
    for width in (2, 4):
        parallel, beam = scaled_run.fork("parallel", width), scaled_run.fork("beam", width)
        assert 0 < parallel.saving < beam.saving < 1
        assert parallel.preemptions == beam.preemptions == 0
        # Each sample or beam needs at least its own private tail beyond what is shared.
        for run in (parallel, beam):
            assert all(s.used_blocks <= s.table_blocks for s in run.samples)
    point = scaled_run.prefix[-1]
    assert point.num_requests == 16 and point.prefix_len == 32
    assert point.on.peak_blocks < point.off.peak_blocks
    assert point.on.prefill_computed < point.off.prefill_computed


def test_scaled_run_report_and_plots(scaled_run, tmp_path):
    paths = write_sharing_plots(scaled_run, tmp_path)
    assert [p.name for p in paths] == ["sharing_prefix.png", "sharing_fork.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 10_000 for p in paths)

    out = io.StringIO()
    print_sharing(scaled_run, Console(file=out, width=240))
    text = out.getvalue()
    assert "Shared system prompt" in text and "beams" in text
    assert "NOT met" not in text
    document = json.loads(json.dumps(scaled_run.to_json()))
    assert document["outputs_identical"] and len(document["forks"]) == 4


def test_parallel_saving_once_done_counts_only_full_prompt_blocks():
    # 33-token prompt: two full blocks shared by 4 samples, the partial third one copied.
    assert parallel_saving_once_done([(33, 31)], 16, 4) == pytest.approx(3 * 2 / (4 * 4))
    assert parallel_saving_once_done([(15, 40)], 16, 6) == 0.0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedkv bench")
    add_bench(parser.add_subparsers(dest="bench", required=True), SHARING)
    return parser.parse_args(argv)


def test_command_line_prints_one_json_document(capsys, tmp_path):
    argv = ["sharing", "--part", "fork", "--num-prompts", "2", "--widths", "2", "--scale", "8"]
    args = _parse([*argv, "--json", "--no-plots", "--out", str(tmp_path)])
    assert args.run(args) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["shared_prefix"] == [] and [f["kind"] for f in document["forks"]] == ["parallel", "beam"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--widths", "0"], "widths must be a non-empty list of positive integers"),
        (["--prefix-lens", "100", "--scale", "8"], "scale 8 must divide every prefix length"),
        (["--num-prompts", "0"], "num_prompts must be a positive integer"),
    ],
)
def test_command_line_rejects_bad_values(argv, message, capsys):
    args = _parse(["sharing", *argv])
    with pytest.raises(SystemExit):
        args.run(args)
    assert message in capsys.readouterr().err


def test_configs_reject_bad_values():
    with pytest.raises(ValueError, match="mix must be one of"):
        SharingConfig(mix="chat")
    with pytest.raises(ValueError, match="user_len must be a positive integer"):
        SharingConfig(user_len=0)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineOptions(block_size=0)
