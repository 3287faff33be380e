"""The quantization a Hugging Face checkpoint declares, read and checked before any weight is.

Read from config.json's ``quantization_config`` (transformers writes it), else from
``quantize_config.json`` (AutoGPTQ, GPTQ) or ``quant_config.json`` (AutoAWQ, AWQ). What loads is
what becomes GGUF blocks (:mod:`pagedkv.models.quantization.blocks`): integer weights of 4 bits
(symmetric or with zero points) or 8 bits (symmetric) in groups of a multiple of 32 input columns,
or one group per row. Every other method (fp8, bitsandbytes, hqq, ...) and every variant outside
that is refused here with one message naming it and what loads, never later as "unused weights".
GPTQ's act-order (``desc_act``) is accepted here and checked per weight: its ``g_idx`` must keep
the columns in order (:mod:`pagedkv.models.quantization.hf_unpack`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: What loads, for the refusals' messages.
SUPPORTED = (
    "gptq (4-bit, or 8-bit with sym=true), awq (4-bit, version gemm, zero_point=true) and "
    "compressed-tensors pack-quantized W4A16 / W8A16 (int weights, group or channel strategy), "
    "in groups of a multiple of 32 columns"
)
#: Files that hold a quantization config outside config.json, and the method each one implies.
SIDE_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))

#: Each method's tensors of one layer, by the suffix after the layer's name; the required first.
PARTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "compressed-tensors": (
        ("weight_packed", "weight_scale"),
        ("weight_zero_point", "weight_shape", "weight_g_idx"),
    ),
}


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's quantized layers are stored."""

    method: str  # a key of PARTS
    bits: int
    #: input columns per scale; None: one scale per row ("channel")
    group_size: int | None
    #: every zero point is the middle code (GPTQ ``sym``, compressed-tensors ``symmetric``)
    symmetric: bool
    #: added to a stored zero point: 1 for GPTQ's original format, which stores ``z - 1``
    zero_offset: int = 0

    @property
    def parts(self) -> tuple[str, ...]:
        required, optional = PARTS[self.method]
        return required + optional

    @property
    def required_parts(self) -> tuple[str, ...]:
        required = PARTS[self.method][0]
        if self.method == "compressed-tensors" and not self.symmetric:
            return (*required, "weight_zero_point")
        return required


def read_scheme(folder: str | Path, config: dict[str, Any]) -> QuantScheme | None:
    """The scheme of the checkpoint in ``folder`` whose config.json is ``config``; None: the
    checkpoint is not quantized. A ``ValueError`` names any method or option that does not load."""
    raw, source = config.get("quantization_config"), "config.json"
    for name, method in SIDE_FILES:
        if raw is not None:
            break
        file = Path(folder) / name
        if file.is_file():
            raw, source = {"quant_method": method, **json.loads(file.read_text(encoding="utf-8"))}, name
    if raw is None:
        return None
    method = str(raw.get("quant_method", "")).lower()
    readers = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed}
    if method not in readers:
        raise ValueError(
            f"quantization method {method!r} ({source}) is not supported; pagedkv loads {SUPPORTED}"
        )
    return readers[method](raw)


def _refuse(method: str, what: str) -> ValueError:
    return ValueError(f"{method} checkpoint with {what} is not supported; pagedkv loads {SUPPORTED}")


def _group(method: str, size: Any) -> int | None:
    if size in (None, -1):
        return None
    if not isinstance(size, int) or size <= 0 or size % 32:
        raise _refuse(method, f"group_size {size!r}")
    return size


def _gptq(raw: dict[str, Any]) -> QuantScheme:
    bits, sym = raw.get("bits"), bool(raw.get("sym", True))
    if bits not in (4, 8):
        raise _refuse("gptq", f"bits={bits!r}")
    if bits == 8 and not sym:
        raise _refuse("gptq", "8 bits and zero points (sym=false)")
    fmt = raw.get("checkpoint_format") or raw.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2") or raw.get("is_marlin_format"):
        raise _refuse("gptq", f"checkpoint_format {'marlin' if raw.get('is_marlin_format') else fmt!r}")
    group = _group("gptq", raw.get("group_size", -1))
    return QuantScheme("gptq", bits, group, sym, zero_offset=1 if fmt == "gptq" else 0)


def _awq(raw: dict[str, Any]) -> QuantScheme:
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise _refuse("awq", f"bits={bits!r}")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", f"version {version!r}")
    if not raw.get("zero_point", True):
        raise _refuse("awq", "zero_point=false")
    return QuantScheme("awq", 4, _group("awq", raw.get("group_size", raw.get("q_group_size"))), False)


def _compressed(raw: dict[str, Any]) -> QuantScheme:
    method = "compressed-tensors"
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(method, f"quantization_status {status!r} (weights not packed)")
    for key in ("kv_cache_scheme", "transform_config"):
        if raw.get(key):
            raise _refuse(method, key)
    sparsity = raw.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise _refuse(method, f"sparsity format {sparsity['format']!r}")
    schemes = set()
    for name, group in (raw.get("config_groups") or {}).items():
        fmt = group.get("format") or raw.get("format")
        if fmt != "pack-quantized":
            raise _refuse(method, f"format {fmt!r} ({name})")
        if group.get("input_activations") or group.get("output_activations"):
            raise _refuse(method, f"quantized activations ({name}; only weight-only W4A16 / W8A16 loads)")
        schemes.add(_weights(group.get("weights") or {}, name))
    if len(schemes) != 1:
        raise _refuse(method, f"{len(schemes)} different weight schemes in config_groups")
    return schemes.pop()


def _weights(args: dict[str, Any], name: str) -> QuantScheme:
    method = "compressed-tensors"
    kind, bits, strategy = args.get("type", "int"), args.get("num_bits"), args.get("strategy")
    symmetric = bool(args.get("symmetric", True))
    if kind != "int":
        raise _refuse(method, f"{kind} weights ({name})")
    if bits not in (4, 8):
        raise _refuse(method, f"num_bits={bits!r} ({name})")
    if bits == 8 and not symmetric:
        raise _refuse(method, f"8-bit asymmetric weights ({name})")
    if strategy not in ("group", "channel"):
        raise _refuse(method, f"strategy {strategy!r} ({name})")
    if args.get("dynamic"):
        raise _refuse(method, f"dynamic weight quantization ({name})")
    group = _group(method, args.get("group_size")) if strategy == "group" else None
    if strategy == "group" and group is None:
        raise _refuse(method, f"strategy group without a group_size ({name})")
    return QuantScheme(method, bits, group, symmetric)
