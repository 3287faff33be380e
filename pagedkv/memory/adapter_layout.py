"""Where a LoRA adapter's weights sit in its pages of the KV block pool.

A block id is, in every layer, two *chunks* of the KV cache of ``block_size * num_kv_heads *
head_dim`` elements each (:func:`chunk_elements`): the block's keys and its values, each
contiguous. An adapter's layer-``l`` weights fill the layer-``l`` chunks of its pages in page
order -- keys of the first page, values of the first page, keys of the second, ... -- numbered
here as one run of *positions* (chunk ``k`` holds positions ``k * chunk`` to ``(k + 1) * chunk``).
What is laid out are the rows the forward pass multiplies by: for each target module
(``q_proj``, ``down_proj``, ...) its ``A``'s rank rows (``in`` elements each) and its ``B``'s
transposed (``out`` elements each).

No row straddles two chunks, so every row is contiguous in the cache and the forward pass reads
it where it is (:mod:`pagedkv.models.lora_paged`). The rows are packed first fit decreasing: the
widest matrices first, each row into the first chunk with room left, so narrow rows fill the
ends wide ones leave (a layer takes about its weights' own elements, not a chunk per row). A row
wider than a chunk (big projections over a small KV shape) cannot be read in place: such rows run
end to end after the packed chunks, and the model computes from slots filled from the pages
(:attr:`AdapterLayout.rows_fit`). The layout is a function of the shapes and the chunk alone --
the same on the control plane (which needs only :attr:`AdapterLayout.pages`) and on the worker
(which moves the bytes and points the forward pass at them,
:mod:`pagedkv.attention.adapter_slabs`) -- and one layer's packing is shared by every layer and
adapter of the same shapes.

Pure Python: shapes are tuples of ints.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Shape = tuple[int, int]


def chunk_elements(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Elements of one block's keys (or values) in one layer: the run a row may not straddle."""
    return block_size * num_kv_heads * head_dim


@functools.lru_cache(maxsize=256)
def pack_rows(matrices: tuple[tuple[int, int], ...], chunk: int) -> tuple[tuple[int, ...], ...]:
    """The positions of the rows of each ``(width, count)`` matrix, first fit decreasing in
    chunks of ``chunk``: rows that fit a chunk never straddle one; wider rows follow, end to end."""
    fill: list[int] = []  # the elements used of each chunk so far
    placed: dict[int, tuple[int, ...]] = {}
    fitting = sorted(
        (i for i, (width, _) in enumerate(matrices) if width <= chunk), key=lambda i: -matrices[i][0]
    )
    for i in fitting:
        width, left = matrices[i]
        rows: list[int] = []
        for k in range(len(fill) + left):  # at most one new chunk per row
            if k == len(fill):
                fill.append(0)
            take = min((chunk - fill[k]) // width, left - len(rows))
            rows += [k * chunk + fill[k] + j * width for j in range(take)]
            fill[k] += take * width
            if len(rows) == left:
                break
        placed[i] = tuple(rows)
    cursor = len(fill) * chunk
    for i, (width, count) in enumerate(matrices):
        if i not in placed:
            placed[i] = tuple(cursor + j * width for j in range(count))
            cursor += count * width
    return tuple(placed[i] for i in range(len(matrices)))


@dataclass(frozen=True)
class TargetSlot:
    """One target module's rows in a layer: ``A`` (``a_shape`` ``[rank, in]``, its rows as they
    are) and ``B`` (``b_shape`` ``[out, rank]``, its rows those of ``B`` transposed), each rank
    row's position."""

    target: str
    a_shape: Shape
    b_shape: Shape
    a_rows: tuple[int, ...]
    b_rows: tuple[int, ...]

    @property
    def end(self) -> int:
        """The position just past its last row."""
        return max(self.a_rows[-1] + self.a_shape[1], self.b_rows[-1] + self.b_shape[0])


@dataclass(frozen=True)
class AdapterLayout:
    """Each layer's target slots, in the order they were given; ``layers[l]`` may be empty (a
    layer the adapter leaves alone). ``chunk``: the elements of one chunk."""

    layers: tuple[tuple[TargetSlot, ...], ...]
    chunk: int

    @classmethod
    def of(cls, shapes: Sequence[Mapping[str, tuple[Shape, Shape]]], chunk: int) -> AdapterLayout:
        """The layout of per-layer ``{target: (a_shape, b_shape)}`` in chunks of ``chunk``
        elements: ``A`` is ``[rank, in]``, ``B`` is ``[out, rank]`` with the same rank."""
        if not isinstance(chunk, int) or chunk <= 0:
            raise ValueError(f"a KV chunk holds a positive number of elements, got {chunk!r}")
        layers = []
        for index, targets in enumerate(shapes):
            checked = []
            for target, (a_shape, b_shape) in targets.items():
                a, b = _checked(index, target, "A", a_shape), _checked(index, target, "B", b_shape)
                if a[0] != b[1]:
                    raise ValueError(
                        f"LoRA layer {index} target {target!r}: A {a} has rank {a[0]} "
                        f"but B {b} has rank {b[1]}"
                    )
                checked.append((target, a, b))
            rows = pack_rows(tuple(m for _, a, b in checked for m in ((a[1], a[0]), (b[0], b[1]))), chunk)
            slots = (TargetSlot(t, a, b, *rows[2 * i : 2 * i + 2]) for i, (t, a, b) in enumerate(checked))
            layers.append(tuple(slots))
        return cls(tuple(layers), chunk)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_elements(self, layer: int) -> int:
        """Positions the layer's rows span, gaps included (0 without targets)."""
        return max((slot.end for slot in self.layers[layer]), default=0)

    @property
    def pages(self) -> int:
        """Block ids the adapter needs: its largest layer's chunks, two to a block."""
        largest = max((self.layer_elements(i) for i in range(self.num_layers)), default=0)
        chunks = -(-largest // self.chunk)
        return max(1, -(-chunks // 2))

    @property
    def rows_fit(self) -> bool:
        """Whether every row lies within one chunk (the forward pass can read it in place)."""
        return all(
            max(slot.a_shape[1], slot.b_shape[0]) <= self.chunk for layer in self.layers for slot in layer
        )


def _checked(layer: int, target: str, name: str, shape: object) -> Shape:
    """``shape`` as a 2-tuple of positive ints, or a ValueError naming where it belongs."""
    dims = tuple(shape) if isinstance(shape, Sequence) else ()
    if len(dims) != 2 or not all(isinstance(d, int) and d > 0 for d in dims):
        raise ValueError(f"LoRA layer {layer} target {target!r}: {name} must be a 2-D shape, got {shape!r}")
    return (dims[0], dims[1])
