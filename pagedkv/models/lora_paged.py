"""LoRA adapters read by the forward pass where they live: in their pages of the KV cache (the
compute half of S-LoRA's unified paging, with no slot tensors at all).

An adapter's weights exist once, as rows in its pages
(:class:`~pagedkv.memory.adapter_layout.AdapterLayout`: ``A``'s rank rows and ``B``'s
transposed, none straddling a KV chunk). The model keeps, per adaptable projection, only a table
of where the rows of the step's adapters are: ``offsets [max_loras, 2, shards * max_rank]``
(int64 element offsets into the KV cache tensor; ``A``'s rows, then ``B``'s), a smaller rank's
rows beyond its own -1 (zero rows the kernel neither reads nor computes). ``max_loras`` keeps
vLLM's meaning, the distinct adapters one step may run: a slot is a row of these tables, not a
copy of an adapter.

The worker points a slot at an adapter each time the plan loads it into the slot or writes it
into pages (:mod:`pagedkv.engine.worker.lora_pages`): an adapter evicted and written again
elsewhere is pointed at its new pages before any row runs with it, never read at its old ones.
A slot not pointed since its adapter's pages may have gone is refused when a step names it
(:meth:`PagedLoRA.check`). On a partial-rotary model the pages hold each ``B`` with its query and
key rows in the model's order (:meth:`PagedLoRA.in_model_order`, as the slots put them), since
the forward pass reads the rows as they are.

The rows must fit a chunk to be read in place: :func:`rows_fit` says whether a model's widest
projection row fits one (otherwise the engine computes from slots filled from the pages).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pagedkv.models.config import ModelConfig
from pagedkv.models.lora import LoRAModules, Shapes, Shards, b_rows, module_places
from pagedkv.models.lora_checkpoint import TARGETS, model_targets, projection_shapes
from pagedkv.models.lora_weights import PagedWeights


def rows_fit(config: ModelConfig, chunk: int) -> str | None:
    """None when every adapter row of ``config``'s projections fits in a KV chunk of ``chunk``
    elements (``block_size * num_kv_heads * head_dim``); else why not, naming the sizes."""
    shapes = projection_shapes(config)
    widest, name = max((max(shapes[target]), target) for target in model_targets(config))
    if widest <= chunk:
        return None
    return (
        f"{name}'s rows of {widest} elements do not fit a KV chunk of {chunk} elements "
        "(block_size * num_kv_heads * head_dim)"
    )


class ModuleRows:
    """One packed projection's table of its adapters' rows in the KV cache ``base``, and where
    each checkpoint projection sits in it (:func:`~pagedkv.models.lora.module_places`)."""

    def __init__(self, shapes: Shapes, shards: Shards, slots: int, rank: int, base: torch.Tensor) -> None:
        self.rank = rank
        self.places, columns = module_places(shapes, shards)
        offsets = torch.full((slots, 2, len(shards) * rank), -1, dtype=torch.long, device=base.device)
        self.weights = PagedWeights(base, offsets, columns, shapes[shards[0]][0])

    def point(self, slot: int, shard: str, a_at: torch.Tensor, b_at: torch.Tensor) -> None:
        """Projection ``shard``'s rank rows of slot ``slot`` at these offsets (``[r]`` each)."""
        first = self.places[shard][0] * self.rank
        offsets = self.weights.offsets[slot]
        offsets[0, first : first + a_at.shape[0]].copy_(a_at)
        offsets[1, first : first + b_at.shape[0]].copy_(b_at)


class PagedLoRA(LoRAModules):
    """The model's adapters as offset tables into ``kv_cache_data`` (the KV cache tensor they
    are paged in): :class:`ModuleRows` per projection."""

    modules: dict[tuple[int, str], ModuleRows]

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, kv_cache_data: torch.Tensor) -> None:
        self.base = kv_cache_data.view(-1)
        #: the slots pointed at an adapter's current pages
        self.pointed: set[int] = set()
        super().__init__(model, max_loras, max_rank)
        #: each target's ``B`` rows in the model's row order, where that is not the file's
        self.b_index = {
            t: index for t in model_targets(self.config) if (index := b_rows(t, self.config, {})) is not None
        }

    def in_model_order(
        self, layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    ) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Per layer ``{target: (A, B)}`` as the file holds them, with each ``B``'s rows in the
        order of the model's rows (what the pages hold)."""
        return [
            {
                t: (a, b.index_select(0, self.b_index[t]) if t in self.b_index else b)
                for t, (a, b) in layer.items()
            }
            for layer in layers
        ]

    def module(self, shapes: Shapes, shards: Shards, linear: nn.Module, like: torch.Tensor) -> ModuleRows:
        return ModuleRows(shapes, shards, self.max_loras, self.max_rank, self.base)

    def point(
        self,
        slot: int,
        layers: list[Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
        scaling: float,
    ) -> None:
        """Slot ``slot`` at an adapter's rows: per layer ``{target: (A rows, B rows)}`` element
        offsets into the cache (untargeted projections zero rows)."""
        self.clear(slot)
        for layer, targets in enumerate(layers):
            for shard, (a_at, b_at) in targets.items():
                self.modules[layer, TARGETS[shard]].point(slot, shard, a_at, b_at)
        self.scaling[slot] = scaling
        self.pointed.add(slot)

    def clear(self, slot: int) -> None:
        """Slot ``slot`` at no adapter: every row zero, and refused by :meth:`check`."""
        self.pointed.discard(slot)
        for module in self.modules.values():
            module.weights.offsets[slot].fill_(-1)
        self.scaling[slot] = 0

    def check(self, adapters: list[int]) -> None:
        stale = [slot for slot in adapters if slot not in self.pointed]
        if stale:
            raise RuntimeError(
                f"LoRA slots {stale} are not pointed at their adapters' pages "
                "(a plan's write or load was lost)"
            )
