"""A model folder's fingerprint: the name of its weights, for keys and values kept on disk.

Keys and values computed by one set of weights mean nothing under another, even of the same
shape; a disk KV tier's files therefore name the weights that wrote them, and a restarted
server loads only files written by the very same ones. The fingerprint is a sha256 over
``config.json`` and every weight file (a GGUF model: its parts), in name order (each file's own
digest, then the list).

Hashing gigabytes of weights takes a while, so each file's digest is remembered in a small
JSON file (``cache_file``, e.g. inside the disk tier's folder) under the file's path, size and
modification time: a restart with unchanged weights hashes nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from pagedkv.tokenizer.gguf_file import gguf_parts

logger = logging.getLogger("pagedkv.models.fingerprint")

#: The files whose contents decide a layer's keys and values.
WEIGHT_PATTERNS = ("config.json", "*.safetensors", "*.bin", "*.pt")
_CHUNK = 1 << 22


def weight_files(folder: Path) -> list[Path]:
    """The files the fingerprint covers, in name order: a GGUF model's parts, else the folder's
    config and weights."""
    gguf = gguf_parts(folder)
    if gguf is not None:
        return gguf
    found = {path for pattern in WEIGHT_PATTERNS for path in folder.glob(pattern) if path.is_file()}
    return sorted(found, key=lambda path: path.name)


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def model_fingerprint(folder: str | Path, cache_file: str | Path | None = None) -> str:
    """``"sha256:<hex>"`` of the model in ``folder`` (see the module doc); ``cache_file``
    remembers each file's digest under its path, size and modification time."""
    folder = Path(folder).resolve()
    files = weight_files(folder)
    if not files:
        raise FileNotFoundError(f"no config.json or weight files in {folder} to fingerprint")
    cache = _read_cache(cache_file)
    total = hashlib.sha256()
    for path in files:
        stat = path.stat()
        key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
        digest = cache.get(key)
        if digest is None:
            digest = cache[key] = file_digest(path)
        total.update(f"{path.name}:{digest}\n".encode())
    if cache_file is not None:
        _write_cache(Path(cache_file), cache)
    return f"sha256:{total.hexdigest()}"


def _read_cache(cache_file: str | Path | None) -> dict[str, str]:
    if cache_file is None:
        return {}
    try:
        cache = json.loads(Path(cache_file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(cache_file: Path, cache: dict[str, str]) -> None:
    """Best effort: a cache that cannot be written only costs the next start a rehash."""
    temp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
    try:
        temp.write_text(json.dumps(cache, sort_keys=True), encoding="utf-8")
        os.replace(temp, cache_file)
    except OSError as err:
        logger.warning("could not remember the model's fingerprint in %s: %s", cache_file, err)
        temp.unlink(missing_ok=True)
