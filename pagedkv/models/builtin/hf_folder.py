"""Hugging Face folders that pagedkv writes itself: JSON files as transformers writes them, and
folders made once in a cache.

:func:`cached_checkpoint` creates a folder atomically: the files are written to a temporary
folder beside the target, which is then renamed into place, so a crash or a concurrent first use
never leaves a half-written model behind (the loser of a race simply discards its copy).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_json(file: Path, data: dict[str, Any]) -> None:
    """``data`` as indented JSON with a final newline (config.json, generation_config.json, ...)."""
    file.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def default_cache_dir() -> Path:
    """``$PAGEDKV_CACHE``, else ``~/.cache/pagedkv``."""
    env = os.environ.get("PAGEDKV_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pagedkv"


def cached_checkpoint(root: Path, name: str, write: Callable[[Path], None]) -> Path:
    """``root/name``, made by ``write(folder)`` on first use (atomically, see the module)."""
    target = root / name
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        os.chmod(tmp, 0o755)
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
