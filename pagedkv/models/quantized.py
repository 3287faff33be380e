"""Linear layers whose weights stay in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K): the only copy of a weight is its blocks, about 4.5 to 8.5 bits per element.

A :class:`QuantizedLinear` holds one or more *parts*, each a ``uint8`` tensor ``[rows, row
bytes]`` of blocks in one ggml type; their output rows are concatenated in order. A single GGUF
tensor is one part (:meth:`QuantizedLinear.from_gguf`). The model's packed projections (q/k/v in
``qkv_proj``, gate/up in ``gate_up_proj``) are made by :meth:`QuantizedLinear.packed`: each output
row's blocks are independent of the other rows', so neighbouring parts of one type are
concatenated row-wise into one part (one product); parts of different types (a GGUF file may
store ``attn_v`` in Q6_K beside Q4_K ``attn_q``) cannot share blocks, so each stays a part and
writes its columns of the shared output in place. Nothing is requantized.

On the CPU in float32 or bfloat16 the product is the C kernel's
(:func:`~pagedkv.kernels.quant_gemm.quant_linear`: dequantized on the fly, float32 sums), which
the C decode stack calls too (``DECODE_QUANT_LINEAR``). A product of at most ``q8_rows`` rows
(set for the whole model by :func:`use_quantized_activations`; 0 by default) rounds the
activations to 8-bit blocks and sums integer products as llama.cpp does, in the stack too. On
CUDA (float32, bfloat16, float16) the product is the Triton kernel's of the same contract
(:func:`~pagedkv.kernels.triton_quant.quant_linear`: the blocks read in place, float activations).
Elsewhere -- another device or dtype, no kernels library, no triton -- the weight is dequantized
to the activation's dtype for each call and multiplied by ``F.linear`` (correct, and as slow as
that sounds: for tests and odd setups).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.kernels import library, quant_gemm, triton_kernels
from pagedkv.models.linear import OutputBuffer


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + bias`` for ``W`` ``[out_features, in_features]`` held as quantized parts:
    ``parts`` is ``(blocks, qtype)`` pairs, ``blocks`` a contiguous CPU ``uint8`` tensor of
    ``rows`` whole rows of ``qtype`` (a ggml type code) blocks; the rows of the parts, in order,
    are ``W``'s. ``bias``: ``[out_features]`` or None."""

    def __init__(
        self, parts: Sequence[tuple[torch.Tensor, int]], in_features: int, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if not parts:
            raise ValueError("a quantized linear layer has at least one part")
        self.in_features = in_features
        #: each part's ggml type code and row count, in output order
        self.qtypes = tuple(int(qtype) for _, qtype in parts)
        self.part_rows = tuple(int(blocks.shape[0]) for blocks, _ in parts)
        self.out_features = sum(self.part_rows)
        for i, (blocks, qtype) in enumerate(parts):
            size = quant_gemm.row_bytes(int(qtype), in_features)
            if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != size:
                raise ValueError(
                    f"part {i}: expected uint8 [rows, {size}], got {blocks.dtype} {tuple(blocks.shape)}"
                )
            self.register_buffer(f"part{i}", blocks.contiguous())
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias must be [{self.out_features}], got {tuple(bias.shape)}")
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        #: rows up to which the C product runs in llama.cpp's 8-bit arithmetic (0: never)
        self.q8_rows = 0

    @classmethod
    def from_gguf(
        cls,
        raw: np.ndarray | torch.Tensor,
        qtype: int,
        shape: tuple[int, int],
        bias: torch.Tensor | None = None,
    ) -> QuantizedLinear:
        """The layer of one GGUF tensor: ``raw`` its bytes (a memory-mapped ``uint8`` array as a
        GGUF reader hands it, or a ``uint8`` tensor), ``qtype`` its ``gguf.GGMLQuantizationType``,
        ``shape`` ``(out, in)``. The bytes are copied once, into the layer's own tensor; nothing
        keeps ``raw``."""
        out_features, in_features = shape
        size = quant_gemm.row_bytes(int(qtype), in_features)
        blocks = torch.empty((out_features, size), dtype=torch.uint8)
        if isinstance(raw, torch.Tensor):
            source = raw.detach().reshape(-1)
            if source.dtype != torch.uint8 or source.numel() != blocks.numel():
                raise ValueError(
                    f"expected {blocks.numel()} uint8 bytes, got {source.numel()} {source.dtype}"
                )
            blocks.view(-1).copy_(source)
        else:
            source = np.asarray(raw).reshape(-1)
            if source.dtype != np.uint8 or source.size != blocks.numel():
                raise ValueError(f"expected {blocks.numel()} uint8 bytes, got {source.size} {source.dtype}")
            blocks.numpy().reshape(-1)[:] = source
        return cls([(blocks, int(qtype))], in_features, bias)

    @classmethod
    def packed(cls, layers: Sequence[QuantizedLinear]) -> QuantizedLinear:
        """One layer for several of the same input (q/k/v, gate/up), output rows in ``layers``'
        order: neighbouring parts of one type are concatenated into one, the others kept apart.
        A bias where some layers have one and others not is zero for the others."""
        if len({layer.in_features for layer in layers}) != 1:
            raise ValueError("packed layers share their input width")
        runs: list[tuple[list[torch.Tensor], int]] = []
        for layer in layers:
            for _, _, qtype, blocks in layer.columns():
                if runs and runs[-1][1] == qtype:
                    runs[-1][0].append(blocks)
                else:
                    runs.append(([blocks], qtype))
        parts = [(blocks[0] if len(blocks) == 1 else torch.cat(blocks), qtype) for blocks, qtype in runs]
        biases = [layer.bias for layer in layers]
        bias = None
        if any(b is not None for b in biases):
            like = next(b for b in biases if b is not None)
            bias = torch.cat(
                [
                    b.detach() if b is not None else like.new_zeros(layer.out_features)
                    for b, layer in zip(biases, layers, strict=True)
                ]
            )
        return cls(parts, layers[0].in_features, bias)

    def columns(self) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """``(first column, columns, qtype, blocks)`` of each part, in output order."""
        column = 0
        for i, (qtype, rows) in enumerate(zip(self.qtypes, self.part_rows, strict=True)):
            yield column, rows, qtype, self._buffers[f"part{i}"]
            column += rows

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized ``[out, in]`` weight in ``dtype`` on the blocks' device (a new tensor):
        the C dequantizer where it runs, on CUDA the Triton one, else gguf-py's (the reference both
        equal)."""
        return torch.cat(
            [_dequantize(blocks, qtype, self.in_features, dtype) for _, _, qtype, blocks in self.columns()]
        )

    def native(self, x: torch.Tensor) -> bool:
        """Whether the C product takes ``x``: a CPU float32 or bfloat16 input, CPU blocks, the
        kernels library here."""
        return (
            x.device.type == "cpu"
            and x.dtype in quant_gemm.DTYPES
            and self._buffers["part0"].device.type == "cpu"
            and library.why_unavailable() is None
        )

    def kernel(self, x: torch.Tensor) -> ModuleType | None:
        """The kernels module whose ``quant_linear`` multiplies ``x`` by the blocks in place:
        :mod:`~pagedkv.kernels.quant_gemm` (C, :meth:`native`), on CUDA
        :mod:`~pagedkv.kernels.triton_quant`; None: the dense fallback."""
        if self.native(x):
            return quant_gemm
        triton_quant = triton_kernels("triton_quant") if x.device.type == "cuda" else None
        return triton_quant if triton_quant is not None and triton_quant.takes(x, self.part0) else None

    def product(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` for ``x [..., in]``; on a kernel's path into ``out`` (``[rows,
        out]``) when given."""
        rows = x.reshape(-1, self.in_features)
        kernel = self.kernel(rows)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if kernel is None:
            y = F.linear(rows, self.dense_weight(x.dtype).to(x.device), bias)
            return y.view(*x.shape[:-1], self.out_features)
        rows = rows.contiguous()
        if out is None:
            out = torch.empty((rows.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        # llama.cpp's arithmetic (the C kernel's) for a product of few rows, where it was asked for
        q8 = (rows.shape[0] <= self.q8_rows,) if kernel is quant_gemm else ()
        for column, width, qtype, blocks in self.columns():
            part_bias = None if bias is None else bias[column : column + width]
            kernel.quant_linear(rows, blocks, qtype, part_bias, out[:, column : column + width], *q8)
        return out.view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def as_function(self, output: OutputBuffer | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """The product as a plain function of ``x`` (what a :class:`~pagedkv.models.ops.Project`
        runs), a small 2-D batch written into ``output``, kept between calls
        (:class:`~pagedkv.models.linear.OutputBuffer`; None: a buffer of its own)."""
        width = self.out_features
        buffer = OutputBuffer() if output is None else output

        def project(x: torch.Tensor) -> torch.Tensor:
            out = buffer.get(x.shape[0], width, x.dtype) if x.dim() == 2 and self.native(x) else None
            return self.product(x, out)

        return project

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtypes={self.qtypes}"


#: ``q8_rows`` of each ``quantized_activations`` mode (``pagedkv.kernels.QUANTIZED_ACTIVATIONS``)
Q8_ROWS = {"float": 0, "q8": quant_gemm.Q8_DECODE_ROWS, "q8-all": 1 << 62}


def use_quantized_activations(model: nn.Module, mode: str) -> str | None:
    """Every quantized layer of ``model`` multiplies in ``mode``'s arithmetic (a name of
    ``pagedkv.kernels.QUANTIZED_ACTIVATIONS``); what runs, for the runtime line, or None for a
    model without quantized layers."""
    if mode not in Q8_ROWS:
        raise ValueError(f"unknown quantized_activations {mode!r}; choose one of {list(Q8_ROWS)}")
    layers = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    for layer in layers:
        layer.q8_rows = Q8_ROWS[mode]
    if not layers:
        return None
    if mode == "float" or library.why_unavailable() is not None:
        return "float activations, float32 sums"
    arithmetic = f"8-bit activations, integer dot products ({quant_gemm.dot_instructions()})"
    return f"up to {quant_gemm.Q8_DECODE_ROWS} rows: {arithmetic}" if mode == "q8" else arithmetic


def _dequantize(blocks: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` dequantized to ``[rows, in_features]`` of ``dtype`` on their device: by the C
    kernel, on CUDA by the Triton one, else by gguf-py on the CPU."""
    if blocks.device.type == "cpu" and dtype in quant_gemm.DTYPES and library.why_unavailable() is None:
        return quant_gemm.dequantize(blocks, qtype, in_features, dtype)
    triton_quant = triton_kernels("triton_quant") if blocks.device.type == "cuda" else None
    if triton_quant is not None and dtype.is_floating_point:
        return triton_quant.dequantize(blocks, qtype, in_features, dtype)
    from gguf.quants import dequantize  # the reference, for where the C cannot run

    dense = torch.from_numpy(dequantize(blocks.cpu().numpy(), qtype))
    return dense.to(device=blocks.device, dtype=dtype)


class QuantizedEmbedding(nn.Module):
    """A token embedding held as GGUF blocks (``[vocab, row bytes]`` ``uint8`` of ggml type
    ``qtype``): a lookup dequantizes only the rows it reads, to the model's ``dtype``, with the
    values a dense embedding dequantized at load would hold. A tied LM head multiplies by the
    same blocks (:meth:`tied_head`): the matrix is held once."""

    def __init__(self, blocks: torch.Tensor, qtype: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        quant_gemm.row_bytes(qtype, hidden_size)  # a type with a kernel, rows of whole blocks
        self.register_buffer("blocks", blocks.contiguous())
        self.qtype, self.hidden_size, self.dtype = int(qtype), hidden_size, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, input_ids.reshape(-1))
        return _dequantize(rows, self.qtype, self.hidden_size, self.dtype).view(*input_ids.shape, -1)

    def tied_head(self) -> QuantizedLinear:
        """The LM head whose weight is this embedding's matrix, over the same blocks."""
        return QuantizedLinear([(self.blocks, self.qtype)], self.hidden_size)
