"""A step's LoRA adapter loads on one rank: every adapter the plan loads is read first, then --
once the ranks agree which reads failed -- written into its pages and its slot, the failed ones
skipped on every rank alike.

An adapter is read from its folder when it is loaded, long after it was checked: the folder may
have moved, or the file changed (its CRC-32 differs from the one taken when it was added), or
be unreadable. That must not fail the step: the step's other rows are fine, and under tensor
parallelism a rank that raised would leave the others waiting inside the forward pass's
collectives. So each rank reads every adapter of the plan before writing any, the ranks agree on
the adapters that failed on any of them (one all-reduce of a flag per adapter over the control
group -- only in steps that read adapters, and every rank has the same plan, so either all ranks
call it or none does), every rank skips those alike, and the forward pass runs. The rows of a
skipped adapter run on whatever its slot held; the engine drops them and fails their requests
with the reason (:mod:`pagedkv.engine.core.adapter_failures`), so no rank hangs and no wrong
token is served.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.worker.lora_pages import PagedAdapterWeights, TierLoads
from pagedkv.models.lora import LoRAModules, LoRASlots
from pagedkv.models.lora_checkpoint import LoRAAdapterError, read_adapter

#: Which of the plan's adapter reads failed on any rank, given this rank's (one flag per read,
#: in plan order: page writes, then slot loads read from their folders).
Agree = Callable[[list[bool]], list[bool]]

#: What another rank's failure is called on a rank whose own read of the adapter succeeded.
ELSEWHERE = "its weights could not be read on another tensor-parallel rank"


def alone(failed: list[bool]) -> list[bool]:
    """One rank: its own failures are all of them."""
    return failed


def load_adapters(
    plan: StepPlan,
    slots: LoRAModules | None,
    pages: PagedAdapterWeights | None,
    agree: Agree = alone,
    tier: TierLoads | None = None,
) -> dict[int, str]:
    """The plan's adapters into their pages (unified paging: from their folders, or kept as the
    step's ``tier`` loads brought them back) and slots; returns the adapters that failed on any
    rank and were skipped, by id, with why."""
    if plan.lora_page_writes and pages is None:
        raise RuntimeError("a plan writes LoRA adapter pages, but this runner does not page adapters")
    if not (plan.lora_page_writes or plan.lora_loads):
        return {}
    assert slots is not None  # a plan loads adapters only into a model with LoRA slots
    from_folder = [load for load in plan.lora_loads if not (load.pages and pages is not None)]
    why: dict[int, str] = {}
    shards = [_attempt(why, write.lora_int_id, pages.read, write, tier) for write in plan.lora_page_writes]
    folders = {
        id(load): _attempt(why, load.lora_int_id, _read_folder, slots, load.path) for load in from_folder
    }
    read_ids = [write.lora_int_id for write in plan.lora_page_writes] + [
        load.lora_int_id for load in from_folder
    ]
    flags = agree([lora_id in why for lora_id in read_ids]) if read_ids else []
    failed = {
        lora_id: why.get(lora_id, ELSEWHERE) for lora_id, bad in zip(read_ids, flags, strict=True) if bad
    }
    for write, shard in zip(plan.lora_page_writes, shards, strict=True):
        if write.lora_int_id not in failed:
            pages.write(write, shard)
    for load in plan.lora_loads:
        if load.lora_int_id in failed:
            continue
        if id(load) in folders:
            slots.load(load.slot, *folders[id(load)])
        else:
            pages.place(load)
    for lora_id in failed if pages is not None else ():
        pages.skip(lora_id)
    return failed


def _attempt(why: dict[int, str], lora_id: int, read: Callable[..., Any], *args: Any) -> Any:
    """``read(*args)``, or None with the reason in ``why`` (a folder moved, a file changed or
    corrupt: the adapter ``lora_id`` fails, the step goes on)."""
    try:
        return read(*args)
    except Exception as err:
        reason = str(err) if isinstance(err, LoRAAdapterError) else f"{type(err).__name__}: {err}"
        why.setdefault(lora_id, reason)
        return None


def _read_folder(slots: LoRASlots, path: str) -> tuple[Any, Any]:
    """An adapter's folder checked against the model, and its tensors (slots without paging)."""
    spec = read_adapter(path, slots.config, slots.max_rank)
    return spec, slots.read(spec)
