"""How many bytes a model's weights will hold once loaded, known before anything is loaded.

The KV pool's "auto" size is what is left after the weights; where the pool is sized before the
ranks load (tensor parallelism, replicas), the weights' bytes are counted, not measured. A model
built on the meta device gives every parameter at the run's dtype (a rank's shard of them under
tensor parallelism), which is what a 16/32-bit checkpoint holds. A quantized weight kept in its
GGUF blocks (on the CPU, where the kernels run them: :mod:`pagedkv.models.quantization.install`)
holds its blocks' bytes instead, 4.5 to 8.5 bits a weight, so each source says what it saves:

- a GGUF file: every tensor of a type the kernels have and two or more dimensions, by its
  header (its elements at the dtype less its blocks' bytes);
- a GPTQ, AWQ or compressed-tensors checkpoint: each quantized layer becomes Q8_0 (8 bits),
  Q4_0 (4 bits, symmetric) or Q4_1 blocks (:func:`~pagedkv.models.quantization.blocks.to_gguf_blocks`);
- ``quantization`` (on-the-fly): every projection of the decoder layers becomes that type, or
  its fallback where a K-quant's 256-weight blocks do not divide the rows.

Under tensor parallelism the last two are counted on the rank's shard; a GGUF file's tensors
are cut evenly, so a rank saves its share of what the whole file saves. A packed projection with
one part of a type without a kernel is dequantized whole by the loader; that rare layer is
counted as kept, a small overestimate of the saving.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedkv.attention import Backend
from pagedkv.kernels import quant_gemm
from pagedkv.models.config import ModelConfig
from pagedkv.models.families import model_class
from pagedkv.models.linear import Linear
from pagedkv.models.loader import checkpoint_names, checkpoint_targets, weight_files
from pagedkv.models.quantization.hf_groups import checkpoint_scheme
from pagedkv.models.quantization.on_the_fly import FALLBACK, TYPES
from pagedkv.tokenizer.gguf_file import gguf_parts, open_gguf

Q = GGMLQuantizationType


def loaded_weight_bytes(
    path: str | Path,
    shard: ModelConfig,
    dtype: torch.dtype,
    backend: Backend,
    keep_quantized: bool,
    quantization: str | None = None,
    ranks: int = 1,
) -> int:
    """Bytes of one rank's weights once loaded: the parameters of ``shard`` (the rank's part of
    the model in ``path``, one of ``ranks``) at ``dtype``, counted on the meta device, less what
    its quantized weights save when ``keep_quantized`` (see the module's docstring)."""
    with torch.device("meta"):
        model = model_class(shard.architecture)(dataclasses.replace(shard, dtype=dtype), backend)
    model.tie_weights()
    dense = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    if not keep_quantized:
        return dense
    if quantization is not None:
        return dense - on_the_fly_saving(model, quantization, dtype)
    saving = gguf_saving(path, dtype)
    if saving is not None:
        return dense - saving // max(1, ranks)
    return dense - checkpoint_saving(path, model, dtype)


def _saved(elements: int, dtype: torch.dtype, qtype: GGMLQuantizationType) -> int:
    """Bytes ``elements`` weights save as ``qtype`` blocks instead of ``dtype`` elements."""
    block, size = GGML_QUANT_SIZES[qtype]
    return elements * dtype.itemsize - elements // block * size


def gguf_saving(path: str | Path, dtype: torch.dtype) -> int | None:
    """What the GGUF model at ``path`` saves by its tensors kept in blocks; None: not a GGUF model."""
    parts = gguf_parts(path)
    if parts is None:
        return None
    saving = 0
    for part in parts:
        for tensor in open_gguf(part).tensors:
            if int(tensor.tensor_type) in quant_gemm.BLOCKS and len(tensor.shape) > 1:
                saving += tensor.n_elements * dtype.itemsize - tensor.n_bytes
    return saving


def checkpoint_saving(path: str | Path, model: torch.nn.Module, dtype: torch.dtype) -> int:
    """What the GPTQ, AWQ or compressed-tensors checkpoint at ``path`` saves by its quantized
    layers kept in blocks (each layer's size read from ``model``, on the meta device: a rank's
    shard, its slice of each layer); 0 for a 16/32-bit checkpoint."""
    scheme = checkpoint_scheme(path, None)
    if scheme is None:
        return 0
    qtype = Q.Q8_0 if scheme.bits == 8 else Q.Q4_0 if scheme.symmetric else Q.Q4_1
    layers = {
        name.rpartition(".")[0]
        for name in checkpoint_names(weight_files(path))
        if name.rpartition(".")[2] in scheme.parts
    }
    targets = checkpoint_targets(model)
    elements = sum(targets[f"{layer}.weight"].numel() for layer in layers if f"{layer}.weight" in targets)
    return _saved(elements, dtype, qtype)


def on_the_fly_saving(model: torch.nn.Module, quantization: str, dtype: torch.dtype) -> int:
    """What quantizing ``model``'s decoder projections to ``quantization`` saves, as
    :func:`~pagedkv.models.quantization.on_the_fly.quantize_linears` quantizes them."""
    saving = 0
    for module in model.model.layers.modules():
        if isinstance(module, Linear) and not module.keeps_precision:
            qtype = TYPES[quantization]
            if module.in_features % GGML_QUANT_SIZES[qtype][0]:
                qtype = FALLBACK.get(qtype, qtype)
            saving += _saved(module.weight.numel(), dtype, qtype)
    return saving
