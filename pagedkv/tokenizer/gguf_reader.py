"""A GGUF file's header read without keeping a Python object per vocabulary entry.

``gguf.GGUFReader`` turns every element of every metadata array into numpy views (two per
string): a 50,000-token vocabulary with its merges is a quarter of a million small arrays, tens
of MiB of heap that the process keeps, fragmented, long after the reader is gone. This reader
walks the same header (GGUF versions 2 and 3, little-endian) but records only where each
metadata value starts; a value becomes Python objects when asked for
(:meth:`GGUFFile.value`), and the caller's list is the only copy of it. The tensors are
described as ``gguf.ReaderTensor`` describes them -- ggml type, ggml shape (row length first),
and ``data``: a numpy view of the memory-mapped file in the layout gguf gives it (elements for
the plain float and integer types, whole blocks of bytes for the others, BF16 included).

The mapping is copy-on-write: the arrays are writable, and nothing of the file is read until a
tensor's data is.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

#: The GGUF versions whose header this reader knows (version 1 counted lengths in 32 bits).
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_UINT32, _FLOAT32, _STRING, _ARRAY = 4, 6, 8, 9
#: GGUF's scalar value types: type code -> struct format (little-endian)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
#: ggml types stored as plain elements, with their numpy dtype; every other type is bytes
_ELEMENTS = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


class GGUFTensorInfo(NamedTuple):
    """One tensor of the file: the fields of ``gguf.ReaderTensor`` that pagedkv reads."""

    name: str
    #: a ``gguf.GGMLQuantizationType``, or the plain number of a type gguf does not know
    tensor_type: int
    #: ggml's dimensions, row length first (uint64)
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    #: where the data starts in the file
    data_offset: int
    #: the data, or None for a type gguf does not know (its size is unknown)
    data: np.ndarray | None


class GGUFFile:
    """The header of a GGUF file: ``fields`` (the metadata keys, in file order), :meth:`value`
    and ``tensors``. A file that is not a whole GGUF file raises ``ValueError``, ``IndexError``
    or ``struct.error`` here (the caller names the file)."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self._data = np.memmap(path, mode="c").view(np.ndarray)  # slicing a plain view is cheaper
        self._buffer = memoryview(self._data)
        (version,) = struct.unpack_from("<I", self._buffer, 4)  # the caller checked the magic
        if version not in VERSIONS:
            order = "big-endian or " if version & 0xFFFF == 0 else ""
            raise ValueError(f"it is a {order}GGUF version pagedkv cannot read ({version}; reads {VERSIONS})")
        tensor_count, kv_count = struct.unpack_from("<QQ", self._buffer, 8)
        offset = 24
        #: metadata key -> (value type, offset of the value)
        self.fields: dict[str, tuple[int, int]] = {}
        for _ in range(kv_count):
            key, offset = self._string(offset)
            (kind,) = struct.unpack_from("<I", self._buffer, offset)
            if key in self.fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            self.fields[key] = (kind, offset + 4)
            offset = self._skip(kind, offset + 4)
        infos = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            (dims,) = struct.unpack_from("<I", self._buffer, offset)
            shape = np.frombuffer(self._buffer, np.uint64, dims, offset + 4).copy()
            kind, start = struct.unpack_from("<IQ", self._buffer, offset + 4 + 8 * dims)
            infos.append((name, shape, kind, start))
            offset += 4 + 8 * dims + 12
        alignment = self.value("general.alignment", DEFAULT_ALIGNMENT)
        uint32 = self.fields.get("general.alignment", (_UINT32,))[0] == _UINT32
        if not uint32 or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a uint32 power of two")
        self.data_offset = -(-offset // alignment) * alignment
        self.tensors: list[GGUFTensorInfo] = []
        names = set()
        for name, shape, kind, start in infos:
            if name in names:
                raise ValueError(f"tensor {name!r} appears twice")
            names.add(name)
            try:
                qtype, known = GGMLQuantizationType(kind), True
            except ValueError:  # named by number where the types are checked
                qtype, known = kind, False
            elements = int(np.prod(shape))
            block, type_size = GGML_QUANT_SIZES[qtype] if known else (1, 0)
            nbytes = elements * type_size // block
            data = self._tensor_data(name, qtype, shape, self.data_offset + start, nbytes) if known else None
            self.tensors.append(
                GGUFTensorInfo(name, qtype, shape, elements, nbytes, self.data_offset + start, data)
            )

    def value(self, key: str, default: Any = None) -> Any:
        """Metadata ``key`` as Python values (an int, float, bool, str, or a list of them;
        float32 scalars as the shortest decimal that is the float32), or ``default``."""
        entry = self.fields.get(key)
        if entry is None:
            return default
        kind, offset = entry
        if kind == _FLOAT32:
            return float(str(np.float32(struct.unpack_from("<f", self._buffer, offset)[0])))
        return self._read(kind, offset)[0]

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._buffer, offset)
        end = offset + 8 + length
        if end > len(self._buffer):
            raise ValueError(f"a string of {length} bytes at {offset} runs past the end")
        return str(self._buffer[offset + 8 : end], "utf-8"), end

    def _skip(self, kind: int, offset: int) -> int:
        """The offset after a value of type ``kind`` at ``offset``, nothing decoded."""
        if kind in _SCALARS:
            return offset + struct.calcsize(_SCALARS[kind])
        if kind == _STRING:
            return offset + 8 + struct.unpack_from("<Q", self._buffer, offset)[0]
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = struct.unpack_from("<IQ", self._buffer, offset)
        offset += 12
        if item in _SCALARS:
            return offset + count * struct.calcsize(_SCALARS[item])
        for _ in range(count):
            offset = self._skip(item, offset)
        return offset

    def _read(self, kind: int, offset: int) -> tuple[Any, int]:
        """The value of type ``kind`` at ``offset``, and the offset after it."""
        if kind in _SCALARS:
            fmt = "<" + _SCALARS[kind]
            return struct.unpack_from(fmt, self._buffer, offset)[0], offset + struct.calcsize(fmt)
        if kind == _STRING:
            return self._string(offset)
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = struct.unpack_from("<IQ", self._buffer, offset)
        offset += 12
        if item in _SCALARS:  # one unpack for the whole array
            fmt = f"<{count}{_SCALARS[item]}"
            return list(struct.unpack_from(fmt, self._buffer, offset)), offset + struct.calcsize(fmt)
        values = []
        for _ in range(count):
            value, offset = self._read(item, offset)
            values.append(value)
        return values, offset

    def _tensor_data(self, name: str, qtype: Any, shape: np.ndarray, start: int, nbytes: int) -> np.ndarray:
        """The tensor's data as gguf's reader shapes it: dimensions reversed (rows first), the
        row in elements for the plain types, in bytes (whole blocks) for the others."""
        if start + nbytes > len(self._data):
            raise ValueError(f"tensor {name!r} ends at byte {start + nbytes}, past the end of the file")
        dims = [int(d) for d in reversed(shape.tolist())]
        raw = self._data[start : start + nbytes]
        dtype = _ELEMENTS.get(int(qtype))
        if dtype is not None:
            return raw.view(dtype).reshape(dims)
        from gguf.quants import quant_shape_to_byte_shape

        return raw.reshape(quant_shape_to_byte_shape(dims, qtype))
