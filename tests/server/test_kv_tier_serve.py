"""The second KV tier seen from outside a server: /metrics, KV events, and a restart.

A server with a host tier publishes the blocks its pool lets go as ``BlockStored`` events with
the medium ``CPU`` under the very hashes the pool announced them with, and loads them back for
a prompt that comes again (vLLM's external prefix cache and offload series count it). A real
``pagedkv serve`` restarted on the same ``--kv-offload-dir`` answers a prompt it saw before the
restart from the disk tier, with the same tokens.
"""

from __future__ import annotations

import itertools

import httpx
import openai

from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from pagedkv.server.kv_events import KVEventsConfig
from pagedkv.server.replicas import free_port
from tests.server.helpers import MODEL, prompts, scrape, wait_idle, wait_until
from tests.server.process import ServeProcess
from tests.server.test_kv_events import EventReader

BLOCK = 16
#: Two long prompts do not fit together: the second evicts the first one's cached blocks.
NUM_BLOCKS = 24


def _complete(base_url: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_the_pools_evictions_reach_the_tier_and_come_back_under_the_same_hashes():
    port = free_port()
    events_config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
    engine = EngineConfig(
        num_kv_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        max_model_len=512,
        max_num_seqs=4,
        kv_offload="host",
        kv_offload_memory="16MiB",
    )
    reader = EventReader(events_config.endpoint)
    first, second = (" ".join(prompts(1, seed, words=150)) for seed in (1, 2))
    try:
        with ServerThread(create_app(engine, kv_events=events_config)) as server:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
            tries = itertools.count()  # ZMQ's slow joiner: send until the reader hears one
            wait_until(
                lambda: (
                    client.completions.create(
                        model=MODEL, prompt=f"warm up {next(tries)} " * 20, max_tokens=1
                    )
                    and reader.poll()
                ),
                60,
                "the first KV event",
            )
            answer = _complete(server.base_url, first)
            _complete(server.base_url, second)  # evicts the first prompt's blocks: they spill
            assert _complete(server.base_url, first) == answer  # loaded back, not recomputed
            metrics = wait_idle(server.base_url)
        events = reader.poll()
    finally:
        reader.close()
    stored = {medium: set() for medium in ("GPU", "CPU")}
    pool_hashes = set()  # stored or removed: a warm-up's BlockStored may precede the subscription
    for event in events:
        if event["type"] == "BlockStored":
            stored[event["medium"]].update(event["block_hashes"])
        if event["type"] in ("BlockStored", "BlockRemoved") and event["medium"] == "GPU":
            pool_hashes.update(event["block_hashes"])
    # the tier announced blocks the pool had announced first, by the same hashes
    assert stored["CPU"] and stored["CPU"] <= pool_hashes
    assert metrics["vllm:external_prefix_cache_hits_total"] > 0
    assert (
        metrics["vllm:external_prefix_cache_queries_total"]
        >= metrics["vllm:external_prefix_cache_hits_total"]
    )
    assert metrics["vllm:kv_offload_total_bytes_total{transfer_type=GPU_to_CPU}"] > 0
    assert metrics["vllm:kv_offload_total_bytes_total{transfer_type=CPU_to_GPU}"] > 0
    assert metrics["pagedkv:kv_offload_blocks_cached"] == len(stored["CPU"]) - sum(
        len(e["block_hashes"]) for e in events if e["type"] == "BlockRemoved" and e["medium"] == "CPU"
    )


def test_a_restarted_server_answers_from_the_disk_tier(tmp_path):
    options = (
        "--num-kv-blocks", "64",
        "--kv-offloading-size", "64MiB",
        "--kv-offload-dir", str(tmp_path / "kv"),
    )  # fmt: skip
    prompt = " ".join(prompts(1, 7, words=80))
    with ServeProcess(*options) as server:
        answer = _complete(server.base_url, prompt)
        before = scrape(server.base_url)
    assert server.returncode == 0
    assert before["vllm:external_prefix_cache_hits_total"] == 0
    assert list((tmp_path / "kv").glob("*.kvblock"))  # written at shutdown
    with ServeProcess(*options) as restarted:
        after_start = scrape(restarted.base_url)
        assert after_start["pagedkv:kv_offload_blocks_cached"] > 0  # yesterday's, indexed
        assert _complete(restarted.base_url, prompt) == answer
        metrics = scrape(restarted.base_url)
    assert restarted.returncode == 0
    assert metrics["vllm:external_prefix_cache_hits_total"] >= BLOCK
    assert metrics["vllm:prefix_cache_hits_total"] == 0  # the pool started empty
    assert metrics["vllm:kv_offload_total_bytes_total{transfer_type=DISK_to_GPU}"] > 0
