"""A GGUF file as a source of named checkpoint tensors, read the way the loader reads safetensors.

The loader (:func:`pagedkv.models.loader.load_weights`) fills every parameter from handles that
offer ``keys()``, ``get_tensor(name)`` and ``get_slice(name)`` under Hugging Face names;
:class:`GGUFTensors` is such a handle over one GGUF file, so GGUF feeds the same fill, the same
packing (``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``) and the same missing/unexpected
checks as safetensors. Three steps turn a GGUF tensor into a checkpoint tensor:

1. its name, llama.cpp's (``blk.3.attn_q.weight``), becomes transformers' (:func:`checkpoint_names`;
   a stacked experts' tensor, ``blk.3.ffn_up_exps.weight``, becomes one name per expert, and
   an expert's own tensor of older Mixtral files, ``blk.3.ffn_up.5.weight``, that expert's name);
2. its data becomes a dense tensor in the (rows, columns) layout of the checkpoint
   (:func:`gguf_weight`: F32/F16/BF16 as stored, quantized types dequantized by ``gguf.quants``,
   the reference implementation) -- the one place a type is decoded;
3. for the Llama architecture the query and key rows are put back in the order transformers'
   rotary embedding expects (:func:`unpermute_rows`): llama.cpp's converter interleaves each
   head's two rotary halves, and this undoes it, as transformers' GGUF loader does.

Step 3 permutes whole rows, and a quantized block never spans rows, so it applies unchanged to
a tensor kept in its quantized blocks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from pagedkv.kernels import quant_gemm
from pagedkv.models.quantization.blocks import QuantizedWeight
from pagedkv.tokenizer.gguf_file import open_gguf

Q = GGMLQuantizationType
#: Types read as they are stored.
DENSE_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
#: Quantized types dequantized on load: llama.cpp's block formats people use.
QUANTIZED_TYPES = frozenset(
    {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS}
)
SUPPORTED_TYPES = DENSE_TYPES | QUANTIZED_TYPES

#: llama.cpp's per-layer tensor names -> transformers' (under ``model.layers.N.``).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
#: llama.cpp's stacked experts (one ``[experts, rows, columns]`` tensor per projection) -> each
#: expert's projection under Qwen's and under Mixtral's name
_EXPERT_NAMES = {
    "ffn_gate_exps": ("gate_proj", "w1"),
    "ffn_up_exps": ("up_proj", "w3"),
    "ffn_down_exps": ("down_proj", "w2"),
}
#: one expert's projection as llama.cpp wrote Mixtral before it stacked experts: ``ffn_up.5``
_EXPERT_OF_ITS_OWN = re.compile(r"(ffn_gate|ffn_up|ffn_down)\.(\d+)")
#: where Gemma's sandwich norms differ: ``ffn_norm`` is the norm before its MLP, not after attention
_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
#: Phi-3's ``ffn_up`` is its fused gate and up projection (gate rows first), as in its checkpoints
_FAMILY_NAMES = {
    "Gemma2ForCausalLM": _GEMMA_NAMES,
    "Gemma3ForCausalLM": _GEMMA_NAMES,
    "Phi3ForCausalLM": {"ffn_up": "mlp.gate_up_proj"},
}
#: the architectures whose norms llama.cpp's converter writes as ``1 + weight`` (the scale Gemma's
#: RMSNorm multiplies by), which the reader turns back into the checkpoint's ``weight``
NORM_PLUS_ONE = frozenset({"Gemma2ForCausalLM", "Gemma3ForCausalLM"})
_MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: RoPE frequency divisors: read into the config (:mod:`pagedkv.models.gguf_config`), not weights:
#: Llama 3.1's scaling, Phi-3's longrope factors for long and for short contexts
ROPE_FREQS = "rope_freqs.weight"
ROPE_TENSORS = frozenset({ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight"})


def type_name(ggml_type: int) -> str:
    """``Q4_K`` for a ggml type number (``type 99`` for one the gguf package does not know)."""
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def checkpoint_names(gguf_name: str, experts: int, architecture: str) -> list[tuple[str, int | None]]:
    """transformers' names of a llama.cpp tensor, each with the index of its expert in a stacked
    tensor (None: the whole tensor): ``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.q_proj.weight``;
    ``blk.0.ffn_up_exps.weight`` of ``experts`` experts -> ``model.layers.0.mlp.experts.E.up_proj.weight``
    for every E (``blk.0.ffn_up.E.weight``, an expert's own tensor in older files: that expert's
    name alone). The names are those of ``architecture``'s checkpoints (Mixtral's router and
    experts sit under ``block_sparse_moe``, Gemma has four norms a layer, Phi-3 fuses its gate and
    up projections in ``ffn_up``). An unknown name is
    returned as it is, so the loader reports it as a weight the model does not use."""
    stem, _, param = gguf_name.rpartition(".")
    if not stem.startswith("blk."):
        mapped = _MODEL_NAMES.get(stem)
        return [(gguf_name if mapped is None else f"{mapped}.{param}", None)]
    _, layer, leaf = stem.split(".", 2)
    mixtral = architecture == "MixtralForCausalLM"
    block = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"
    if leaf in _EXPERT_NAMES:
        proj = _EXPERT_NAMES[leaf][mixtral]
        return [(f"{block}.experts.{e}.{proj}.{param}", e) for e in range(experts)]
    own = _EXPERT_OF_ITS_OWN.fullmatch(leaf)
    if own is not None:
        proj = _EXPERT_NAMES[f"{own[1]}_exps"][mixtral]
        return [(f"{block}.experts.{own[2]}.{proj}.{param}", None)]
    if mixtral and leaf == "ffn_gate_inp":
        return [(f"{block}.gate.{param}", None)]
    mapped = _FAMILY_NAMES.get(architecture, {}).get(leaf) or _LAYER_NAMES.get(leaf)
    return [(gguf_name if mapped is None else f"model.layers.{layer}.{mapped}.{param}", None)]


def gguf_weight(tensor: ReaderTensor, expert: int | None = None) -> torch.Tensor:
    """The tensor (or its ``expert``-th matrix, of a stacked one) as a dense torch tensor of the
    checkpoint's layout (rows, columns), sharing the file's pages where the type is stored dense.

    This is the one step from a ggml type to a parameter: a loader that keeps quantized types
    quantized branches here, returning the raw blocks (``tensor.data``, uint8 rows) with
    ``tensor.tensor_type`` instead of dequantizing."""
    kind = tensor.tensor_type
    data = tensor.data if expert is None else tensor.data[expert]
    if kind in (Q.F32, Q.F16):
        return torch.from_numpy(data)
    if kind == Q.BF16:
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    if kind in QUANTIZED_TYPES:
        return torch.from_numpy(dequantize(data, kind))
    raise ValueError(f"tensor {tensor.name} has type {type_name(kind)}, which pagedkv cannot read")


def unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of a query or key projection of ``heads`` heads
    (weight or bias: rows first): within each head, rows ``(pair, half)`` go back to ``(half, pair)``."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _rows(tensor: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """``rows`` (first, count) of ``tensor``; None: all of them."""
    return tensor if rows is None else tensor.narrow(0, *rows)


class _Dense:
    """A dense tensor behind the slice interface the tensor-parallel reader reads
    (``get_shape()``, indexing): each rank cuts its rows or columns from it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


class GGUFTensors:
    """One GGUF file as the loader's tensor handle: ``keys()`` are checkpoint names, each read
    on request (a quantized tensor is dequantized then, so one tensor at a time is held dense;
    a stacked experts' tensor one expert at a time).

    ``rotary_heads`` (Llama only; None for the others): the query and key head counts whose
    rows :func:`unpermute_rows` puts back. ``architecture``: the checkpoint's, whose names the
    tensors take and whose norms may be stored plus one (:data:`NORM_PLUS_ONE`). ``split``: the
    parts ``(name, first row, rows)`` of a fused projection's checkpoint name (Phi-3's
    ``qkv_proj``, ``gate_up_proj``; None: not fused), each then read as its rows, so the fused
    tensor feeds the same packing as the parts a safetensors checkpoint holds."""

    def __init__(
        self,
        file: Path,
        rotary_heads: tuple[int, int] | None,
        keep_quantized: bool = False,
        architecture: str = "LlamaForCausalLM",
        split: Callable[[str], list[tuple[str, int, int]] | None] = lambda name: None,
    ) -> None:
        self.file = file
        self.keep_quantized = keep_quantized
        self.norm_plus_one = architecture in NORM_PLUS_ONE
        reader = open_gguf(file)
        #: checkpoint name -> (tensor, its expert, its rows (first, count)); None: all of it
        self._tensors: dict[str, tuple[ReaderTensor, int | None, tuple[int, int] | None]] = {}
        for tensor in reader.tensors:
            if tensor.name not in ROPE_TENSORS:
                experts = int(tensor.shape[-1]) if len(tensor.shape) == 3 else 0
                for name, expert in checkpoint_names(tensor.name, experts, architecture):
                    for part, first, rows in split(name) or [(name, 0, None)]:
                        self._tensors[part] = (tensor, expert, None if rows is None else (first, rows))
        self._heads: dict[str, int] = {}
        if rotary_heads is not None:
            self._heads = {"q_proj": rotary_heads[0], "k_proj": rotary_heads[1]}

    def __enter__(self) -> GGUFTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tensors.clear()  # the last reference to the mapping's arrays goes with it

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_tensor(self, name: str) -> torch.Tensor | QuantizedWeight:
        """The tensor ``name``: dense, or with ``keep_quantized`` a quantized type the CPU
        kernels run as its blocks (a :class:`QuantizedWeight` of the mapped bytes). A vector
        under a matrix's name (llama.cpp's shared-expert gate, one row) is read as that row."""
        tensor, expert, rows = self._tensors[name]
        heads = self._heads.get(name.rsplit(".", 2)[-2])
        if self.keep_quantized and int(tensor.tensor_type) in quant_gemm.BLOCKS and len(tensor.shape) > 1:
            data = np.asarray(tensor.data if expert is None else tensor.data[expert])
            raw = _rows(torch.from_numpy(data.reshape(int(tensor.shape[1]), -1)), rows)
            raw = raw if heads is None else unpermute_rows(raw, heads)
            shape = (raw.shape[0], int(tensor.shape[0]))  # ggml lists the row length first
            return QuantizedWeight(raw.numpy(), Q(tensor.tensor_type), shape)
        dense = _rows(gguf_weight(tensor, expert), rows)
        if name.endswith("shared_expert_gate.weight"):
            dense = dense.reshape(1, -1)
        if self.norm_plus_one and name.endswith("norm.weight"):
            dense = dense - 1
        return dense if heads is None else unpermute_rows(dense, heads)

    def get_slice(self, name: str) -> _Dense | QuantizedWeight:
        """What a tensor-parallel rank cuts its slice from: the dense tensor, or a quantized one
        kept as its blocks whole (the rank keeps the blocks of its slice,
        :meth:`~pagedkv.models.tensor_slice.TensorSlice.blocks_of`)."""
        tensor = self.get_tensor(name)
        return tensor if isinstance(tensor, QuantizedWeight) else _Dense(tensor)
