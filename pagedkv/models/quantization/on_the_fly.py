"""On-the-fly quantization of a 16/32-bit checkpoint to llama.cpp's types, by llama.cpp's names.

Every projection of the decoder layers (q/k/v, o, gate/up, down, each expert's) is quantized row
by row, as ``llama-quantize`` does; the embedding, the final norm, the LM head and an MoE's
routers (:attr:`~pagedkv.models.linear.Linear.keeps_precision`) keep the checkpoint's precision.
Q8_0, Q4_0, Q4_1 and Q5_0 use the ``gguf`` package's quantizers (ports of ggml's reference
ones), Q4_K :mod:`pagedkv.models.quantization.k_quants`. A K-quant needs rows of a
multiple of 256 weights; a projection whose rows are not falls back as in llama.cpp
(``llama-quant.cpp``): Q4_K to Q5_0.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from pagedkv.config.model import QUANTIZATION_NAMES
from pagedkv.models.linear import Linear
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.quantization.blocks import QuantizedWeight
from pagedkv.models.quantization.install import DEQUANTIZED, KEPT, quantize_module
from pagedkv.models.quantization.k_quants import quantize_q4_k

Q = GGMLQuantizationType
#: ``quantization`` names -> ggml types.
TYPES: dict[str, GGMLQuantizationType] = {
    "q8_0": Q.Q8_0,
    "q4_0": Q.Q4_0,
    "q4_1": Q.Q4_1,
    "q5_0": Q.Q5_0,
    "q4_k": Q.Q4_K,
}
assert tuple(TYPES) == QUANTIZATION_NAMES  # the torch-free list the engine's options are checked against
#: llama.cpp's type for rows a K-quant's 256-weight blocks do not divide.
FALLBACK = {Q.Q4_K: Q.Q5_0}


def quantize_weight(
    weight: torch.Tensor, qtype: GGMLQuantizationType, name: str = "weight"
) -> QuantizedWeight:
    """``weight`` ``[out, in]`` as ``qtype`` blocks (or its fallback, for rows it does not divide)."""
    rows = weight.detach().to(device="cpu", dtype=torch.float32).numpy()
    if rows.shape[1] % GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK.get(qtype, qtype)
    block = GGML_QUANT_SIZES[qtype][0]
    if rows.shape[1] % block:
        raise ValueError(
            f"{name}: rows of {rows.shape[1]} weights do not split into {qtype.name} blocks of {block}"
        )
    raw = quantize_q4_k(rows) if qtype == Q.Q4_K else quantize(rows, qtype)
    return QuantizedWeight(raw, qtype, (rows.shape[0], rows.shape[1]))


def quantize_linears(model: LlamaForCausalLM, quantization: str, keep: bool) -> str:
    """Quantize every projection of ``model``'s decoder layers to ``quantization`` (a name of
    :data:`TYPES`), in place: each becomes a :class:`~pagedkv.models.quantized.QuantizedLinear`
    when ``keep``, else takes its blocks' values densely. Returns what the weights became."""
    if quantization not in TYPES:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {list(TYPES)}")
    layers = model.model.layers
    for name, module in list(layers.named_modules()):
        if isinstance(module, Linear) and not module.keeps_precision:
            weight = quantize_weight(module.weight.data, TYPES[quantization], f"layers.{name}")
            quantize_module(layers, name, weight, keep)
    return KEPT if keep else DEQUANTIZED
