"""Build a model from a Hugging Face folder (config.json plus one or sharded *.safetensors) or a
GGUF file (:mod:`pagedkv.models.gguf_weights`: the same fill from a second source of named tensors).

The model is created uninitialised (no random init of weights about to be overwritten) directly
in the target dtype and on the target device, then filled tensor by tensor with safetensors'
``safe_open`` so at most one tensor is held twice in memory. Checkpoint tensors keep their
Hugging Face names; the model packs some of them (``q_proj``/``k_proj``/``v_proj`` into
``qkv_proj``, ``gate_proj``/``up_proj`` into ``gate_up_proj``), so each name maps to a parameter
or to a row slice of one (:func:`checkpoint_targets`); a checkpoint that stores them fused (Phi-3)
reads as its parts (:mod:`pagedkv.models.fused_weights`). Every target must be filled exactly once:
a missing or unexpected tensor is an error naming it, never a silent random weight.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from pagedkv.attention import resolve_backend
from pagedkv.config.model import LOAD_FORMATS
from pagedkv.models.config import ModelConfig
from pagedkv.models.dtypes import resolve_dtype
from pagedkv.models.dummy_weights import fill_dummy_weights
from pagedkv.models.families import model_class
from pagedkv.models.fused_weights import SplitFused, fused_parts
from pagedkv.models.gguf_weights import GGUFTensors
from pagedkv.models.linear import PackedLinear, choose_linear_kernel, pack_linears
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.quantization.blocks import QuantizedWeight
from pagedkv.models.quantization.hf_groups import QuantizedLayers, checkpoint_scheme
from pagedkv.models.quantization.hf_scheme import QuantScheme
from pagedkv.models.quantization.install import blocks_to, install_quantized, keeps_blocks
from pagedkv.models.quantization.on_the_fly import quantize_linears
from pagedkv.models.quantized import use_quantized_activations
from pagedkv.models.rope import rotary_row_order
from pagedkv.tokenizer.gguf_file import SUFFIX, gguf_parts

if TYPE_CHECKING:
    from pagedkv.models.parallel import TensorParallel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

#: Tensors some checkpoints carry that the model recomputes instead of loading.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

#: Tensors whose rows (per head) a partial-rotary model reorders (:func:`rotary_row_order`).
_ROTARY_ROWS = tuple(
    f"self_attn.{t}"
    for t in (
        "q_proj.weight",
        "q_proj.bias",
        "k_proj.weight",
        "k_proj.bias",
        "q_norm.weight",
        "k_norm.weight",
    )
)


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a model: a GGUF model's parts (:func:`~pagedkv.tokenizer.gguf_file.gguf_parts`),
    else the folder's safetensors: the index's shards, else model.safetensors, else all."""
    gguf = gguf_parts(path)
    if gguf is not None:
        return gguf
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / SINGLE_FILE).is_file():
        files = [folder / SINGLE_FILE]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{INDEX_FILE} in {folder} lists shards that do not exist: {missing}")
    return files


def return_freed_heap() -> None:
    """Give the pages freed while loading back to the system. Loading builds a full-size model and
    replaces its placeholder tensors (with the checkpoint's, packed or kept in blocks) and reads
    through transient buffers; glibc keeps the freed heap mapped in the process unless trimmed, so
    the loaded model would be charged for memory it no longer holds. Elsewhere than glibc: nothing."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl has no malloc_trim)
        return
    libc.malloc_trim(0)


def load_model(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    attention_backend: str | None = None,
    linear_kernel: str = "auto",
    batch_hint: int = 2048,
    tensor_parallel: TensorParallel | None = None,
    load_format: str = "auto",
    quantization: str | None = None,
    quantized_activations: str = "float",
) -> LlamaForCausalLM:
    """The model of folder ``path`` in eval mode, weights cast to ``dtype`` (default: the
    checkpoint's own dtype; "auto": see :func:`~pagedkv.models.dtypes.resolve_dtype`) on
    ``device``, its attention kernels those of ``attention_backend`` (default: the device's, see
    :mod:`pagedkv.attention.backends`), its linear layers packed for ``linear_kernel`` once the
    weights are in (see :mod:`pagedkv.models.linear`; ``batch_hint``: the most rows per call).
    With ``tensor_parallel``: that rank's shard of the model, each tensor read as the slice it
    holds (packed like any other weight: the parallel layers are linear layers on their shard;
    quantized weights as the blocks of the slice, :mod:`pagedkv.models.parallel`).
    ``load_format="dummy"``: no weights are read, every tensor is drawn on the device
    (:mod:`pagedkv.models.dummy_weights`); ``path`` needs only its config.json. A quantized
    checkpoint (GPTQ, AWQ, compressed-tensors) loads through GGUF blocks
    (:mod:`pagedkv.models.quantization`); ``quantization`` ("q8_0", "q4_k", ...) quantizes the
    decoder layers' projections of a 16/32-bit one the way llama.cpp does; ``quantized_activations``
    ("float", "q8", "q8-all") is the arithmetic of the quantized layers' products
    (:func:`~pagedkv.models.quantized.use_quantized_activations`)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {list(LOAD_FORMATS)}")
    scheme = checkpoint_scheme(path, quantization)
    backend = resolve_backend(attention_backend, torch.device(device))
    cfg = ModelConfig.from_pretrained(path)
    dtype = resolve_dtype(dtype, default=cfg.dtype, device=device)
    kernel = choose_linear_kernel(linear_kernel, torch.device(device), dtype)
    cfg = dataclasses.replace(cfg, dtype=dtype)  # model.config describes the model as loaded
    family = model_class(cfg.architecture)
    # quantized weights stay in their blocks where kernels run them (a rank: its slice)
    keep = keeps_blocks(torch.device(device), tensor_parallel is None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if tensor_parallel is None:
                model = family(cfg, attention_backend=backend)
            else:
                model = tensor_parallel.build(cfg, backend)
    finally:
        torch.set_default_dtype(previous)
    model.tie_weights()
    if load_format == "dummy":
        fill_dummy_weights(checkpoint_targets(model))
    else:
        read = None if tensor_parallel is None else tensor_parallel.tensor_reader(model)
        held = load_weights(model, weight_files(path), read, scheme, checkpoint=cfg, keep_quantized=keep)
        if held is not None:
            source = "GGUF" if scheme is None else f"{scheme.method} int{scheme.bits}"
            model.quantization = f"{source}, {held}"
            dense = None if tensor_parallel is None else tensor_parallel.dense_projections()
            if dense is not None:
                model.quantization += f"; {dense}"
    if quantization is not None:
        held = quantize_linears(model, quantization, keep)
        model.quantization = f"{quantization} on load, {held}"
    if keep:
        blocks_to(model, torch.device(device))
    model.requires_grad_(False)
    model.linear_kernel = pack_linears(model, kernel, batch_hint)
    model.quantized_products = use_quantized_activations(model, quantized_activations)
    return_freed_heap()
    return model.eval()


def checkpoint_targets(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Checkpoint tensor name -> the tensor it fills: a parameter, or for a packed projection
    (:class:`~pagedkv.models.llama.PackedLinear`) the row slice of that projection's shard,
    named as the checkpoint names it (``model.layers.0.self_attn.q_proj.weight``)."""
    # tied weights appear once, under the embedding's name
    targets = {name: param.data for name, param in model.named_parameters()}
    for module_name, module in model.named_modules():
        if not isinstance(module, PackedLinear):
            continue
        parent = module_name.rpartition(".")[0]
        for param_name, param in module.named_parameters(recurse=False):
            del targets[f"{module_name}.{param_name}"]
            for shard, (start, rows) in module.shard_rows().items():
                targets[f"{parent}.{shard}.{param_name}"] = param.data.narrow(0, start, rows)
    return targets


def checkpoint_names(files: list[Path]) -> list[str]:
    """The names of every tensor of ``files`` (their headers only)."""
    names = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def load_weights(
    model: LlamaForCausalLM,
    files: list[Path],
    read: Callable[[str, Any], torch.Tensor] | None = None,
    scheme: QuantScheme | None = None,
    checkpoint: ModelConfig | None = None,
    keep_quantized: bool = False,
) -> str | None:
    """Copy every tensor of ``files`` into the parameter (or packed row slice) it names;
    ``read(name, file)`` reads a tensor (default: whole; a tensor-parallel rank: its slice).
    With a quantization ``scheme``, a quantized layer's tensors fill its ``weight`` together
    (read whole, repacked as GGUF blocks, then cut by ``read`` as a GGUF file's would be).
    ``checkpoint``: the whole model's config, when ``model`` holds a tensor-parallel rank's shard
    (a GGUF file's rows are put back by the whole model's head counts); default ``model.config``.
    Quantized weights (a quantized checkpoint's layers, a GGUF file's quantized tensors) go
    through :func:`~pagedkv.models.quantization.install.install_quantized`, kept in their blocks
    with ``keep_quantized``; returns what they became (None: there were none)."""
    targets = checkpoint_targets(model)
    layers = None if scheme is None else QuantizedLayers(scheme, checkpoint_names(files), targets)
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    quantized: dict[str, QuantizedWeight] = {}
    for file in files:
        with _open_weights(file, checkpoint or model.config, keep_quantized) as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                tensor: torch.Tensor | QuantizedWeight | None = None
                if layers is not None and layers.claims(name):
                    done = layers.add(name, f.get_tensor(name))
                    if done is None:  # more of the layer's parts to come
                        continue
                    name, tensor = done
                    if read is not None:  # a rank keeps its slice of the layer's blocks
                        tensor = read(name, _Repacked(tensor))
                target = targets.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                if tensor is None:
                    tensor = f.get_tensor(name) if read is None else read(name, f)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"weight {name} in {file.name} has shape {tuple(tensor.shape)}, "
                        f"but the config implies {tuple(target.shape)}"
                    )
                if model.config.rotary_dim is not None and name.endswith(_ROTARY_ROWS):
                    tensor = _rotary_rows(tensor, model.config)
                if isinstance(tensor, QuantizedWeight):
                    quantized[name] = tensor
                else:
                    target.copy_(tensor)
                loaded.add(name)
    if unexpected:
        raise ValueError(
            f"the checkpoint has {len(unexpected)} weights this {model.config.architecture} does not use "
            f"(config.json may not match the weights): {sorted(unexpected)[:8]}"
        )
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights: {missing[:8]}")
    return install_quantized(model, quantized, targets, keep_quantized)


class _Repacked:
    """A quantized checkpoint's layer, repacked as GGUF blocks whole, behind the handle a rank's
    ``read`` takes: it cuts its slice as from a GGUF file's quantized tensor."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight

    def get_tensor(self, name: str) -> QuantizedWeight:
        return self.weight

    def get_slice(self, name: str) -> QuantizedWeight:
        return self.weight


def _rotary_rows(
    tensor: torch.Tensor | QuantizedWeight, config: ModelConfig
) -> torch.Tensor | QuantizedWeight:
    """Query/key rows (whole heads) in :func:`rotary_row_order`; a quantized weight's rows are
    its rows of blocks (a block never spans two rows), moved as they are."""
    order = rotary_row_order(config.head_dim, config.rotary_dim or config.head_dim)
    heads = tensor.shape[0] // config.head_dim
    if isinstance(tensor, QuantizedWeight):
        raw = tensor.raw.reshape(heads, config.head_dim, -1)[:, order.numpy()]
        return QuantizedWeight(raw.reshape(tensor.raw.shape), tensor.qtype, tensor.shape)
    return tensor.unflatten(0, (heads, config.head_dim))[:, order].flatten(0, 1)


def _open_weights(file: Path, config: ModelConfig, keep_quantized: bool) -> Any:
    """A handle on one weight file: safetensors' own, its fused projections split into their
    parts, or a GGUF file's (:class:`~pagedkv.models.gguf_weights.GGUFTensors`, its Llama and
    Mixtral query/key rows unpermuted, its stacked experts and Phi-3's fused projections shown
    as their parts; its quantized tensors as blocks with ``keep_quantized``)."""
    if file.suffix != SUFFIX:
        return SplitFused(safe_open(str(file), framework="pt", device="cpu"), config)
    llama = config.architecture in ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
    heads = (config.num_heads, config.num_kv_heads) if llama else None
    return GGUFTensors(
        file, heads, keep_quantized, config.architecture, lambda name: fused_parts(name, config)
    )
