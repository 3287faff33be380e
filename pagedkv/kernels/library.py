"""The kernels library: every C source in ``csrc/`` compiled together into one shared library on
first use (:mod:`pagedkv.cbuild`), loaded once per process, each entry point given its signature
from :mod:`.signatures`.

This is the only place the library is built or loaded. When it cannot be (no C compiler, a
compiler that rejects every flag set, a cached file this machine cannot load), :func:`load`
raises :class:`KernelsUnavailable` with the reason, the same reason every time, and each caller
falls back to its torch reference: the engine still runs, slower.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from pagedkv import cbuild
from pagedkv.kernels.signatures import SIGNATURES

CSRC = Path(__file__).parent / "csrc"
NAME = "pagedkv_kernels"

#: an entry point: called with addresses and numbers, it returns its C result
Entry = Callable[..., "int | None"]


class KernelsUnavailable(RuntimeError):
    """pagedkv's CPU kernels cannot run on this machine; the message says why."""


class KernelLibrary:
    """The loaded library; :meth:`entry` is an entry point by its C name, typed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._library = ctypes.CDLL(str(path))  # held: its functions live as long as it does
        self._entries: dict[str, Entry] = {}
        for name, signature in SIGNATURES.items():
            try:
                fn = getattr(self._library, name)
            except AttributeError:  # float16 is missing from builds without _Float16
                continue
            fn.restype, fn.argtypes = signature.result, signature.arguments
            self._entries[name] = fn

    def entry(self, name: str) -> Entry | None:
        """The entry point ``name`` (``rms_norm_bf16``...), or None when this build lacks it."""
        return self._entries.get(name)


def sources() -> list[Path]:
    """The library's C sources (``csrc/*.c``; every header beside them is part of its key)."""
    return sorted(CSRC.glob("*.c"))


def build(flag_sets: Sequence[Sequence[str]] = cbuild.FLAG_SETS) -> Path:
    """The library file, compiled with the first of ``flag_sets`` that works unless already
    cached; :class:`KernelsUnavailable` when none does."""
    try:
        return cbuild.build_library(NAME, sources(), flag_sets)
    except cbuild.BuildError as exc:
        raise KernelsUnavailable(str(exc)) from None


@functools.cache
def _loaded() -> KernelLibrary | str:
    """The library, or why it is unavailable: decided once per process."""
    try:
        path = build()
    except KernelsUnavailable as exc:
        return str(exc)
    try:
        return KernelLibrary(path)
    except OSError as exc:
        return f"could not load {path}: {exc}"


def load() -> KernelLibrary:
    """The library, built on first use; :class:`KernelsUnavailable` saying why not."""
    loaded = _loaded()
    if isinstance(loaded, str):
        raise KernelsUnavailable(loaded)
    return loaded


def why_unavailable() -> str | None:
    """Why the library cannot run here, or None when it can."""
    loaded = _loaded()
    return loaded if isinstance(loaded, str) else None
