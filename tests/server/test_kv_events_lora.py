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
