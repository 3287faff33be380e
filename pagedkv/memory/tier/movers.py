"""One rank's side of a step's tier moves: what the executor calls, around the forward pass.

The executor runs, on every rank, for the step's :class:`~pagedkv.memory.KVTransfers`::

    mover.store(kv_cache, transfers)   # outbound: spills and swap-outs leave the pool
    copy_blocks(kv_cache, plan.block_copies)
    loaded = mover.load(kv_cache, transfers)   # inbound: loads and swap-ins
    ... forward pass ...
    report = TransferReport(stored=mover.take_stored(), loaded=loaded)

:class:`HostTierMover` does it all within the step. :class:`DiskTierMover` copies outbound
blocks to host memory within the step (so the pool may reuse them) and hands the files to
writer threads, which delete the files of forgotten hashes and write new ones; a file's name
always goes to the same thread, so what happens to one name happens in the order it was asked
(several threads, because each write waits for its fsync and the disk takes concurrent ones
together). :meth:`DiskTierMover.take_stored` reports the writes that ended since. Inbound
files are read -- in parallel, on their own threads, never queued behind the writer -- and
checked before the step's forward pass, so a step waits for the loads it needs and for nothing
else. Writes waiting beyond ``max_pending_bytes`` are refused at once (reported failed: a spill
is only a chance to save work), so the queue holds a bounded amount of host memory.

A failure of one file (a read, a write, a delete) is logged, but a lasting condition -- a full
disk, a read-only folder -- fails every file: each kind is logged at most once per interval,
with how many failed since and in all (:mod:`pagedkv.log_limits`), and :meth:`DiskTierMover.close`
reports what is still held back. The engine serves on meanwhile: a failed write is a spill not
kept, a failed read a block recomputed.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from pagedkv.attention.kv_cache import KVCache
from pagedkv.log_limits import ThrottledLog
from pagedkv.memory.tier.disk import CorruptBlockError, DiskKVTier
from pagedkv.memory.tier.host import HostKVTier, gather_blocks, load_blocks, scatter_blocks, store_blocks
from pagedkv.memory.tier.transfers import KVTransfers

logger = logging.getLogger("pagedkv.memory.tier.movers")

_STOP = object()


class HostTierMover:
    """Moves a step's blocks between the pool and a :class:`HostKVTier`, all within the step."""

    def __init__(self, tier: HostKVTier) -> None:
        self.tier = tier
        self._stored: list[tuple[int, bool]] = []

    def store(self, kv_cache: KVCache, transfers: KVTransfers) -> None:
        store_blocks(kv_cache, self.tier, transfers.outbound())
        self._stored += [(slot, True) for _, slot in transfers.outbound()]

    def load(self, kv_cache: KVCache, transfers: KVTransfers) -> list[tuple[int, bool]]:
        load_blocks(self.tier, kv_cache, transfers.inbound())
        return [(slot, True) for slot, _ in transfers.inbound()]

    def take_stored(self) -> list[tuple[int, bool]]:
        stored, self._stored = self._stored, []
        return stored

    def close(self) -> None:
        """Nothing runs in the background."""


class DiskTierMover:
    """Moves a step's blocks between the pool and a :class:`DiskKVTier` (see the module doc)."""

    def __init__(
        self,
        tier: DiskKVTier,
        max_pending_bytes: int = 256 << 20,
        read_threads: int = 4,
        write_threads: int = 4,
    ) -> None:
        self.tier = tier
        self.max_pending_bytes = max_pending_bytes
        self.write_threads = write_threads
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(write_threads)]
        self._lock = threading.Lock()
        self._stored: list[tuple[int, bool]] = []
        self._pending_bytes = 0
        #: writes refused because the queue was full, and writes that failed (a full disk)
        self.writes_refused = 0
        self.writes_failed = 0
        self.reads_failed = 0
        self._log = ThrottledLog(logger, "KV tier")
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="pagedkv-kv-read")
        self._writers = [
            threading.Thread(target=self._write_loop, args=(q,), name=f"pagedkv-kv-write-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for writer in self._writers:
            writer.start()

    # -- the step -------------------------------------------------------------------------------
    def store(self, kv_cache: KVCache, transfers: KVTransfers) -> None:
        """Forget ``transfers.forgotten``, then copy the outbound blocks to host memory and queue
        their files; returns once the pool blocks may be reused."""
        for digest in transfers.forgotten:
            self._queue_of(digest).put(("delete", digest))
        moves = [(s.block_id, s.slot, s) for s in transfers.spills]
        moves += [(block, slot, None) for block, slot in transfers.swap_outs]
        size = self.tier.layout.block_bytes
        with self._lock:
            room = max(0, (self.max_pending_bytes - self._pending_bytes) // size)
            accepted, refused = moves[:room], moves[room:]
            self._pending_bytes += len(accepted) * size
            self._stored += [(slot, False) for _, slot, _ in refused]
        self.writes_refused += len(refused)
        if not accepted:
            return
        data, scales = gather_blocks(kv_cache, [block for block, _, _ in accepted])
        for i, (_, slot, spill) in enumerate(accepted):
            name = slot if spill is None else spill.block_hash
            self._queue_of(name).put(("write", slot, spill, data[i], None if scales is None else scales[i]))

    def load(self, kv_cache: KVCache, transfers: KVTransfers) -> list[tuple[int, bool]]:
        """Read and check this step's inbound files (in parallel), copy the good ones into the
        pool, and say which slots loaded; a file that fails its check is not loaded."""
        jobs = [(load.slot, load.block_id, load.block_hash) for load in transfers.loads]
        jobs += [(slot, block, None) for slot, block in transfers.swap_ins]
        if not jobs:
            return []
        results = list(self._readers.map(self._read, jobs))
        good = [(job, found) for job, found in zip(jobs, results, strict=True) if found is not None]
        if good:
            blocks = [block for (_, block, _), _ in good]
            data = torch.stack([found[0] for _, found in good])
            scales = None if good[0][1][1] is None else torch.stack([found[1] for _, found in good])
            scatter_blocks(kv_cache, blocks, data, scales)
        for slot, _, digest in jobs:
            if digest is None:
                self._queue_of(slot).put(("delete_swap", slot))  # swapped in: its file is done with
        return [(slot, found is not None) for (slot, _, _), found in zip(jobs, results, strict=True)]

    def take_stored(self) -> list[tuple[int, bool]]:
        """Outbound writes that ended since the last call, ``(slot, ok)``."""
        with self._lock:
            stored, self._stored = self._stored, []
        return stored

    def drain(self) -> None:
        """Wait until every queued delete and write has ended (shutdown, tests)."""
        flushed = [threading.Event() for _ in self._queues]
        for q, done in zip(self._queues, flushed, strict=True):
            q.put(("flush", done))
        for done in flushed:
            done.wait()

    def close(self) -> None:
        """Finish the queued writes, then stop the threads (idempotent)."""
        for q, writer in zip(self._queues, self._writers, strict=True):
            if writer.is_alive():
                q.put(_STOP)
                writer.join()
        self._readers.shutdown(wait=True)
        self._log.flush()

    def _queue_of(self, name: int) -> queue.SimpleQueue:
        """The one writer queue for a file name (a block hash, or a swap slot)."""
        return self._queues[name % len(self._queues)]

    # -- threads --------------------------------------------------------------------------------
    def _read(self, job: tuple[int, int, int | None]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        slot, _, digest = job
        try:
            return self.tier.read_swap(slot) if digest is None else self.tier.read_block(digest)
        except (CorruptBlockError, OSError) as err:
            with self._lock:
                self.reads_failed += 1
                failed = self.reads_failed
            what = "a swap" if digest is None else f"block {digest:#x}"
            self._log.warning(
                "read",
                "failed reads",
                "not loading %s from slot %d: %s (%d failed reads in all)",
                what,
                slot,
                err,
                failed,
            )
            return None

    def _write_loop(self, jobs: queue.SimpleQueue) -> None:
        while (item := jobs.get()) is not _STOP:
            kind = item[0]
            if kind == "flush":
                item[1].set()
            elif kind == "delete":
                self._quietly(self.tier.remove_block, item[1])
            elif kind == "delete_swap":
                self._quietly(self.tier.remove_swap, item[1])
            else:
                self._write(*item[1:])

    def _write(self, slot: int, spill, data: torch.Tensor, scales: torch.Tensor | None) -> None:
        try:
            if spill is None:
                self.tier.write_swap(slot, data, scales)
            else:
                self.tier.write_block(spill.block_hash, spill.parent_hash, spill.token_ids, data, scales)
            ok = True
        except OSError as err:
            ok, error = False, err
        with self._lock:
            self.writes_failed += not ok
            failed = self.writes_failed
            self._pending_bytes -= self.tier.layout.block_bytes
            self._stored.append((slot, ok))
        if not ok:
            self._log.warning(
                "write",
                "failed writes",
                "could not write slot %d to %s: %s (%d failed writes in all; a block not kept is "
                "recomputed when needed)",
                slot,
                self.tier.folder,
                error,
                failed,
            )

    def _quietly(self, remove, what: int) -> None:
        try:
            remove(what)
        except OSError as err:
            self._log.warning("remove", "failed deletes", "could not remove a file: %s", err)
