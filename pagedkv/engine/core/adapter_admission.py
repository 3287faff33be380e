"""LoRA adapters at admission: a waiting sequence of an adapter is admitted only when the
adapter is resident or can take a slot (:class:`~pagedkv.memory.adapters.AdapterResidency`),
and admitting it places the adapter. An adapter is in use while a running sequence runs with
it; the running set is the only record of that, so nothing is counted that could leak."""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.engine.core.sequence import Sequence
from pagedkv.memory.adapters import AdapterResidency


def adapters_in_use(running: Iterable[Sequence]) -> set[int]:
    """The ids of the adapters the ``running`` sequences run with: the slots that must stay."""
    return {seq.request.lora_int_id for seq in running if seq.request.lora_request is not None}


def adapter_waits(adapters: AdapterResidency, seq: Sequence, running: Iterable[Sequence]) -> bool:
    """``seq`` runs with an adapter that is not resident and finds no slot free or idle."""
    lora_id = seq.request.lora_int_id
    return lora_id is not None and not adapters.can_place(lora_id, adapters_in_use(running))


def place_adapter(adapters: AdapterResidency, seq: Sequence, running: Iterable[Sequence]) -> None:
    """Give ``seq``'s adapter (if any) its slot; :func:`adapter_waits` said there is one."""
    lora = seq.request.lora_request
    if lora is not None:
        slot = adapters.place(lora.lora_int_id, lora.lora_name, str(lora.lora_path), adapters_in_use(running))
        assert slot is not None  # checked by adapter_waits before the room was made
