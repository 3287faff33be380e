"""One rank's second KV tier: its bytes (host slots or disk files) and each step's moves.

The driver sizes the tier and refuses one that cannot be had before anything is allocated
(:func:`plan_tier`: a host tier larger than the memory available, a disk tier larger than its
folder's free space, an unwritable folder), in blocks of the whole model. Every rank then
builds a :class:`RankTier` over its own KV cache -- ``capacity`` slots of its share of the KV
heads -- and the model runner calls :meth:`RankTier.move` before each forward pass: outbound
moves (spills, swap-outs), the step's copy-on-write copies, inbound moves (loads, swap-ins), in
that order (see :mod:`pagedkv.memory.tier.transfers`). Every rank moves the same blocks and slots,
so a block's shards always travel together.

The disk tier names the model by a fingerprint of its weights (:mod:`pagedkv.models.fingerprint`)
in every file's header, next to the dtype, block size and layout: a restarted engine loads only
files it could have written itself. It runs on one rank: its files' writes end at different
times on different ranks, which the step's acknowledgements do not gather.
"""

from __future__ import annotations

import time
from pathlib import Path

from pagedkv.attention import KVCache, copy_blocks
from pagedkv.engine.config import EngineSettings
from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.worker.executor.base import TierSpec
from pagedkv.memory import TransferReport
from pagedkv.memory.tier.disk import DiskKVTier
from pagedkv.memory.tier.host import HostKVTier, KVLayout
from pagedkv.memory.tier.limits import check_disk_tier, check_host_tier
from pagedkv.memory.tier.movers import DiskTierMover, HostTierMover
from pagedkv.models import ModelConfig
from pagedkv.models.dtypes import resolve_dtype
from pagedkv.models.fingerprint import model_fingerprint

#: Where a disk tier remembers its model's fingerprint between runs.
FINGERPRINT_CACHE = ".model-fingerprints.json"


def block_bytes(config: EngineSettings, model_config: ModelConfig) -> int:
    """Bytes one KV block takes for the whole model (every rank's share together)."""
    dtype = resolve_dtype(config.model.dtype, default=model_config.dtype, device=config.model.device)
    return KVCache.block_bytes(
        model_config.kv_spec(), config.cache.block_size, dtype, config.cache.kv_cache_dtype
    )


def plan_tier(config: EngineSettings, model_path: Path, model_config: ModelConfig) -> TierSpec | None:
    """The tier every rank builds (None: ``kv_offload`` is off), refused with the figures when
    its size holds no block, or the host or the folder cannot hold it (the options themselves
    were checked by :class:`~pagedkv.config.TierConfig`)."""
    tier = config.tier
    if tier.kind is None:
        return None
    assert tier.capacity_bytes is not None  # TierConfig requires a size with a tier
    per_block = block_bytes(config, model_config)
    capacity = tier.capacity_bytes // per_block
    if capacity < 1:
        raise ValueError(
            f"--kv-offloading-size {tier.capacity_bytes} bytes holds no KV block "
            f"({per_block} bytes each, all ranks)"
        )
    if tier.kind == "host":
        check_host_tier(capacity * per_block)
        return TierSpec("host", capacity, per_block)
    folder = tier.folder
    assert folder is not None  # TierConfig requires a folder with a disk tier
    check_disk_tier(folder, capacity * per_block)
    model = model_fingerprint(model_path, folder / FINGERPRINT_CACHE)
    return TierSpec("disk", capacity, per_block, str(folder), model)


class RankTier:
    """One rank's tier over ``kv_cache`` (rank ``tp_rank`` of ``tp_size``; see the module doc)."""

    def __init__(self, spec: TierSpec, kv_cache: KVCache, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.spec = spec
        layout = KVLayout.of(kv_cache, spec.model, tp_rank, tp_size)
        self.disk: DiskKVTier | None = None
        if spec.kind == "host":
            host = HostKVTier(layout, spec.capacity, pin_memory=kv_cache.device.type == "cuda")
            self.mover: HostTierMover | DiskTierMover = HostTierMover(host)
        else:
            self.disk = DiskKVTier(spec.folder, layout)
            self.mover = DiskTierMover(self.disk)
        self._loaded: list[tuple[int, bool]] = []
        #: the last step's inbound moves: destination block -> its entry in ``_loaded``
        self._inbound: dict[int, int] = {}
        self._seconds_out = self._seconds_in = 0.0

    def move(self, kv_cache: KVCache, plan: StepPlan) -> None:
        """The step's moves around its copy-on-write copies, in the executor's order."""
        self._inbound = {}
        transfers = plan.kv_transfers
        if transfers is None or transfers.is_empty:
            copy_blocks(kv_cache, plan.block_copies)
            return
        started = time.perf_counter()
        self.mover.store(kv_cache, transfers)
        stored = time.perf_counter()
        copy_blocks(kv_cache, plan.block_copies)
        copied = time.perf_counter()
        start = len(self._loaded)
        self._loaded += self.mover.load(kv_cache, transfers)
        self._inbound = {block: start + i for i, (_, block) in enumerate(transfers.inbound())}
        self._seconds_out += stored - started
        self._seconds_in += time.perf_counter() - copied

    def loaded(self, block_ids: tuple[int, ...]) -> bool:
        """Every one of these blocks was loaded by this step's moves and passed the tier's check."""
        return all(b in self._inbound and self._loaded[self._inbound[b]][1] for b in block_ids)

    def reject(self, block_ids: tuple[int, ...]) -> None:
        """This step's loads into these blocks brought wrong bytes (a check after the tier's own
        failed): they are reported failed, so the tier forgets those copies."""
        for block in block_ids:
            if block in self._inbound:
                slot, _ = self._loaded[self._inbound[block]]
                self._loaded[self._inbound[block]] = (slot, False)

    def report(self) -> TransferReport:
        """What ended since the last call: outbound writes, inbound loads, the time they took."""
        report = TransferReport(self.mover.take_stored(), self._loaded, self._seconds_out, self._seconds_in)
        self._loaded, self._seconds_out, self._seconds_in = [], 0.0, 0.0
        self._inbound = {}
        return report

    def found(self) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """A disk tier's loadable block files, oldest first: (hash, parent hash, token ids)."""
        if self.disk is None:
            return []
        return [(block.block_hash, block.parent_hash, block.token_ids) for block in self.disk.scan()]

    def discard(self, hashes: list[int]) -> None:
        """Delete the files of blocks the engine did not index (a disk tier)."""
        if self.disk is not None:
            for digest in hashes:
                self.disk.remove_block(digest)

    def drain(self) -> None:
        """Wait for a disk tier's queued writes (shutdown)."""
        if isinstance(self.mover, DiskTierMover):
            self.mover.drain()

    def close(self) -> None:
        """Finish the queued writes and stop the tier's threads (idempotent)."""
        self.mover.close()
