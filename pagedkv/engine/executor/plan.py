"""StepPlan: the one record the engine hands the executor per step.

Plain data only -- ints, lists of ints, booleans; no sequences, no tensors -- so that it can be
pickled or sent as JSON to worker processes (tensor parallelism broadcasts the same record to
every rank), and so that the model runner builds a step from it alone. Block ids mean the same
thing on every rank: each rank's KV pool holds its shard of the heads at the same ids.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step: its tokens ``start .. start + len(token_ids) - 1``.

    The positions before ``start`` are already in the KV cache; ``block_table`` maps the
    sequence's logical blocks to physical ones and covers at least ``end`` tokens.
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    #: The slice ends at the sequence's last token, whose logits the engine samples from.
    needs_logits: bool

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """Everything one forward pass computes: the slices in batch order, and the copy-on-write
    block copies ``(source, destination)`` to perform before it."""

    slices: list[SeqSlice]
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.slices)

    @property
    def num_logits(self) -> int:
        """Rows of logits the step returns: one per slice that needs them, in slice order."""
        return sum(s.needs_logits for s in self.slices)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepPlan:
        return cls(
            slices=[SeqSlice(**s) for s in data["slices"]],
            block_copies=[(int(src), int(dst)) for src, dst in data["block_copies"]],
        )
