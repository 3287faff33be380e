"""The part of a checkpoint tensor one tensor-parallel rank holds (:mod:`pagedkv.models.parallel`),
read from a safetensors slice handle, cut from a tensor in memory, or taken from a quantized
weight's blocks where the cut falls between blocks; and :class:`ParallelLayer`, a layer that
says which parts it holds."""

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
    bias is added once, by rank 0); ``blocks``: a projection's or the vocabulary's matrix,
    which may stay in its quantized blocks (:meth:`blocks_of`)."""

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
        """This slice of ``weight`` in its own blocks: whole rows (padding rows all-zero bytes,
        which every GGUF type reads as zeros: each block's scales are f16 zeros), or whole
        blocks of input columns; None where the slice is no quantized matrix's, is zeros, or
        its columns would cut a block (or be padded)."""
        if not self.blocks or self.zero:
            return None
        rows, columns = weight.shape
        if self.dim == 0:
            raw = weight.raw[self.start : self.start + self.count]
            if self.size > self.count:
                padding = np.zeros((self.size - self.count, raw.shape[1]), dtype=np.uint8)
                raw = np.concatenate([raw, padding])
            return QuantizedWeight(raw, weight.qtype, (self.size, columns))
        if self.size != self.count:
            return None
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


class ParallelLayer:
    """A layer holding a slice of checkpoint tensors; says which slice of which."""

    def checkpoint_slices(self, parent: str, name: str) -> dict[str, TensorSlice]:
        """Checkpoint tensor name -> the slice this layer holds (``parent``: the name of the
        module holding this layer, ``name``: this layer's)."""
        raise NotImplementedError
