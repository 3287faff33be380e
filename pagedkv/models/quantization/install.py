"""The one place a quantized weight enters the model.

Until the linear layers run GGUF blocks themselves (``QuantizedLinear.from_gguf(raw, qtype,
shape)``), a quantized weight is dequantized here with the ``gguf`` package's reference into the
dense parameter it fills, so every quantized source -- GPTQ, AWQ, compressed-tensors, on-the-fly
quantization -- loads and runs end to end, and its numbers are those of the blocks. The dense
value is ggml's own dequantization (``d * q`` or ``d * q + m`` in float32), cast to the model's
dtype.
"""

from __future__ import annotations

import torch
from gguf.quants import dequantize

from pagedkv.models.quantization.blocks import QuantizedWeight

#: What :func:`install_quantized` makes of the blocks, for the engine's description.
HELD_AS = "dequantized into dense weights"


def install_quantized(target: torch.Tensor, weight: QuantizedWeight) -> None:
    """Fill ``target`` (a weight parameter, or a packed projection's row slice of one) with
    ``weight``, whose shape it must have."""
    if tuple(target.shape) != weight.shape:
        raise ValueError(
            f"a {weight.qtype.name} weight of shape {weight.shape} cannot fill {tuple(target.shape)}"
        )
    target.copy_(torch.from_numpy(dequantize(weight.raw, weight.qtype)))
