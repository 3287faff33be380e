"""One compact decoder for the whole Llama family: Llama, Mistral, Qwen2 and Qwen3.

They differ only in switches read from :class:`ModelConfig`: q/k/v bias (Qwen2), per-head q/k
RMSNorm (Qwen3), a sliding window (Mistral, optionally Qwen), tied embeddings, an explicit
``head_dim``. Module and parameter names mirror transformers', except that, as in vLLM, the
q/k/v projections are packed into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (one
GEMM each); the loader maps the checkpoint's ``q_proj``... tensors onto their row slices. Unlike
transformers the forward pass takes *packed* tokens of many sequences (no batch or padding
dimension) and writes keys and values only through the layer ops, reading them through
:func:`pagedkv.attention.attend`.

The modules here hold the weights under their checkpoint names; what a layer *does* is its op
list (:meth:`DecoderLayer.ops`, in the vocabulary of :mod:`pagedkv.models.ops`), built once from
the modules: the step program runs it as one flat loop, cheaper than calling the module tree,
and the C decode stack is lowered from it. The family's switches are read there and in the
modules: Qwen2's biases (in the projections), Qwen3's q/k norms (in the q/k/v layout),
Mistral's sliding window (in the attention options). The element-wise work between the matrix
multiplies (RMSNorm, rotary, the KV write, SiLU) goes through :mod:`pagedkv.models.layer_ops`:
fused C calls on the CPU, torch elsewhere. Op order and rounding mirror transformers (RMSNorm in
float32 then cast back, weight applied after the cast) so fp32 logits agree to ~1e-6."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention import AttentionMetadata, AttentionOptions, Backend, KVCache
from pagedkv.kernels.tiled_gemm import tiled_rows
from pagedkv.models import layer_ops
from pagedkv.models.config import ModelConfig
from pagedkv.models.layer_ops import QKVLayout
from pagedkv.models.linear import TORCH, GateUpLinear, Linear, LinearKernel, PackedLinear
from pagedkv.models.ops import (
    AddNorm,
    Attend,
    DecoderOps,
    ForwardBatch,
    GateUpAct,
    LoRARows,
    Op,
    Project,
    RotaryWriteKV,
)
from pagedkv.models.rope import RotaryEmbedding
from pagedkv.models.step_program import StepProgram

if TYPE_CHECKING:
    from pagedkv.models.lora import LoRAModules


class RMSNorm(nn.Module):
    """transformers' ``LlamaRMSNorm`` weight and epsilon; the arithmetic is the layer ops'."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Embedding(nn.Module):
    """Token embedding without ``nn.Embedding``'s random init (see :class:`Linear`). Its matrix
    may be the LM head's in the tiled layout (a 1-D weight, ``tie_word_embeddings``): rows are
    then read out of the tiles."""

    #: what :func:`~pagedkv.models.linear.pack_linears` asks before tiling a head tied to it
    reads_tiled_weight = True

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() == 1:
            return tiled_rows(self.weight, input_ids, self.hidden_size)
        return F.embedding(input_ids, self.weight)

    def holding_blocks(self, layer: nn.Module) -> nn.Module:
        """The module that takes this embedding's place when its matrix is kept in GGUF blocks:
        ``layer``, a :class:`~pagedkv.models.quantized.QuantizedEmbedding` of the same rows. A
        tensor-parallel shard wraps it in its own kind."""
        return layer


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        window, cap = cfg.layer_sliding_window(layer), cfg.attn_logit_softcapping
        self.options = AttentionOptions(cfg.attention_scale, window, cap)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = PackedLinear(
            cfg.hidden_size,
            {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
            bias=cfg.attention_bias,
        )
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def layout(self) -> QKVLayout:
        """The packed q/k/v output's layout, with the Qwen3 q/k norm weights when there are."""
        if not self.qk_norm:
            return QKVLayout(self.num_heads, self.num_kv_heads, self.head_dim)
        norms = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        return QKVLayout(self.num_heads, self.num_kv_heads, self.head_dim, *norms)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def ops(self) -> tuple[Op, ...]:
        """The layer's forward pass: pre-norm attention, then the gated MLP, each sublayer's
        output added to the residual by the next norm."""
        attention = attention_ops(self.self_attn, self.input_layernorm, self.post_attention_layernorm)
        return (*attention, GateUpAct(self.mlp.gate_up_proj), Project(self.mlp.down_proj))


def attention_ops(attn: Attention, input_norm: RMSNorm, post_norm: RMSNorm) -> tuple[Op, ...]:
    """A Llama layer's attention sublayer: ``input_norm`` (adding the last sublayer's output to
    the residual), attention, then ``post_norm``, which adds its output and norms the MLP's input."""
    layout = attn.layout()
    return (
        AddNorm(input_norm.weight, input_norm.eps),
        Project(attn.qkv_proj),
        RotaryWriteKV(layout, attn.layer),
        Attend(layout, attn.options, attn.layer),
        Project(attn.o_proj),
        AddNorm(post_norm.weight, post_norm.eps),
    )


class LlamaModel(nn.Module):
    """The embedding, the layers and the final norm, under the checkpoint's names; another family
    names its own ``layer_class``."""

    #: the module one layer's weights live in (built as ``layer_class(cfg, layer_index)``)
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head; ``forward`` returns final hidden states, not logits, so the
    engine can project only the rows it samples from (:meth:`compute_logits`). Another family
    subclasses it with its own ``decoder_class``, :meth:`decoder_ops` and, where they differ,
    :meth:`embed` and :meth:`compute_logits` (:mod:`pagedkv.models.gemma2`)."""

    #: the module tree holding the embedding, the layers and the final norm
    decoder_class: type[nn.Module] = LlamaModel

    def __init__(self, cfg: ModelConfig, attention_backend: Backend) -> None:
        super().__init__()
        self.config = cfg
        #: the attention kernels every layer calls (see ``pagedkv.attention.resolve_backend``)
        self.attention_backend = attention_backend
        self.model = self.decoder_class(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, cfg.rotary_dim)
        local = cfg.local_rope
        #: the sliding layers' rotary tables where their RoPE differs (Gemma 3); None: ``rotary``
        self.local_rotary = (
            None if local is None else RotaryEmbedding(local, cfg.head_dim, cfg.max_position_embeddings)
        )
        #: what the linear layers run on; set by the loader once the weights are in
        self.linear_kernel = LinearKernel(TORCH, "not packed")
        #: how the loader quantized the weights ("gptq int4, ..."); None: dense, as stored
        self.quantization: str | None = None
        #: the arithmetic of the quantized layers' products, set by the loader; None: no such layer
        self.quantized_products: str | None = None
        #: the op list as one flat loop (:mod:`pagedkv.models.step_program`), built by the first
        #: forward (after loading and packing: a tensor-parallel shard's layers are in by then)
        self.step_program: StepProgram | None = None
        #: the LoRA adapters' slots (:mod:`pagedkv.models.lora`: slot tensors, or offsets into
        #: their pages, :mod:`pagedkv.models.lora_paged`), set before the first forward; None:
        #: no adapters
        self.lora: LoRAModules | None = None

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the checkpoint ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def decoder_ops(self) -> DecoderOps:
        """Every layer's ops, then the final norm (which adds the last layer's output)."""
        norm = self.model.norm
        layers = tuple(layer.ops() for layer in self.model.layers)
        return DecoderOps(layers, (AddNorm(norm.weight, norm.eps),))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
        lora: LoRARows | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` for packed ``input_ids``/``positions`` ``[T]``, or
        ``[R, hidden]`` of the rows ``output_rows [R]`` (increasing), which saves the last
        layer's projections for the others (see :class:`ForwardBatch`); ``lora``: the rows'
        adapters (:attr:`lora`'s :meth:`~pagedkv.models.lora.LoRAModules.rows`)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must be 1-D and equally long, got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        x = self.embed(input_ids)
        batch = self.forward_batch(x, positions, kv_cache, metadata, output_rows)
        if lora is not None:
            batch = dataclasses.replace(batch, lora=lora)
        if self.step_program is None:
            self.step_program = StepProgram.of(self)
        return self.step_program.run(x, batch)

    def forward_batch(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None,
    ) -> ForwardBatch:
        """What every op of the step shares, for the embedded tokens ``x``: with the sliding
        layers' own ``cos``/``sin`` where they have them."""
        cos, sin = self.rotary.cos_sin(positions, x.dtype, metadata.max_seq_len)
        local_cos = local_sin = None
        if self.local_rotary is not None:
            local_cos, local_sin = self.local_rotary.cos_sin(positions, x.dtype, metadata.max_seq_len)
        ops, backend = layer_ops.select(x), self.attention_backend
        return ForwardBatch(ops, cos, sin, kv_cache, metadata, backend, output_rows, local_cos, local_sin)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states the first layer reads for ``input_ids [T]``."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` for hidden states ``[N, hidden]``."""
        return self.lm_head(hidden).float()
