"""A mixture of experts' routed MLP as one call into C on the CPU (``moe_experts_<S>``, in
``pagedkv/kernels/csrc/layer_ops_moe_body.h``), for the step program and the C decode stack.

The kernel computes what :meth:`~pagedkv.models.moe.RouteExperts.run` computes, in its order --
the router's logits, the float32 softmax and top-k, the (row, expert) pairs grouped by expert,
each expert once over its rows on the tiled kernels, the weighted products added into their
rows expert by expert, then the shared expert scaled by ``sigmoid`` of its gate -- in one call
instead of a dozen torch calls per expert. On a tensor-parallel rank each expert holds the
rank's share of its intermediate rows, so the kernel's output is the rank's partial sum (each
weighted expert output is linear in its down projection's partial product), which the block
all-reduces once, as the torch path does. It takes weights in the tiled layout of the
activations' dtype (float32, bfloat16). Both paths call it on the same data, so the stack's
hidden states are the program's bit for bit; its ``exp`` is libm's, so the routing weights may
differ from torch's in their last float32 bit.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedkv.kernels import library
from pagedkv.kernels.library import KernelsUnavailable
from pagedkv.kernels.signatures import ADDRESS, SUFFIXES
from pagedkv.models.linear import GateUpLinear, Linear
from pagedkv.models.moe_config import MoeConfig

#: ``flags`` of moe_experts_<S> (kernels.h)
RENORMALIZE, FLOAT32_WEIGHTS = 1, 2
#: the dtypes the kernel takes (those with a tiled GEMM)
DTYPES = (torch.float32, torch.bfloat16)


def flags(moe: MoeConfig) -> int:
    return RENORMALIZE * moe.renormalize + FLOAT32_WEIGHTS * moe.float32_weights


def expert_rows(block: Any) -> tuple[int, int]:
    """The intermediate rows of ``block``'s routed experts and of its shared one (0: none)."""
    shared = getattr(block, "shared_expert", None)
    return block.experts[
        0
    ].gate_up_proj.out_features // 2, 0 if shared is None else shared.gate_up_proj.out_features // 2


def _tiled(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    weight = linear._parameters["weight"]
    return weight if weight.dim() == 1 and weight.dtype == dtype else None


def weight_table(
    block: Any, dtype: torch.dtype, tiled: Callable[[nn.Module], torch.Tensor | None] | None = None
) -> ctypes.Array | None:
    """The kernel's ``weights`` for ``block`` (a :class:`~pagedkv.models.moe.SparseMoeBlock`):
    the router's tiled weight, then each expert's gate/up and down (then, with a shared expert,
    its one-logit gate, gate/up and down), as read by ``tiled`` (the
    weight in the tiled layout of ``dtype``, or None); None when one is not (a quantized
    projection, another kernel). A tensor-parallel rank's experts are its shares of their rows
    (:class:`~pagedkv.models.parallel.ColumnParallelGateUp`, down projections that leave their
    partial products unreduced), read alike."""
    tiled = tiled or (lambda linear: _tiled(linear, dtype))
    linears: list[nn.Module] = [block.gate]
    shared = getattr(block, "shared_expert", None)
    for i, expert in enumerate([*block.experts, *([] if shared is None else [shared])]):
        gate_up, down = expert.gate_up_proj, getattr(expert, expert.down_name)
        if not isinstance(gate_up, GateUpLinear) or not gate_up.paired or not isinstance(down, Linear):
            return None
        if i == len(block.experts):  # the shared expert: its gate first
            linears.append(block.shared_expert_gate)
        linears += [gate_up, down]
    routers = [block.gate, *([] if shared is None else [block.shared_expert_gate])]
    if not all(isinstance(r, Linear) for r in routers) or any(linear.bias is not None for linear in linears):
        return None
    weights = [tiled(linear) for linear in linears]
    if any(weight is None for weight in weights):
        return None
    return (ADDRESS * len(weights))(*(weight.data_ptr() for weight in weights))


def native_experts(x: torch.Tensor, block: Any, moe: MoeConfig) -> torch.Tensor | None:
    """The routed experts' output ``[T, hidden]`` for ``x`` by the kernel, or None when it
    cannot run them (off the CPU, another dtype, weights off the tiled layout, no library)."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or x.dim() != 2 or not x.shape[0]:
        return None
    table = weight_table(block, x.dtype)
    if table is None:
        return None
    try:
        entry = library.load().entry(f"moe_experts_{SUFFIXES[x.dtype]}")
    except KernelsUnavailable:
        return None
    if entry is None:
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    args = (x.shape[0], x.shape[1], moe.num_experts, moe.top_k, *expert_rows(block), flags(moe))
    if entry(x.data_ptr(), table, out.data_ptr(), *args):
        raise MemoryError("the experts kernel could not allocate its workspace")
    return out
