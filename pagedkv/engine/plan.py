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
    #: Every row's logits are returned, not only the last: the slice computes prompt tokens
    #: whose prompt logprobs were asked for (each row's logits score the next prompt token).
    prompt_logits: bool = False
    #: The sequence's prompt length, or None: positions below it are prompt tokens, the others
    #: generated ones, whose attention the backend computes the same way when a preempted
    #: sequence computes them again (see ``AttentionMetadata.prompt_lens``).
    prompt_len: int | None = None
    #: The slice's last tokens are this many proposed ones (speculative decoding): the step
    #: verifies them, so the logits of each of them and of the token before them are returned.
    num_spec_tokens: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def logits_rows(self) -> range:
        """The rows of this slice (0 = its first token) whose logits the step returns: all of
        them for prompt logprobs, else the last ``1 + num_spec_tokens`` if it is sampled, else
        none."""
        length = len(self.token_ids)
        if self.prompt_logits:
            return range(length)
        return range(length - 1 - self.num_spec_tokens, length) if self.needs_logits else range(0)


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
        """Rows of logits the step returns: each slice's :meth:`SeqSlice.logits_rows`, in order."""
        return sum(len(s.logits_rows()) for s in self.slices)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepPlan:
        return cls(
            slices=[SeqSlice(**s) for s in data["slices"]],
            block_copies=[(int(src), int(dst)) for src, dst in data["block_copies"]],
        )
