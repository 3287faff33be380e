"""Where a LoRA adapter's weights sit in its pages of the KV block pool.

A block id is, in every layer, a slab of ``2 * block_size * num_kv_heads * head_dim`` elements of
the KV cache: the block's key chunk then its value chunk (:func:`slab_elements`). An adapter's
layer-``l`` weights are laid end to end over the layer-``l`` slabs of its pages, in page order:
for each target module (``q_proj``, ``down_proj``, ...) its ``A`` (``[rank, in_features]``) then
its ``B`` (``[out_features, rank]``), row-major. The layout records each one's offset and shape; it
is the same on the control plane (which needs only :meth:`AdapterLayout.pages`) and on the worker
(which moves the bytes, :mod:`pagedkv.attention.adapter_slabs`).

Pure Python: shapes are tuples of ints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod

Shape = tuple[int, int]


def slab_elements(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Elements one block id holds in one layer: its keys and its values."""
    return 2 * block_size * num_kv_heads * head_dim


@dataclass(frozen=True)
class TargetSlot:
    """One target module's ``A`` and ``B`` in a layer's flattened pages."""

    target: str
    a_offset: int
    a_shape: Shape
    b_offset: int
    b_shape: Shape

    @property
    def end(self) -> int:
        """The element just past ``B``."""
        return self.b_offset + prod(self.b_shape)


@dataclass(frozen=True)
class AdapterLayout:
    """Each layer's target slots, in the order they were given; ``layers[l]`` may be empty (a
    layer the adapter leaves alone)."""

    layers: tuple[tuple[TargetSlot, ...], ...]

    @classmethod
    def of(cls, shapes: Sequence[Mapping[str, tuple[Shape, Shape]]]) -> AdapterLayout:
        """The layout of per-layer ``{target: (a_shape, b_shape)}``: ``A`` is ``[rank, in]``,
        ``B`` is ``[out, rank]`` with the same rank."""
        layers = []
        for index, targets in enumerate(shapes):
            slots, offset = [], 0
            for target, (a_shape, b_shape) in targets.items():
                a, b = _checked(index, target, "A", a_shape), _checked(index, target, "B", b_shape)
                if a[0] != b[1]:
                    raise ValueError(
                        f"LoRA layer {index} target {target!r}: A {a} has rank {a[0]} "
                        f"but B {b} has rank {b[1]}"
                    )
                slot = TargetSlot(target, offset, a, offset + prod(a), b)
                slots.append(slot)
                offset = slot.end
            layers.append(tuple(slots))
        return cls(tuple(layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_elements(self, layer: int) -> int:
        """Elements the layer's weights take (0 for a layer without targets)."""
        slots = self.layers[layer]
        return slots[-1].end if slots else 0

    def pages(self, slab: int) -> int:
        """Block ids the adapter needs: its largest layer's elements in slabs of ``slab``."""
        if slab <= 0:
            raise ValueError(f"a slab holds a positive number of elements, got {slab}")
        largest = max((self.layer_elements(i) for i in range(self.num_layers)), default=0)
        return max(1, -(-largest // slab))


def _checked(layer: int, target: str, name: str, shape: object) -> Shape:
    """``shape`` as a 2-tuple of positive ints, or a ValueError naming where it belongs."""
    dims = tuple(shape) if isinstance(shape, Sequence) else ()
    if len(dims) != 2 or not all(isinstance(d, int) and d > 0 for d in dims):
        raise ValueError(f"LoRA layer {layer} target {target!r}: {name} must be a 2-D shape, got {shape!r}")
    return (dims[0], dims[1])
