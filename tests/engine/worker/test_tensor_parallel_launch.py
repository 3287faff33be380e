"""The launches the README documents, run for real on this machine: two "machines" started
with ``--nnodes 2 --node-rank K`` (each its own ``pagedkv generate`` process), and torchrun
starting both ranks. Each must print what one rank prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.distributed.rendezvous import free_port
from tests.checkpoints import make_checkpoint

PROMPT = "def f(x):"
PAGEDKV = [sys.executable, "-m", "pagedkv.cli"]


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory) -> tuple[Path, str]:
    path = make_checkpoint(tmp_path_factory.mktemp("tp-launch"), "qwen2")
    out = LLM(str(path), dtype="float32").generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False
    )
    return path, out[0].outputs[0].text


def _generate(*options: str, launcher: tuple[str, ...] = ()) -> subprocess.Popen:
    command = [
        *launcher,
        *PAGEDKV,
        "generate",
        "--max-tokens",
        "12",
        "--dtype",
        "float32",
        "--tensor-parallel-size",
        "2",
        *options,
    ]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.Popen(
        [*command, PROMPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _printed(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return out


def test_two_machines_with_nnodes_options(model_and_text):
    path, text = model_and_text
    meet = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port("127.0.0.1")))
    second = _generate("--model", str(path), *meet, "--node-rank", "1")
    first = _generate("--model", str(path), *meet, "--node-rank", "0")
    assert repr(text) in _printed(first)
    assert _printed(second) == ""  # machine 1 only held rank 1; it served nothing


def test_torchrun_starts_every_rank(model_and_text):
    path, text = model_and_text
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2")
    launch = (*torchrun, "--master-port", str(free_port("127.0.0.1")), "--no-python")
    assert repr(text) in _printed(_generate("--model", str(path), launcher=launch))
