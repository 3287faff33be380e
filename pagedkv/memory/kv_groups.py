"""Which layers share a block table: the KV groups of a model with sliding-window layers.

vLLM v1's hybrid layout. Layers with the same attention window (``None``: full attention) form
one kind; every kind is cut into groups of ``group_size`` layers, ``group_size`` being the
smallest kind's layer count, so each group holds at most ``group_size`` layers. Layer ``j`` of
every group stores its keys and values in physical tensor ``j`` (its *slot*): a block id is one
page in each of the ``group_size`` tensors, and the group whose table holds the id owns the page
in all of them. So one pool of blocks, each ``group_size`` layers deep, serves every group, and
a sliding group's table can hand blocks back while a full group's keeps growing.

A model whose layers all attend over the whole context has no groups (None): one table, one
tensor per layer, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    """The grouping of a model's layers; group 0 is a full-attention group when there is one.

    windows: per group, the window its layers attend over (None: the whole context).
    layer_group: per layer, its group. layer_slot: per layer, its physical KV tensor.
    group_size: the physical tensors (the layers one block spans).
    """

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    group_size: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    def describe(self) -> str:
        kinds = ", ".join("full" if w is None else f"window {w}" for w in self.windows)
        return f"{self.num_groups} KV groups of {self.group_size} layers ({kinds})"


def plan_kv_groups(layer_windows: Sequence[int | None]) -> KVGroups | None:
    """The groups of layers attending over ``layer_windows`` (per layer; None: full attention),
    or None when no layer has a window (nothing to page by window)."""
    if not layer_windows or all(w is None for w in layer_windows):
        return None
    for window in layer_windows:
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ValueError(f"a layer's sliding window must be a positive integer or None, got {window!r}")
    kinds: dict[int | None, list[int]] = {}
    # Full attention first, so that group 0 is a full group whenever the model has one.
    for layer in sorted(range(len(layer_windows)), key=lambda i: layer_windows[i] is not None):
        kinds.setdefault(layer_windows[layer], []).append(layer)
    group_size = min(len(layers) for layers in kinds.values())
    windows: list[int | None] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    for window, layers in kinds.items():
        for start in range(0, len(layers), group_size):
            for slot, layer in enumerate(layers[start : start + group_size]):
                layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(window)
    return KVGroups(tuple(windows), tuple(layer_group), tuple(layer_slot), group_size)
