"""``pagedkv bench throughput --llamacpp-gguf FILE``: one GGUF file for every engine. pagedkv runs
it in its blocks, transformers dequantized, llama.cpp's worker is handed the file itself (no
conversion), the workloads come from the file's vocabulary, and the file and its tensor types are
named in the output."""

import json
import sys

import pytest

from pagedkv.bench.throughput import ThroughputConfig
from pagedkv.bench.throughput_engines import _rival_options
from pagedkv.cli import main
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint
from tests.gguf_files import Q, write_gguf


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    return write_gguf(make_checkpoint(tmp, "llama"), tmp / "tiny-q8_0.gguf", Q.Q8_0)


def test_one_gguf_file_runs_on_pagedkv_and_transformers_and_is_named(q8_gguf, tmp_path, capsys, monkeypatch):
    argv = [
        "bench", "throughput", "--llamacpp-gguf", str(q8_gguf), "--engines", "pagedkv", "llamacpp",
        "transformers", "--dtypes", "float32", "--workloads", "uniform", "--num-requests", "3",
        "--prompt-len", "8", "--max-tokens", "6", "--repeats", "1", "--out", str(tmp_path / "out"),
        "--llamacpp-python", sys.executable,
    ]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    status = out["engines"]["float32"]
    assert status["pagedkv"]["state"] == status["transformers"]["state"] == "ok"
    assert "kept in GGUF blocks" in status["pagedkv"]["info"]["runtime"]
    assert status["llamacpp"]["state"] == "not run"  # this Python has no llama_cpp
    assert out["model"]["config"]["vocab_size"] == TEST_VOCAB_SIZE  # the file's embedding rows
    assert all(t < TEST_VOCAB_SIZE for w in out["runs"] for t in sum(w.get("token_ids", []), []))
    assert out["model"]["weight_types"]["Q8_0"] > 0 and out["model"]["weight_types"]["F32"] > 0
    uniform = {r["engine"]: r for r in out["runs"] if r["workload"] == "uniform"}
    assert uniform["pagedkv"]["generated_tokens"] == uniform["transformers"]["generated_tokens"] == 18
    (row,) = [r for r in out["agreement"] if r["workload"] == "uniform"]
    assert (row["engine"], row["reference"], row["requests"]) == ("pagedkv", "transformers", 3)
    assert out["gemm"] == {}  # the float kernels' roofline says nothing of blocks
    monkeypatch.setenv("COLUMNS", "400")
    assert main(argv) == 0
    assert f"model: {q8_gguf} (GGUF tensors: " in capsys.readouterr().out


def test_llamacpp_is_handed_the_file_itself(q8_gguf, tmp_path):
    config = ThroughputConfig(llamacpp_gguf=str(q8_gguf), out=tmp_path)
    for dtype in ("float32", "bfloat16"):
        load = _rival_options(config, q8_gguf, dtype)["llamacpp"]["load"]
        assert load["gguf"] == str(q8_gguf.resolve())
    assert not config.gemm and config.decode_batches == ()


def test_a_gguf_and_another_model_or_no_file_are_usage_errors(q8_gguf, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")  # a folder --model accepts
    for extra in (["--model", str(tmp_path)], ["--model-shape", "llama-3.2-1b"]):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "throughput", "--llamacpp-gguf", str(q8_gguf), *extra])
        assert exc.value.code == 2
        assert "each name the model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "throughput", "--llamacpp-gguf", str(tmp_path / "none.gguf")])
    assert exc.value.code == 2
    assert "no such .gguf file" in capsys.readouterr().err
