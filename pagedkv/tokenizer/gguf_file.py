"""A GGUF file (llama.cpp's format) as pagedkv opens it: which files hold the model, each opened
memory-mapped, and its metadata read as Python values.

A GGUF model is one ``.gguf`` file, or a split model ``name-00001-of-0000N.gguf`` ... whose first
part holds the metadata and every part some of the tensors; naming any part, or a folder
holding one model's parts (and no config.json), opens all of them. Each file is mapped
copy-on-write (arrays are writable and nothing is copied until written) and only its header is
read (:class:`~pagedkv.tokenizer.gguf_reader.GGUFFile`): tensor data stays on disk until a
weight is converted, and a metadata value becomes Python objects only when it is asked for.

Every way a file can fail to open -- not a GGUF file, cut short, a damaged header -- is one
:class:`GGUFError` naming the file and the problem, never a decoding error deep in numpy.

This module lives with the tokenizer because both sides read GGUF metadata: the tokenizer
package stands alone (no torch, nothing else of pagedkv) and the model side may import it.
"""

from __future__ import annotations

import functools
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.tokenizer.gguf_reader import GGUFFile

SUFFIX = ".gguf"
MAGIC = b"GGUF"
#: llama.cpp's name of one part of a split model (gguf-split, GGUFWriter's shards).
_SPLIT_PART = re.compile(r"(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf")
_UNSET = object()


class GGUFError(ValueError):
    """A GGUF model that cannot be opened; the message names the file and the problem."""


def gguf_parts(path: str | Path) -> list[Path] | None:
    """The files of the GGUF model at ``path``, first part first, or None when ``path`` is no
    GGUF model (a Hugging Face folder: one with config.json, or without any .gguf file).

    ``path`` is a .gguf file (any part of a split model stands for all of them) or a folder
    holding one model's .gguf file(s); a folder with several models is an error naming them."""
    path = Path(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        files = sorted(path.glob("*" + SUFFIX))
        if not files:
            return None
        models = sorted({_model_name(file) for file in files})
        if len(models) > 1:
            raise GGUFError(f"{path} holds {len(models)} GGUF models {models}: name the file to load")
        return _split_parts(files[0])
    if path.suffix == SUFFIX:
        return _split_parts(path)
    return None


def _model_name(file: Path) -> str:
    match = _SPLIT_PART.fullmatch(file.name)
    return file.name if match is None else f"{match['stem']}{SUFFIX}"


def _split_parts(file: Path) -> list[Path]:
    match = _SPLIT_PART.fullmatch(file.name)
    if match is None:
        if not file.is_file():
            raise FileNotFoundError(f"no GGUF file {file}")
        return [file]
    count = int(match["count"])
    parts = [file.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}{SUFFIX}") for i in range(1, count + 1)]
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{file.name} is one of {count} parts of a split GGUF model; missing beside it: {missing}"
        )
    return parts


def open_gguf(file: Path) -> GGUFFile:
    """``file`` opened memory-mapped; a :class:`GGUFError` naming it when it is not a whole GGUF file.

    The config, the tokenizer and the loader each open the model, so the last few readers are
    kept (the header is walked once), each under the file's identity (path, size, modification
    time) -- a rewritten file is read anew."""
    stat = Path(file).stat()
    return _open(Path(file).resolve(), stat.st_size, stat.st_mtime_ns)


def release_readers() -> None:
    """Forget the readers :func:`open_gguf` keeps: their mappings hold the files' pages, which
    count in the process's memory once read, and a loaded model has its own copy of every weight."""
    _open.cache_clear()


@functools.lru_cache(maxsize=4)
def _open(file: Path, size: int, mtime_ns: int) -> GGUFFile:
    with open(file, "rb") as f:
        head = f.read(len(MAGIC))
    if head != MAGIC:
        raise GGUFError(f"{file} is not a GGUF file: it starts with {head!r}, not {MAGIC!r}")
    from pagedkv.tokenizer.gguf_reader import GGUFFile  # numpy and gguf on first use only

    try:
        return GGUFFile(file)
    except (ValueError, IndexError, OverflowError, struct.error) as err:
        # the reader walks its header and slices every tensor out of the mapping: a file cut
        # short fails there, reading past the end
        raise GGUFError(f"{file} is truncated or damaged ({size} bytes): {err}") from None


def field(reader: GGUFFile, key: str, default: Any = _UNSET, file: Path | None = None) -> Any:
    """The value of metadata ``key`` (a number, a string, or a list of them); ``default`` when
    absent, or a :class:`GGUFError` naming ``file`` and the key when there is no default."""
    if key not in reader.fields:
        if default is _UNSET:
            raise GGUFError(f"{file or 'the GGUF file'} lacks the metadata key {key!r}")
        return default
    try:
        return reader.value(key)
    except UnicodeDecodeError as err:
        raise GGUFError(f"{file or 'the GGUF file'}: metadata {key!r} is not valid UTF-8 ({err})") from None
