"""Gemma 2 and Gemma 3 (text): the Llama decoder's attention and MLP modules in Gemma's layer.

What differs from :mod:`pagedkv.models.llama`, each where transformers' ``Gemma2ForCausalLM``
has it: four RMSNorms a layer (a "sandwich": the attention and MLP outputs are normed before
they are added to the residual), each ``rmsnorm(x) * (1 + weight)`` rounded once in float32
(:class:`~pagedkv.models.ops.OffsetNorm`); a GeGLU MLP (``gelu_pytorch_tanh``,
:class:`~pagedkv.models.ops.GateUpGelu`); the embedding scaled by ``sqrt(hidden_size)`` rounded
to the hidden dtype; attention scaled by ``query_pre_attn_scalar ** -0.5`` with soft-capped
scores, sliding on every other layer (both in the attention options, from
:class:`~pagedkv.models.config.ModelConfig`); soft-capped logits; tied embeddings. Module and
parameter names are the checkpoint's, so the loader fills it as it fills Llama. Every op has a C
form (:mod:`pagedkv.models.decode_gemma`: the C decode stack runs its decode steps); the
embedding scale and the logit soft-cap are outside the layers (:meth:`Gemma2ForCausalLM.embed`,
:meth:`Gemma2ForCausalLM.compute_logits`).

Gemma 3 is the same layer with switches, as Qwen3 is Llama's: q/k norms (``1 + weight``, in the
q/k/v layout), no soft-caps, five sliding layers to one full, and the sliding layers' own RoPE
base (``rope_local_base_freq``: a second rotary table, the batch's ``local_cos``/``local_sin``).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv.models.config import ModelConfig
from pagedkv.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm
from pagedkv.models.ops import (
    Attend,
    DecoderOps,
    GateUpGelu,
    OffsetNorm,
    Op,
    Project,
    RotaryWriteKV,
)


class Gemma2DecoderLayer(DecoderLayer):
    """Llama's layer with a norm after each sublayer too (the sandwich)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        #: whether the layer rotates by the sliding layers' own RoPE (Gemma 3's local one)
        self.local_rope = cfg.local_rope is not None and cfg.layer_sliding_window(layer) is not None

    def ops(self) -> tuple[Op, ...]:
        """Pre- and post-norm attention, then pre- and post-norm GeGLU; a sublayer's normed
        output is added to the residual by the next adding norm."""
        attn, mlp = self.self_attn, self.mlp
        layout = attn.layout()
        if layout.q_norm is not None:  # Gemma 3's q/k norms are Gemma's 1 + weight norms
            layout = dataclasses.replace(layout, offset=True)
        return (
            _norm(self.input_layernorm, add=True),
            Project(attn.qkv_proj),
            RotaryWriteKV(layout, attn.layer, self.local_rope),
            Attend(layout, attn.options, attn.layer),
            Project(attn.o_proj),
            _norm(self.post_attention_layernorm, add=False),
            _norm(self.pre_feedforward_layernorm, add=True),
            GateUpGelu(mlp.gate_up_proj),
            Project(mlp.down_proj),
            _norm(self.post_feedforward_layernorm, add=False),
        )


def _norm(norm: RMSNorm, add: bool) -> OffsetNorm:
    return OffsetNorm(norm.weight, norm.eps, add)


class Gemma2Model(LlamaModel):
    layer_class = Gemma2DecoderLayer


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2's (and Gemma 3's) decoder plus the (tied) LM head, run as
    :class:`LlamaForCausalLM` runs its op list (which also builds Gemma 3's local rotary)."""

    decoder_class = Gemma2Model

    def decoder_ops(self) -> DecoderOps:
        """Every layer's ops, then the final norm (which adds the last layer's output)."""
        layers = tuple(layer.ops() for layer in self.model.layers)
        return DecoderOps(layers, (_norm(self.model.norm, add=True),))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding times ``sqrt(hidden_size)``, that factor first rounded to the hidden
        dtype (transformers' ``normalizer``: 55.5, not 55.43, for 3072 in bfloat16)."""
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]``, soft-capped in the hidden dtype as transformers caps."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
