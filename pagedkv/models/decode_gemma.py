"""The C decode stack's forms of Gemma's ops (:class:`~pagedkv.models.ops.OffsetNorm`,
:class:`~pagedkv.models.ops.GateUpGelu`), and the records of a norm that adds to the residual,
which Llama's :class:`~pagedkv.models.ops.AddNorm` shares.

Each record calls the kernel the op's compiled torch path calls
(``pagedkv/kernels/csrc/layer_ops_gemma_body.h``): ``rmsnorm(x) * (1 + w)`` rounded once, and
GeGLU as the paired tiled gate/up product followed by ``gelu_tanh(gate) * up``, so the hidden
states are the step program's bit for bit. Gemma's other switches need no op of their own here:
the score soft-cap is the attention record's, the q/k norms and the sliding layers' rotary
table are fields of the rotary record, and the embedding scale and the logit soft-cap are
outside the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from pagedkv.kernels.signatures import DecodeBuffer, DecodeCode
from pagedkv.models.linear import GateUpLinear
from pagedkv.models.ops import GateUpGelu, OffsetNorm, Op, Project
from pagedkv.models.quantized import QuantizedLinear


class Lowering(Protocol):
    """What these lowerings use of the decode stack's lowering state (``_Lowering``)."""

    current: int
    widths: list[int]
    residual_started: bool

    def emit(self, code: DecodeCode, width: int, dst: int | None = None, **fields: Any) -> None: ...

    def fits(self, weight: torch.Tensor | None, size: int) -> bool: ...

    def tiled(self, linear: nn.Module) -> torch.Tensor | None: ...

    def lower(self, op: Op) -> str | None: ...


def adding_norm(
    weight: torch.Tensor, eps: float, norm: DecodeCode, add_norm: DecodeCode, low: Lowering
) -> str | None:
    """The records of a norm that first adds ``x`` to the residual (``norm`` and ``add_norm``:
    its plain and adding opcodes); the first one makes the embedding the residual."""
    width = low.widths[low.current]
    if not low.fits(weight, width):
        return "a norm weight the compiled norms do not take"
    fields = {"weight": weight.data_ptr(), "eps": eps}
    if not low.residual_started:  # the embedding becomes the residual, then is normalised
        low.emit(DecodeCode.COPY, width, dst=DecodeBuffer.RESIDUAL)
        low.emit(norm, width, **fields)
        low.residual_started = True
    elif width == low.widths[DecodeBuffer.RESIDUAL]:
        low.emit(add_norm, width, dst=low.current, **fields)
    else:
        return "a residual add of another width"
    return None


def _offset_norm(op: OffsetNorm, low: Lowering) -> str | None:
    if op.add:
        return adding_norm(op.weight, op.eps, DecodeCode.OFFSET_NORM, DecodeCode.ADD_OFFSET_NORM, low)
    width = low.widths[low.current]
    if not low.fits(op.weight, width):
        return "a norm weight the compiled norms do not take"
    low.emit(DecodeCode.OFFSET_NORM, width, weight=op.weight.data_ptr(), eps=op.eps)
    return None


def _gate_up_gelu(op: GateUpGelu, low: Lowering) -> str | None:
    """The packed product (a quantized one as a projection's records), then the activation."""
    gate_up = op.gate_up
    if isinstance(gate_up, QuantizedLinear):
        if (why := low.lower(Project(gate_up))) is not None:
            return why
    elif type(gate_up) is not GateUpLinear:
        return "tensor-parallel shards"
    else:
        weight = low.tiled(gate_up)
        if weight is None or not gate_up.paired:
            return "linear layers not on the tiled kernel"
        low.emit(DecodeCode.GATE_UP, gate_up.out_features, weight=weight.data_ptr(), n_in=gate_up.in_features)
    low.emit(DecodeCode.GELU_TANH_AND_MUL, gate_up.out_features // 2)
    return None


#: Gemma's op kinds and their lowerings (merged into the stack's table)
GEMMA_LOWERINGS: dict[type[Op], Callable[[Any, Any], str | None]] = {
    OffsetNorm: _offset_norm,
    GateUpGelu: _gate_up_gelu,
}
