"""KV cache events from a real server's block pool, read off its ZMQ socket as vllm-router reads them."""

from __future__ import annotations

import itertools

import httpx
import msgpack
import openai
import pytest
import zmq

from pagedkv.engine import EngineConfig
from pagedkv.memory import salted_root
from pagedkv.server import ServerThread, create_app
from pagedkv.server.kv_events import KVEventsConfig, block_hash
from pagedkv.server.replicas import free_port
from tests.server.helpers import MODEL, wait_until

BLOCK = 16
#: Small on purpose: a few long prompts must evict earlier ones.
NUM_BLOCKS = 24


class EventReader:
    """A ZMQ SUB on the server's endpoint that keeps every decoded event, in order."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)  # see ZmqKVEventPublisher
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.events: list[dict] = []
        self.seqs: list[int] = []

    def poll(self) -> list[dict]:
        while self.socket.poll(10):
            topic, seq, payload = self.socket.recv_multipart()
            ts, events, rank = msgpack.unpackb(payload)
            assert topic == b"" and isinstance(ts, float) and rank == 0
            self.seqs.append(int.from_bytes(seq, "big"))
            self.events.extend(events)
        return self.events

    def close(self) -> None:
        self.socket.close(0)


@pytest.fixture(scope="module")
def published():
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
    engine = EngineConfig(num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=256, max_num_seqs=4)
    reader = EventReader(config.endpoint)
    with ServerThread(create_app(engine, kv_events=config)) as server:
        # The SUB may join after the first message (ZMQ's slow joiner): send until it hears one.
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        # A new prompt each try: a repeated one would hit the prefix cache and store no block.
        tries = itertools.count()
        wait_until(
            lambda: (
                client.completions.create(model=MODEL, prompt=f"warm up {next(tries)} " * 20, max_tokens=1)
                and reader.poll()
            ),
            60,
            "the first KV event",
        )
        # The SUB has joined, but what went out before it did is lost: clear the cache (the
        # engine is idle) so that from here the events replay the whole cache.
        server.app.state.engine.engine.reset_prefix_cache()
        wait_until(lambda: reader.poll()[-1]["type"] == "AllBlocksCleared", 30, "AllBlocksCleared")
        reader.events.clear()
        yield server, client, reader
    reader.close()


def _render(server, prompt: str) -> list[int]:
    rendered = httpx.post(server.base_url + "/v1/completions/render", json={"model": MODEL, "prompt": prompt})
    assert rendered.status_code == 200
    (only,) = rendered.json()
    return only["token_ids"]


def test_stored_blocks_carry_the_prompt_tokens_and_chain_hashes(published):
    server, client, reader = published
    prompt = "the block pool announces every full block it caches " * 4
    ids = _render(server, prompt)
    start = len(reader.poll())
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    full = (len(ids) - 1) // BLOCK  # a prompt's last token is never cached before it is computed

    def stored_blocks():
        stored = [e for e in reader.poll()[start:] if e["type"] == "BlockStored"]
        return stored[:full] if len(stored) >= full else None

    stored = wait_until(stored_blocks, 30, "BlockStored events for the prompt")
    parent = None
    for index, event in enumerate(stored):
        tokens = ids[index * BLOCK : (index + 1) * BLOCK]
        assert event["token_ids"] == tokens and event["block_size"] == BLOCK
        assert event["parent_block_hash"] == parent
        assert event["block_hashes"] == [block_hash(parent, tokens)]
        parent = event["block_hashes"][0]
    # the first messages may go out before the SUB has joined (ZMQ's slow joiner); from the
    # first one heard, sequence numbers count up by one: no message lost, none repeated
    first = reader.seqs[0]
    assert reader.seqs == list(range(first, first + len(reader.seqs)))


def test_salted_blocks_are_announced_in_the_same_format_under_salted_hashes(published):
    server, client, reader = published
    prompt = "a salted prompt is announced under hashes of its own salt " * 4
    ids = _render(server, prompt)
    full = (len(ids) - 1) // BLOCK
    announced = []
    for salt in ("tenant-a", None):
        start = len(reader.poll())
        extra = {} if salt is None else {"cache_salt": salt}
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)

        def stored_blocks(start=start):
            stored = [e for e in reader.poll()[start:] if e["type"] == "BlockStored"]
            return stored[:full] if len(stored) >= full else None

        announced.append(wait_until(stored_blocks, 30, "BlockStored events for the prompt"))
    salted, plain = announced
    root = salted_root("tenant-a")
    parent, plain_parent = root, None
    for index, (event, twin) in enumerate(zip(salted, plain, strict=True)):
        tokens = ids[index * BLOCK : (index + 1) * BLOCK]
        assert event.keys() == twin.keys() and event["token_ids"] == twin["token_ids"] == tokens
        # vLLM's format: a first block's parent is null, salted or not; the salt is nowhere
        assert event["parent_block_hash"] == (None if parent == root else parent)
        assert event["block_hashes"] == [block_hash(parent, tokens)] != twin["block_hashes"]
        assert twin["block_hashes"] == [block_hash(plain_parent, tokens)]
        parent, plain_parent = event["block_hashes"][0], twin["block_hashes"][0]
    assert "tenant-a" not in str(salted)


def test_evicted_blocks_are_removed_and_a_reset_clears_all(published):
    server, client, reader = published
    live: set[int] = set()
    for i in range(4):  # each prompt holds ~10 of the 24 blocks: later ones evict earlier ones
        client.completions.create(model=MODEL, prompt=f"eviction round {i} " * 30, max_tokens=1)

    def replayed():
        live.clear()
        for event in reader.poll():
            if event["type"] == "BlockStored":
                live.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                assert set(event["block_hashes"]) <= live, "removed a block never stored"
                live.difference_update(event["block_hashes"])
            else:
                live.clear()
        removed = any(e["type"] == "BlockRemoved" for e in reader.events)
        return removed and len(live) == server.app.state.engine.engine.kv_manager.pool.num_cached_blocks

    wait_until(replayed, 30, "events that replay to the pool's cached blocks")
    assert len(live) <= NUM_BLOCKS
    server.app.state.engine.engine.reset_prefix_cache()  # idle engine: safe from this thread
    wait_until(lambda: reader.poll()[-1]["type"] == "AllBlocksCleared", 30, "AllBlocksCleared")


@pytest.mark.parametrize(
    "text, problem",
    [("{", "not valid JSON"), ("[]", "JSON object"), ('{"publisher": "kafka"}', "'zmq' or 'null'")],
)
def test_a_bad_kv_events_config_says_what_is_wrong(text, problem):
    with pytest.raises(ValueError, match=problem):
        KVEventsConfig.from_json(text)
