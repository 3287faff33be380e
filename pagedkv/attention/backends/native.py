"""Build and load the C paged-attention kernel for the CPU (``csrc/paged_attention_cpu.c``).

The kernel reads keys and values in place from the block pool, which no composition of torch
operators can do without first copying every context (see ``benchmarks/attention.py`` for the
numbers). It is plain C with OpenMP, compiled on first use with the system C compiler (``$CC``,
else ``cc``) for this machine (``-march=native``) in well under a second, cached under
``$PAGEDKV_KERNEL_CACHE`` (default ``~/.cache/pagedkv``) by a hash of the source, the flags
and the CPU's feature flags, and called through :mod:`ctypes` (which releases the GIL). Once
torch is imported, its own OpenMP runtime is the one the kernel links against, so the two
share a thread pool. When no compiler is available, :func:`load` returns ``None`` and says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.c"
#: tried in order; each later set gives up something the compiler may lack
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"],
    ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-DPAGEDKV_NO_F16"],  # no _Float16
    ["-O3", "-shared", "-fPIC", "-DPAGEDKV_NO_F16"],  # no OpenMP (Apple clang): single-threaded
)
SUFFIXES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
#: quantized pool element types: entry ``paged_attention_rows_<query suffix>_<this>``
POOL_SUFFIXES = {torch.float8_e4m3fn: "fp8", torch.int8: "i8"}
MAX_GROUP = 64  # the kernel's limit on query heads per KV head is its stack arrays; see the source

_ARGTYPES = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64, ctypes.c_float]
_ARGTYPES += [ctypes.c_int64, ctypes.c_int]


class NativeKernel:
    """The compiled library; ``fn(dtype, pool_dtype)`` is the entry point for a query in ``dtype``
    over pools of ``pool_dtype`` (the same dtype, or a quantized one with scales)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.functions = {}
        for dtype, suffix in SUFFIXES.items():
            pools = {dtype: suffix} | {pool: f"{suffix}_{name}" for pool, name in POOL_SUFFIXES.items()}
            for pool, name in pools.items():
                entry = f"paged_attention_rows_{name}"
                if hasattr(self.lib, entry):  # float16 is missing from builds without _Float16
                    fn = getattr(self.lib, entry)
                    fn.restype = ctypes.c_int
                    fn.argtypes = _ARGTYPES
                    self.functions[dtype, pool] = fn

    def fn(self, dtype: torch.dtype, pool_dtype: torch.dtype | None = None):
        """The entry point for these dtypes (``pool_dtype`` defaults to ``dtype``), or ``None``
        when this build lacks it."""
        return self.functions.get((dtype, pool_dtype or dtype))


def _cpu_fingerprint() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    root = os.environ.get("PAGEDKV_KERNEL_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedkv"


def _compile(compiler: str, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, text=True
        )
        os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> NativeKernel | str:
    """The kernel, or a string saying why it could not be built."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return "no C compiler found (set $CC)"
    if not SOURCE.exists():
        return f"the kernel source {SOURCE} is missing from this installation"
    source = SOURCE.read_bytes()
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), _cpu_fingerprint().encode()]))
        target = cache_dir() / f"paged_attention_cpu-{key.hexdigest()[:16]}.so"
        try:
            if not target.exists():
                _compile(compiler, flags, target)
            return NativeKernel(target)
        except (OSError, subprocess.CalledProcessError) as exc:  # no such flag, unwritable cache, ...
            detail = getattr(exc, "stderr", "") or str(exc)
            errors.append(f"{compiler} {' '.join(flags)}: {detail.strip()[:500]}")
    return (
        f"could not build the CPU attention kernel in {cache_dir()} (set $PAGEDKV_KERNEL_CACHE): "
        + " | ".join(errors)
    )
