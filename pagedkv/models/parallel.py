"""Tensor parallelism, Megatron style as vLLM does it: each rank holds a slice of every layer.

* ``qkv_proj`` and ``gate_up_proj`` are column-parallel: each rank holds *its* query heads, its
  key/value heads and its gate/up rows (the packed weight is cut per projection, not as one
  block), so attention and the SiLU gate run on local data with no communication (the gate/up
  product fused with the SiLU, as on one device: :class:`ColumnParallelGateUp`).
* ``o_proj`` and ``down_proj`` are row-parallel: each rank multiplies its input columns and one
  all-reduce sums the partial products (two all-reduces per layer).
* A mixture of experts (:mod:`pagedkv.models.moe`) cuts every expert, and the shared one, as
  the MLP: each rank holds its gate/up rows and down columns of each; the routers are
  replicated, so every rank routes every row alike. The experts' down projections do not
  all-reduce: the block adds its weighted partial outputs (in the experts' C call on the CPU,
  as on one device: the weighted sum of partial products is the rank's partial sum) and
  all-reduces once per layer.
* The embedding and the LM head are vocabulary-parallel (:mod:`pagedkv.models.vocab_parallel`):
  each rank holds ``ceil(vocab / N)`` rows (the last rank's tail padded with zeros); the
  embedding masks ids it does not hold and all-reduces, the LM head computes its vocabulary
  slice of the sampled rows only and gathers them on rank 0.

Every layer is the single-device layer (:class:`Linear`, :class:`PackedLinear`,
:class:`~pagedkv.models.llama.Embedding`) over the rank's shard, calling the parent's forward,
so whatever kernel the parent uses the shard uses. The loader fills each shard by reading only
its slice of each checkpoint tensor (:meth:`TensorParallel.tensor_reader`).

Quantized weights (a GGUF file's blocks; a GPTQ, AWQ or compressed-tensors layer, repacked as
blocks whole before the rank keeps its slice) stay quantized on the ranks: a column-parallel
shard holds whole rows of blocks, a row-parallel one the blocks of its input columns
(:class:`QuantizedRowParallelLinear`, the same all-reduce), the embedding and the LM head their
vocabulary rows. A block never straddles two ranks, so each rank's blocks are the file's own
bytes (a checkpoint's group of 128 columns is four blocks of 32 with its scale, so a rank may
hold part of a group), and a row-parallel slice whose columns would cut a block (o_proj or
down_proj of a K-quant, 256 weights a block, split finer than that) is read dequantized
instead: that projection stays dense on every rank, and the model's description says which and
why (:meth:`TensorParallel.dense_projections`).

KV heads: each rank holds ``num_kv_heads / N`` of them, so its KV pool is 1/N of the whole and
a block id means the same block on every rank. With fewer KV heads than ranks each KV head is
replicated on ``N / num_kv_heads`` consecutive ranks, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize
from torch import nn

from pagedkv.attention import Backend
from pagedkv.models.config import ModelConfig
from pagedkv.models.families import model_class
from pagedkv.models.linear import GateUpLinear, Linear, OutputBuffer, PackedLinear
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.quantization.blocks import QuantizedWeight
from pagedkv.models.quantized import QuantizedLinear
from pagedkv.models.tensor_slice import ParallelLayer, TensorSlice
from pagedkv.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

logger = logging.getLogger(__name__)


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError naming the numbers when ``cfg`` cannot be split over ``size`` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads >= size and cfg.num_kv_heads % size:
        problems.append(f"{cfg.num_kv_heads} key/value heads")
    if cfg.num_kv_heads < size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} key/value heads (fewer than the ranks, and not a divisor)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    moe = cfg.moe
    if moe is not None and moe.expert_size % size:
        problems.append(f"expert intermediate size {moe.expert_size}")
    if moe is not None and (moe.shared_expert_size or 0) % size:
        problems.append(f"shared expert intermediate size {moe.shared_expert_size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} cannot split this {cfg.architecture}: "
            f"{', '.join(problems)} not divisible by {size}"
        )


def kv_heads_per_rank(cfg: ModelConfig, size: int) -> int:
    """KV heads each rank holds: ``num_kv_heads / size``, at least one (replicated)."""
    return max(1, cfg.num_kv_heads // size)


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's model: its heads, its intermediate rows (each expert's too), its
    vocabulary rows."""
    check_divisible(cfg, size)
    moe = cfg.moe
    if moe is not None:
        shared = None if moe.shared_expert_size is None else moe.shared_expert_size // size
        moe = dataclasses.replace(moe, expert_size=moe.expert_size // size, shared_expert_size=shared)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=kv_heads_per_rank(cfg, size),
        intermediate_size=cfg.intermediate_size // size,
        vocab_size=-(-cfg.vocab_size // size),
        moe=moe,
    )


@dataclass
class CollectiveStats:
    """Time this rank spent inside collectives (waiting for the slowest rank included)."""

    calls: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in a tensor-parallel group; builds and loads that rank's model."""

    rank: int
    size: int
    #: the process group of the ranks (None only in tests of the slicing)
    group: Any = None
    stats: CollectiveStats = field(default_factory=CollectiveStats)
    #: projection and ggml type -> why this rank holds it dense (its slice would cut blocks)
    dense: dict[str, str] = field(default_factory=dict)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        dist.all_reduce(tensor, group=self.group)
        self._count(started)
        return tensor

    def gather_columns(self, tensor: torch.Tensor, total: int) -> torch.Tensor:
        """Rank 0: every rank's ``[n, cols]`` side by side, cut to ``total`` columns; other
        ranks: their own part (unused)."""
        started = time.perf_counter()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(tensor, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        self._count(started)
        return torch.cat(parts, dim=-1)[:, :total] if parts is not None else tensor

    def _count(self, started: float) -> None:
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - started

    def build(self, cfg: ModelConfig, backend: Backend) -> LlamaForCausalLM:
        """This rank's model, uninitialised: the single-device model of :func:`shard_config`
        with its projections, embedding and LM head swapped for their parallel versions."""
        local = shard_config(cfg, self.size)
        model = model_class(cfg.architecture)(local, attention_backend=backend)
        hd = cfg.head_dim
        q_start = self.rank * local.num_heads * hd
        kv_start = self.first_kv_head(cfg) * hd
        for layer in model.model.layers:
            attn = layer.self_attn
            kv = (kv_start, attn.kv_size)
            qkv = {"q_proj": (q_start, attn.q_size), "k_proj": kv, "v_proj": kv}
            attn.qkv_proj = ColumnParallelLinear(cfg.hidden_size, qkv, bias=cfg.attention_bias)
            attn.o_proj = RowParallelLinear(attn.q_size, cfg.hidden_size, cfg.o_proj_bias, self, q_start)
            block = getattr(layer, "sparse_block", None)
            mlps = [layer.mlp] if block is None else block.mlps()
            for mlp in mlps:
                self._shard_mlp(mlp, cfg, reduce=block is None)
            if block is not None:  # the experts' partial sums are added once, by the block
                block.all_reduce = self.all_reduce
        model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self)
        model.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self)
        return model

    def _shard_mlp(self, mlp: nn.Module, cfg: ModelConfig, reduce: bool) -> None:
        """A gated MLP (Llama's, or an expert: its own checkpoint names) cut to the rank's share
        of its intermediate rows; its down projection all-reduces with ``reduce``."""
        rows = mlp.gate_up_proj.out_features // 2  # the local config's: the rank's share
        gate, up = mlp.gate_up_proj.shards
        first = self.rank * rows
        bias = mlp.gate_up_proj.bias is not None
        mlp.gate_up_proj = ColumnParallelGateUp(cfg.hidden_size, first, rows, bias, (gate, up))
        down_name = getattr(mlp, "down_name", "down_proj")
        down = RowParallelLinear(rows, cfg.hidden_size, bias, self, first, reduce)
        setattr(mlp, down_name, down)

    def first_kv_head(self, cfg: ModelConfig) -> int:
        """The first KV head this rank holds: its share of them, or, with fewer KV heads than
        ranks, the one head it holds a copy of."""
        if cfg.num_kv_heads >= self.size:
            return self.rank * cfg.num_kv_heads // self.size
        return self.rank // (self.size // cfg.num_kv_heads)  # replicated on consecutive ranks

    def checkpoint_slices(self, model: LlamaForCausalLM) -> dict[str, TensorSlice]:
        """Checkpoint tensor name -> the slice this rank loads; names absent are replicated."""
        slices: dict[str, TensorSlice] = {}
        for name, module in model.named_modules():
            if isinstance(module, ParallelLayer):
                slices.update(module.checkpoint_slices(name.rpartition(".")[0], name))
        return slices

    def tensor_reader(self, model: LlamaForCausalLM):
        """``read(name, handle)`` for the loader: this rank's slice of checkpoint tensor
        ``name`` from an open safetensors file, reading only that slice. A GGUF handle keeping
        blocks, or a quantized checkpoint's layer once the loader has repacked it, gives a
        quantized weight whole: a matrix's slice keeps its blocks where no block is cut,
        anything else is dequantized and cut."""
        slices = self.checkpoint_slices(model)

        def read(name: str, handle: Any) -> torch.Tensor | QuantizedWeight:
            piece = slices.get(name)
            if piece is None:
                return handle.get_tensor(name)
            lazy = handle.get_slice(name)
            if not isinstance(lazy, QuantizedWeight):
                return piece.read(lazy)
            kept = piece.blocks_of(lazy)
            if kept is not None:
                return kept
            if piece.blocks:
                self._held_dense(name, lazy, piece)
            return piece.cut(torch.from_numpy(dequantize(lazy.raw, lazy.qtype)))

        return read

    def _held_dense(self, name: str, weight: QuantizedWeight, piece: TensorSlice) -> None:
        projection = name.rsplit(".", 2)[-2]
        key = f"{projection} {weight.qtype.name}"
        if key not in self.dense:
            block = GGML_QUANT_SIZES[weight.qtype][0]
            self.dense[key] = f"blocks of {block} input columns, {piece.count} per rank"
            logger.info("tensor parallel: %s held dense (%s)", key, self.dense[key])

    def dense_projections(self) -> str | None:
        """What the description adds: the quantized projections this rank holds dense, and why."""
        if not self.dense:
            return None
        held = "; ".join(f"{key}: {why}" for key, why in self.dense.items())
        return f"dense on the {self.size} ranks, a block would straddle two: {held}"


class ColumnParallelLinear(PackedLinear, ParallelLayer):
    """Packed projections, each cut to the rank's rows: ``shards`` maps each checkpoint
    projection to ``(first row in the checkpoint, rows)``. Its output stays sharded."""

    def __init__(self, in_features: int, shards: dict[str, tuple[int, int]], bias: bool) -> None:
        super().__init__(in_features, {name: rows for name, (_, rows) in shards.items()}, bias)
        self.checkpoint_rows = dict(shards)

    def checkpoint_slices(self, parent: str, name: str) -> dict[str, TensorSlice]:
        params = ["weight"] + (["bias"] if self.bias is not None else [])
        return {
            f"{parent}.{shard}.{param}": TensorSlice(0, start, rows, rows, blocks=param == "weight")
            for shard, (start, rows) in self.checkpoint_rows.items()
            for param in params
        }


class ColumnParallelGateUp(GateUpLinear, ParallelLayer):
    """An MLP's (or an expert's) gate and up rows ``first .. first + rows`` of each, packed as
    the single-device :class:`GateUpLinear` packs them: tiled, in the paired layout with the
    SiLU fused, which the experts' C call also takes (:mod:`pagedkv.models.moe_native`).
    ``names``: the checkpoint's names of the gate and the up projection."""

    def __init__(self, in_features: int, first: int, rows: int, bias: bool, names: tuple[str, str]) -> None:
        super().__init__(in_features, rows, bias, names)
        self.checkpoint_rows = dict.fromkeys(names, (first, rows))

    checkpoint_slices = ColumnParallelLinear.checkpoint_slices


class _Reduced:
    """A row-parallel layer's forward and function: the parent's partial product, all-reduced
    with ``reduce`` (else left a partial sum for its owner)."""

    tp: TensorParallel
    reduce: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return self.tp.all_reduce(out) if self.reduce else out

    def as_function(self, output: OutputBuffer | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        local = super().as_function(output)
        return (lambda x: self.tp.all_reduce(local(x))) if self.reduce else local

    def partial_function(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The rank's partial product, never all-reduced: LoRA adds each row's partial adapter
        output to it before the all-reduce (:class:`~pagedkv.models.ops.LoRAProject`)."""
        return super().as_function()


class RowParallelLinear(_Reduced, Linear, ParallelLayer):
    """The rank's input columns; one all-reduce sums the partial products. Rank 0 alone holds
    the bias, so it is added once. Without ``reduce`` the output stays a partial sum, which the
    owner adds up once (an MoE block: every expert's, weighted, then one all-reduce)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TensorParallel,
        first_column: int,
        reduce: bool = True,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.first_column = first_column
        self.reduce = reduce

    def holding_blocks(self, layer: nn.Module) -> nn.Module:
        return QuantizedRowParallelLinear(layer, self.tp, self.reduce)

    def checkpoint_slices(self, parent: str, name: str) -> dict[str, TensorSlice]:
        cols = self.in_features
        slices = {f"{name}.weight": TensorSlice(1, self.first_column, cols, cols, blocks=True)}
        if self.bias is not None:
            rows = self.out_features
            slices[f"{name}.bias"] = TensorSlice(0, 0, rows, rows, zero=self.tp.rank != 0)
        return slices


class QuantizedRowParallelLinear(_Reduced, QuantizedLinear):
    """A row-parallel layer over the GGUF blocks of the rank's input columns (``layer``'s
    parts, not copied): the product of its columns, all-reduced as :class:`RowParallelLinear`'s.
    The C decode stack does not lower it (it has no all-reduce)."""

    def __init__(self, layer: QuantizedLinear, tp: TensorParallel, reduce: bool) -> None:
        parts = [(blocks, qtype) for _, _, qtype, blocks in layer.columns()]
        super().__init__(parts, layer.in_features, None if layer.bias is None else layer.bias.data)
        self.tp = tp
        self.reduce = reduce
