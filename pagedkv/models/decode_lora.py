"""The C decode stack's forms of the LoRA ops (:class:`~pagedkv.models.ops.LoRAProject`,
:class:`~pagedkv.models.ops.LoRAGateUp`), and the step's rows they read.

A LoRA op lowers to its base projection's records, then one ``LORA`` record (slot tensors) or
``LORA_PAGED`` record (the adapters' rows in the KV cache's pages, through the projection's
offset table) that adds each row's adapter output for the projection's input to its output, by
the kernel :meth:`~pagedkv.models.ops.LoRARows.add` calls on the CPU (``lora_bgmv`` or
``lora_bgmv_paged``): the hidden states are the program's bit for bit. A gate/up op's product
is the plain paired one, the adapters' outputs join it, then the separate activation follows,
as the program runs them. The records read the step's rows' slots and the slots' scalings from
buffers the stack holds (:class:`LoRARowBuffers`), filled before each call, so a step of any mix
of adapters runs the same records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from pagedkv.kernels.signatures import DecodeCode, DecodeOp
from pagedkv.models.linear import BUFFER_ROWS, GateUpLinear
from pagedkv.models.lora_weights import PagedWeights
from pagedkv.models.ops import GateUpAct, LoRAGateUp, LoRAProject, LoRARows, Op, Project
from pagedkv.models.quantized import QuantizedLinear


class Lowering(Protocol):
    """What these lowerings use of the decode stack's lowering state (``_Lowering``)."""

    dtype: torch.dtype
    current: int
    records: list[DecodeOp]
    lora_rows: tuple[int, int]

    def emit(self, code: DecodeCode, width: int, dst: int | None = None, **fields: Any) -> None: ...

    def tiled(self, linear: nn.Module) -> torch.Tensor | None: ...

    def lower(self, op: Op) -> str | None: ...


def _adapters(op: LoRAProject | LoRAGateUp, src: int, low: Lowering) -> str | None:
    """The record adding each row's adapter output for the buffer ``src`` (the projection's
    input) to ``current`` (its output): ``LORA`` on slot tensors, ``LORA_PAGED`` on the
    adapters' rows in the KV cache's pages."""
    weights = op.weights
    slot, scaling = low.lora_rows
    fields = {"lora_columns": weights.columns.data_ptr(), "lora_slot": slot, "lora_scaling": scaling}
    fields |= {"lora_slots": weights.slots, "lora_shards": weights.columns.shape[0] - 1}
    if isinstance(weights, PagedWeights):
        base, offsets = weights.base, weights.offsets
        if base.dtype != low.dtype or base.device.type != "cpu" or not offsets.is_contiguous():
            return "LoRA pages in a KV cache of another dtype"
        fields |= {"weight": base.data_ptr(), "lora_b": offsets.data_ptr(), "lora_rank": weights.rank}
        fields |= {"n_in": weights.n_in, "n_out": weights.bounds[-1]}
        low.records.append(DecodeOp(code=DecodeCode.LORA_PAGED, src=src, dst=low.current, **fields))
        return None
    a, b = weights.a, weights.b
    if any(t.dtype != low.dtype or t.device.type != "cpu" or not t.is_contiguous() for t in (a, b)):
        return "LoRA slot tensors of another dtype"
    fields |= {
        "weight": a.data_ptr(),
        "lora_b": b.data_ptr(),
        "lora_rank": a.shape[1] // fields["lora_shards"],
    }
    fields |= {"n_in": a.shape[2], "n_out": b.shape[2]}
    low.records.append(DecodeOp(code=DecodeCode.LORA, src=src, dst=low.current, **fields))
    return None


def lora_project(op: LoRAProject, low: Lowering) -> str | None:
    src = low.current
    return low.lower(op.base) or _adapters(op, src, low)


def lora_gate_up(op: LoRAGateUp, low: Lowering) -> str | None:
    """The plain gate/up product, the adapters' outputs added to it, then the activation."""
    if type(op.base) is not GateUpAct:
        return f"no C form for {type(op.base).__name__}"
    gate_up, src = op.gate_up, low.current
    if isinstance(gate_up, QuantizedLinear):
        if (why := low.lower(Project(gate_up))) is not None:
            return why
    elif type(gate_up) is not GateUpLinear:
        return "tensor-parallel shards"
    else:
        weight = low.tiled(gate_up)
        if weight is None or not gate_up.paired:
            return "linear layers not on the tiled kernel"
        fields = {"weight": weight.data_ptr(), "n_in": gate_up.in_features}
        low.emit(DecodeCode.GATE_UP, gate_up.out_features, **fields)
    if (why := _adapters(op, src, low)) is not None:
        return why
    low.emit(DecodeCode.SILU_AND_MUL, gate_up.out_features // 2)
    return None


#: the LoRA ops' lowerings, for the decode stack's table
LORA_LOWERINGS: dict[type[Op], Callable[[Any, Lowering], str | None]] = {
    LoRAProject: lora_project,
    LoRAGateUp: lora_gate_up,
}


class LoRARowBuffers:
    """The step's rows' adapter slots (int32, -1 for a base row) and the slots' scalings
    (float32), where a stack's LoRA records read them; empty for an op list without LoRA ops."""

    def __init__(self, ops: tuple[Op, ...]) -> None:
        slots = [op.weights.slots for op in ops if isinstance(op, (LoRAProject, LoRAGateUp))]
        self.slot = torch.full((BUFFER_ROWS if slots else 0,), -1, dtype=torch.int32)
        self.scaling = torch.zeros(max(slots, default=0), dtype=torch.float32)

    def addresses(self) -> tuple[int, int]:
        return self.slot.data_ptr(), self.scaling.data_ptr()

    def stage(self, lora: LoRARows | None, tokens: int) -> bool:
        """The rows of a step of ``tokens`` rows in place (every row a base row without
        ``lora``); False when the records cannot run them: there are none, or ``lora`` holds
        other slots than they were lowered for, or off the CPU."""
        if lora is None:
            self.slot[:tokens].fill_(-1)
            return True
        if lora.scaling.shape != self.scaling.shape or not self.slot.numel():
            return False
        if lora.slot.device.type != "cpu" or lora.scaling.device.type != "cpu":
            return False
        self.slot[:tokens].copy_(lora.slot)
        self.scaling.copy_(lora.scaling)
        return True
