"""The one place a quantized weight enters the model.

Every quantized source -- a GGUF file's quantized tensors, GPTQ, AWQ, compressed-tensors,
on-the-fly quantization -- hands the loader :class:`QuantizedWeight`\\ s (GGUF blocks) under
checkpoint names. :func:`install_quantized` then turns each linear layer whose weights all came
quantized, in a type the CPU kernels have (:data:`pagedkv.kernels.quant_gemm.BLOCKS`), into a
:class:`~pagedkv.models.quantized.QuantizedLinear` holding those blocks as its only copy (a packed
q/k/v or gate/up projection keeps its parts' types side by side); the op list's ``Project`` then
runs it, and the C decode stack lowers it; the token embedding becomes a
:class:`~pagedkv.models.quantized.QuantizedEmbedding` (a LM head tied to it multiplies by the same
blocks). A tensor-parallel shard's projection holds the blocks of its rows or of its whole
blocks of input columns (:mod:`pagedkv.models.parallel`), in its all-reduce where it has one
(:meth:`~pagedkv.models.linear.Linear.holding_blocks`); its embedding and LM head their
vocabulary rows (:mod:`pagedkv.models.vocab_parallel`). Anything else -- a packed projection
with a dense part; a type without a kernel; a model that is not kept quantized (no kernel reads
blocks on its device) -- is dequantized into its dense parameter with the ``gguf`` package's
reference (``d * q`` or ``d * q + m`` in float32, cast to the model's dtype).

Blocks are kept where kernels read them (:func:`keeps_blocks`): on the CPU (C), and on one CUDA
device with triton installed (:mod:`pagedkv.kernels.triton_quant`); they are read on the CPU
and then moved to the model's device once (:func:`blocks_to`).
"""

from __future__ import annotations

import torch
from gguf.quants import dequantize
from torch import nn

from pagedkv.kernels import quant_gemm, triton_kernels
from pagedkv.models.linear import Linear, PackedLinear
from pagedkv.models.quantization.blocks import QuantizedWeight
from pagedkv.models.quantized import QuantizedEmbedding, QuantizedLinear

#: What :func:`install_quantized` made of the blocks, for the engine's description.
KEPT = "kept in GGUF blocks"
DEQUANTIZED = "dequantized into dense weights"
#: the checkpoint name of the token embedding
EMBEDDING = "model.embed_tokens.weight"


def keeps_blocks(device: torch.device, whole: bool) -> bool:
    """Whether a model on ``device`` keeps quantized weights in their blocks: on the CPU, and on
    CUDA where triton imports and the model is ``whole`` (not a tensor-parallel rank's shard)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and whole and triton_kernels("triton_quant") is not None


def blocks_to(model: nn.Module, device: torch.device) -> None:
    """Every quantized layer's blocks moved to ``device``, a tensor shared by several layers (an
    embedding and the LM head tied to it) moved once and still shared."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            for name, blocks in module._buffers.items():
                if blocks is not None and blocks.device != device:
                    if id(blocks) not in moved:
                        moved[id(blocks)] = blocks.to(device)
                    module._buffers[name] = moved[id(blocks)]


def install_quantized(
    model: nn.Module, weights: dict[str, QuantizedWeight], targets: dict[str, torch.Tensor], keep: bool
) -> str | None:
    """Put ``weights`` (checkpoint name -> blocks) into ``model``: linear layers whose weights
    all came quantized become :class:`QuantizedLinear` when ``keep``, every other weight fills its
    target in ``targets`` (checkpoint name -> parameter or packed row slice) dense. Returns
    :data:`KEPT` or :data:`DEQUANTIZED` (what the larger part became), None without weights."""
    if not weights:
        return None
    pending, kept = dict(weights), 0
    if keep:
        for name, module in list(model.named_modules()):
            if not isinstance(module, Linear):
                continue
            parts = _parts(name, module)
            blocks = [pending.get(part) for part in parts]
            if not all(b is not None and int(b.qtype) in quant_gemm.BLOCKS for b in blocks):
                continue
            _replace(model, name, module.holding_blocks(quantized_linear(module, blocks)))
            for part in parts:
                del pending[part]
            kept += 1
    embedding = pending.get(EMBEDDING)
    if keep and embedding is not None and int(embedding.qtype) in quant_gemm.BLOCKS:
        _keep_embedding(model, pending.pop(EMBEDDING))
        kept += 1
    for name, weight in pending.items():
        dequantize_into(targets[name], weight)
    return KEPT if kept and kept >= len(pending) else DEQUANTIZED


def _keep_embedding(model: nn.Module, weight: QuantizedWeight) -> None:
    """The embedding as its blocks, and a LM head tied to it multiplying by the same blocks
    (a tensor-parallel rank's: its vocabulary rows, in the layers' own kinds)."""
    dense = model.model.embed_tokens
    blocks = QuantizedLinear.from_gguf(weight.raw, int(weight.qtype), weight.shape).columns()
    embedding = QuantizedEmbedding(next(blocks)[3], int(weight.qtype), weight.shape[1], dense.weight.dtype)
    model.model.embed_tokens = dense.holding_blocks(embedding)
    if model.config.tie_word_embeddings:
        model.lm_head = model.lm_head.holding_blocks(embedding.tied_head())


def quantize_module(model: nn.Module, name: str, weight: QuantizedWeight, keep: bool) -> None:
    """The linear layer ``name`` of ``model`` made of ``weight`` (its whole weight, every
    shard of a packed projection at once, of one type): a :class:`QuantizedLinear` with the
    layer's bias when ``keep``, else its dense weight dequantized in place."""
    module = model.get_submodule(name)
    if not (keep and int(weight.qtype) in quant_gemm.BLOCKS):
        dequantize_into(module.weight.data, weight)
        return
    bias = None if module.bias is None else module.bias.data.clone()
    layer = QuantizedLinear.from_gguf(weight.raw, int(weight.qtype), weight.shape, bias)
    _replace(model, name, module.holding_blocks(layer))


def dequantize_into(target: torch.Tensor, weight: QuantizedWeight) -> None:
    """Fill ``target`` (a parameter or a packed projection's row slice) with ``weight``'s values."""
    if tuple(target.shape) != weight.shape:
        raise ValueError(
            f"a {weight.qtype.name} weight of shape {weight.shape} cannot fill {tuple(target.shape)}"
        )
    target.copy_(torch.from_numpy(dequantize(weight.raw, weight.qtype)))


def quantized_linear(module: Linear, blocks: list[QuantizedWeight]) -> QuantizedLinear:
    """``module`` (a plain or packed linear layer, with its loaded bias) as blocks: one part per
    shard of a packed projection, in its row order."""
    rows = module.shard_rows().values() if isinstance(module, PackedLinear) else [(0, module.out_features)]
    layers = []
    for weight, (start, count) in zip(blocks, rows, strict=True):  # shapes checked by the loader
        bias = None if module.bias is None else module.bias.data.narrow(0, start, count).clone()
        layers.append(QuantizedLinear.from_gguf(weight.raw, int(weight.qtype), weight.shape, bias))
    return layers[0] if len(layers) == 1 else QuantizedLinear.packed(layers)


def _parts(name: str, module: Linear) -> list[str]:
    """The checkpoint names of ``module``'s weight: one per shard of a packed projection."""
    if isinstance(module, PackedLinear):
        parent = name.rpartition(".")[0]
        return [f"{parent}.{shard}.weight" for shard in module.shard_rows()]
    return [f"{name}.weight"]


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, layer)
