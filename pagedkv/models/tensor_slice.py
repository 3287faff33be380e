"""The part of a checkpoint tensor one tensor-parallel rank holds (:mod:`pagedkv.models.parallel`),
read from a safetensors slice handle, cut from a tensor in memory, or taken from a quantized
weight's blocks where the cut falls between blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES

from pagedkv.models.quantization.blocks import QuantizedWeight


@dataclass(frozen=True)
class TensorSlice:
    """The part of a checkpoint tensor one rank holds: ``count`` entries from ``start`` along
    ``dim``, zero-padded to ``size`` entries; ``zero``: the rank holds zeros (a row-parallel
    bias is added once, by rank 0); ``blocks``: a projection's weight, which may stay in its
    quantized blocks (:meth:`blocks_of`)."""

    dim: int
    start: int
    count: int
    size: int
    zero: bool = False
    blocks: bool = False

    def read(self, lazy: Any) -> torch.Tensor:
        """The slice of a safetensors ``get_slice`` handle (reads only these bytes)."""
        return self._fill(lazy[self._index(len(lazy.get_shape()))])

    def cut(self, tensor: torch.Tensor) -> torch.Tensor:
        """The slice of a whole tensor in memory."""
        return self._fill(tensor[self._index(tensor.dim())])

    def blocks_of(self, weight: QuantizedWeight) -> QuantizedWeight | None:
        """This slice of ``weight`` in its own blocks: whole rows, or whole blocks of input
        columns; None where the slice is no projection's, is zeros or padding, or its columns
        would cut a block."""
        if not self.blocks or self.zero or self.size != self.count:
            return None
        rows, columns = weight.shape
        if self.dim == 0:
            raw = weight.raw[self.start : self.start + self.count]
            return QuantizedWeight(raw, weight.qtype, (self.count, columns))
        block, block_bytes = GGML_QUANT_SIZES[weight.qtype]
        if self.start % block or self.count % block:
            return None
        first, width = self.start // block * block_bytes, self.count // block * block_bytes
        raw = np.ascontiguousarray(weight.raw[:, first : first + width])
        return QuantizedWeight(raw, weight.qtype, (rows, self.count))

    def _index(self, dims: int) -> tuple[slice, ...]:
        index: list[slice] = [slice(None)] * dims
        index[self.dim] = slice(self.start, self.start + self.count)
        return tuple(index)

    def _fill(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.zero:
            tensor = torch.zeros_like(tensor)
        if self.size > self.count:
            pad = [0, 0] * (tensor.dim() - 1 - self.dim) + [0, self.size - self.count]
            tensor = F.pad(tensor, pad)
        return tensor
