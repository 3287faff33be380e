"""Where a LoRA adapter's weights sit in its pages of the KV block pool.

A block id is, in every layer, two *chunks* of the KV cache of ``block_size * num_kv_heads *
head_dim`` elements each (:func:`chunk_elements`): the block's keys and its values, each
contiguous. An adapter's layer-``l`` weights fill the layer-``l`` chunks of its pages in page
order -- keys of the first page, values of the first page, keys of the second, ... -- numbered
here as one run of *positions* (chunk ``k`` holds positions ``k * chunk`` to ``(k + 1) * chunk``).
For each target module (``q_proj``, ``down_proj``, ...) come its ``A``'s rank rows (``in``
elements each) then its ``B``'s, transposed (``out`` elements each): the rows the forward pass
multiplies by, one rank row of either matrix a contiguous run of elements.

A row never straddles two chunks when it fits in one: it starts at the next chunk instead (the
gap is zero), so every row is contiguous in the cache and the forward pass reads it where it is
(:mod:`pagedkv.models.lora_paged`). A row wider than a chunk (big projections over a small KV
shape) runs on across chunks, which the forward pass cannot read in place: such a model computes
from slots filled from the pages (:attr:`AdapterLayout.rows_fit`). The layout is the same on the
control plane (which needs only :attr:`AdapterLayout.pages`) and on the worker (which moves the
bytes and points the forward pass at them, :mod:`pagedkv.attention.adapter_slabs`).

Pure Python: shapes are tuples of ints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Shape = tuple[int, int]


def chunk_elements(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Elements of one block's keys (or values) in one layer: the run a row may not straddle."""
    return block_size * num_kv_heads * head_dim


@dataclass(frozen=True)
class Rows:
    """``count`` rows of ``width`` elements placed from position ``first`` in chunks of
    ``chunk``: one after the other, each moved to the next chunk's start when it would straddle
    a boundary it fits within."""

    first: int
    width: int
    count: int
    chunk: int

    def position(self, row: int) -> int:
        """Where row ``row`` starts."""
        if self.width > self.chunk:
            return self.first + row * self.width
        in_first = (self.chunk - self.first % self.chunk) // self.width  # rows left in the first chunk
        if row < in_first:
            return self.first + row * self.width
        per_chunk = self.chunk // self.width
        later, within = divmod(row - in_first, per_chunk)
        return (self.first // self.chunk + 1 + later) * self.chunk + within * self.width

    def positions(self) -> list[int]:
        return [self.position(row) for row in range(self.count)]

    @property
    def end(self) -> int:
        """The position just past the last row."""
        return self.position(self.count - 1) + self.width


def place(cursor: int, width: int, count: int, chunk: int) -> Rows:
    """``count`` rows of ``width`` from ``cursor`` on, the first moved to the next chunk when it
    would straddle one it fits within."""
    if width <= chunk and cursor % chunk + width > chunk:
        cursor += chunk - cursor % chunk
    return Rows(cursor, width, count, chunk)


@dataclass(frozen=True)
class TargetSlot:
    """One target module's rows in a layer: ``A`` (``a_shape`` ``[rank, in]``, its rows as they
    are) and ``B`` (``b_shape`` ``[out, rank]``, its rows those of ``B`` transposed)."""

    target: str
    a_shape: Shape
    b_shape: Shape
    a_rows: Rows
    b_rows: Rows

    @property
    def end(self) -> int:
        """The position just past ``B``'s last row."""
        return self.b_rows.end


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
            slots, cursor = [], 0
            for target, (a_shape, b_shape) in targets.items():
                a, b = _checked(index, target, "A", a_shape), _checked(index, target, "B", b_shape)
                if a[0] != b[1]:
                    raise ValueError(
                        f"LoRA layer {index} target {target!r}: A {a} has rank {a[0]} "
                        f"but B {b} has rank {b[1]}"
                    )
                a_rows = place(cursor, a[1], a[0], chunk)
                b_rows = place(a_rows.end, b[0], b[1], chunk)
                slots.append(TargetSlot(target, a, b, a_rows, b_rows))
                cursor = b_rows.end
            layers.append(tuple(slots))
        return cls(tuple(layers), chunk)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_elements(self, layer: int) -> int:
        """Positions the layer's rows take, gaps at chunk ends included (0 without targets)."""
        slots = self.layers[layer]
        return slots[-1].end if slots else 0

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
