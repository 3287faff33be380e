"""KV events name the LoRA adapter of the blocks they announce, read off the ZMQ socket as
vllm-router reads them, from a real engine's block pool."""

from __future__ import annotations

from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.memory import block_hash
from pagedkv.server.kv_events import KVEventsConfig, ZmqKVEventPublisher
from pagedkv.server.replicas import free_port
from tests.checkpoints import make_checkpoint
from tests.lora_adapters import make_adapter
from tests.server.helpers import wait_until
from tests.server.test_kv_events import EventReader

BLOCK = 16


def test_an_adapters_blocks_are_announced_with_its_id_and_name(tmp_path):
    base = make_checkpoint(tmp_path, "llama")
    lora = LoRARequest("tuned", 7, str(make_adapter(tmp_path / "tuned", base, seed=1)))
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{free_port()}")
    prompt = list(range(10, 10 + 2 * BLOCK + 3))  # two full blocks
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with LLM(str(base), dtype="float32", enable_lora=True, num_kv_blocks=64, block_size=BLOCK) as llm:
        engine = llm.engine
        publisher = ZmqKVEventPublisher(config, BLOCK, lora_roots=engine.lora_roots)
        reader = EventReader(publisher.endpoint)
        engine.kv_manager.set_listener(publisher)
        try:
            # the SUB may join late (ZMQ's slow joiner): store blocks until it hears some
            def heard():
                engine.reset_prefix_cache()
                llm.generate([prompt, prompt], params, lora_request=[None, lora], use_tqdm=False)
                return [e for e in reader.poll() if e["type"] == "BlockStored"]

            wait_until(lambda: len(heard()) >= 4, 30, "BlockStored events")
        finally:
            engine.kv_manager.set_listener(None)
            publisher.close()
            reader.close()
    stored = [e for e in reader.events if e["type"] == "BlockStored"][-4:]
    by_adapter = {(e["lora_id"], e["lora_name"]) for e in stored}
    assert by_adapter == {(None, None), (7, "tuned")}
    first = [e for e in stored if e["parent_block_hash"] is None]
    plain = next(e for e in first if e["lora_id"] is None)
    tuned = next(e for e in first if e["lora_id"] == 7)
    assert plain["token_ids"] == tuned["token_ids"] == prompt[:BLOCK]
    assert plain["block_hashes"] == [block_hash(None, prompt[:BLOCK])] != tuned["block_hashes"]


def test_an_adapters_blocks_spilled_to_the_second_tier_are_announced_with_its_id(tmp_path):
    """Evicted from a small pool, an adapter's cached blocks move to the host tier; the tier's
    ``BlockStored`` events (medium CPU) name the adapter too, its first block and the one
    chained under it alike, and the base model's name none."""
    base = make_checkpoint(tmp_path, "llama")
    lora = LoRARequest("tuned", 7, str(make_adapter(tmp_path / "tuned", base, seed=1)))
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{free_port()}")
    tuned_prompt = list(range(10, 10 + 2 * BLOCK + 3))  # two full blocks
    base_prompt = list(range(100, 100 + 11 * BLOCK + 3))  # more than the pool has plain free
    params = SamplingParams(max_tokens=1, temperature=0.0)
    options = dict(dtype="float32", enable_lora=True, max_lora_rank=4, num_kv_blocks=16, block_size=BLOCK)
    with LLM(str(base), **options, kv_offload="host", kv_offload_memory="1MiB") as llm:
        engine = llm.engine
        publisher = ZmqKVEventPublisher(config, BLOCK, lora_roots=engine.lora_roots)
        reader = EventReader(publisher.endpoint)
        engine.kv_manager.set_listener(publisher)
        try:

            def heard():
                engine.reset_prefix_cache()
                llm.generate([tuned_prompt], params, lora_request=lora, use_tqdm=False)
                llm.generate([base_prompt], params, use_tqdm=False)
                return [e for e in reader.poll() if e["type"] == "BlockStored" and e["medium"] == "CPU"]

            wait_until(lambda: len(heard()) >= 2, 30, "the tier's BlockStored events")
        finally:
            engine.kv_manager.set_listener(None)
            publisher.close()
            reader.close()
    spilled = [e for e in reader.events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    tuned = [e for e in spilled if e["token_ids"] in (tuned_prompt[:BLOCK], tuned_prompt[BLOCK : 2 * BLOCK])]
    assert tuned and {(e["lora_id"], e["lora_name"]) for e in tuned} == {(7, "tuned")}
    assert {e["token_ids"][0] for e in tuned} == {tuned_prompt[0], tuned_prompt[BLOCK]}
    plain = [e for e in spilled if e not in tuned]
    assert all(e["lora_id"] is None and e["lora_name"] is None for e in plain)
