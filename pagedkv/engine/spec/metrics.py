"""What speculation did in a step (or since start): vLLM's ``SpecDecodingStats``, by its names.

A *draft* is one sequence's proposal verified in one step (``num_draft_tokens`` of them in all),
``num_accepted_tokens`` the proposed tokens the target model kept, and
``num_accepted_tokens_per_pos[i]`` how many drafts kept their token at position ``i`` (every
draft that kept position ``i`` kept all before it). vLLM exports them as the counters
``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
``..._num_accepted_tokens_per_pos{position=i}``, and logs the two ratios below.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Counts of drafts, drafted and accepted tokens; add steps together with :meth:`merge`."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: Drafts that kept their token at position ``i`` (0-based); as long as the longest draft.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record one verified draft of ``num_draft_tokens`` of which the first
        ``num_accepted_tokens`` were kept. A sequence that proposed nothing is no draft."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(
                f"a draft of {num_draft_tokens} tokens cannot have {num_accepted_tokens} accepted"
            )
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted_tokens):
            per_pos[position] += 1

    def merge(self, other: SpecDecodingStats) -> None:
        """Add ``other``'s counts to these."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for position, count in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[position] += count

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens (None before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verified draft yields on average: its accepted tokens plus the one the target
        model adds after them (vLLM's ``1 + accepted / drafts``; None before any draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def request_metrics(self, disabled_reason: str | None = None) -> dict[str, float | str]:
        """One request's counts for its ``RequestOutput.metrics``, by vLLM's metric names
        without the ``vllm:`` prefix; with ``disabled_reason``, only why it did not speculate."""
        if disabled_reason is not None:
            return {"spec_decode_disabled_reason": disabled_reason}
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }

    def acceptance_rate_per_pos(self) -> list[float]:
        """Share of drafts that kept position ``i``: a draft shorter than ``i + 1`` counts as
        not keeping it, as in vLLM (all drafts there have the same length)."""
        if not self.num_drafts:
            return []
        return [count / self.num_drafts for count in self.num_accepted_tokens_per_pos]
