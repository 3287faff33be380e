"""The loader's hook for quantized checkpoints: a layer's tensors (``qweight``, ``qzeros``,
``scales``, ...) become one weight.

The loader reads tensors one at a time, file by file, and a layer's parts may sit in different
shards. :class:`QuantizedLayers` knows from the checkpoint's tensor names which parts each layer
has, holds the parts read so far, and returns the layer's weight as GGUF blocks when its last
part arrives, so at most one layer's packed tensors wait at a time for an unsharded file. A
tensor-parallel rank reads each layer whole as well and keeps the blocks of its slice
(:meth:`~pagedkv.models.parallel.TensorParallel.tensor_reader`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from pathlib import Path

import torch

from pagedkv.models.quantization.blocks import QuantizedWeight, to_gguf_blocks
from pagedkv.models.quantization.hf_scheme import QuantScheme, read_scheme
from pagedkv.models.quantization.hf_unpack import unpack
from pagedkv.tokenizer.gguf_file import gguf_parts


def checkpoint_scheme(folder: str | Path, quantization: str | None) -> QuantScheme | None:
    """The quantization of the checkpoint in ``folder`` (None: a 16/32-bit one), refusing
    on-the-fly ``quantization`` of an already quantized checkpoint. A GGUF model has none: its
    quantization is each tensor's own type."""
    if gguf_parts(folder) is not None:
        return None
    with open(Path(folder) / "config.json", encoding="utf-8") as f:
        scheme = read_scheme(folder, json.load(f))
    if scheme is not None and quantization is not None:
        raise ValueError(
            f"quantization={quantization!r} quantizes a 16/32-bit checkpoint; this one is already "
            f"quantized ({scheme.method}): leave quantization unset"
        )
    return scheme


class QuantizedLayers:
    """Gathers each quantized layer's parts; see the module's docstring."""

    def __init__(self, scheme: QuantScheme, names: Iterable[str], model_names: Collection[str]) -> None:
        """``names``: every tensor of the checkpoint; ``model_names``: the tensors the model loads."""
        self.scheme = scheme
        self.expected: dict[str, set[str]] = {}  # layer name -> the parts the checkpoint has
        for name in names:
            layer, _, part = name.rpartition(".")
            if part in scheme.parts:
                self.expected.setdefault(layer, set()).add(part)
        # AutoGPTQ writes an all-zero bias for every layer it quantizes, also where the model has none
        self.placeholder_biases = {f"{layer}.bias" for layer in self.expected} - set(model_names)
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def claims(self, name: str) -> bool:
        """``name`` is a part of a quantized layer, or a placeholder bias of one."""
        layer, _, part = name.rpartition(".")
        return part in self.expected.get(layer, ()) or name in self.placeholder_biases

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, QuantizedWeight] | None:
        """Take part ``name``; once its layer is complete, the model's weight name for it
        (``<layer>.weight``) and the weight. A placeholder bias is dropped."""
        if name in self.placeholder_biases:
            if tensor.any():
                raise ValueError(
                    f"{name}: the model has no bias on this layer, and the checkpoint's is not zero"
                )
            return None
        layer, _, part = name.rpartition(".")
        parts = self.pending.setdefault(layer, {})
        parts[part] = tensor
        if parts.keys() != self.expected[layer]:
            return None
        del self.pending[layer]
        missing = sorted(set(self.scheme.required_parts) - parts.keys())
        if missing:
            raise ValueError(f"quantized layer {layer} lacks {missing} ({self.scheme.method})")
        weight = to_gguf_blocks(unpack(self.scheme, parts, layer), self.scheme.symmetric, layer)
        return f"{layer}.weight", weight
