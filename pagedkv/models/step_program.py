"""The decoder's forward pass as one flat loop over per-layer records.

The layers are ``nn.Module`` objects so that checkpoints, tensor-parallel shards and packing
find their weights by name; running them as a module tree is another matter. A decode step
would make about ten module calls and more than a dozen attribute look-ups through
``Module.__getattr__`` (a Python function) per layer, and on the CPU each runs with cold caches:
the weights of the previous layers have just streamed through them. So every layer's weights,
norms, q/k/v layout and attention options are read once into a :class:`LayerRecord`, and the
layers run as one loop over those records, with the same ops in the same order: the hidden
states are bit for bit those of the module calls they replace.

The records never go stale: a linear layer is read through :meth:`Linear.as_function`, which
looks its weight up at each call (packing replaces it), and the norm weights are loaded in place.
A layer whose class adds work to its product (a tensor-parallel all-reduce) contributes that
work through its own ``as_function``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedkv.attention import AttentionMetadata, AttentionOptions, Backend, KVCache, attend
from pagedkv.models.decode_stack import DecodeStack, decode_stack
from pagedkv.models.layer_ops import QKVLayout, TorchOps
from pagedkv.models.linear import BUFFER_ROWS

#: a linear layer's forward as a plain function of its input (:meth:`Linear.as_function`)
LinearFunction = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ForwardBatch:
    """What every layer of one forward pass shares: the rotary ``cos``/``sin`` of the step's
    positions, the KV cache, the step's attention metadata (SGLang's ``ForwardBatch``) and the
    element-wise ops for its device and dtype."""

    ops: TorchOps
    cos: torch.Tensor
    sin: torch.Tensor
    kv_cache: KVCache
    metadata: AttentionMetadata
    #: The rows whose final hidden states the caller needs (increasing), or None for all. The
    #: other rows -- a prompt's tokens before its last -- are dropped after the last layer's
    #: attention: their keys and values are in the cache by then, and nothing reads the rest of
    #: their pass (llama.cpp's ``inp_out_ids``).
    output_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerRecord:
    """What one decoder layer's forward pass reads, captured once."""

    input_norm: tuple[torch.Tensor, float]  # (weight, eps)
    qkv: LinearFunction
    layout: QKVLayout
    kv_layer: int
    attention: AttentionOptions
    q_size: int  # query heads x head_dim: the attention output's row width
    o: LinearFunction
    post_norm: tuple[torch.Tensor, float]
    #: ``silu(gate) * up`` of the post-attention hidden states, given the step's ops
    gate_up_act: Callable[[torch.Tensor, TorchOps], torch.Tensor]
    down: LinearFunction


def _gate_up_act(gate_up: nn.Module) -> Callable[[torch.Tensor, TorchOps], torch.Tensor]:
    """The layer's gate/up activation as its projection makes it (a
    :class:`~pagedkv.models.linear.GateUpLinear`, fused when tiled), else (a tensor-parallel
    shard) its product, then ``ops.silu_and_mul``."""
    if hasattr(gate_up, "act_function"):
        return gate_up.act_function()
    project = gate_up.as_function()
    return lambda x, ops: ops.silu_and_mul(project(x))


@dataclass(frozen=True)
class StepProgram:
    """Every layer's record, the final norm and the attention backend of one model, and the C
    stack (:mod:`pagedkv.models.decode_stack`) that runs its decode steps where it can."""

    layers: tuple[LayerRecord, ...]
    final_norm: tuple[torch.Tensor, float]
    backend: Backend
    stack: DecodeStack | None = None

    @classmethod
    def of(cls, model: nn.Module) -> StepProgram:
        """The program of a :class:`~pagedkv.models.llama.LlamaForCausalLM` (or its tensor-parallel
        shard: its row-parallel layers' functions all-reduce)."""
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            record = LayerRecord(
                input_norm=(layer.input_layernorm.weight, layer.input_layernorm.eps),
                qkv=attn.qkv_proj.as_function(),
                layout=attn.layout(),
                kv_layer=attn.layer,
                attention=attn.options,
                q_size=attn.q_size,
                o=attn.o_proj.as_function(),
                post_norm=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps),
                gate_up_act=_gate_up_act(mlp.gate_up_proj),
                down=mlp.down_proj.as_function(),
            )
            layers.append(record)
        norm = model.model.norm
        stack = decode_stack(model, norm.weight.dtype)
        return cls(tuple(layers), (norm.weight, norm.eps), model.attention_backend, stack)

    def run(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The final hidden states for the embedded tokens ``x [T, hidden]`` (of the rows
        ``batch.output_rows`` only, when given).

        Layers pass vLLM's residual stream ``(x, residual)``: ``x`` is the last sublayer's
        output, not yet added, so that the add and the next RMSNorm are one fused op."""
        ops, kv_cache, metadata = batch.ops, batch.kv_cache, batch.metadata
        if self.stack is not None and batch.output_rows is None:
            hidden = self.stack.run(x, batch.cos, batch.sin, kv_cache, metadata)
            if hidden is not None:
                return hidden
        tokens = x.shape[0]
        residual = None
        last, rows = self.layers[-1], batch.output_rows  # every config has a layer
        for layer in self.layers:
            if residual is None:  # the first layer: x is the embedding
                x, residual = ops.rms_norm(x, *layer.input_norm), x
            else:
                x, residual = ops.add_rms_norm(x, residual, *layer.input_norm)
            kv = kv_cache.layers[layer.kv_layer]
            q = ops.rotary_write_kv(layer.qkv(x), layer.layout, batch.cos, batch.sin, kv, metadata)
            out = attend(q, kv, metadata, layer.attention, self.backend).reshape(tokens, layer.q_size)
            if layer is last and rows is not None:
                out, residual = out.index_select(0, rows), residual.index_select(0, rows)
            x, residual = ops.add_rms_norm(layer.o(out), residual, *layer.post_norm)
            x = layer.down(layer.gate_up_act(x, ops))
        hidden = ops.add_rms_norm(x, residual, *self.final_norm)[0]
        # a small batch's hidden states are the last down projection's kept output buffer
        # (OutputBuffer): the caller gets a copy, which the next forward pass cannot overwrite
        return hidden.clone() if hidden.shape[0] <= BUFFER_ROWS else hidden
