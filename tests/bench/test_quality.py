"""``pagedkv bench quality`` on the built-in model, scaled down to seconds.

With one KV cache dtype the table is auto's row alone; comparing auto with itself (two engines,
same pool, same scheduling) must give zero logits error and identical continuations -- what makes
the quantized rows' errors mean something.
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from pagedkv.bench.quality import (
    HeldOut,
    QualityConfig,
    QualityResult,
    compare,
    print_quality,
    quality_engine,
    run_dtype,
)
from pagedkv.cli import main
from pagedkv.engine.perplexity import perplexity
from pagedkv.models.builtin.train import stdlib_text

SMALL = QualityConfig(
    max_heldout_chars=2_000, window=48, logits_rows=100, num_prompts=2, prompt_len=16, gen_tokens=12
)


def test_the_command_prints_json_and_writes_it(tmp_path, capsys):
    argv = ["bench", "quality", "--json", "--out", str(tmp_path), "--max-heldout-chars", "2000"]
    argv += ["--window", "48", "--logits-rows", "50", "--num-prompts", "2", "--prompt-len", "16"]
    argv += ["--gen-tokens", "8", "--max-num-batched-tokens", "64", "--kv-cache-dtypes", "fp8"]
    assert main(argv) in (0, 1)  # 1: fp8 missed the perplexity goal (reported, not hidden)
    document = json.loads(capsys.readouterr().out)
    assert document == json.loads((tmp_path / "quality.json").read_text())
    auto, fp8 = document["rows"]
    assert auto["kv_cache_dtype"] == "auto" and auto["perplexity_change_pct"] is None
    # fewer bytes than the model's dtype, scales included (float32: under half; bfloat16: 576 of 1024)
    assert fp8["kv_cache_dtype"] == "fp8" and fp8["bytes_per_token"] < auto["bytes_per_token"]
    assert 2 < auto["perplexity"] < 500 and abs(fp8["perplexity_change_pct"]) < 50
    assert fp8["perplexity_change_pct"] == pytest.approx(100 * (fp8["perplexity"] / auto["perplexity"] - 1))
    assert 0 < fp8["logits_mean_abs_error"] <= fp8["logits_max_abs_error"]  # quantized: not bit-equal
    assert 0 <= fp8["token_agreement"] <= 1 and fp8["identical_continuations"] <= 2
    assert document["ok"] == (fp8["perplexity_change_pct"] <= 1.0)
    assert document["heldout"]["scored_tokens"] > 100 and document["logits_rows_compared"] == 50
    assert document["config"]["window"] == 48 and document["config"]["engine"]["max_num_batched_tokens"] == 64


def test_a_text_file_in_llama_perplexity_chunks(tmp_path, capsys):
    """``--text`` scores the file as the model's tokenizer encodes it whole; ``--llamacpp-chunks``
    cuts it into whole chunks of --window, each scoring the tokens after its middle."""
    text = tmp_path / "text.py"
    (source,) = stdlib_text.read_sources(stdlib_text.split_files()[1][:1])
    text.write_text(source[:3_000], encoding="utf-8")
    argv = ["bench", "quality", "--json", "--out", str(tmp_path), "--text", str(text), "--llamacpp-chunks"]
    argv += ["--window", "32", "--logits-rows", "8", "--num-prompts", "1", "--prompt-len", "8"]
    argv += ["--gen-tokens", "2", "--kv-cache-dtypes", "auto"]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    num_tokens = len(HeldOut.from_file(None, text).documents[0])
    assert document["heldout"]["files"] == 1 and document["heldout"]["windows"] == num_tokens // 32
    assert document["heldout"]["scored_tokens"] == (num_tokens // 32) * (32 - 16 - 1)
    assert 2 < document["rows"][0]["perplexity"] < 500


def test_auto_against_itself_has_no_error_and_the_perplexity_of_the_engine():
    heldout = HeldOut.load(None, SMALL.max_heldout_chars)
    first, second = (run_dtype(SMALL, "auto", heldout) for _ in range(2))
    row = compare(second, first)
    assert row.perplexity_change_pct == 0.0 and row.token_agreement == 1.0
    assert row.identical_continuations == 2 and row.first_divergence_mean == SMALL.gen_tokens
    assert row.logits_max_abs_error == 0.0 and first.logits.shape[0] == SMALL.logits_rows
    assert [len(g) for g in first.generated] == [SMALL.gen_tokens] * 2
    direct = perplexity(quality_engine(SMALL, "auto"), heldout.documents, SMALL.window)
    assert first.perplexity == direct
    result = QualityResult(SMALL, 1, heldout.chars, direct.num_tokens, direct.num_windows, 2, 100)
    result.rows = [compare(first, first), row]
    console = Console(width=80, record=True)
    print_quality(result, console)
    table = console.export_text()
    assert f"{direct.perplexity:.3f}" in table and "+0.00%" in table and "100.0%" in table
    assert "met  perplexity within +1 % of auto" in table and all(
        len(line) <= 80 for line in table.splitlines()
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-cache-dtypes", "fp4"], "invalid choice: 'fp4'"),
        (["--window", "1"], "window must hold at least 2 tokens"),
        (["--stride", "300"], "stride must be in [1, window = 256]"),
        (["--gen-tokens", "0"], "gen_tokens must be a positive integer"),
        (
            ["--llamacpp-chunks", "--stride", "64"],
            "llamacpp_chunks are consecutive chunks: they take no stride",
        ),
        (["--text", "t.txt", "--max-heldout-chars", "9"], "max_heldout_chars cuts the held-out files"),
    ],
)
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "quality", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
