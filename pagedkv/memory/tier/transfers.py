"""What moves between the device pool and the second tier in one step, as plain data.

:class:`~pagedkv.memory.tier.manager.TieredKVCacheManager` decides the moves while the scheduler
allocates; the executor performs them on every rank (each its shard of the KV heads) before the
step's forward pass, in this order:

1. **outbound** -- spills (an evicted cached block to the tier, by hash) and swap-outs (a
   preempted sequence's blocks): they read pool blocks that this very step may hand to someone
   else, so they read before anything is written;
2. the step's **copy-on-write copies** (``StepPlan.block_copies``): a copy planned for a
   sequence preempted later in the same step may target a block handed on since;
3. **inbound** -- loads (a prefix hit in the tier) and swap-ins: they write fresh blocks, after
   any such stale copy, and the forward pass then reads them.

Every device read and write of a step's transfers ends within that step; only a disk tier's
file writes (from a host staging copy) may outlive it, which is why a spill or swap-out is
acknowledged separately (:class:`TransferReport`). Inbound transfers are acknowledged by the
end of their step: a step waits for the loads it needs and for nothing else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class BlockSpill:
    """Copy pool block ``block_id`` into tier ``slot`` as the block named ``block_hash`` (the
    parent hash and tokens go into a disk file's header, so a restart can index it)."""

    block_id: int
    slot: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockLoad:
    """Copy tier ``slot`` (block ``block_hash``) into pool block ``block_id``."""

    slot: int
    block_id: int
    block_hash: int


@dataclass(frozen=True)
class KVTransfers:
    """One step's moves. Swap-outs are ``(pool block, tier slot)``, swap-ins ``(tier slot, pool
    block)``. A pool block is the destination of at most one inbound move. ``forgotten``: hashes
    the tier dropped since the last step, whose files a disk tier deletes before this step's
    writes (one of them may be stored again under the same name)."""

    spills: list[BlockSpill] = field(default_factory=list)
    swap_outs: list[tuple[int, int]] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    swap_ins: list[tuple[int, int]] = field(default_factory=list)
    forgotten: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.spills or self.swap_outs or self.loads or self.swap_ins or self.forgotten)

    @property
    def num_outbound(self) -> int:
        return len(self.spills) + len(self.swap_outs)

    @property
    def num_inbound(self) -> int:
        return len(self.loads) + len(self.swap_ins)

    def outbound(self) -> list[tuple[int, int]]:
        """Every (pool block, tier slot) read out of the pool, spills first."""
        return [(s.block_id, s.slot) for s in self.spills] + list(self.swap_outs)

    def inbound(self) -> list[tuple[int, int]]:
        """Every (tier slot, pool block) written into the pool, loads first."""
        return [(load.slot, load.block_id) for load in self.loads] + list(self.swap_ins)

    def done(self) -> TransferReport:
        """The report of a tier that finished every move within the step (the host tier)."""
        return TransferReport(
            stored=[(slot, True) for _, slot in self.outbound()],
            loaded=[(slot, True) for slot, _ in self.inbound()],
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVTransfers:
        return cls(
            spills=[BlockSpill(**{**s, "token_ids": tuple(s["token_ids"])}) for s in data["spills"]],
            swap_outs=[(int(b), int(s)) for b, s in data["swap_outs"]],
            loads=[BlockLoad(**load) for load in data["loads"]],
            swap_ins=[(int(s), int(b)) for s, b in data["swap_ins"]],
            forgotten=[int(h) for h in data["forgotten"]],
        )


@dataclass(frozen=True)
class TransferReport:
    """What the executor finished: outbound moves by tier slot, ``(slot, ok)`` (a spill or swap-out
    whose bytes are now in the tier), and inbound moves by tier slot (``ok`` False: the slot's
    contents failed their check and were not loaded); and the time the steps spent on them, out
    of the pool and into it (a disk tier's file writes, off the step, not included)."""

    stored: list[tuple[int, bool]] = field(default_factory=list)
    loaded: list[tuple[int, bool]] = field(default_factory=list)
    seconds_out: float = 0.0
    seconds_in: float = 0.0


@dataclass
class SwapCostModel:
    """Swap or recompute a preempted sequence: whichever costs less time.

    Swapping moves its blocks out and back in (``2 * bytes / copy_bytes_per_s``); recomputing
    runs its lost tokens through prefill again (``tokens / prefill_tokens_per_s``). The rates
    are inputs: the engine replaces the defaults with what it measures.
    """

    #: bytes per second one way between the pool and the tier (a block batch)
    copy_bytes_per_s: float = 4e9
    #: prompt tokens per second the model prefills
    prefill_tokens_per_s: float = 4e3

    def __post_init__(self) -> None:
        if self.copy_bytes_per_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError(
                f"SwapCostModel rates must be positive, got copy_bytes_per_s={self.copy_bytes_per_s} "
                f"and prefill_tokens_per_s={self.prefill_tokens_per_s}"
            )

    def swap_seconds(self, num_bytes: int) -> float:
        return 2 * num_bytes / self.copy_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def prefers_swap(self, num_bytes: int, num_tokens: int) -> bool:
        """Swap when moving ``num_bytes`` out and back is faster than recomputing ``num_tokens``."""
        return num_tokens > 0 and self.swap_seconds(num_bytes) < self.recompute_seconds(num_tokens)
