"""A decode step's decoder layers as one call into C (``pagedkv/kernels/csrc/decode_stack.c``),
lowered from the model's op list.

The step program (:mod:`pagedkv.models.step_program`) runs each op as a call into a compiled
kernel with a little Python between them. On the CPU that Python runs with cold caches -- every
projection has just streamed its weights through L2 and L3 -- and a decode step makes about
eight such calls per layer: on a small batch the glue is a share of the step worth removing.

Each op of :mod:`pagedkv.models.ops` with a C form lowers here to the :class:`DecodeOp` records
the C loop runs (an opcode, the buffers it reads and writes, its weights and shape), calling the
kernel the op's torch path calls on the same data: the hidden states are bit for bit the
program's. A model whose every op lowers gets the stack; an op without a lowering, a projection
off the tiled kernel or a tensor-parallel shard leaves every step to the program, and
:func:`describe` says why. A projection kept in GGUF blocks
(:class:`~pagedkv.models.quantized.QuantizedLinear`) lowers to one record per part, each writing
its columns of one buffer, as its own product does; a quantized gate/up projection is followed by
the separate activation, as :class:`~pagedkv.models.ops.GateUpAct` runs it. A new op kind with
a C form is one lowering function below, one opcode and one ``case`` of the C loop.

The stack takes a step when every row is a generated token, the batch fits its buffers
(:data:`~pagedkv.models.linear.BUFFER_ROWS` rows) and the per-call attention checks are off (they
run in the program). Generated rows are decodes and, with speculative decoding, the ``k + 1``
rows of a sequence verifying ``k`` proposed tokens: the row kernel takes any number of rows per
sequence, each attending its sequence up to its own position
(:func:`~pagedkv.attention.backends.cpu_rows.generated_rows`, the rows the program's prefill
attention gives the same kernel). With KV groups (hybrid paging) a layer's KV write and
attention records name its group, and the step passes every group's slots and block tables,
as each op of the program reads its group's metadata. Like the program, it reads each
projection's weight as its module holds it at every step: a replaced weight is lowered again
(or, no longer tiled, leaves the steps to the program).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedkv.attention import KVCache
from pagedkv.attention.backends import cpu_rows
from pagedkv.attention.checks import per_call_checks
from pagedkv.kernels import library, paged_attention, tiled_gemm
from pagedkv.kernels.signatures import ADDRESS, I64, SUFFIXES, DecodeBuffer, DecodeCode, DecodeOp
from pagedkv.models import layer_ops
from pagedkv.models.decode_gemma import GEMMA_LOWERINGS, adding_norm
from pagedkv.models.decode_lora import LORA_LOWERINGS, LoRARowBuffers
from pagedkv.models.decode_step_tables import StepTables
from pagedkv.models.linear import BUFFER_ROWS, GateUpLinear, Linear, PackedLinear
from pagedkv.models.ops import AddNorm, Attend, ForwardBatch, GateUpAct, KeepRows, Op, Project, RotaryWriteKV
from pagedkv.models.quantized import QuantizedLinear


class _Lowering:
    """The records of an op list, appended op by op, and the buffers they name.

    ``current`` is the buffer holding the stream's ``x`` (the torch path's tensor); an op reads
    it and writes a working buffer of its output's width that is neither it nor the residual.
    Without a KV cache (the check at build time) the pools are left empty."""

    def __init__(self, dtype: torch.dtype, hidden: int, kv_cache: KVCache | None) -> None:
        self.dtype, self.kv_cache = dtype, kv_cache
        self.lora_rows = (0, 0)  # where the LoRA records read the step's rows (LoRARowBuffers)
        self.records: list[DecodeOp] = []
        self.widths = [hidden] * DecodeBuffer.WORK  # INPUT, RESIDUAL, OUTPUT
        self.current = int(DecodeBuffer.INPUT)
        self.residual_started = False
        #: whether a record rotates by the second rotary table (Gemma 3's sliding layers)
        self.local_rope = False
        #: each projection's parameter table, and the weight read from it
        self.parameters: list[dict[str, Any]] = []
        self.weights: list[torch.Tensor] = []
        #: (sliding window, heads, head_dim) of each attention split computed per step
        self.splits: list[tuple[int, int, int]] = []
        #: what records point into besides the weights (an experts' weight table): held
        self.held: list[Any] = []

    def lower(self, op: Op) -> str | None:
        """Append ``op``'s records, or say why it has none."""
        lowering = _LOWERINGS.get(type(op))
        if lowering is not None:
            return lowering(op, self)
        own = getattr(op, "decode_lowering", None)  # an op defined with its family (RouteExperts)
        return f"no C form for {type(op).__name__}" if own is None else own(self)

    def emit(self, code: DecodeCode, width: int, dst: int | None = None, **fields: Any) -> None:
        """Append a record reading ``current`` and writing ``dst`` (a new working buffer of
        ``width`` when None), which becomes ``current`` unless ``dst`` was given."""
        move = dst is None
        if dst is None:
            free = [
                i
                for i in range(DecodeBuffer.WORK, len(self.widths))
                if self.widths[i] == width and i != self.current
            ]
            dst = free[0] if free else len(self.widths)
            if not free:
                self.widths.append(width)
        self.records.append(DecodeOp(code=code, src=self.current, dst=dst, n_out=width, **fields))
        if move:
            self.current = dst

    def fits(self, weight: torch.Tensor | None, size: int) -> bool:
        """Whether a norm weight is what the compiled norms read for rows of ``size``."""
        if weight is None:
            return True
        return weight.dtype == self.dtype and weight.shape == (size,) and weight.is_contiguous()

    def tiled(self, linear: nn.Module) -> torch.Tensor | None:
        """The projection's weight as its module holds it now, when in the tiled layout of the
        stack's dtype (read again at each step: :meth:`DecodeStack.run`)."""
        params = linear._parameters
        weight = params["weight"]
        self.parameters.append(params)
        self.weights.append(weight)
        return weight if weight.dim() == 1 and weight.dtype == self.dtype else None

    def pools(self, kv_layer: int, kv_heads: int, head_dim: int) -> dict[str, Any] | str:
        """The layer's key and value pools, block size and KV group (whose slots and block tables
        it reads) as record fields, or why the C cannot use them (it takes unquantized,
        contiguous pools of the model's dtype and heads)."""
        if self.kv_cache is None:
            return {}
        kv = self.kv_cache.layers[kv_layer]
        if kv.quantized or kv.key.dtype != self.dtype or kv.key.device.type != "cpu":
            return "a quantized KV cache or one of another dtype"
        if kv.key.shape[2:] != (kv_heads, head_dim):
            return "a KV cache of other heads"
        if not (kv.key.is_contiguous() and kv.value.is_contiguous()):
            return "a KV cache that is not contiguous"
        pools = {"key_pool": kv.key.data_ptr(), "value_pool": kv.value.data_ptr()}
        return pools | {"block_size": kv.block_size, "group": kv.group}

    def split(self, window: int, heads: int, head_dim: int) -> int:
        key = (window, heads, head_dim)
        if key not in self.splits:
            self.splits.append(key)
        return self.splits.index(key)


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _add_norm(op: AddNorm, low: _Lowering) -> str | None:
    return adding_norm(op.weight, op.eps, DecodeCode.NORM, DecodeCode.ADD_NORM, low)


def _quantized(linear: QuantizedLinear, low: _Lowering) -> str | None:
    """One record per part of a quantized projection, each writing its columns of one buffer
    (the parts' calls of :meth:`QuantizedLinear.product`)."""
    bias = linear.bias
    if bias is not None and (bias.dtype != low.dtype or not bias.is_contiguous()):
        return "a quantized projection's bias of another dtype"
    if any(blocks.device.type != "cpu" for *_, blocks in linear.columns()):
        return "quantized weights off the CPU"
    src, dst = low.current, None
    for column, width, qtype, blocks in linear.columns():
        bias_at = None if bias is None else bias.data_ptr() + column * bias.element_size()
        fields = {"weight": blocks.data_ptr(), "bias": bias_at, "n_in": linear.in_features}
        fields |= {"qtype": qtype, "column": column, "columns": width, "q8_rows": linear.q8_rows}
        if dst is None:
            low.emit(DecodeCode.QUANT_LINEAR, linear.out_features, **fields)
            dst = low.current
        else:  # the later parts read the same input into the same buffer
            low.records.append(
                DecodeOp(code=DecodeCode.QUANT_LINEAR, src=src, dst=dst, n_out=linear.out_features, **fields)
            )
    return None


def _project(op: Project, low: _Lowering) -> str | None:
    linear = op.linear
    if type(linear) is QuantizedLinear:
        return _quantized(linear, low)
    if type(linear) not in (Linear, PackedLinear):
        return "tensor-parallel shards"
    weight = low.tiled(linear)
    if weight is None:
        return "linear layers not on the tiled kernel"
    fields = {"weight": weight.data_ptr(), "bias": _address(linear.bias), "n_in": linear.in_features}
    low.emit(DecodeCode.LINEAR, linear.out_features, **fields)
    return None


def _rotary_write_kv(op: RotaryWriteKV, low: _Lowering) -> str | None:
    layout, ops = op.layout, layer_ops.native_ops(low.dtype)
    heads, kv_heads, dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
    if dim > ops.max_head_dim:
        return "a head wider than the rotary kernel takes"
    if dim % 2:
        return "an attention shape the compiled kernels do not take"
    if low.widths[low.current] != (heads + 2 * kv_heads) * dim:
        return "a q/k/v layout its projection does not make"
    if not (low.fits(layout.q_norm, dim) and low.fits(layout.k_norm, dim)):
        return "a q/k norm weight the compiled norms do not take"
    pools = low.pools(op.kv_layer, kv_heads, dim)
    if isinstance(pools, str):
        return pools
    norms = {"q_norm": _address(layout.q_norm), "k_norm": _address(layout.k_norm), "eps": layout.eps}
    shape = {"heads": heads, "kv_heads": kv_heads, "head_dim": dim}
    low.local_rope = low.local_rope or op.local
    rope = {"offset": int(layout.offset), "rope": int(op.local)}
    low.emit(DecodeCode.ROTARY_WRITE_KV, heads * dim, **pools, **norms, **shape, **rope)
    return None


def _attend(op: Attend, low: _Lowering) -> str | None:
    layout, options = op.layout, op.options
    heads, kv_heads, dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
    if heads // kv_heads > paged_attention.MAX_GROUP or dim % 2:
        return "an attention shape the compiled kernels do not take"
    pools = low.pools(op.kv_layer, kv_heads, dim)
    if isinstance(pools, str):
        return pools
    window = options.sliding_window or 0
    low.emit(
        DecodeCode.ATTEND,
        heads * dim,
        **pools,
        scale=options.scale,
        soft_cap=options.soft_cap or 0.0,
        window=window,
        split=low.split(window, heads, dim),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=dim,
    )
    return None


def _gate_up_act(op: GateUpAct, low: _Lowering) -> str | None:
    gate_up = op.gate_up
    if isinstance(gate_up, QuantizedLinear):  # the product, then the separate activation
        if (why := _quantized(gate_up, low)) is not None:
            return why
        low.emit(DecodeCode.SILU_AND_MUL, gate_up.out_features // 2)
        return None
    if type(gate_up) is not GateUpLinear:
        return "tensor-parallel shards"
    weight = low.tiled(gate_up)
    if weight is None or not gate_up.paired:
        return "linear layers not on the tiled kernel"
    fields = {"weight": weight.data_ptr(), "n_in": gate_up.in_features}
    low.emit(DecodeCode.GATE_UP_SILU, gate_up.out_features // 2, **fields)
    return None


def _keep_rows(op: KeepRows, low: _Lowering) -> str | None:
    return None  # the stack takes only steps that keep every row


#: each op kind with a C form, and how it lowers: appends its records, or says why it cannot
_LOWERINGS: dict[type[Op], Callable[[Any, _Lowering], str | None]] = {
    AddNorm: _add_norm,
    Project: _project,
    RotaryWriteKV: _rotary_write_kv,
    Attend: _attend,
    GateUpAct: _gate_up_act,
    KeepRows: _keep_rows,
    **GEMMA_LOWERINGS,
    **LORA_LOWERINGS,
}


def _lower(ops: tuple[Op, ...], low: _Lowering) -> str | None:
    """Lower every op into ``low``, then copy the result to the output; or say why not."""
    for op in ops:
        if (why := low.lower(op)) is not None:
            return why
    width = low.widths[DecodeBuffer.OUTPUT]
    if low.widths[low.current] != width:
        return "a last op that does not make hidden states"
    low.emit(DecodeCode.COPY, width, dst=DecodeBuffer.OUTPUT)
    return None


def _unsupported(model: nn.Module, ops: tuple[Op, ...], dtype: torch.dtype) -> str | None:
    """Why the C stack cannot run ``model``'s op list ``ops`` in ``dtype``, or None when it can."""
    if model.model.norm.weight.device.type != "cpu":
        return f"{model.model.norm.weight.device.type}: the CPU only"
    if (why := tiled_gemm.why_unavailable(dtype)) is not None:
        return why  # no kernels library, or a dtype the tiled GEMM (and so the stack) lacks
    if layer_ops.native_ops(dtype) is None:
        return f"no compiled layer ops for {dtype}"
    if model.attention_backend.name != "cpu":
        return f"attention backend {model.attention_backend.name!r}"
    return _lower(ops, _Lowering(dtype, model.config.hidden_size, None))


class DecodeStack:
    """The C decode stack of one op list in one dtype, with its buffers; :meth:`run` takes a
    step or returns None for the program to run it."""

    def __init__(self, ops: tuple[Op, ...], dtype: torch.dtype, hidden: int) -> None:
        self.ops, self.dtype, self.hidden = ops, dtype, hidden
        self._run = library.load().entry(f"decode_stack_{SUFFIXES[dtype]}")
        shape = _Lowering(dtype, hidden, None)
        _lower(ops, shape)
        #: the residual and working buffers (held); :meth:`run` points at the step's input and output
        self._buffers = {
            i: torch.empty((BUFFER_ROWS, width), dtype=dtype)
            for i, width in enumerate(shape.widths)
            if i not in (DecodeBuffer.INPUT, DecodeBuffer.OUTPUT)
        }
        self._addresses = (ADDRESS * len(shape.widths))()
        for i, buffer in self._buffers.items():
            self._addresses[i] = buffer.data_ptr()
        #: the records of the last bind, or None when the op list did not lower then
        self._records: ctypes.Array[DecodeOp] | None = None
        self._kv_cache: KVCache | None = None
        self._parameters: list[dict[str, Any]] = []
        self._bound: list[torch.Tensor] = []
        self._splits = shape.splits
        self._chunks, self._threads = (I64 * len(self._splits))(), (I64 * len(self._splits))()
        self._lora_rows = LoRARowBuffers(ops)

    def _bind(self, kv_cache: KVCache) -> None:
        """Lower the op list again for ``kv_cache`` and the projections' current weights (held:
        the addresses the C reads stay valid until the next bind). No records when it does not
        lower (a weight off the tiled layout, a pool the C does not take): the steps go to the
        program until the cache or a weight changes again."""
        low = _Lowering(self.dtype, self.hidden, kv_cache)
        low.lora_rows = self._lora_rows.addresses()
        lowered = _lower(self.ops, low) is None
        self._records = (DecodeOp * len(low.records))(*low.records) if lowered else None
        self._kv_cache, self._parameters, self._bound = kv_cache, low.parameters, low.weights
        self._held = low.held
        self._tables = StepTables(self.dtype, kv_cache.num_groups, low.local_rope)

    def run(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """The final hidden states ``[T, hidden]`` of a step of generated rows ``x``, or None
        when this step is not one the stack takes (the caller runs the program)."""
        kv_cache, metadata = batch.kv_cache, batch.metadata
        tokens = x.shape[0]
        if not 0 < tokens <= BUFFER_ROWS or per_call_checks() or x.dtype != self.dtype:
            return None
        if x.device.type != "cpu":
            return None
        rows = cpu_rows.generated_rows(metadata)
        if rows is None or rows.row_seq.shape[0] != tokens:
            return None
        replaced = any(
            params["weight"] is not bound for params, bound in zip(self._parameters, self._bound, strict=True)
        )
        if kv_cache is not self._kv_cache or replaced:
            self._bind(kv_cache)
        if self._records is None or not self._tables.point(batch, rows):
            return None
        for i, (window, heads, head_dim) in enumerate(self._splits):
            self._threads[i], self._chunks[i] = cpu_rows.split_work(rows.total(window), heads, head_dim)
        if not self._lora_rows.stage(batch.lora, tokens):
            return None
        x = x.contiguous()
        out = torch.empty_like(x)
        self._addresses[DecodeBuffer.INPUT] = x.data_ptr()
        self._addresses[DecodeBuffer.OUTPUT] = out.data_ptr()
        status = self._run(
            self._records,
            len(self._records),
            self._addresses,
            tokens,
            self._tables.cos,
            self._tables.sin,
            self._tables.slots,
            self._tables.tables,
            self._tables.widths,
            rows.row_seq.data_ptr(),
            rows.row_pos.data_ptr(),
            self._chunks,
            self._threads,
        )
        if status == 1:
            raise MemoryError("a kernel of the decode stack could not allocate its workspace")
        if status:
            raise RuntimeError(f"the decode stack stopped with status {status}")
        return out


def decode_stack(model: nn.Module, ops: tuple[Op, ...], dtype: torch.dtype) -> DecodeStack | None:
    """The C decode stack of ``model``'s ops in order
    (:meth:`~pagedkv.models.ops.DecoderOps.sequence`) for activations of ``dtype``, or None when
    it has none (see :func:`_unsupported`)."""
    if _unsupported(model, ops, dtype) is not None:
        return None
    return DecodeStack(ops, dtype, model.config.hidden_size)


def describe(model: nn.Module) -> str:
    """What runs the model's decode steps, for the CLI's runtime line: the C stack, or the step
    program and why."""
    why = _unsupported(model, model.decoder_ops().sequence(), model.model.norm.weight.dtype)
    return "C stack" if why is None else f"step program ({why})"
