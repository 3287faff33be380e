"""The built-in model's text: the Python standard library's own source files.

Every Python installation has them, so training and evaluation need no download. The choice of
files is a pure function of their paths:

- every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, in sorted order of its
  POSIX path relative to that root, except those inside the folders in :data:`SKIPPED_DIRS`
  (test suites, which some distributions ship and others do not; installed third-party
  packages; the codec tables of ``encodings`` and the generated docs of ``pydoc_data``, which
  are data rather than code);
- a file is **held out** (never trained on) when the SHA-256 of its relative path, read as an
  integer, is divisible by :data:`HELD_OUT_EVERY`. The rule looks at the file's own path only,
  so a distribution that lacks some modules moves no other file between the two sets.

The text itself differs between Python versions, so each trained folder records the version
and a fingerprint of the text it saw (``training.json``).
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable
from pathlib import Path

#: One file in this many is held out.
HELD_OUT_EVERY = 10

#: Folder names (anywhere in a relative path) whose files are never used.
SKIPPED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "encodings",
        "pydoc_data",
        "lib-dynload",
    }
)


def stdlib_root() -> Path:
    """The folder of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the usable ``*.py`` files under ``root``, sorted."""
    root = stdlib_root() if root is None else Path(root)
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        folders = rel.parts[:-1]
        if any(part in SKIPPED_DIRS or part.startswith("config-") for part in folders):
            continue
        files.append(rel.as_posix())
    if not files:
        raise FileNotFoundError(f"no Python source files under {root}: is the standard library installed?")
    return sorted(files)


def is_held_out(relpath: str) -> bool:
    """Whether the file at ``relpath`` belongs to the held-out set (see the module docstring)."""
    return int(hashlib.sha256(relpath.encode("utf-8")).hexdigest(), 16) % HELD_OUT_EVERY == 0


def split_files(root: Path | None = None) -> tuple[list[str], list[str]]:
    """(training files, held-out files), each sorted."""
    files = source_files(root)
    return [f for f in files if not is_held_out(f)], [f for f in files if is_held_out(f)]


def read_sources(
    relpaths: Iterable[str], root: Path | None = None, max_chars: int | None = None
) -> list[str]:
    """The texts of ``relpaths`` in order, stopping before the file that would pass
    ``max_chars`` characters in all (at least one file is always read). Sources are UTF-8 by
    PEP 3120; a stray invalid byte becomes U+FFFD rather than an error."""
    root = stdlib_root() if root is None else Path(root)
    texts: list[str] = []
    total = 0
    for relpath in relpaths:
        text = (root / relpath).read_bytes().decode("utf-8", errors="replace")
        if max_chars is not None and texts and total + len(text) > max_chars:
            break
        texts.append(text)
        total += len(text)
    return texts


def fingerprint(relpaths: Iterable[str], texts: Iterable[str]) -> str:
    """SHA-256 over every (path, text) pair: equal fingerprints mean the same text was used."""
    digest = hashlib.sha256()
    for relpath, text in zip(relpaths, texts, strict=False):
        digest.update(relpath.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    return digest.hexdigest()
