"""Running an engine's requests with adapters while checking, after every step, that each
block's refcount is its holders: tables, plus one for an adapter's page (unified paging)."""

from collections import Counter

from pagedkv import SamplingParams

MAX_NEW = 5
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def check_holders(engine) -> None:
    """Each block's refcount is the tables holding it plus one if it is an adapter's page, and an
    adapter's pins are the running sequences of it that hold a table."""
    pool, paged = engine.kv_manager.pool, engine.scheduler.paged_adapters
    holders = Counter(b for t in engine.kv_manager.snapshot().tables.values() for b in t.block_ids)
    resident = paged.pages.resident()
    pages = Counter(b for r in resident for b in r.block_ids)
    assert all(n == 1 for n in pages.values()) and not set(pages) & set(holders)
    assert [pool.refcount(b) for b in range(pool.num_blocks)] == [
        holders[b] + pages[b] for b in range(pool.num_blocks)
    ]
    running = Counter(
        s.request.lora_int_id for s in engine.scheduler.running if s.seq_id in engine.kv_manager
    )
    assert {r.adapter_id: r.pins for r in resident if r.pins} == {k: n for k, n in running.items() if k}


def run_checked(engine, requests) -> dict[str, list[int]]:
    """Greedy tokens of ``requests`` (id, prompt ids, LoRARequest or None) by request id, every
    block's holders checked after every step (:func:`check_holders`)."""
    for rid, prompt, lora in requests:
        engine.add_request(rid, prompt, GREEDY, lora_request=lora)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        check_holders(engine)
    return tokens
