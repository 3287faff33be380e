"""``pagedkv serve --model org/name`` as a user runs it, from a Hugging Face cache, offline.

The cache is built on disk (``tests/hub_cache.py``); the servers inherit HF_HUB_OFFLINE=1 from
``tests/conftest.py`` and find the cache through HF_HUB_CACHE or ``--download-dir``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from tests.checkpoints import make_checkpoint
from tests.hub_cache import add_snapshot
from tests.server.process import SERVE, ServeProcess

REPO = "org/tiny-greedy"
OVERRIDE_LOG = (
    "Default sampling parameters have been overridden by the model's Hugging Face generation config: "
    "{'temperature': 0.0}"
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache holding ``org/tiny-greedy``, whose generation_config.json asks for greedy decoding."""
    folder = make_checkpoint(tmp_path_factory.mktemp("checkpoint"))
    file = folder / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "temperature": 0.0}))
    cache = tmp_path_factory.mktemp("hub")
    add_snapshot(cache, REPO, folder)
    return cache


def test_serve_a_hub_id_from_hf_hub_cache(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with ServeProcess("--model", REPO, "--num-kv-blocks", "64") as server:
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == [REPO]  # the id, as vLLM serves it
            texts = [
                client.completions.create(model=REPO, prompt="hello", max_tokens=6, seed=seed).choices[0].text
                for seed in (1, 2)
            ]
            greedy = client.completions.create(model=REPO, prompt="hello", max_tokens=6, temperature=0)
    assert texts == [greedy.choices[0].text] * 2  # the model's temperature 0.0
    assert server.returncode == 0
    assert server.stderr.count(OVERRIDE_LOG) == 1


def test_serve_reads_download_dir_and_generation_config_vllm(cache):
    options = ("--model", REPO, "--download-dir", str(cache), "--generation-config", "vllm")
    with ServeProcess(*options, "--num-kv-blocks", "64") as server:
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == [REPO]
    assert "Default sampling parameters" not in server.stderr


def test_serve_a_missing_id_exits_with_one_clear_line(cache):
    command = [sys.executable, "-c", SERVE, "serve", "--model", "org/missing", "--download-dir", str(cache)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert (
        f"cannot load the model 'org/missing' (revision 'main') from the Hugging Face Hub: the cache holds "
        f"no snapshot of this revision, and downloads are off (HF_HUB_OFFLINE=1; "
        f"cache {cache})"
    ) in done.stderr
