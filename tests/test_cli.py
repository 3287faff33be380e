"""The ``pagedkv`` command line: simulate (tables, --json, plots) and demo."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from pagedkv.cli import build_parser, main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DESIGN_FIELDS = {"kv_bytes_per_token", "example", "batches", "block_sizes", "prefix_sharing", "capacity"}


def run_json(capsys, *args):
    assert main(["simulate", "--json", "--no-plots", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_json_is_one_document_with_the_fields(capsys):
    doc = run_json(capsys)
    assert DESIGN_FIELDS <= set(doc)
    assert (doc["example"]["paged_slots"], doc["example"]["naive_slots"]) == (96, 6144)
    assert all(row["paged"]["utilization"] >= 0.98 for row in doc["batches"])
    assert all(0.20 <= row["naive"]["utilization"] <= 0.30 for row in doc["batches"])
    assert doc["capacity"]["ratio"] >= 3
    assert doc["plots"] == []


def test_same_seed_same_json(capsys):
    first = run_json(capsys, "--seed", "3", "--workload", "sharegpt")
    second = run_json(capsys, "--seed", "3", "--workload", "sharegpt")
    assert first == second
    assert first["config"]["workload"] == "sharegpt" and first["config"]["seed"] == 3


def test_options_reach_the_simulation(capsys):
    doc = run_json(
        capsys,
        "--block-size",
        "32",
        "--max-seq-len",
        "1024",
        "--gpu-memory",
        "24GiB",
        "--weights-memory",
        "14GB",
    )
    assert doc["config"]["kv_memory_bytes"] == 24 * 2**30 - 14 * 10**9
    assert (
        doc["example"]["naive_slots"] == 3 * 1024 and doc["example"]["paged_slots"] == 128
    )  # 2+2+1 blocks of 32
    assert (
        doc["capacity"]["naive_requests"]
        == doc["config"]["kv_memory_bytes"] // doc["kv_bytes_per_token"] // 1024
    )


def test_simulate_prints_tables(capsys, tmp_path):
    assert main(["simulate", "--no-plots", "--out", str(tmp_path / "unused")]) == 0
    text = capsys.readouterr().out
    assert "6,144" in text and "96 slots paged" in text and "naive (Max)" in text and "Capacity" in text
    assert "Plots written" not in text and not (tmp_path / "unused").exists()


def test_json_lists_the_plots_it_wrote_as_valid_pngs(capsys, tmp_path):
    assert main(["simulate", "--json", "--out", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    names = {Path(p).name for p in doc["plots"]}
    assert names >= {
        "utilization_vs_batch.png",
        "waste_breakdown.png",
        "block_size_tradeoff.png",
        "memory_map.png",
    }
    for path in map(Path, doc["plots"]):
        assert path.parent == tmp_path and path.read_bytes()[:8] == PNG_SIGNATURE
        assert imread(path).ndim == 3


def test_simulate_html_writes_one_small_replay(capsys, tmp_path):
    doc = run_json(capsys, "--html", str(tmp_path / "replay"))
    path = Path(doc["replay"])
    assert [p.name for p in (tmp_path / "replay").iterdir()] == [path.name]
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert path.stat().st_size < 1_000_000  # a few hundred KB for the default 5,000-step trace
    assert main(["simulate", "--no-plots", "--html", str(tmp_path / "again")]) == 0
    assert f"Replay written to {tmp_path / 'again' / path.name}" in capsys.readouterr().out  # never wrapped


def test_demo_writes_the_report(capsys, tmp_path):
    assert main(["demo", "--out", str(tmp_path / "pagedkv-report")]) == 0
    text = capsys.readouterr().out
    assert "pagedkv demo" in text and str(tmp_path / "pagedkv-report") in text
    written = sorted((tmp_path / "pagedkv-report").glob("*.png"))
    lines = {line.strip() for line in text.splitlines()}
    assert all(str(path) in lines for path in written)  # each path whole on its line, however long
    plots = {p.name for p in written}
    assert {"memory_map.png", "waste_breakdown.png", "sharing_prefix.png", "sharing_fork.png"} <= plots
    assert {"capacity_utilization.png", "capacity_concurrency.png"} <= plots
    assert len(plots) == 9
    # The live engine part names its model and gives every block back.
    assert "built-in tiny Llama" in text
    held_after = re.search(r"blocks still held after the(?: batch)?\s+(\d+) ", text)
    assert held_after and held_after.group(1) == "0"
    # Every claim the demo prints is met; the capacity section's are all counts, so this holds on
    # any host (the timed figures beside them are never judged).
    checks = [
        line.strip() for line in text.splitlines() if line.startswith(("  met  ", "  NOT met  ", "  n/a  "))
    ]
    assert len(checks) == 9 and all(line.startswith("met  ") for line in checks), checks
    assert "NOT met" not in text and "throughput" not in " ".join(checks)
    for claim in ("requests at once (peak): paged >= 2x contig.", "of its held KV slots empty once full"):
        assert any(claim in line for line in checks), claim


def test_generate_with_the_builtin_model(capsys):
    assert main(["generate", "Hello", "Paged attention", "--max-tokens", "6", "-n", "2", "--seed", "3",
                 "--temperature", "0.7", "--num-kv-blocks", "64"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "built-in tiny Llama" in text
    assert text.count("(length)") == 4


def test_enforce_eager_reaches_the_engine_and_its_description(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # the engine line unwrapped
    assert main(["generate", "Hello", "--max-tokens", "3", "--num-kv-blocks", "64", "--enforce-eager"]) == 0
    assert "cuda graphs off (enforce_eager)" in capsys.readouterr().out
    assert main(["generate", "Hello", "--max-tokens", "3", "--num-kv-blocks", "64"]) == 0
    assert "cuda graphs off (cpu device: graphs are a CUDA feature)" in capsys.readouterr().out


def test_generate_reports_an_impossible_request(capsys):
    assert main(["generate", "Hello", "--max-tokens", "100", "--num-kv-blocks", "4"]) == 1
    assert "can never fit in the KV cache" in capsys.readouterr().out


def test_generate_takes_unset_sampling_flags_from_the_model(capsys, tmp_path):
    """A flag left unset takes generation_config.json's value; a flag given wins over it."""
    from tests.checkpoints import make_checkpoint

    folder = make_checkpoint(tmp_path)
    config_file = folder / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "max_new_tokens": 2}))

    def answers(*flags: str) -> list[str]:
        assert main(["generate", "Hello", "--model", str(folder), "--num-kv-blocks", "64", *flags]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("[0]")]

    from_model = answers()
    assert from_model == answers("--max-tokens", "2", "--temperature", "0")  # greedy, the model's length
    assert from_model != answers("--max-tokens", "12")


def test_generate_rejects_bad_sampling_values(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "Hello", "--temperature", "-1"])
    assert exit_info.value.code == 2
    assert "temperature" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simulate", "--gpu-memory", "80XB"], "cannot parse a byte size"),
        (["simulate", "--gpu-memory", "8GB"], "no memory left for the KV cache"),
        (["simulate", "--workload", "chat"], "invalid choice"),
        (["simulate", "--block-size", "0"], "block_size must be a positive integer"),
        (["simulate", "--max-seq-len", "512", "--prefix-len", "600"], "prefix_len"),
        ([], "required"),
    ],
)
def test_bad_arguments_are_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "simulate", "generate", "serve", "bench throughput"])
def test_subcommands_are_registered(command):
    assert build_parser().parse_args(command.split()).command == command.split()[0]


def test_module_entry_point():
    done = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "simulate", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--workload" in done.stdout and "--json" in done.stdout
