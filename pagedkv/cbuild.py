"""Compile C sources of this package into a shared library, once per sources, flags and CPU.

pagedkv's C is compiled on first use with the system C compiler (``$CC``, else ``cc``, ``gcc``
or ``clang``) for this machine (``-march=native``, OpenMP), each source of a library in its own
process, and cached under ``$PAGEDKV_KERNEL_CACHE`` (default ``~/.cache/pagedkv``) by a hash of
the sources, the headers beside them, the flags and the CPU's feature flags. A library is
written to a temporary name and renamed into place, so concurrent builders never load a
half-written file. Once torch is imported, its own OpenMP runtime is the one a library links
against, so they share a thread pool.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

#: compiler flags, tried in order; each later set gives up something the compiler may lack
FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-march=native", "-fopenmp", "-DPAGEDKV_NO_F16"),  # no _Float16
    ("-O3", "-DPAGEDKV_NO_F16"),  # no OpenMP (Apple clang): single-threaded
)


class BuildError(RuntimeError):
    """A library could not be built: no compiler, a missing source, or every flag set failed."""


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


def compiler() -> str:
    """The C compiler's path; :class:`BuildError` when there is none."""
    found = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if found is None:
        raise BuildError("no C compiler found: install gcc or clang, or set $CC")
    return found


def _link(cc: str, flags: Sequence[str], sources: Sequence[Path], target: Path) -> None:
    """Compile every source to an object (all at once) and link them into ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = [Path(scratch) / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]
        includes = sorted({f"-I{source.parent}" for source in sources})
        running: list[subprocess.Popen] = []
        try:
            for source, obj in zip(sources, objects, strict=True):
                command = [cc, *flags, "-fPIC", *includes, "-c", str(source), "-o", str(obj)]
                running.append(subprocess.Popen(command, stderr=subprocess.PIPE, text=True))
        finally:  # every compiler started is waited for, even when a later one cannot start
            outcomes = [(process.communicate()[1], process.returncode) for process in running]
        failures = [stderr or f"{cc} exited with {code}" for stderr, code in outcomes if code]
        if failures:
            raise subprocess.CalledProcessError(1, cc, stderr="\n".join(failures))
        linked = Path(scratch) / "library.so"
        command = [cc, *flags, "-shared", "-o", str(linked), *map(str, objects), "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(linked, target)


def build_library(name: str, sources: Sequence[Path], flag_sets: Sequence[Sequence[str]] = FLAG_SETS) -> Path:
    """The shared library ``name`` built from ``sources`` (compiled now unless cached), with the
    first flag set that compiles; :class:`BuildError` saying why when none does."""
    cc = compiler()
    missing = [str(source) for source in sources if not source.exists()]
    if missing:
        raise BuildError(f"C sources missing from this installation: {', '.join(missing)}")
    headers = sorted({h for source in sources for h in source.parent.glob("*.h")})
    contents = [path.read_bytes() for path in (*sources, *headers)]
    errors = []
    for flags in flag_sets:
        key = hashlib.sha256(b"\0".join([*contents, " ".join(flags).encode(), _cpu_fingerprint().encode()]))
        target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
        try:
            if not target.exists():
                _link(cc, flags, sources, target)
            return target
        except (OSError, subprocess.CalledProcessError) as exc:  # no such flag, unwritable cache, ...
            detail = getattr(exc, "stderr", "") or str(exc)
            errors.append(f"{cc} {' '.join(flags)}: {detail.strip()[:500]}")
    where = f"{cache_dir()} (set $PAGEDKV_KERNEL_CACHE)"
    raise BuildError(f"could not build {name} in {where}: " + " | ".join(errors))
