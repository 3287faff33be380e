"""How many blocks the KV pool gets: the size given, or by default ("auto") a share of the memory
left once the weights are loaded.

The rule, for each rank (:func:`auto_pool_blocks`)::

    share  = AUTO_KV_SHARE * available / ranks_sharing
    cap    = max_num_seqs * request blocks
    floor  = request blocks
    blocks = max(floor, min(cap, share // block_bytes))

``available`` is what the device can still hand out with the weights in place (the host's
``MemAvailable``, or less inside a container whose memory limit is lower; a CUDA device's free
memory). Half of it is left as headroom: for the step's activations, the server and the
tokenizer, and on the CPU for the OS and the other processes of the machine. The ranks of one
machine that draw on the same memory (the CPU's) split the share between them.

``request blocks`` is what one request at the full context holds at its peak:
``ceil(max_model_len / block_size)``, or with KV groups the sum over the groups (a sliding group
holds about its window) and the null block (the executors count it,
:func:`~pagedkv.memory.hybrid_manager.group_peak_blocks`). The cap is what ``max_num_seqs``
sequences at the full context can hold at once: a larger pool
could only keep more finished prefixes cached, so a small model on a big machine takes what
its batch can use, not half the machine. The floor is one request at the full context, so any
request the engine admits fits; when even that is more than ``available``, the engine refuses
to start, naming the options that shrink it.

Pure Python (no torch): the executors measure ``available`` and the block's bytes and call in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pagedkv.memory.block_table import blocks_for
from pagedkv.memory.kv_bytes import parse_bytes

#: The share of the memory left after the weights that the auto-sized pool takes (per machine).
AUTO_KV_SHARE = 0.5
#: ``kv_cache_memory``'s value that sizes the pool by the rule above.
AUTO = "auto"


def size_text(num_bytes: int) -> str:
    """GiB with two decimals; MiB below one GiB."""
    if num_bytes < 2**30:
        return f"{num_bytes / 2**20:.1f} MiB"
    return f"{num_bytes / 2**30:.2f} GiB"


def kv_cache_bytes(value: str | int) -> int | None:
    """``kv_cache_memory`` as bytes ('2GiB', '512MB', an int), or None for "auto"; a size that
    is not positive, or text that is neither, is a ValueError."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return None
    size = parse_bytes(value)
    if size <= 0:
        raise ValueError(f"kv_cache_memory must be positive or 'auto', got {value!r}")
    return size


def auto_pool_blocks(
    available: int,
    block_bytes: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    ranks_sharing: int = 1,
    request_blocks: int | None = None,
) -> int:
    """Blocks of one rank's pool by the module's rule, given the ``available`` bytes after the
    weights, shared by ``ranks_sharing`` ranks, and ``block_bytes`` per block on that rank;
    ``request_blocks``: one full-context request's peak (None: its tokens' blocks)."""
    full_context = request_blocks if request_blocks is not None else blocks_for(max_model_len, block_size)
    ranks = max(1, ranks_sharing)
    if full_context * block_bytes > available // ranks:
        shared = f" for {ranks} ranks" if ranks > 1 else ""
        raise ValueError(
            f"the KV cache needs at least {size_text(full_context * block_bytes)} per rank for one "
            f"request of max_model_len {max_model_len} tokens, but only {size_text(available)} is "
            f"available after the weights{shared}: lower --max-model-len, or set --kv-cache-memory "
            f"or --num-kv-blocks"
        )
    share = int(AUTO_KV_SHARE * available) // ranks
    cap = max_num_seqs * full_context
    return max(full_context, min(cap, share // block_bytes))


@dataclass(frozen=True)
class PoolSizing:
    """One rank's pool as sized at start-up, and where its size came from."""

    num_blocks: int
    block_size: int
    #: bytes of one block on one rank (scales included)
    block_bytes: int
    #: "auto", "kv_cache_memory" or "num_kv_blocks"
    source: str
    #: bytes the auto rule started from (None unless ``source`` is "auto")
    available: int | None = None
    #: ranks that each hold such a pool
    ranks: int = 1

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """The start-up line: 'KV cache: N blocks of B tokens (X GiB, Y tokens), sized ...'."""
        per_rank = " per rank" if self.ranks > 1 else ""
        head = (
            f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens "
            f"({size_text(self.nbytes)}{per_rank}, {self.tokens} tokens)"
        )
        if self.source == AUTO:
            return f"{head}, sized auto from {size_text(self.available or 0)} available"
        return f"{head}, from --{self.source.replace('_', '-')}"


def available_host_memory() -> int:
    """Bytes the host can give a new allocation without swapping: ``MemAvailable`` on Linux
    (else the free physical pages), or less where the process's cgroup limits its memory."""
    available = _meminfo_available()
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = _cgroup_room()
    return available if room is None else min(available, room)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


#: (limit, usage, stat) files of a cgroup v2 and of a v1 memory controller
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat"),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/memory.stat",
    ),
)


def _cgroup_room() -> int | None:
    """The cgroup's limit less its working set (usage less inactive file pages, which the
    kernel reclaims first, as container runtimes count it); None without a limit."""
    for limit_file, usage_file, stat_file in _CGROUP_FILES:
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text())
            stat = dict(line.split() for line in Path(stat_file).read_text().splitlines() if " " in line)
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 2**60:  # v1 says "no limit" with a huge number
            return None
        inactive = int(stat.get("inactive_file", stat.get("total_inactive_file", 0)))
        return max(0, int(limit_text) - (usage - inactive))
    return None
