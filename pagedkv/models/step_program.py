"""The decoder's forward pass: its op list (:mod:`pagedkv.models.ops`) run as one flat loop, or
the C decode stack lowered from the same list.

The layers are ``nn.Module`` objects so that checkpoints, tensor-parallel shards and packing
find their weights by name; running them as a module tree is another matter. A decode step
would make about ten module calls and more than a dozen attribute look-ups through
``Module.__getattr__`` (a Python function) per layer, and on the CPU each runs with cold caches:
the weights of the previous layers have just streamed through them. So the model lists its ops
once (:meth:`~pagedkv.models.llama.LlamaForCausalLM.decoder_ops`), and a step is one loop over
their bound ``run`` methods: no look-up by name, no module call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pagedkv.models.decode_stack import DecodeStack, decode_stack
from pagedkv.models.linear import BUFFER_ROWS
from pagedkv.models.ops import ForwardBatch, Op, Stream

#: an op's bound ``run``
_Run = Callable[[torch.Tensor, torch.Tensor | None, ForwardBatch], Stream]


@dataclass(frozen=True)
class StepProgram:
    """A model's ops in order (:meth:`~pagedkv.models.ops.DecoderOps.sequence`; with LoRA
    slots, the ops that apply them: :meth:`~pagedkv.models.lora.LoRASlots.wrap`) and the C stack
    (:mod:`pagedkv.models.decode_stack`) that runs its decode steps where it can. ``stack`` is
    lowered from the base ops and runs the steps without adapter rows (the fused gate/up
    product included); ``lora_stack``, lowered from the ops with adapters, runs the others."""

    ops: tuple[Op, ...]
    stack: DecodeStack | None = None
    lora_stack: DecodeStack | None = None
    _runs: tuple[_Run, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_runs", tuple(op.run for op in self.ops))

    @classmethod
    def of(cls, model: nn.Module) -> StepProgram:
        """The program of a :class:`~pagedkv.models.llama.LlamaForCausalLM` (or its tensor-parallel
        shard: its row-parallel layers' functions all-reduce)."""
        ops = model.decoder_ops().sequence()
        dtype = model.model.norm.weight.dtype
        stack = decode_stack(model, ops, dtype)
        lora = getattr(model, "lora", None)
        if lora is None:
            return cls(ops, stack)
        wrapped = lora.wrap(ops)
        return cls(wrapped, stack, decode_stack(model, wrapped, dtype))

    def run(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The final hidden states for the embedded tokens ``x [T, hidden]`` (of the rows
        ``batch.output_rows`` only, when given)."""
        stack = self.stack if batch.lora is None else self.lora_stack
        if stack is not None and batch.output_rows is None:
            hidden = stack.run(x, batch.cos, batch.sin, batch.kv_cache, batch.metadata, batch.lora)
            if hidden is not None:
                return hidden
        residual = None
        for run in self._runs:
            x, residual = run(x, residual, batch)
        # a small batch's hidden states are the last down projection's kept output buffer
        # (OutputBuffer): the caller gets a copy, which the next forward pass cannot overwrite
        return x.clone() if x.shape[0] <= BUFFER_ROWS else x
