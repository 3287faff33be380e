"""Start-up checks of a second KV tier: refused with the figures, before anything is allocated.

A host tier larger than the memory the system can give (``MemAvailable``) would push the
server into swap or the OOM killer hours later; a disk tier larger than the free space would
fail its writes one by one; an unwritable folder would fail every write. Each is a
configuration error, said at start-up with the numbers to change.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from pagedkv.memory.pool_sizing import available_host_memory
from pagedkv.memory.tier.disk import SUFFIX, fsync_dir


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB ({num_bytes} bytes)"


def check_host_tier(size_bytes: int) -> None:
    """Refuse a host tier of ``size_bytes`` that the host cannot hold."""
    if size_bytes <= 0:
        raise ValueError(f"--kv-offloading-size must be positive, got {size_bytes} bytes")
    available = available_host_memory()
    if size_bytes > available:
        raise ValueError(
            f"--kv-offloading-size {gib(size_bytes)} is more than the host memory available: "
            f"{gib(available)} (MemAvailable). Lower --kv-offloading-size."
        )


def check_disk_tier(folder: str | Path, size_bytes: int) -> None:
    """Refuse a disk tier of ``size_bytes`` in ``folder`` (created if missing) that the folder
    cannot take: unwritable, or less free space than the tier needs beyond the block files it
    already holds (a restart reuses them)."""
    if size_bytes <= 0:
        raise ValueError(f"--kv-offloading-size must be positive, got {size_bytes} bytes")
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{uuid.uuid4().hex}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"pagedkv")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
        fsync_dir(path)
    except OSError as err:
        raise ValueError(f"--kv-offload-dir {path} is not a writable folder: {err}") from None
    held = sum(f.stat().st_size for f in path.iterdir() if f.name.endswith(SUFFIX) and f.is_file())
    free = shutil.disk_usage(path).free
    if size_bytes > free + held:
        raise ValueError(
            f"--kv-offloading-size {gib(size_bytes)} is more than the disk tier can take in {path}: "
            f"{gib(free)} free plus {gib(held)} of its block files. Lower --kv-offloading-size or "
            f"choose another --kv-offload-dir."
        )
