"""A GGUF file (llama.cpp's format) as pagedkv opens it: which files hold the model, each opened
memory-mapped, and its metadata read as Python values.

A GGUF model is one ``.gguf`` file, or a split model ``name-00001-of-0000N.gguf`` ... whose first
part holds the metadata and every part some of the tensors; naming any part, or a folder
holding one model's parts (and no config.json), opens all of them. ``gguf.GGUFReader`` maps each
file (copy-on-write, so arrays are writable and nothing is copied until written) and reads only
its header: tensor data stays on disk until a weight is converted.

Every way a file can fail to open -- not a GGUF file, cut short, a damaged header -- is one
:class:`GGUFError` naming the file and the problem, never a decoding error deep in numpy.

This module lives with the tokenizer because both sides read GGUF metadata: the tokenizer
package stands alone (no torch, nothing else of pagedkv) and the model side may import it.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gguf import GGUFReader

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


def open_gguf(file: Path) -> GGUFReader:
    """``file`` opened memory-mapped; a :class:`GGUFError` naming it when it is not a whole GGUF file.

    The config, the tokenizer and the loader each open the model: parsing a header with a large
    vocabulary takes seconds, so the last few readers are kept, each under the file's identity
    (path, size, modification time) -- a rewritten file is parsed anew."""
    stat = Path(file).stat()
    return _open(Path(file).resolve(), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _reader_class() -> type[GGUFReader]:
    """``GGUFReader`` slicing a plain array view of its mapping: a vocabulary's 100,000 strings
    are 200,000 slices, each several times slower on ``np.memmap`` than on its base class. The
    view shares the mapping; should the reader's parsing step be renamed, this only does nothing.
    Made on first use, so that importing pagedkv does not import gguf."""
    import numpy as np
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        def _build_fields(self, offs: int, count: int) -> int:
            self.data = self.data.view(np.ndarray)
            return super()._build_fields(offs, count)

    return PlainViewReader


def release_readers() -> None:
    """Forget the readers :func:`open_gguf` keeps: their mappings hold the files' pages, which
    count in the process's memory once read, and a loaded model has its own copy of every weight."""
    _open.cache_clear()


@functools.lru_cache(maxsize=4)
def _open(file: Path, size: int, mtime_ns: int) -> GGUFReader:
    with open(file, "rb") as f:
        head = f.read(len(MAGIC))
    if head != MAGIC:
        raise GGUFError(f"{file} is not a GGUF file: it starts with {head!r}, not {MAGIC!r}")
    try:
        return _reader_class()(file, "c")
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as err:
        # the reader slices its header and every tensor out of the mapping: a file cut short
        # fails there, as an index or reshape error
        raise GGUFError(f"{file} is truncated or damaged ({size} bytes): {err}") from None


def field(reader: GGUFReader, key: str, default: Any = _UNSET, file: Path | None = None) -> Any:
    """The value of metadata ``key`` (a number, a string, or a list of them); ``default`` when
    absent, or a :class:`GGUFError` naming ``file`` and the key when there is no default."""
    entry = reader.fields.get(key)
    if entry is None:
        if default is _UNSET:
            raise GGUFError(f"{file or 'the GGUF file'} lacks the metadata key {key!r}")
        return default
    try:
        value = entry.contents()
    except UnicodeDecodeError as err:
        raise GGUFError(f"{file or 'the GGUF file'}: metadata {key!r} is not valid UTF-8 ({err})") from None
    from gguf import GGUFValueType

    if entry.types == [GGUFValueType.FLOAT32]:
        import numpy as np

        # the shortest decimal that is this float32: the value the writer meant (1e-05, not 9.9999997e-06)
        return float(str(np.float32(value)))
    return value
