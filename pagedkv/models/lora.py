"""The resident LoRA adapters' weights inside a model, and the op list that applies them.

Every adaptable projection of every layer gets two slot tensors, zero until an adapter is
loaded: ``a [slots, shards * max_rank, in]`` and ``b [slots, shards * max_rank, out]`` (``B``
transposed, so a slot's rows are contiguous). The packed projections hold one block of
``max_rank`` rows per checkpoint projection -- q, k, v in ``qkv_proj``, gate and up in
``gate_up_proj`` -- and each ``B`` block writes only its projection's output columns, so the
packed product of the delta is block-diagonal: each shard's ``B_s A_s x`` lands in its own
columns, as PEFT's separate q/k/v (gate/up) layers compute it. Where checkpoints fuse the
projections (Phi-3: ``qkv_proj``, ``gate_up_proj``), PEFT's adapters target the fused module --
one ``A`` over the hidden size, one ``B`` over every output row -- and the packed projection
holds one block over all its columns (vLLM's packing of such models), so a fused adapter costs
one shrink, not three. A smaller rank is zero-padded: the zeros add nothing. The scaling
(``lora_alpha / r``) is a slot's, applied per row by the step's :class:`~pagedkv.models.ops.LoRARows`.

On a tensor-parallel rank (:mod:`pagedkv.models.parallel`) the slots hold the rank's shard of
each adapter, cut as vLLM cuts it: a column-parallel projection (q/k/v, gate/up) keeps ``A``
whole and the rows of ``B`` of the rank's output rows (its heads, its gate/up rows), so each
rank adds its own output columns' delta; a row-parallel one (o, down) keeps ``A``'s columns of
the rank's input features and ``B`` whole, so each rank's delta is a partial sum added before
the all-reduce that already sums the base product -- no communication of its own. A fused
``B`` is cut into the rank's rows of each of its parts (its q rows, k rows, v rows: the order
of the rank's packed rows). On a partial-rotary model (Phi-4-mini) the loader reorders each
query and key head's rows (:func:`~pagedkv.models.rope.rotary_row_order`); ``B``'s q/k rows are
put in the same order (:func:`b_rows`), so the adapter's output adds to the rows it was trained
for. :class:`ShardCut` is that cut, in one place: the slots and, under unified paging, a rank's
adapter pages hold exactly what it gives.

:meth:`LoRAModules.wrap` turns a model's op list into the one with adapters: each adaptable
projection's op becomes a :class:`~pagedkv.models.ops.LoRAProject` or
:class:`~pagedkv.models.ops.LoRAGateUp` holding its weights (:mod:`pagedkv.models.lora_weights`),
and a step without adapter rows runs exactly the base ops. Loading reads one PEFT folder
(checked by :mod:`pagedkv.models.lora_checkpoint`) into one slot. :class:`LoRAModules` is what
the slots share with the paged form (:mod:`pagedkv.models.lora_paged`), which holds no weights
of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pagedkv.models.config import ModelConfig
from pagedkv.models.lora_checkpoint import FUSED, TARGETS, AdapterSpec, model_targets, projection_shapes
from pagedkv.models.lora_weights import LoRAWeights, SlotWeights
from pagedkv.models.ops import GateUpAct, GateUpGelu, LoRAGateUp, LoRAProject, LoRARows, Op, Project
from pagedkv.models.rope import rotary_row_order

#: the packed modules adapters adapt
_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
#: each target's ``(in_features, out_features)``; a packed module's targets
Shapes = dict[str, tuple[int, int]]
Shards = tuple[str, ...]
#: the activation method of the step's ops each gate/up op applies
_ACTIVATIONS: dict[type, str] = {GateUpAct: "silu_and_mul", GateUpGelu: "gelu_tanh_and_mul"}


def module_shards(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each packed module's targets on a model of ``config``, in their row order inside it:
    q, k, v in ``qkv_proj`` (or ``qkv_proj`` itself, where checkpoints fuse it), ..."""
    targets = model_targets(config)
    return {module: tuple(t for t in targets if TARGETS[t] == module) for module in _MODULES}


def b_rows(
    shard: str, checkpoint: ModelConfig, checkpoint_rows: dict[str, tuple[int, int]]
) -> torch.Tensor | None:
    """The rows of target ``shard``'s whole ``B`` that a slot holds, in the order of the model's
    own rows, or None for all of them in order. A fused target's parts follow one another (q, k,
    v), each cut to a column-parallel shard's ``(first row, rows)`` of that part
    (``checkpoint_rows``: its heads, its gate/up rows); on a partial-rotary model the query and key
    rows of each head are in :func:`~pagedkv.models.rope.rotary_row_order`, as the loader puts
    the base weights' rows (so the adapter's output rows land on the rows they add to)."""
    shapes = projection_shapes(checkpoint)
    parts, offset = [], 0
    for part in FUSED.get(shard, (shard,)):
        index = torch.arange(shapes[part][1])
        if checkpoint.rotary_dim is not None and part in ("q_proj", "k_proj"):
            order = rotary_row_order(checkpoint.head_dim, checkpoint.rotary_dim)
            index = index.view(-1, checkpoint.head_dim)[:, order].flatten()
        if part in checkpoint_rows:
            first, count = checkpoint_rows[part]
            index = index[first : first + count]
        parts.append(index + offset)
        offset += shapes[part][1]
    index = torch.cat(parts)
    return None if torch.equal(index, torch.arange(offset)) else index


def module_places(shapes: Shapes, shards: Shards) -> tuple[dict[str, tuple[int, int, int]], torch.Tensor]:
    """Where each target of a packed module sits: ``shard -> (block index, first output column,
    columns)`` (a fused target is the module's one block, over all its columns), and the bounds
    of each block's output columns (block ``p`` writes ``columns[p]:columns[p + 1]``, int64
    ``[shards + 1]``)."""
    places: dict[str, tuple[int, int, int]] = {}
    column = 0
    for block, name in enumerate(shards):
        width = shapes[name][1]
        places[name] = (block, column, width)
        column += width
    return places, torch.tensor([place[1] for place in places.values()] + [column])


class ShardCut:
    """Which part of each target's whole ``A`` and ``B`` a packed projection's adapter weights
    hold, and in which row order: a tensor-parallel shard's columns of ``A`` (a row-parallel
    ``linear``: its input features) and rows of ``B`` (a column-parallel one's ``checkpoint_rows``:
    its heads, its gate/up rows), ``B``'s rows in the order of the model's own rows
    (:func:`b_rows`); all of it, in order, on a whole full-rotary model. The one place an adapter
    is cut to what a model holds: the slots, and under unified paging the pages, hold exactly what
    it gives. ``checkpoint``: the whole model's config (None: a whole full-rotary model's layer)."""

    def __init__(
        self, shards: Shards, linear: nn.Module | None = None, checkpoint: ModelConfig | None = None
    ):
        # read by the names the shards of pagedkv.models.parallel give (importing them is a cycle)
        checkpoint_rows = getattr(linear, "checkpoint_rows", {})
        if checkpoint_rows and checkpoint is None:
            raise ValueError("a tensor-parallel shard's LoRA weights need the whole model's config")
        #: the rows of each target's whole ``B`` held, in their order, where that is not all of
        #: them in order (:func:`b_rows`)
        self.b_index: dict[str, torch.Tensor] = {}
        for shard in shards if checkpoint is not None else ():
            index = b_rows(shard, checkpoint, checkpoint_rows)
            if index is not None:
                self.b_index[shard] = index
        #: a row-parallel shard's ``(first column, columns)`` of ``A`` (its input features)
        first = getattr(linear, "first_column", None)
        self.a_columns = None if first is None else (first, linear.in_features)

    def __call__(self, shard: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target ``shard``'s ``a [r, in]`` and ``b [out, r]``, whole as the file holds them, cut
        (possibly views)."""
        if self.a_columns is not None:
            first, count = self.a_columns
            a = a[:, first : first + count]
        if shard in self.b_index:
            b = b.index_select(0, self.b_index[shard].to(b.device))
        return a, b


class ModuleSlots:
    """One packed projection's slot tensors, and where each of its targets sits
    (:func:`module_places`). ``linear`` (the projection) and ``checkpoint`` say which part of
    each adapter matrix the slots hold (:class:`ShardCut`, applied by :meth:`put`)."""

    def __init__(
        self,
        shapes: Shapes,
        shards: Shards,
        slots: int,
        rank: int,
        like: torch.Tensor,
        linear: nn.Module | None = None,
        checkpoint: ModelConfig | None = None,
    ) -> None:
        in_features = shapes[shards[0]][0]
        self.rank = rank
        self.cut = ShardCut(shards, linear, checkpoint)
        self.places, columns = module_places(shapes, shards)
        #: the bounds of each block's output columns, on the slots' device, where the kernels read them
        self.columns = columns.to(like.device)
        rows = len(shards) * rank
        self.a = torch.zeros((slots, rows, in_features), dtype=like.dtype, device=like.device)
        self.b = torch.zeros((slots, rows, int(self.columns[-1])), dtype=like.dtype, device=like.device)
        self.weights = SlotWeights(self.a, self.b, self.columns)

    def put(self, slot: int, shard: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Adapter matrices ``a [r, in]`` and ``b [out, r]`` of target ``shard`` (the whole
        model's, as the file holds them), cut by :attr:`cut`, into ``slot``."""
        self.place(slot, shard, *self.cut(shard, a, b))

    def place(self, slot: int, shard: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Target ``shard``'s ``a`` and ``b`` as :attr:`cut` gives them, into ``slot``."""
        block, column, width = self.places[shard]
        first, r = block * self.rank, a.shape[0]
        self.a[slot, first : first + r].copy_(a)
        self.b[slot, first : first + r, column : column + width].copy_(b.t())


class LoRAModules:
    """What both adapter forms keep per model: ``max_loras`` slots (the distinct adapters one
    step may run), each slot's scaling, and one entry per adaptable projection of every layer
    (:meth:`module`, in :attr:`modules` by ``(layer, packed module name)``), each with the
    ``weights`` its LoRA op reads. ``checkpoint``: the whole model's config when ``model`` is a
    tensor-parallel shard (its own config is the shard's); adapters are checked against it
    (:attr:`config`)."""

    def __init__(
        self, model: nn.Module, max_loras: int, max_rank: int, checkpoint: ModelConfig | None = None
    ) -> None:
        config = model.config
        #: the config adapters are read for: the whole model's
        self.config = checkpoint or config
        #: the config of what the model holds (a rank's shard's): the shapes :meth:`cut` gives
        self.local_config = config
        like = model.model.norm.weight
        shapes = projection_shapes(config)
        self.max_loras, self.max_rank = max_loras, max_rank
        #: (layer, packed module name) -> its entry; the module object's id -> the same entry
        self.modules: dict[tuple[int, str], Any] = {}
        self._by_module: dict[int, Any] = {}
        for index, layer in enumerate(model.model.layers):
            owners = {"qkv_proj": layer.self_attn, "o_proj": layer.self_attn}
            owners |= {"gate_up_proj": layer.mlp, "down_proj": layer.mlp}
            for name, shards in module_shards(config).items():
                linear = getattr(owners[name], name)
                entry = self.module(shapes, shards, linear, like)
                self.modules[index, name] = entry
                self._by_module[id(linear)] = entry
        #: each slot's scaling (``lora_alpha / r``; 0 for an empty slot)
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=like.device)

    def module(self, shapes: Shapes, shards: Shards, linear: nn.Module, like: torch.Tensor) -> Any:
        """The entry of one packed projection (its ``weights``: a :data:`LoRAWeights`; its
        ``cut``: a :class:`ShardCut` of ``linear``); ``like``: a tensor of the model's dtype and
        device."""
        raise NotImplementedError

    def cut(
        self, layer: int, shard: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s target ``shard``, whole as the file holds it, cut to what this model
        (a rank's shard, or all of it) holds (:class:`ShardCut`)."""
        return self.modules[layer, TARGETS[shard]].cut(shard, a, b)

    def rows(self, row_slots: Sequence[int], output_rows: torch.Tensor | None) -> LoRARows | None:
        """The step's :class:`LoRARows` for each row's slot (-1: base), or None when every row
        is a base row (the step runs the base ops, C decode stack and graphs included)."""
        adapters = sorted({slot for slot in row_slots if slot >= 0})
        if not adapters:
            return None
        self.check(adapters)
        device = self.scaling.device
        slot = torch.tensor(row_slots, dtype=torch.int32).to(device)
        kept = None if output_rows is None else slot.index_select(0, output_rows)
        return LoRARows(slot, self.scaling, kept, torch.tensor(adapters, dtype=torch.long).to(device))

    def check(self, adapters: list[int]) -> None:
        """Raise if a step's slots cannot be run (the slots hold whatever was loaded: no check)."""

    def wrap(self, ops: Sequence[Op]) -> tuple[Op, ...]:
        """``ops`` with every adaptable projection's op applying the step's adapters."""
        wrapped: list[Op] = []
        adapted = 0
        for op in ops:
            if isinstance(op, Project) and id(op.linear) in self._by_module:
                weights: LoRAWeights = self._by_module[id(op.linear)].weights
                linear = op.linear
                if getattr(linear, "reduce", False):  # a row-parallel shard: add before its all-reduce
                    op = LoRAProject(op, weights, linear.partial_function(), linear.tp.all_reduce)
                else:
                    op = LoRAProject(op, weights)
            elif type(op) in _ACTIVATIONS and id(op.gate_up) in self._by_module:
                weights = self._by_module[id(op.gate_up)].weights
                op = LoRAGateUp(op, op.gate_up, _ACTIVATIONS[type(op)], weights)
            adapted += isinstance(op, (LoRAProject, LoRAGateUp))
            wrapped.append(op)
        if adapted != len(self._by_module):
            raise ValueError(
                f"this model's op list runs {adapted} of its {len(self._by_module)} adaptable projections"
            )
        return tuple(wrapped)


class LoRASlots(LoRAModules):
    """``max_loras`` adapter slots over every layer of ``model`` (a Llama-family or Gemma
    model, or a tensor-parallel rank's shard of one), in the dtype and on the device of its
    norms: :class:`ModuleSlots` per projection."""

    modules: dict[tuple[int, str], ModuleSlots]

    def module(self, shapes: Shapes, shards: Shards, linear: nn.Module, like: torch.Tensor) -> ModuleSlots:
        return ModuleSlots(shapes, shards, self.max_loras, self.max_rank, like, linear, self.config)

    def read(self, spec: AdapterSpec) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """Every ``(A, B)`` of adapter ``spec``, whole, by ``(layer, target)``: read before any
        slot changes, so a file that fails to read changes nothing."""
        with safe_open(spec.weights_file, framework="pt") as tensors:
            return {
                key: (tensors.get_tensor(a), tensors.get_tensor(b)) for key, (a, b) in spec.tensors.items()
            }

    def load(
        self,
        slot: int,
        spec: AdapterSpec,
        read: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """Adapter ``spec`` into ``slot``, replacing what the slot held (untargeted projections
        zeroed), from its tensors as :meth:`read` gives them (read now if not given): a file
        that fails to read leaves the slot as it was."""
        read = self.read(spec) if read is None else read
        self.clear(slot)
        for (layer, shard), (a, b) in read.items():
            self.modules[layer, TARGETS[shard]].put(slot, shard, a, b)
        self.scaling[slot] = spec.scaling

    def clear(self, slot: int) -> None:
        for slots in self.modules.values():
            slots.a[slot].zero_()
            slots.b[slot].zero_()
        self.scaling[slot] = 0
