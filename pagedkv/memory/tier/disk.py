"""The disk tier: one file per KV block, written crash safe, checked before it is ever loaded.

A file (big-endian integers)::

    magic       8 bytes   b"PAGEDKV\\x01"
    header_len  4 bytes
    header_crc  4 bytes   crc32 of the header
    header      JSON: layout (model, dtype, kv_cache_dtype, block size, layers, KV heads, head
                dim, tensor-parallel rank and size), kind ("block" or "swap"), block_hash,
                parent_hash, token_ids, payload_bytes, payload_crc32
    payload     the block's bytes then its scales, as a host tier slot holds them

A hashed block's file is named after its chained hash and the rank (``<hash:016x>.r<rank>.kvblock``),
so a restart finds yesterday's prefixes by listing the folder; a swap file after its tier slot
(``swap-<slot>.r<rank>.kvblock``) -- swaps do not outlive the process. Every file is written to a
temporary name in the same folder, fsync'd, renamed over its final name, and the folder fsync'd:
a crash leaves the old file or the whole new one, never half of one, plus a temporary that the
next start-up removes.

What is never loaded: a file whose header names another layout (another model, dtype, block
size or rank wrote it), and one that is short, long, or fails a checksum (a torn or damaged
file). :meth:`DiskKVTier.scan` checks headers and sizes, and says in one line how many files it
skipped, by reason, with an example (a folder of another model's files is thousands of them);
every read checks the payload's checksum before a byte reaches the pool.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from pagedkv.memory.tier.host import KVLayout

logger = logging.getLogger("pagedkv.memory.tier.disk")

MAGIC = b"PAGEDKV\x01"
_PREAMBLE = struct.Struct(">8sII")  # magic, header length, header crc32
#: the largest header a reader accepts (a block's token ids and the layout: far less)
MAX_HEADER_BYTES = 1 << 20
SUFFIX = ".kvblock"
TEMP_PREFIX = ".tmp-"


#: Why a file is not loaded, as the start-up scan counts them.
TORN = "torn or damaged"
OTHER_LAYOUT = "written for another KV layout (model, dtype, block size or rank)"
OTHER_BLOCK = "holding another block than its name says"
FOREIGN = "not a pagedkv KV block file"
UNREADABLE = "unreadable"


class CorruptBlockError(ValueError):
    """A tier file that must not be loaded: torn, damaged, or written under another layout;
    ``reason`` is one of the reasons above."""

    def __init__(self, message: str, reason: str = TORN) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class DiskBlock:
    """A block file the scan found loadable: its name in the tier and when it was written."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    path: Path
    mtime: float


def block_file_name(block_hash: int, tp_rank: int) -> str:
    return f"{block_hash:016x}.r{tp_rank}{SUFFIX}"


def swap_file_name(slot: int, tp_rank: int) -> str:
    return f"swap-{slot}.r{tp_rank}{SUFFIX}"


def encode_block(layout: KVLayout, header: dict, payload: list[memoryview]) -> list[bytes | memoryview]:
    """The pieces of a file holding ``payload`` (written in order, never joined in memory)."""
    crc = 0
    for piece in payload:
        crc = zlib.crc32(piece, crc)
    full = {
        **header,
        "layout": layout.to_dict(),
        "payload_bytes": sum(p.nbytes for p in payload),
        "payload_crc32": crc,
    }
    head = json.dumps(full, sort_keys=True).encode()
    return [_PREAMBLE.pack(MAGIC, len(head), zlib.crc32(head)), head, *payload]


def read_header(path: Path, layout: KVLayout) -> tuple[dict, int]:
    """A file's header, checked against ``layout`` and the file's size; and where its payload
    starts. Raises :class:`CorruptBlockError` saying what is wrong."""
    with open(path, "rb") as f:
        return _checked_header(f, path.name, layout)


def read_payload(path: Path, layout: KVLayout, kind: str, block_hash: int | None = None) -> bytearray:
    """The checked payload of a ``kind`` file (of ``block_hash``, for a block file), read once."""
    with open(path, "rb") as f:
        header, _ = _checked_header(f, path.name, layout)
        if header.get("kind") != kind or (kind == "block" and header.get("block_hash") != block_hash):
            held = f"{header.get('kind')} {header.get('block_hash')}"
            raise CorruptBlockError(f"{path.name}: holds {held}, not {kind} {block_hash}", OTHER_BLOCK)
        payload = bytearray(header["payload_bytes"])
        got = f.readinto(payload)
    if got != len(payload) or zlib.crc32(payload) != header["payload_crc32"]:
        raise CorruptBlockError(f"{path.name}: damaged payload (checksum mismatch)")
    return payload


def _checked_header(f: BinaryIO, name: str, layout: KVLayout) -> tuple[dict, int]:
    preamble = f.read(_PREAMBLE.size)
    if len(preamble) < _PREAMBLE.size:
        raise CorruptBlockError(f"{name}: torn file ({len(preamble)} bytes, no header)")
    magic, head_len, head_crc = _PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise CorruptBlockError(f"{name}: not a pagedkv KV block file (magic {magic!r})", FOREIGN)
    if head_len > MAX_HEADER_BYTES:
        raise CorruptBlockError(f"{name}: header length {head_len} is implausible")
    head = f.read(head_len)
    if len(head) < head_len or zlib.crc32(head) != head_crc:
        raise CorruptBlockError(f"{name}: torn or damaged header (checksum mismatch)")
    try:
        header = json.loads(head)
        payload_bytes = int(header["payload_bytes"])
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptBlockError(f"{name}: unreadable header ({err})") from None
    if header.get("layout") != layout.to_dict():
        raise CorruptBlockError(
            f"{name}: written for another KV layout {header.get('layout')}, "
            f"this server's is {layout.to_dict()}",
            OTHER_LAYOUT,
        )
    start = _PREAMBLE.size + head_len
    size = os.fstat(f.fileno()).st_size
    if payload_bytes != layout.block_bytes or size != start + payload_bytes:
        raise CorruptBlockError(
            f"{name}: torn file ({size} bytes where the header says {start + payload_bytes})"
        )
    return header, start


def write_atomically(path: Path, pieces: list[bytes | memoryview]) -> None:
    """Write ``pieces`` to ``path`` so that a crash leaves the old file or the new one whole."""
    temp = path.with_name(f"{TEMP_PREFIX}{path.name}-{uuid.uuid4().hex}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for piece in pieces:
            view = memoryview(piece)
            while view.nbytes:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        temp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(temp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def payload_views(data: torch.Tensor, scales: torch.Tensor | None) -> list[memoryview]:
    """One block's bytes (``[*layout.data_shape]`` uint8) and scales, as buffers to write."""
    views = [memoryview(data.contiguous().numpy()).cast("B")]
    if scales is not None:
        views.append(memoryview(scales.contiguous().numpy().view(np.uint8)).cast("B"))
    return views


def split_payload(payload: bytearray, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The inverse of :func:`payload_views`: (bytes ``[*data_shape]``, scales or None), sharing
    ``payload``'s memory."""
    raw = torch.frombuffer(payload, dtype=torch.uint8)
    data = raw[: layout.data_bytes].view(layout.data_shape)
    if not layout.quantized:
        return data, None
    return data, raw[layout.data_bytes :].view(torch.float32).view(layout.scale_shape)


class DiskKVTier:
    """The files of one rank's disk tier in ``folder`` (see the module doc)."""

    def __init__(self, folder: str | Path, layout: KVLayout) -> None:
        self.folder = Path(folder)
        self.layout = layout
        self.folder.mkdir(parents=True, exist_ok=True)

    def block_path(self, block_hash: int) -> Path:
        return self.folder / block_file_name(block_hash, self.layout.tp_rank)

    def swap_path(self, slot: int) -> Path:
        return self.folder / swap_file_name(slot, self.layout.tp_rank)

    def write_block(
        self,
        block_hash: int,
        parent_hash: int | None,
        token_ids: tuple[int, ...],
        data: torch.Tensor,
        scales: torch.Tensor | None,
    ) -> None:
        header = {"kind": "block", "block_hash": block_hash, "parent_hash": parent_hash}
        header["token_ids"] = list(token_ids)
        pieces = encode_block(self.layout, header, payload_views(data, scales))
        write_atomically(self.block_path(block_hash), pieces)

    def write_swap(self, slot: int, data: torch.Tensor, scales: torch.Tensor | None) -> None:
        header = {"kind": "swap", "block_hash": None, "parent_hash": None, "token_ids": []}
        pieces = encode_block(self.layout, header, payload_views(data, scales))
        write_atomically(self.swap_path(slot), pieces)

    def read_block(self, block_hash: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A block file's bytes and scales, checked; :class:`CorruptBlockError` if it may not
        be loaded, ``FileNotFoundError`` if it is gone."""
        payload = read_payload(self.block_path(block_hash), self.layout, "block", block_hash)
        return split_payload(payload, self.layout)

    def read_swap(self, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return split_payload(read_payload(self.swap_path(slot), self.layout, "swap"), self.layout)

    def remove_block(self, block_hash: int) -> None:
        self.block_path(block_hash).unlink(missing_ok=True)

    def remove_swap(self, slot: int) -> None:
        self.swap_path(slot).unlink(missing_ok=True)

    def scan(self) -> list[DiskBlock]:
        """This rank's loadable block files, oldest first (the order to index them in, least
        recently used first). Removes what a crash or the last run left that no one can use
        (temporaries, swap files); skips the files it cannot load, and says so in one line."""
        found = []
        skipped: Counter[str] = Counter()
        example = ""
        rank = re.escape(f".r{self.layout.tp_rank}{SUFFIX}")
        block_name = re.compile(rf"([0-9a-f]{{16}}){rank}")
        for path in sorted(self.folder.iterdir()):
            name = path.name
            if name.startswith(TEMP_PREFIX) or re.fullmatch(rf"swap-\d+{rank}", name):
                path.unlink(missing_ok=True)
                continue
            match = block_name.fullmatch(name)
            if match is None:
                continue  # another rank's file, or not a tier file at all
            try:
                header, _ = read_header(path, self.layout)
                if header.get("kind") != "block" or header.get("block_hash") != int(match.group(1), 16):
                    raise CorruptBlockError(f"{name}: its header names another block", OTHER_BLOCK)
            except (CorruptBlockError, OSError) as err:
                skipped[getattr(err, "reason", UNREADABLE)] += 1
                example = example or f"{path}: {err}"
                continue
            parent = header["parent_hash"]
            tokens = tuple(header["token_ids"])
            found.append(DiskBlock(header["block_hash"], parent, tokens, path, path.stat().st_mtime))
        found.sort(key=lambda block: block.mtime)
        if skipped:
            reasons = ", ".join(f"{count} {reason}" for reason, count in skipped.most_common())
            logger.warning(
                "KV tier: not loading %d files of %s: %s; e.g. %s",
                skipped.total(),
                self.folder,
                reasons,
                example,
            )
        return found
