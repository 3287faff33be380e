"""The dtypes a model runs in: their names in config.json and on the command line, and the one
that ``"auto"`` picks on a device."""

from __future__ import annotations

import torch

from pagedkv.config.model import DTYPE_NAMES

#: dtype names accepted in config.json and by :func:`pagedkv.models.load_model`.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
assert ("auto", *DTYPES) == DTYPE_NAMES  # the torch-free list the engine's options are checked against


def resolve_dtype(
    dtype: torch.dtype | str | None,
    default: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> torch.dtype:
    """A torch dtype from a torch dtype, a name ('bfloat16', 'torch.float16'), None (-> default)
    or "auto" (-> :func:`auto_dtype` of ``device``)."""
    if dtype is None:
        return default
    if dtype == "auto":
        return auto_dtype(device)
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; choose one of {list(DTYPES)}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of ['auto', *{list(DTYPES)}]")
    return DTYPES[name]


def auto_dtype(device: str | torch.device) -> torch.dtype:
    """bfloat16 where the hardware multiplies it natively (CUDA; a CPU with AVX512-BF16 or AMX),
    float32 elsewhere: emulated bfloat16 is slower than float32 and only loses precision."""
    if torch.device(device).type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: torch's own probes, else the flags in /proc/cpuinfo."""
    names = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    probes = [getattr(torch.cpu, name, None) for name in names]
    if any(probe is not None and probe() for probe in probes):
        return True
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the spelling KVSpec and config.json use."""
    return str(dtype).removeprefix("torch.")
