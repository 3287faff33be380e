"""The vocabulary-parallel embedding and LM head of a tensor-parallel rank
(:mod:`pagedkv.models.parallel`), dense or in GGUF blocks.

Each rank holds ``ceil(vocab / N)`` rows of the embedding matrix (the last rank's tail padded):
the embedding looks up the ids it holds, gives zeros for the others, and one all-reduce adds the
one rank's row that is not zero (exact: every other term is zero); the LM head computes its
vocabulary slice of the rows it is given (the sampled ones) and gathers them on rank 0, the
padding cut off. A GGUF row is whole blocks, so a rank's rows of a quantized matrix are a byte
slice of the file's (:meth:`~pagedkv.models.tensor_slice.TensorSlice.blocks_of`) and both layers
keep them: :class:`QuantizedVocabParallelEmbedding` dequantizes the rows it reads,
:class:`QuantizedParallelLMHead` multiplies by the blocks (a head tied to the embedding by the
same blocks: :meth:`~pagedkv.models.quantized.QuantizedEmbedding.tied_head`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from pagedkv.models.linear import Linear
from pagedkv.models.llama import Embedding
from pagedkv.models.quantized import QuantizedEmbedding, QuantizedLinear
from pagedkv.models.tensor_slice import ParallelLayer, TensorSlice


class Collectives(Protocol):
    """What the vocabulary layers ask of their rank (a
    :class:`~pagedkv.models.parallel.TensorParallel`)."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def gather_columns(self, tensor: torch.Tensor, total: int) -> torch.Tensor: ...


def vocab_slice(vocab_size: int, tp: Collectives) -> TensorSlice:
    """The rank's rows of a ``vocab_size``-row matrix, padded to ``ceil(vocab_size / N)``;
    kept in blocks where the matrix is quantized."""
    rows = -(-vocab_size // tp.size)
    start = min(tp.rank * rows, vocab_size)
    return TensorSlice(0, start, min(rows, vocab_size - start), rows, blocks=True)


class _Masked:
    """The embedding's forward: the parent's lookup of the ids the rank holds, zeros for the
    others, all-reduced."""

    rows: TensorSlice
    tp: Collectives

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.count)
        out = super().forward(local.masked_fill(outside, 0))
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class _Gathered:
    """The LM head's forward: the parent's logits of the rank's vocabulary slice, gathered on
    rank 0 and cut to ``vocab_size``."""

    tp: Collectives
    vocab_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_columns(super().forward(x), self.vocab_size)


class VocabParallelEmbedding(_Masked, Embedding, ParallelLayer):
    """The rank's vocabulary rows of the token embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: Collectives) -> None:
        self.rows = vocab_slice(vocab_size, tp)
        super().__init__(self.rows.size, hidden_size)
        self.tp = tp

    def holding_blocks(self, layer: QuantizedEmbedding) -> nn.Module:
        return QuantizedVocabParallelEmbedding(layer, self.rows, self.tp)

    def checkpoint_slices(self, parent: str, name: str) -> dict[str, TensorSlice]:
        return {f"{name}.weight": self.rows}


class ParallelLMHead(_Gathered, Linear, ParallelLayer):
    """The rank's vocabulary rows of the LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: Collectives) -> None:
        self.rows = vocab_slice(vocab_size, tp)
        super().__init__(hidden_size, self.rows.size, bias=False)
        self.tp = tp
        self.vocab_size = vocab_size

    def holding_blocks(self, layer: nn.Module) -> nn.Module:
        return QuantizedParallelLMHead(layer, self.tp, self.vocab_size)

    def checkpoint_slices(self, parent: str, name: str) -> dict[str, TensorSlice]:
        return {f"{name}.weight": self.rows}


class QuantizedVocabParallelEmbedding(_Masked, QuantizedEmbedding):
    """The rank's vocabulary rows as GGUF blocks (``layer``'s, not copied)."""

    def __init__(self, layer: QuantizedEmbedding, rows: TensorSlice, tp: Collectives) -> None:
        super().__init__(layer.blocks, layer.qtype, layer.hidden_size, layer.dtype)
        self.rows = rows
        self.tp = tp


class QuantizedParallelLMHead(_Gathered, QuantizedLinear):
    """The rank's vocabulary rows of the LM head as GGUF blocks (``layer``'s parts, not copied)."""

    def __init__(self, layer: QuantizedLinear, tp: Collectives, vocab_size: int) -> None:
        parts = [(blocks, qtype) for _, _, qtype, blocks in layer.columns()]
        super().__init__(parts, layer.in_features)
        self.tp = tp
        self.vocab_size = vocab_size
