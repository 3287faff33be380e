"""Checkpoints that store a projection fused: Phi-3's ``self_attn.qkv_proj`` (queries, keys,
values stacked by rows) and ``mlp.gate_up_proj`` (gate rows, then up rows, the halves
transformers' ``Phi3MLP`` chunks).

The model packs the same projections (:class:`~pagedkv.models.linear.PackedLinear`) but the
loader fills them by their split names, one row slice each, so that a tensor-parallel rank reads
only its rows and a missing part is named. :class:`SplitFused` wraps an open safetensors file
and shows each fused tensor as its parts under the split names (``q_proj``, ``k_proj``,
``v_proj``; ``gate_proj``, ``up_proj``); a part is read as its rows of the fused tensor, and
only those rows are read from the file.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.models.config import ModelConfig


def fused_parts(name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    """``(part name, first row, rows)`` of each part of the fused tensor ``name`` (rows as the
    whole model's config implies them); None when ``name`` is not a fused projection."""
    module, _, param = name.rpartition(".")
    parent, _, fused = module.rpartition(".")
    if param not in ("weight", "bias"):
        return None
    if fused == "qkv_proj" and parent.endswith("self_attn"):
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    elif fused == "gate_up_proj" and parent.endswith("mlp"):
        sizes = {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    else:
        return None
    parts, start = [], 0
    for part, rows in sizes.items():
        parts.append((f"{parent}.{part}.{param}", start, rows))
        start += rows
    return parts


class SplitFused:
    """An open safetensors file whose fused projections read as their parts."""

    def __init__(self, handle: Any, config: ModelConfig) -> None:
        self.handle = handle
        #: part name -> (fused tensor name, first row, rows)
        self.parts: dict[str, tuple[str, int, int]] = {}
        self.names: list[str] = []
        for name in handle.keys():
            parts = fused_parts(name, config)
            if parts is None:
                self.names.append(name)
                continue
            rows = handle.get_slice(name).get_shape()[0]
            if rows != parts[-1][1] + parts[-1][2]:
                implied = {part: count for part, _, count in parts}
                raise ValueError(f"fused weight {name} has {rows} rows, but the config implies {implied}")
            for part, start, count in parts:
                self.parts[part] = (name, start, count)
                self.names.append(part)

    def __enter__(self) -> SplitFused:
        self.handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.names

    def get_tensor(self, name: str) -> torch.Tensor:
        if name not in self.parts:
            return self.handle.get_tensor(name)
        fused, start, rows = self.parts[name]
        return self.handle.get_slice(fused)[start : start + rows]

    def get_slice(self, name: str) -> Any:
        if name not in self.parts:
            return self.handle.get_slice(name)
        fused, start, rows = self.parts[name]
        return _PartSlice(self.handle.get_slice(fused), start, rows)


class _PartSlice:
    """A lazy part of a fused tensor: indexing reads only the rows asked for."""

    def __init__(self, fused: Any, start: int, rows: int) -> None:
        self.fused, self.start, self.rows = fused, start, rows

    def get_shape(self) -> list[int]:
        return [self.rows, *self.fused.get_shape()[1:]]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        first, *rest = index
        begin, end, step = first.indices(self.rows)
        if step != 1:
            raise ValueError("a fused weight's part is read in contiguous rows")
        return self.fused[(slice(self.start + begin, self.start + end), *rest)]
