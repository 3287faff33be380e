"""The second KV tier's part of the engine's settings: where the blocks the pool lets go are
kept (host RAM or files on disk), how much, and how a preempted request leaves the pool
(``pagedkv.engine.core.kv_tier``). What the machine can give -- memory available, a folder's free
space -- is checked when the tier is allocated; everything the options alone decide is
checked here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedkv.config.checks import one_of
from pagedkv.memory.tier.manager import PREEMPTION_MODES

#: Where a second KV tier keeps the blocks the pool lets go.
KV_OFFLOAD_KINDS = ("host", "disk")


@dataclass(frozen=True)
class TierConfig:
    """A second KV tier (``kind`` None: off), checked when made."""

    #: None (off), "host" (RAM) or "disk" (files in ``folder``, found again by a restarted engine).
    kind: str | None
    #: The tier's bytes, all ranks together (each holds its share of the KV heads).
    capacity_bytes: int | None
    #: The disk tier's folder (created if missing).
    folder: Path | None
    #: "swap" (a preempted request's blocks go to the tier), "recompute", or None: whichever
    #: the cost model finds cheaper, per request.
    preemption_mode: str | None

    def __post_init__(self) -> None:
        one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if self.kind is None:
            if self.preemption_mode == "swap":
                raise ValueError("preemption_mode='swap' needs a second KV tier (--kv-offloading-size)")
            return
        if self.kind not in KV_OFFLOAD_KINDS:
            raise ValueError(f"kv_offload must be one of {KV_OFFLOAD_KINDS} or None, got {self.kind!r}")
        if self.capacity_bytes is None:
            raise ValueError(f"kv_offload={self.kind!r} needs a size: --kv-offloading-size (e.g. 8GiB)")
        if self.capacity_bytes <= 0:
            raise ValueError(f"--kv-offloading-size must be positive, got {self.capacity_bytes} bytes")
        if (self.kind == "disk") != (self.folder is not None):
            raise ValueError(
                "kv_offload='disk' needs a folder (--kv-offload-dir)"
                if self.kind == "disk"
                else "--kv-offload-dir is the disk tier's folder; kv_offload='host' keeps blocks in RAM"
            )
