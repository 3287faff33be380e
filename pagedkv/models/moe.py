"""Mixture-of-Experts families: Mixtral, Qwen2-MoE and Qwen3-MoE, the Llama layer with a sparse MLP.

Attention is Llama's (Qwen2-MoE's q/k/v biases and Qwen3-MoE's q/k norms are the same switches
as Qwen2's and Qwen3's); the MLP of a sparse layer is a router and ``num_experts`` gated SiLU
MLPs, of which each token runs its ``top_k`` (:class:`~pagedkv.models.moe_config.MoeConfig`).
The routing follows transformers' ``*TopKRouter`` for each family: a softmax over every expert in
float32, the ``top_k`` largest probabilities, divided by their sum where the family renormalises
(Mixtral always, Qwen with ``norm_topk_prob``), and the expert outputs summed weighted by them.
Qwen2-MoE adds a shared expert every token runs, its output scaled by
``sigmoid(shared_expert_gate(x))``; Qwen's ``mlp_only_layers`` / ``decoder_sparse_step`` layers
keep Llama's dense MLP.

The experts run grouped by expert, as vLLM's fused MoE and llama.cpp's ``mul_mat_id`` do: the
step's (row, expert) assignments are sorted by expert, and each expert with rows multiplies
them in one gate/up and one down product, so a batch reads each active expert's weights once
(not once per token), and an expert no row chose is not read at all. The weighted products are
added back into their rows expert by expert in increasing expert order, as transformers' loop
adds them, so float32 sums round alike. Every expert is a packed gate/up projection and a down
projection (:class:`~pagedkv.models.linear.GateUpLinear`, :class:`~pagedkv.models.linear.Linear`)
and runs on whatever kernel those run on: tiled with the fused SiLU on the CPU.

Module names are the checkpoint's (Mixtral: ``block_sparse_moe.gate``,
``block_sparse_moe.experts.N.w1/w3/w2``; Qwen: ``mlp.gate``,
``mlp.experts.N.gate_proj/up_proj/down_proj``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate``), as ``save_pretrained`` writes them, so the loader fills them as it
fills Llama. On the CPU, with the weights tiled, the routed experts are one call into C
(:mod:`pagedkv.models.moe_native`), in the step program and in the C decode stack alike.

Tensor parallelism cuts every expert (the shared one too) as it cuts Llama's MLP, each rank
holding its share of the intermediate rows, as vLLM's fused MoE does; the router is replicated,
so every rank routes every row alike. A rank's weighted expert outputs are partial sums, and one
all-reduce per layer adds them (not one per expert); on the CPU the rank's experts run in the
same C call as on one device, its output the rank's partial sum. The C decode stack, which has no
all-reduce, leaves a rank's steps to the step program.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedkv.kernels.signatures import DecodeCode
from pagedkv.models.config import ModelConfig
from pagedkv.models.linear import GateUpLinear, Linear, OutputBuffer
from pagedkv.models.llama import MLP, Attention, LlamaForCausalLM, LlamaModel, RMSNorm, attention_ops
from pagedkv.models.moe_config import MoeConfig
from pagedkv.models.moe_native import expert_rows, flags, native_experts, weight_table
from pagedkv.models.ops import ForwardBatch, GateUpAct, Op, Project, Stream

#: a gated MLP's checkpoint names: (gate, up, down)
QWEN_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_NAMES = ("w1", "w3", "w2")


class ExpertMLP(nn.Module):
    """One expert: a gated SiLU MLP of ``size`` intermediate rows under its checkpoint ``names``
    (gate, up, down): the gate and up projections packed into one GEMM."""

    def __init__(self, hidden: int, size: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        gate, up, down = names
        self.gate_up_proj = GateUpLinear(hidden, size, bias=False, names=(gate, up))
        self.down_name = down
        self.add_module(down, Linear(size, hidden, bias=False))

    def ops(self) -> tuple[GateUpAct, Project]:
        """``silu(gate) * up``, then the down projection (a Llama MLP's two ops)."""
        return GateUpAct(self.gate_up_proj), Project(getattr(self, self.down_name))


class Router(Linear):
    """A router: one logit per expert (or the shared expert's one gate logit). Kept in the
    checkpoint's precision by on-the-fly quantization, as llama.cpp keeps ``ffn_gate_inp``: a
    small error in a logit can pick another expert."""

    keeps_precision = True


class SparseMoeBlock(nn.Module):
    """A sparse layer's MLP: the router ``gate`` (one logit per expert), the routed experts and,
    with ``moe.shared_expert_size``, the shared expert and its one-logit ``shared_expert_gate``."""

    def __init__(self, cfg: ModelConfig, moe: MoeConfig, names: tuple[str, str, str]) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.gate = Router(hidden, moe.num_experts, bias=False)
        experts = (ExpertMLP(hidden, moe.expert_size, names) for _ in range(moe.num_experts))
        self.experts = nn.ModuleList(experts)
        if moe.shared_expert_size is not None:
            self.shared_expert = ExpertMLP(hidden, moe.shared_expert_size, QWEN_NAMES)
            self.shared_expert_gate = Router(hidden, 1, bias=False)
        #: on a tensor-parallel rank, the all-reduce that adds the ranks' partial outputs
        #: (set by :meth:`~pagedkv.models.parallel.TensorParallel.build`); None: one device
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def mlps(self) -> list[ExpertMLP]:
        """Every expert, the shared one last."""
        shared = [self.shared_expert] if hasattr(self, "shared_expert") else []
        return [*self.experts, *shared]


def _run_mlp(ops: tuple[GateUpAct, Project], x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """An expert's output for its rows ``x``."""
    act, down = ops
    return down.run(act.run(x, None, batch)[0], None, batch)[0]


def route(logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``top_k`` experts ``[T, k]`` (int64) and their weights ``[T, k]`` for router
    ``logits [T, E]``: transformers' softmax in float32, top-k, renormalisation where ``moe``
    asks; the weights stay float32 (Mixtral) or are rounded to the logits' dtype (Qwen)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(moe.top_k, dim=-1)
    if moe.renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    if not moe.float32_weights:
        weights = weights.to(logits.dtype)
    return experts, weights


@dataclass(frozen=True, eq=False)
class RouteExperts(Op):
    """A sparse MLP on the normed hidden states ``x``: route each row to its experts, run each
    expert once over the rows that chose it, and sum the weighted outputs per row (plus the
    gated shared expert, when the block has one); the MLP's output ``[T, hidden]`` out."""

    block: SparseMoeBlock
    moe: MoeConfig
    router: Project = field(init=False, repr=False)
    experts: tuple[tuple[GateUpAct, Project], ...] = field(init=False, repr=False)
    shared: tuple[Project, tuple[GateUpAct, Project]] | None = field(init=False, repr=False)
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        block = self.block
        object.__setattr__(self, "router", Project(block.gate))
        object.__setattr__(self, "experts", tuple(expert.ops() for expert in block.experts))
        shared = None
        if self.moe.shared_expert_size is not None:
            shared = Project(block.shared_expert_gate), block.shared_expert.ops()
        object.__setattr__(self, "shared", shared)
        object.__setattr__(self, "all_reduce", block.all_reduce)
        # the experts run one after another, each one's output weighted into a new tensor
        # before the next starts: one gate/up and one down output serve them all
        first_act, first_down = self.experts[0]
        for act, down in [*self.experts[1:], *([shared[1]] if shared else [])]:
            act.output.share(first_act.output)
            down.output.share(first_down.output)

    def kept_outputs(self) -> tuple[OutputBuffer, ...]:
        """The router's output, the experts' shared gate/up and down outputs, the shared
        expert's gate's."""
        gate = () if self.shared is None else (self.shared[0].output,)
        return (self.router.output, self.experts[0][0].output, self.experts[0][1].output, *gate)

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> Stream:
        out = native_experts(x, self.block, self.moe)  # the routed and the shared experts, in C
        if out is None:
            experts, weights = route(self.router.run(x, None, batch)[0], self.moe)
            out = self.grouped(x, experts, weights, batch)
            if self.shared is not None:
                gate, mlp = self.shared
                scale = torch.sigmoid(gate.run(x, None, batch)[0])
                out = out + scale * _run_mlp(mlp, x, batch)
        if self.all_reduce is not None:  # a rank's experts hold its share of their rows
            out = self.all_reduce(out)
        return out, residual

    def decode_lowering(self, low: Any) -> str | None:
        """The C decode stack's record of the routed experts (the kernel the CPU program calls:
        :mod:`pagedkv.models.moe_native`), reading the weights through ``low`` (the stack's
        lowering state), or why there is none."""
        if self.all_reduce is not None:
            return "tensor-parallel shards"
        table = weight_table(self.block, low.dtype, low.tiled)
        if table is None:
            return "experts not on the tiled kernel"
        low.held.append(table)
        moe, width = self.moe, low.widths[low.current]
        fields = {"experts": moe.num_experts, "top_k": moe.top_k, "moe_flags": flags(moe)}
        fields["expert_rows"], fields["shared_rows"] = expert_rows(self.block)
        low.emit(DecodeCode.MOE_EXPERTS, width, weight=ctypes.addressof(table), n_in=width, **fields)
        return None

    def grouped(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """``sum_j weights[t, j] * expert[experts[t, j]](x[t])`` for every row ``t``: the
        assignments sorted by expert (stable: rows stay in order), each expert's rows gathered
        and run in one call, the weighted products added into their rows in expert order."""
        top_k = experts.shape[1]
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows = order // top_k
        sorted_weights = weights.flatten()[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                mine = rows[start : start + count]
                y = _run_mlp(expert, x.index_select(0, mine), batch)
                out.index_add_(0, mine, (y * sorted_weights[start : start + count]).to(x.dtype))
            start += count
        return out


class MoeDecoderLayer(nn.Module):
    """Llama's pre-norm layer whose MLP is a :class:`SparseMoeBlock` (under Mixtral's name
    ``block_sparse_moe`` or Qwen's ``mlp``), or Llama's dense MLP on a Qwen dense layer."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ValueError(f"{cfg.architecture} has no mixture of experts in its config")
        self.self_attn = Attention(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = moe
        self.sparse = moe.sparse(layer)
        mixtral = cfg.architecture == "MixtralForCausalLM"
        self.block_name = "block_sparse_moe" if mixtral else "mlp"
        if self.sparse:
            names = MIXTRAL_NAMES if mixtral else QWEN_NAMES
            self.add_module(self.block_name, SparseMoeBlock(cfg, moe, names))
        else:
            self.mlp = MLP(cfg)

    @property
    def sparse_block(self) -> SparseMoeBlock | None:
        """The layer's mixture of experts; None on a dense layer."""
        return getattr(self, self.block_name) if self.sparse else None

    def ops(self) -> tuple[Op, ...]:
        """Llama's attention ops, then the routed experts (or Llama's dense MLP ops)."""
        attention = attention_ops(self.self_attn, self.input_layernorm, self.post_attention_layernorm)
        if not self.sparse:
            return (*attention, GateUpAct(self.mlp.gate_up_proj), Project(self.mlp.down_proj))
        return (*attention, RouteExperts(self.sparse_block, self.moe))


class MoeModel(LlamaModel):
    layer_class = MoeDecoderLayer


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral's, Qwen2-MoE's or Qwen3-MoE's decoder plus the LM head, run as
    :class:`LlamaForCausalLM` runs its op list."""

    decoder_class = MoeModel
