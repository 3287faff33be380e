"""Where KV memory goes: the categories of Figure 2 of the PagedAttention paper.

* token states -- slots holding a key/value that has been computed: the only useful part;
* reservation -- slots held for tokens the request will generate later (useful eventually,
  wasted now);
* internal fragmentation -- slots held beyond the request's final length: never used (for paged
  memory, the unfilled end of each request's last block);
* external fragmentation -- free slots that cannot be used because no single hole is large
  enough (the holes between contiguous regions).

``free`` is memory nobody needs at the moment (only a fixed-size memory has it).
"""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass

WASTE_CATEGORIES = ("reservation", "internal_fragmentation", "external_fragmentation")


@dataclass(frozen=True)
class Breakdown:
    """Slot counts (floats, so that time averages fit too)."""

    token_states: float
    reservation: float = 0.0
    internal_fragmentation: float = 0.0
    external_fragmentation: float = 0.0
    free: float = 0.0

    def __add__(self, other: Breakdown) -> Breakdown:
        return Breakdown(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def scaled(self, factor: float) -> Breakdown:
        return Breakdown(*(a * factor for a in astuple(self)))

    @property
    def reserved(self) -> float:
        """Token states plus all waste: the memory the allocator has made unavailable (held
        slots, and holes too small to use), i.e. everything but idle free memory."""
        return self.token_states + self.waste

    @property
    def waste(self) -> float:
        return self.reservation + self.internal_fragmentation + self.external_fragmentation

    @property
    def utilization(self) -> float:
        """Token states over :attr:`reserved` (1.0 for an empty allocator: nothing is wasted)."""
        return self.token_states / self.reserved if self.reserved else 1.0

    def fractions(self) -> dict[str, float]:
        """Every category as a fraction of reserved + free slots (they sum to 1)."""
        total = self.reserved + self.free
        return {k: (v / total if total else 0.0) for k, v in asdict(self).items()}

    def to_json(self, bytes_per_token: int) -> dict:
        return {
            "reserved_bytes": round(self.reserved * bytes_per_token),
            "used_bytes": round(self.token_states * bytes_per_token),
            "utilization": self.utilization,
            "waste_bytes": {k: round(getattr(self, k) * bytes_per_token) for k in WASTE_CATEGORIES},
        }
