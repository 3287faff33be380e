"""A PEFT LoRA folder read and checked against the base model, without loading its tensors.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (what
``PeftModel.save_pretrained`` writes). The check reads the config and the safetensors header
(a JSON table of names, shapes and byte ranges) only, so a request naming a bad adapter is
refused when it is added, before it takes any engine state, and names what is wrong: a missing
or truncated file, a rank over ``max_lora_rank``, a target module pagedkv does not run (or that
is not this model's: Phi-3's checkpoints, and so its adapters, fuse q/k/v and gate/up), a tensor
whose shape is not the base model's (an adapter of another model), or a PEFT feature it does not
implement (``modules_to_save``, trained biases, DoRA, per-module rank or alpha patterns). What
passes is an :class:`AdapterSpec`, from which :mod:`pagedkv.models.lora` loads the tensors into a
slot. No torch here: the engine checks adapters on its own thread.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The projections an adapter may target, and the packed module each is a part of (its shard
#: name inside that module: vLLM packs q/k/v and gate/up the same way). A checkpoint that fuses
#: them (Phi-3's) names the packed modules themselves: such a target is all of its module.
TARGETS: dict[str, str] = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "o_proj": "o_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
    "qkv_proj": "qkv_proj",
    "gate_up_proj": "gate_up_proj",
}
#: each fused target's parts, in their row order inside it (its ``B``'s rows: q, k, v; gate, up)
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
#: architectures whose checkpoints fuse q/k/v and gate/up, so that PEFT adapters of them target
#: ``qkv_proj`` and ``gate_up_proj`` (transformers' modules of these models)
FUSED_ARCHITECTURES = frozenset({"Phi3ForCausalLM"})

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)


class LoRAAdapterError(ValueError):
    """An adapter folder that cannot serve this model; the message names the folder and why."""


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its rank, the factor its product is scaled by (``lora_alpha / r``,
    or ``lora_alpha / sqrt(r)`` with rsLoRA), and for each ``(layer, projection)`` it adapts the
    names of its ``A [r, in]`` and ``B [out, r]`` tensors in :attr:`weights_file`."""

    folder: Path
    rank: int
    scaling: float
    tensors: dict[tuple[int, str], tuple[str, str]]

    @property
    def weights_file(self) -> Path:
        return self.folder / WEIGHTS_FILE


def model_targets(config: Any) -> tuple[str, ...]:
    """The target modules adapters of a model of ``config`` name: its checkpoint's projections,
    fused (``qkv_proj``, ``gate_up_proj``) where its checkpoints fuse them, else split."""
    split = {part for parts in FUSED.values() for part in parts}
    left_out = split if config.architecture in FUSED_ARCHITECTURES else set(FUSED)
    return tuple(name for name in TARGETS if name not in left_out)


def projection_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each adaptable projection of a model of ``config``
    (a :class:`~pagedkv.models.config.ModelConfig`), the fused ones' outputs all their parts'."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    for name, parts in FUSED.items():
        shapes[name] = (hidden, sum(shapes[part][1] for part in parts))
    return shapes


def layer_shapes(spec: AdapterSpec, config: Any) -> list[dict[str, tuple[tuple[int, int], tuple[int, int]]]]:
    """Per layer of a model of ``config``, each projection ``spec`` adapts and its ``A`` and ``B``
    shapes (``[r, in]``, ``[out, r]``), in the order of :attr:`AdapterSpec.tensors` -- the order
    unified paging lays them out in an adapter's pages."""
    shapes = projection_shapes(config)
    layers: list[dict[str, tuple[tuple[int, int], tuple[int, int]]]] = [{} for _ in range(config.num_layers)]
    for layer, shard in spec.tensors:
        in_features, out_features = shapes[shard]
        layers[layer][shard] = ((spec.rank, in_features), (out_features, spec.rank))
    return layers


def read_adapter(folder: str | Path, config: Any, max_rank: int) -> AdapterSpec:
    """The :class:`AdapterSpec` of the PEFT folder ``folder`` for a model of ``config``, or a
    :class:`LoRAAdapterError` naming what does not fit."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter folder {str(folder)!r} does not exist")
    targets = model_targets(config)
    settings = _read_config(folder, targets, config.architecture)
    rank, scaling = _rank_and_scaling(folder, settings, max_rank)
    header = _read_header(folder / WEIGHTS_FILE)
    shapes = projection_shapes(config)
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, entry in header.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise LoRAAdapterError(
                f"{folder}: tensor {name!r} is not a LoRA A/B matrix of a decoder projection"
            )
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in targets:
            raise _unsupported(folder, f"target module {module!r} is", targets, config.architecture)
        if layer >= config.num_layers:
            raise LoRAAdapterError(
                f"{folder}: tensor {name!r} is for layer {layer}; the model has {config.num_layers}"
            )
        in_features, out_features = shapes[module]
        expected = [rank, in_features] if side == "A" else [out_features, rank]
        if list(entry["shape"]) != expected:
            raise LoRAAdapterError(
                f"{folder}: tensor {name!r} has shape {entry['shape']}, the base model needs {expected} "
                "(an adapter of another base model, or another rank)"
            )
        found.setdefault((layer, module), {})[side] = name
    if not found:
        raise LoRAAdapterError(f"{folder}: {WEIGHTS_FILE} holds no LoRA tensors")
    tensors = {}
    for key, sides in found.items():
        if set(sides) != {"A", "B"}:
            raise LoRAAdapterError(
                f"{folder}: layer {key[0]} {key[1]} has lora_{set('AB') - set(sides)} missing"
            )
        tensors[key] = (sides["A"], sides["B"])
    return AdapterSpec(folder, rank, scaling, tensors)


def _unsupported(folder: Path, what: str, targets: tuple[str, ...], architecture: str) -> LoRAAdapterError:
    """The refusal of target modules ``what``, naming what this model's adapters may target."""
    fused = ", whose checkpoints fuse q/k/v and gate/up" if architecture in FUSED_ARCHITECTURES else ""
    return LoRAAdapterError(
        f"{folder}: {what} not supported on {architecture}{fused} (supported: {sorted(targets)})"
    )


def _read_config(folder: Path, targets: tuple[str, ...], architecture: str) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    try:
        settings = json.loads(file.read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(f"{folder}: {CONFIG_FILE} is missing (not a PEFT adapter folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LoRAAdapterError(f"{folder}: {CONFIG_FILE} is not valid JSON: {err}") from None
    if not isinstance(settings, dict):
        raise LoRAAdapterError(f"{folder}: {CONFIG_FILE} must hold a JSON object")
    refusals = {
        "peft_type": settings.get("peft_type", "LORA") not in ("LORA", None),
        "use_dora (DoRA)": bool(settings.get("use_dora")),
        "modules_to_save": bool(settings.get("modules_to_save")),
        "bias": settings.get("bias", "none") not in ("none", None),
        "rank_pattern": bool(settings.get("rank_pattern")),
        "alpha_pattern": bool(settings.get("alpha_pattern")),
        "fan_in_fan_out": bool(settings.get("fan_in_fan_out")),
    }
    refused = [name for name, bad in refusals.items() if bad]
    if refused:
        raise LoRAAdapterError(f"{folder}: {', '.join(refused)} is not supported in LoRA adapters")
    named = settings.get("target_modules")
    if isinstance(named, list):
        unknown = sorted(set(named) - set(targets))
        if unknown:
            raise _unsupported(folder, f"target module(s) {unknown} are", targets, architecture)
    return settings


def _rank_and_scaling(folder: Path, settings: dict[str, Any], max_rank: int) -> tuple[int, float]:
    rank, alpha = settings.get("r"), settings.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{folder}: {CONFIG_FILE} needs a positive integer 'r', got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"{folder}: LoRA rank {rank} is over max_lora_rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"{folder}: {CONFIG_FILE} needs a number 'lora_alpha', got {alpha!r}")
    scale = math.sqrt(rank) if settings.get("use_rslora") else rank
    return rank, alpha / scale


def _read_header(file: Path) -> dict[str, dict[str, Any]]:
    """The tensors a safetensors file names (its ``__metadata__`` left out), checked to lie
    inside the file: a truncated download is refused here, not half-loaded later."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LoRAAdapterError(f"{file}: not a safetensors file (shorter than its header)")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise LoRAAdapterError(
                    f"{file}: corrupt safetensors header (length {length} beyond the file)"
                )
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise LoRAAdapterError(
            f"{file.parent}: {file.name} is missing (adapter_model.bin is not read)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise LoRAAdapterError(f"{file}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise LoRAAdapterError(f"{file}: corrupt safetensors header")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise LoRAAdapterError(f"{file}: tensor {name!r} lies outside the file (truncated or corrupt)")
    return header
