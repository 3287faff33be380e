"""Compile a C source of this package into a shared library, once per source, flags and CPU.

The CPU kernels (paged attention, the decoder layer's fused element-wise ops) are plain C with
OpenMP, compiled on first use with the system C compiler (``$CC``, else ``cc``) for this machine
(``-march=native``) in well under a second, cached under ``$PAGEDKV_KERNEL_CACHE`` (default
``~/.cache/pagedkv``) by a hash of the source, the flags and the CPU's feature flags, and called
through :mod:`ctypes` (which releases the GIL). Once torch is imported, its own OpenMP runtime is
the one a library links against, so they share a thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

#: tried in order; each later set gives up something the compiler may lack
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"],
    ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-DPAGEDKV_NO_F16"],  # no _Float16
    ["-O3", "-shared", "-fPIC", "-DPAGEDKV_NO_F16"],  # no OpenMP (Apple clang): single-threaded
)


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


def _compile(compiler: str, flags: list[str], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *flags, "-o", tmp, str(source), "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(source: Path) -> Path | str:
    """The shared library built from ``source`` (compiled now unless cached), or a string
    saying why it could not be built."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return "no C compiler found (set $CC)"
    if not source.exists():
        return f"the kernel source {source} is missing from this installation"
    text = source.read_bytes()
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), _cpu_fingerprint().encode()]))
        target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
        try:
            if not target.exists():
                _compile(compiler, flags, source, target)
            return target
        except (OSError, subprocess.CalledProcessError) as exc:  # no such flag, unwritable cache, ...
            detail = getattr(exc, "stderr", "") or str(exc)
            errors.append(f"{compiler} {' '.join(flags)}: {detail.strip()[:500]}")
    where = f"{cache_dir()} (set $PAGEDKV_KERNEL_CACHE)"
    return f"could not build {source.name} in {where}: " + " | ".join(errors)


def load(source: Path) -> ctypes.CDLL | str:
    """The shared library built from ``source``, loaded, or a string saying why it could not be
    built or loaded (a cached file this machine cannot load)."""
    built = build(source)
    if isinstance(built, str):
        return built
    try:
        return ctypes.CDLL(str(built))
    except OSError as exc:
        return f"could not load {built}: {exc}"
