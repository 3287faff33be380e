"""The vocabulary a decoder's forward pass is written in: one small op per step of a layer.

A model family lists each layer's ops once, from its config and its modules (for the Llama
family: :func:`pagedkv.models.llama.decoder_ops`), as llama.cpp builds a graph once. That list is
the forward pass: :class:`~pagedkv.models.step_program.StepProgram` runs it in torch, one loop
over the ops, and :mod:`pagedkv.models.decode_stack` lowers the same list to the records its C
loop runs. A new family, a new weight kind or a new op is written here and in those two places,
never as a third copy of the layer.

Every op passes vLLM's residual stream ``(x, residual)`` on: ``x`` is what the last op made (the
hidden states, a projection's output, the rotated queries, the attention output), ``residual``
the running sum of the sublayer outputs, None until the first :class:`AddNorm` starts it. Ops
hold their modules and weights and read a projection's weight at each call (packing or a reload
replaces it; :meth:`~pagedkv.models.linear.Linear.as_function`); norm weights are loaded in
place. The element-wise work goes through the step's ops object (:mod:`pagedkv.models.layer_ops`:
fused C on the CPU, torch elsewhere), so an op rounds as that reference does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pagedkv.attention import AttentionMetadata, AttentionOptions, Backend, KVCache, attend
from pagedkv.models.layer_ops import QKVLayout, TorchOps
from pagedkv.models.linear import OutputBuffer
from pagedkv.models.lora_weights import LoRAWeights

#: the residual stream between two ops: ``(x, residual)``
Stream = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class ForwardBatch:
    """What every op of one forward pass shares: the rotary ``cos``/``sin`` of the step's
    positions, the KV cache, the step's attention metadata (SGLang's ``ForwardBatch``), the
    attention backend and the element-wise ops for its device and dtype."""

    ops: TorchOps
    cos: torch.Tensor
    sin: torch.Tensor
    kv_cache: KVCache
    metadata: AttentionMetadata
    backend: Backend
    #: The rows whose final hidden states the caller needs (increasing), or None for all. The
    #: other rows -- a prompt's tokens before its last -- are dropped after the last layer's
    #: attention (:class:`KeepRows`): their keys and values are in the cache by then, and
    #: nothing reads the rest of their pass (llama.cpp's ``inp_out_ids``).
    output_rows: torch.Tensor | None = None
    #: the sliding layers' own rotary ``cos``/``sin`` where their RoPE differs (Gemma 3)
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None
    #: The step's rows' LoRA adapters; None: every row runs the base model.
    lora: LoRARows | None = None


@dataclass(frozen=True)
class LoRARows:
    """Which adapter slot each row of a step runs with: ``slot [T]`` (int32, -1 for a base row),
    ``kept`` the same for the rows :class:`KeepRows` keeps (None when it keeps all), each slot's
    factor ``scaling [slots]`` (float32: the adapter's ``lora_alpha / r``) and ``adapters``, the
    step's distinct slots (int64, increasing).

    :meth:`add` is Punica's BGMV: each row times its own slot's ``A``, scaled, times its
    ``B``, added to the row's output; a base row gets exactly nothing. The projection's weights
    say where the adapters are and how the product runs (:mod:`pagedkv.models.lora_weights`):
    on the CPU one call of the C kernel, whose work is the rows' own adapters' products -- the C
    decode stack calls the same kernel on the same data."""

    slot: torch.Tensor
    scaling: torch.Tensor
    kept: torch.Tensor | None = None
    adapters: torch.Tensor | None = None

    def add(self, x: torch.Tensor, weights: LoRAWeights, out: torch.Tensor) -> torch.Tensor:
        """``out [T, out]`` plus the rows' adapter outputs for ``x [T, in]`` (in place where it
        can), from a projection's adapter ``weights``."""
        slot = self.slot if x.shape[0] == self.slot.shape[0] or self.kept is None else self.kept
        return weights.add(x, slot, self.scaling, self.adapters, out)


class Op:
    """One step of the forward pass: ``run`` maps the stream to the next one."""

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> Stream:
        raise NotImplementedError

    def kept_outputs(self) -> tuple[OutputBuffer, ...]:
        """The outputs this op keeps between calls (:class:`~pagedkv.models.linear.OutputBuffer`),
        in a fixed order: the same op of another layer shares them
        (:meth:`DecoderOps.share_outputs`)."""
        return ()


@dataclass(frozen=True, eq=False)
class AddNorm(Op):
    """``x + residual`` becomes the residual and ``x`` its RMSNorm (one fused op); with no
    residual yet (the first layer) ``x`` itself, the embedding, becomes it."""

    weight: torch.Tensor
    eps: float

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> Stream:
        if residual is None:
            return batch.ops.rms_norm(x, self.weight, self.eps), x
        return batch.ops.add_rms_norm(x, residual, self.weight, self.eps)


@dataclass(frozen=True, eq=False)
class Project(Op):
    """``x`` through a linear layer, by its :meth:`~pagedkv.models.linear.Linear.as_function`
    (a tensor-parallel shard's all-reduces there)."""

    linear: nn.Module
    output: OutputBuffer = field(default_factory=OutputBuffer, repr=False)
    project: Callable[[torch.Tensor], torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "project", self.linear.as_function(self.output))

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> Stream:
        return self.project(x), residual

    def kept_outputs(self) -> tuple[OutputBuffer, ...]:
        return (self.output,)


@dataclass(frozen=True, eq=False)
class RotaryWriteKV(Op):
    """The packed q/k/v projection ``x`` in: rotary (after the optional per-head q/k norms) on q
    and k, k and v written into the layer's KV slots; the queries ``[T, Hq, D]`` out. ``local``:
    by the batch's ``local_cos``/``local_sin`` (a sliding layer of Gemma 3)."""

    layout: QKVLayout
    kv_layer: int
    local: bool = False

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> Stream:
        kv = batch.kv_cache.layers[self.kv_layer]
        cos, sin = (batch.local_cos, batch.local_sin) if self.local else (batch.cos, batch.sin)
        metadata = batch.metadata.of_group(kv.group)
        return batch.ops.rotary_write_kv(x, self.layout, cos, sin, kv, metadata), residual


@dataclass(frozen=True, eq=False)
class Attend(Op):
    """The queries ``x`` attend the layer's cached keys and values on the step's backend; the
    output ``[T, Hq * D]`` out."""

    layout: QKVLayout
    options: AttentionOptions
    kv_layer: int

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> Stream:
        kv = batch.kv_cache.layers[self.kv_layer]
        out = attend(x, kv, batch.metadata.of_group(kv.group), self.options, batch.backend)
        return out.reshape(x.shape[0], self.layout.num_heads * self.layout.head_dim), residual


@dataclass(frozen=True, eq=False)
class KeepRows(Op):
    """The stream's rows ``batch.output_rows`` only (all when None). The program puts it after
    the last layer's attention, whose KV write needed every row."""

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> Stream:
        rows = batch.output_rows
        if rows is None:
            return x, residual
        return x.index_select(0, rows), residual.index_select(0, rows)


@dataclass(frozen=True, eq=False)
class GateUpAct(Op):
    """``silu(gate) * up`` of ``x`` by the gate/up projection: fused into a paired tiled GEMM
    (:meth:`~pagedkv.models.linear.GateUpLinear.act_function`), else (a tensor-parallel shard)
    its product, then the step's ``silu_and_mul``."""

    gate_up: nn.Module
    output: OutputBuffer = field(default_factory=OutputBuffer, repr=False)
    act: Callable[[torch.Tensor, TorchOps], torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if hasattr(self.gate_up, "act_function"):
            act = self.gate_up.act_function(self.output)
        else:
            project = self.gate_up.as_function(self.output)

            def act(x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
                return ops.silu_and_mul(project(x))

        object.__setattr__(self, "act", act)

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> Stream:
        return self.act(x, batch.ops), residual

    def kept_outputs(self) -> tuple[OutputBuffer, ...]:
        return (self.output,)


@dataclass(frozen=True, eq=False)
class OffsetNorm(Op):
    """Gemma's RMSNorm ``rmsnorm(x) * (1 + weight)``, all in float32 and cast back once
    (transformers' ``Gemma2RMSNorm``). The weight is applied before the cast, not after it as in
    :class:`AddNorm`, so folding ``1 + weight`` into an :class:`AddNorm` would round otherwise in
    bfloat16. With ``add``, ``x + residual`` first becomes the residual (with no residual yet,
    ``x`` itself: the scaled embedding), as in :class:`AddNorm`; without, the residual passes on
    untouched (the norm of a sublayer's output, before it is added)."""

    weight: torch.Tensor
    eps: float
    add: bool

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> Stream:
        if not self.add:
            return batch.ops.offset_rms_norm(x, self.weight, self.eps), residual
        # x is a fresh norm output (or the embedding), so adding into it loses nothing
        residual = x if residual is None else x.add_(residual)
        return batch.ops.offset_rms_norm(residual, self.weight, self.eps), residual


@dataclass(frozen=True, eq=False)
class GateUpGelu(Op):
    """``gelu_tanh(gate) * up`` of ``x`` by the gate/up projection (Gemma's GeGLU, transformers'
    ``gelu_pytorch_tanh``): the packed product, then the step's ``gelu_tanh_and_mul``."""

    gate_up: nn.Module
    output: OutputBuffer = field(default_factory=OutputBuffer, repr=False)
    project: Callable[[torch.Tensor], torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "project", self.gate_up.as_function(self.output))

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> Stream:
        return batch.ops.gelu_tanh_and_mul(self.project(x)), residual

    def kept_outputs(self) -> tuple[OutputBuffer, ...]:
        return (self.output,)


@dataclass(frozen=True, eq=False)
class LoRAProject(Op):
    """``base`` (a :class:`Project`), plus each row's adapter output when the step has adapter
    rows; ``weights``: the projection's adapters (slot tensors or pages, :class:`LoRARows`).

    A row-parallel tensor-parallel shard gives ``partial`` (its product, not all-reduced) and
    ``reduce`` (the all-reduce): its slots hold ``A``'s columns of the rank's input features,
    so each rank's adapter output is a partial sum too, added before the one all-reduce, whose
    sum over the ranks is the whole adapter output."""

    base: Project
    weights: LoRAWeights
    partial: Callable[[torch.Tensor], torch.Tensor] | None = None
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> Stream:
        if batch.lora is None:
            return self.base.run(x, residual, batch)
        if self.partial is None or self.reduce is None:
            out, residual = self.base.run(x, residual, batch)
            return batch.lora.add(x, self.weights, out), residual
        return self.reduce(batch.lora.add(x, self.weights, self.partial(x))), residual


@dataclass(frozen=True, eq=False)
class LoRAGateUp(Op):
    """A gate/up op (``base``: :class:`GateUpAct` or :class:`GateUpGelu`) with adapters: with
    adapter rows in the step, the packed product first, each row's adapter output added to it,
    then the activation ``activation`` (a method of the step's ops); else ``base`` as it is."""

    base: Op
    gate_up: nn.Module
    activation: str
    weights: LoRAWeights
    project: Callable[[torch.Tensor], torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "project", self.gate_up.as_function())

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> Stream:
        if batch.lora is None:
            return self.base.run(x, residual, batch)
        product = batch.lora.add(x, self.weights, self.project(x))
        return getattr(batch.ops, self.activation)(product), residual


@dataclass(frozen=True)
class DecoderOps:
    """A decoder's forward pass as ops: each layer's, then the final ones (the final norm)."""

    layers: tuple[tuple[Op, ...], ...]
    final: tuple[Op, ...]

    def sequence(self) -> tuple[Op, ...]:
        """Every op in order, with :class:`KeepRows` after the last layer's last attention
        (the layers' end when it has none); the layers' kept outputs shared
        (:meth:`share_outputs`)."""
        self.share_outputs()
        *body, last = self.layers
        attends = [i for i, op in enumerate(last) if isinstance(op, Attend)]
        cut = attends[-1] + 1 if attends else len(last)
        flat = [op for layer in body for op in layer]
        return (*flat, *last[:cut], KeepRows(), *last[cut:], *self.final)

    def share_outputs(self) -> None:
        """Op ``j`` of every layer keeps its outputs in op ``j`` of the first layer of its kind
        (same op type, as many kept outputs): one layer's outputs for the whole model.

        Safe because a kept output never outlives its layer's next op of the same position:
        each op's output is read by the ops after it in the same layer (the last one's by the
        next layer's first norm), and the residual is never a kept output -- the norms add into
        the residual, which is the embedding's tensor (:class:`AddNorm`), or a fresh norm's
        output (:class:`OffsetNorm`)."""
        first: dict[tuple[int, type, int], Op] = {}
        for layer in self.layers:
            for j, op in enumerate(layer):
                kept = op.kept_outputs()
                owner = first.setdefault((j, type(op), len(kept)), op)
                for mine, theirs in zip(kept, owner.kept_outputs(), strict=True):
                    if mine is not theirs:
                        mine.share(theirs)
