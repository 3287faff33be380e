"""LoRA adapters at admission: a waiting sequence of an adapter is admitted only when the
adapter is resident or can take a slot (:class:`~pagedkv.memory.adapters.AdapterResidency`),
and admitting it places the adapter. An adapter is in use while a running sequence runs with
it; the running set is the only record of that, so nothing is counted that could leak."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from pagedkv.config.lora import LoRAConfig
from pagedkv.engine.core.adapter_paging import PagedAdapters
from pagedkv.engine.core.scheduler_output import SchedulerOutput
from pagedkv.engine.core.sequence import Sequence
from pagedkv.memory import KVCacheManager, TieredKVCacheManager
from pagedkv.memory.adapters import AdapterResidency
from pagedkv.memory.tier.adapter_entries import AdapterTierCopies


class Scheduling(Protocol):
    """What of the scheduler the functions below read (it passes itself)."""

    kv_manager: KVCacheManager
    running: list[Sequence]
    adapters: AdapterResidency | None
    paged_adapters: PagedAdapters | None


def adapter_parts(
    config: LoRAConfig | None, kv_manager: KVCacheManager
) -> tuple[AdapterResidency | None, PagedAdapters | None]:
    """The adapter slots and, under unified paging, the adapter pages a scheduler of ``config``
    keeps (None, None without LoRA); with a second KV tier behind ``kv_manager``, evicted
    adapters' pages are kept there."""
    if config is None:
        return None, None
    paged = None
    if config.unified_paging:
        tier = AdapterTierCopies(kv_manager) if isinstance(kv_manager, TieredKVCacheManager) else None
        paged = PagedAdapters(kv_manager.pool, tier)
    return AdapterResidency(config.max_loras), paged


def adapters_in_use(running: Iterable[Sequence]) -> set[int]:
    """The ids of the adapters the ``running`` sequences run with: the slots that must stay."""
    return {seq.request.lora_int_id for seq in running if seq.request.lora_request is not None}


def adapter_waits(adapters: AdapterResidency, seq: Sequence, running: Iterable[Sequence]) -> bool:
    """``seq`` runs with an adapter that is not resident and finds no slot free or idle."""
    lora_id = seq.request.lora_int_id
    return lora_id is not None and not adapters.can_place(lora_id, adapters_in_use(running))


class AdapterGate:
    """One admission pass's adapter rule, first come first served: a sequence of an adapter that
    finds no slot waits, and so does every adapter's sequence after it in the pass (base
    sequences do not). Without it a stream of requests of resident adapters would keep every slot
    in use, and an adapter outside them would never be placed."""

    def __init__(self, adapters: AdapterResidency | None, running: list[Sequence]) -> None:
        self.adapters, self.running = adapters, running
        self.closed = False

    def waits(self, seq: Sequence) -> bool:
        if self.adapters is None or seq.request.lora_request is None:
            return False
        self.closed = self.closed or adapter_waits(self.adapters, seq, self.running)
        return self.closed


def allocate_with_adapter(
    scheduler: Scheduling, seq: Sequence, reserve: int, use_cache: bool, salt: str | None
) -> int:
    """``seq``'s KV blocks (the cached tokens returned), with its adapter placed in a slot and,
    under unified paging, its pages loaded and pinned around them."""
    if scheduler.adapters is not None:
        place_adapter(scheduler.adapters, seq, scheduler.running)
    args = (seq.token_ids, reserve, use_cache, salt)
    if scheduler.paged_adapters is None:
        return scheduler.kv_manager.allocate(seq.seq_id, *args)
    return scheduler.paged_adapters.allocate(scheduler.kv_manager, seq, *args)


def place_adapter(adapters: AdapterResidency, seq: Sequence, running: Iterable[Sequence]) -> None:
    """Give ``seq``'s adapter (if any) its slot; :func:`adapter_waits` said there is one."""
    lora = seq.request.lora_request
    if lora is not None:
        slot = adapters.place(lora.lora_int_id, lora.lora_name, str(lora.lora_path), adapters_in_use(running))
        assert slot is not None  # checked by adapter_waits before the room was made


def record_adapters(out: SchedulerOutput, adapters: AdapterResidency, paged: PagedAdapters | None) -> None:
    """The step's adapter placements into ``out``: slot loads (pointed at the adapters' pages
    under unified paging), every resident adapter's slot, and the pages to write and evicted."""
    out.lora_loads = adapters.take_loads()
    out.lora_slots = adapters.slots()
    if paged is not None:
        out.lora_loads = paged.with_pages(out.lora_loads)
        out.lora_page_writes = paged.take_writes()
        out.lora_evicted = paged.pages.take_evicted()


def release_adapter(scheduler: Scheduling, seq: Sequence) -> None:
    """``seq`` gave its block table back (finished or preempted): under unified paging its
    adapter's pin goes with it."""
    if scheduler.paged_adapters is not None:
        scheduler.paged_adapters.release(seq)


def page_blocks(scheduler: Scheduling, seq: Sequence) -> int:
    """Free blocks ``seq``'s adapter takes at admission beside its KV blocks (unified paging)."""
    return 0 if scheduler.paged_adapters is None else scheduler.paged_adapters.blocks_to_admit(seq)
