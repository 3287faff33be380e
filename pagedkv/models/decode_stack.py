"""A decode step's decoder layers as one call into C (``pagedkv/kernels/csrc/decode_stack.c``).

The step program (:mod:`pagedkv.models.step_program`) runs each layer as a handful of calls into
compiled kernels with a little Python between them. On the CPU that Python runs with cold
caches -- every projection has just streamed its weights through L2 and L3 -- and a decode step
makes about eight such calls per layer: on a small batch the glue is a share of the step worth
removing.

:class:`DecodeStack` hands the same kernels' inputs -- weights, KV pools, buffers -- to one C
function that calls them in the program's order: the hidden states are bit for bit the
program's. It takes a step when everything in it has a compiled kernel -- tiled projections (no
tensor-parallel shards), the paired gate/up with its fused activation, the compiled norms and
rotary + KV write, the ``cpu`` attention backend's row kernel on unquantized pools -- every row
is a generated token, the batch fits its buffers (:data:`~pagedkv.models.linear.BUFFER_ROWS`
rows) and the per-call attention checks are off (they run in the program). Generated rows are
decodes and, with speculative decoding, the ``k + 1`` rows of a sequence verifying ``k``
proposed tokens: the row kernel takes any number of rows per sequence, each attending its
sequence up to its own position (:func:`~pagedkv.attention.backends.cpu_rows.generated_rows`, the
rows the program's prefill attention gives the same kernel), so a verifying step costs about a
decode step of as many rows instead of a pass through the program. Anything else runs the
program, unchanged. Like the program, it reads each projection's weight as its module holds it
at every step: a replaced weight is bound again (or, no longer tiled, leaves the steps to the
program).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from pagedkv.attention import AttentionMetadata, KVCache
from pagedkv.attention.backends import cpu_rows
from pagedkv.attention.checks import per_call_checks
from pagedkv.kernels import library, paged_attention, tiled_gemm
from pagedkv.kernels.signatures import I64, SUFFIXES, DecodeBuffers, DecodeLayer
from pagedkv.models import layer_ops
from pagedkv.models.linear import BUFFER_ROWS, GateUpLinear, Linear, PackedLinear


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass(frozen=True)
class _Weights:
    """One layer's weights as the C reads them (held, so their addresses stay valid)."""

    input_norm: tuple[torch.Tensor, float]
    qkv: PackedLinear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_eps: float
    o: Linear
    post_norm: tuple[torch.Tensor, float]
    gate_up: GateUpLinear
    down: Linear
    attention: nn.Module  # the layer's Attention: heads, options, KV layer index


def _unsupported(model: nn.Module, dtype: torch.dtype) -> str | None:
    """Why the C stack cannot run ``model``'s layers in ``dtype``, or None when it can."""
    if model.model.norm.weight.device.type != "cpu":
        return f"{model.model.norm.weight.device.type}: the CPU only"
    if (why := tiled_gemm.why_unavailable(dtype)) is not None:
        return why  # no kernels library, or a dtype the tiled GEMM (and so the stack) lacks
    if layer_ops.native_ops(dtype) is None:
        return f"no compiled layer ops for {dtype}"
    if model.attention_backend.name != "cpu":
        return f"attention backend {model.attention_backend.name!r}"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        plain = {type(attn.qkv_proj), type(attn.o_proj), type(mlp.down_proj)} <= {Linear, PackedLinear}
        if not plain or type(mlp.gate_up_proj) is not GateUpLinear:
            return "tensor-parallel shards"
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        tiled = all(p.weight.dim() == 1 and p.weight.dtype == dtype for p in projections)
        if not (tiled and mlp.gate_up_proj.paired):
            return "linear layers not on the tiled kernel"
        if attn.num_heads // attn.num_kv_heads > paged_attention.MAX_GROUP or attn.head_dim % 2:
            return "an attention shape the compiled kernels do not take"
        if attn.head_dim > layer_ops.native_ops(dtype).max_head_dim:
            return "a head wider than the rotary kernel takes"
    return None


class DecodeStack:
    """The C decode stack of one model in one dtype, with its buffers; :meth:`run` takes a step
    or returns None for the program to run it."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype, self.hidden = dtype, model.config.hidden_size
        self._run = library.load().entry(f"decode_stack_{SUFFIXES[dtype]}")
        self._weights = tuple(self._layer_weights(layer) for layer in model.model.layers)
        norm = model.model.norm
        self._final_norm = (norm.weight, norm.eps)
        attn0, mlp0 = model.model.layers[0].self_attn, model.model.layers[0].mlp
        widths = {
            "residual": self.hidden,
            "y": self.hidden,
            "qkv": attn0.q_size + 2 * attn0.kv_size,
            "q": attn0.q_size,
            "att": attn0.q_size,
            "act": mlp0.intermediate_size,
        }
        self._buffers = {
            name: torch.empty((BUFFER_ROWS, width), dtype=dtype) for name, width in widths.items()
        }
        self._buffer_struct = DecodeBuffers(*(t.data_ptr() for t in self._buffers.values()))
        self._layers = (DecodeLayer * len(self._weights))()
        self._kv_cache: KVCache | None = None
        #: each projection's parameter table, and the weights the layer records point at
        self._parameters = [p._parameters for w in self._weights for p in (w.qkv, w.o, w.gate_up, w.down)]
        self._bound: list[torch.Tensor | None] = [None] * len(self._parameters)
        n = len(self._weights)
        self._chunks, self._threads = (I64 * n)(), (I64 * n)()
        #: layer indexes by sliding window (0: none): the attention split is computed per window
        self._by_window: dict[int, list[int]] = {}
        for i, w in enumerate(self._weights):
            self._by_window.setdefault(w.attention.options.sliding_window or 0, []).append(i)

    @staticmethod
    def _layer_weights(layer: nn.Module) -> _Weights:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm = attn.q_norm.weight if attn.qk_norm else None
        k_norm = attn.k_norm.weight if attn.qk_norm else None
        qk_eps = attn.q_norm.eps if attn.qk_norm else 0.0
        return _Weights(
            (layer.input_layernorm.weight, layer.input_layernorm.eps),
            attn.qkv_proj,
            q_norm,
            k_norm,
            qk_eps,
            attn.o_proj,
            (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps),
            mlp.gate_up_proj,
            mlp.down_proj,
            attn,
        )

    def _current_weights(self) -> list[torch.Tensor]:
        """The projections' weights as their modules hold them now (packing or a reload may
        replace a parameter; the step program reads it at each call, and so must this)."""
        return [params["weight"] for params in self._parameters]

    def _bind(self, kv_cache: KVCache) -> None:
        """Fill the layer records for ``kv_cache`` and the projections' current weights (held:
        the addresses the C reads stay valid until the next bind)."""
        self._bound = self._current_weights()
        for i, w in enumerate(self._weights):
            attn, kv = w.attention, kv_cache.layers[w.attention.layer]
            self._layers[i] = DecodeLayer(
                w.input_norm[0].data_ptr(),
                w.qkv.weight.data_ptr(),
                _ptr(w.qkv.bias),
                _ptr(w.q_norm),
                _ptr(w.k_norm),
                w.o.weight.data_ptr(),
                _ptr(w.o.bias),
                w.post_norm[0].data_ptr(),
                w.gate_up.weight.data_ptr(),
                w.down.weight.data_ptr(),
                _ptr(w.down.bias),
                kv.key.data_ptr(),
                kv.value.data_ptr(),
                w.input_norm[1],
                w.qk_eps,
                w.post_norm[1],
                attn.options.scale,
                attn.options.soft_cap or 0.0,
                attn.q_size + 2 * attn.kv_size,
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
                kv.block_size,
                attn.options.sliding_window or 0,
                w.gate_up.out_features // 2,
            )
        self._kv_cache = kv_cache

    def _tiled(self) -> bool:
        """Whether every projection still holds a tiled weight of the stack's dtype (the paired
        gate/up layout included: a repacked layer would say so through ``paired``)."""
        paired = all(w.gate_up.paired for w in self._weights)
        return paired and all(t.dim() == 1 and t.dtype == self.dtype for t in self._current_weights())

    def _takes(self, kv_cache: KVCache) -> bool:
        """Whether ``kv_cache``'s layers are what the C writes and reads: unquantized, contiguous
        pools of the model's dtype in the layout of its heads."""
        for w in self._weights:
            attn, kv = w.attention, kv_cache.layers[w.attention.layer]
            if kv.quantized or kv.key.dtype != self.dtype or kv.key.device.type != "cpu":
                return False
            if kv.key.shape[2:] != (attn.num_kv_heads, attn.head_dim):
                return False
            if not (kv.key.is_contiguous() and kv.value.is_contiguous()):
                return False
        return True

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The final hidden states ``[T, hidden]`` of a step of generated rows, or None when this
        step is not one the stack takes (the caller runs the program)."""
        tokens = x.shape[0]
        if not 0 < tokens <= BUFFER_ROWS or per_call_checks() or x.dtype != self.dtype:
            return None
        if x.device.type != "cpu":
            return None
        rows = cpu_rows.generated_rows(metadata)
        if rows is None or rows.row_seq.shape[0] != tokens:
            return None
        replaced = any(
            now is not bound for now, bound in zip(self._current_weights(), self._bound, strict=True)
        )
        if kv_cache is not self._kv_cache or replaced:
            if not (self._takes(kv_cache) and self._tiled()):
                return None
            self._bind(kv_cache)
        slots = metadata.slot_mapping
        if slots.dtype != torch.int64 or cos.dtype != self.dtype:
            return None
        if not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        for window, layers in self._by_window.items():
            w = self._weights[layers[0]].attention
            threads, chunk = cpu_rows.split_work(rows.total(window), w.num_heads, w.head_dim)
            for i in layers:
                self._threads[i], self._chunks[i] = threads, chunk
        x = x.contiguous()
        out = torch.empty_like(x)
        status = self._run(
            self._layers,
            len(self._weights),
            self._final_norm[0].data_ptr(),
            self._final_norm[1],
            ctypes.byref(self._buffer_struct),
            x.data_ptr(),
            out.data_ptr(),
            tokens,
            self.hidden,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            rows.tables.data_ptr(),
            rows.tables.shape[1],
            rows.row_seq.data_ptr(),
            rows.row_pos.data_ptr(),
            self._chunks,
            self._threads,
        )
        if status:
            raise MemoryError("a kernel of the decode stack could not allocate its workspace")
        return out


def decode_stack(model: nn.Module, dtype: torch.dtype) -> DecodeStack | None:
    """The model's C decode stack for activations of ``dtype``, or None when it has none (see
    :func:`_unsupported`)."""
    return None if _unsupported(model, dtype) is not None else DecodeStack(model, dtype)


def describe(model: nn.Module) -> str:
    """What runs the model's decode steps, for the CLI's runtime line: the C stack, or the step
    program and why."""
    why = _unsupported(model, model.model.norm.weight.dtype)
    return "C stack" if why is None else f"step program ({why})"
