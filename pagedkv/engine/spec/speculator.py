"""The engine's side of speculative decoding: who proposes how many tokens before each step.

Before the scheduler runs, :meth:`Speculator.propose` looks at the running sequences that
decode (one token left to compute), asks the policy (:mod:`.policy`) how many tokens each should
propose -- at most what its ``max_tokens`` and the context length leave after the token the step
adds anyway -- asks the proposer for them and leaves them in ``Sequence.spec_token_ids``. The
scheduler then gives them slots where it can (:mod:`.scheduling`), and the sample stage verifies
what was scheduled (:mod:`.verify`).

Some requests never speculate, with the reason in ``Request.spec_disabled_reason`` (and their
output's metrics): beam search, whose beams rank every candidate of every step rather than
sample one, and structured output, whose grammar would have to judge every drafted token
before verification could keep it. The proposer is anything with ``propose(seq_ids,
token_ids, num_tokens)`` and ``release(seq_id)``: prompt lookup
(:class:`.ngram.NgramProposer`) or a draft model (:class:`.draft.DraftModelProposer`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from pagedkv.config.speculative import SpeculativeConfig
from pagedkv.engine.core.sequence import Request
from pagedkv.engine.core.sequence import Sequence as EngineSequence
from pagedkv.engine.spec.metrics import SpecDecodingStats
from pagedkv.engine.spec.policy import SpecPolicy, StepCostModel


class Proposer(Protocol):
    def propose(
        self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]], num_tokens: Sequence[int]
    ) -> list[list[int]]: ...

    def release(self, seq_id: Hashable) -> None: ...


def disabled_reason(request: Request) -> str | None:
    """Why ``request`` does not speculate, or None when it may."""
    if request.beam is not None:
        return "beam search"
    if request.params.structured_outputs is not None:
        return "structured output"
    return None


class Speculator:
    """Proposals before each step, and the totals of what verification kept (see the module
    docstring); :mod:`.verify` records each verified draft through :meth:`observe`."""

    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.policy = SpecPolicy(
            config.num_speculative_tokens,
            max_num_batched_tokens,
            config.disable_by_batch_size,
            StepCostModel(verify_overhead=0.1),
        )
        self.max_model_len = max_model_len
        #: Every draft verified since the engine started.
        self.totals = SpecDecodingStats()
        #: Sequences the proposer and the policy hold state for.
        self._tracked: set[int] = set()

    def propose(self, running: list[EngineSequence]) -> None:
        """Set ``spec_token_ids`` of each decoding sequence in ``running`` (empty: none)."""
        self.forget_gone(running)  # e.g. aborted since the last step
        decoding = [s for s in running if s.num_computed_tokens == s.num_tokens - 1]
        if not decoding:
            return
        seq_ids = [s.seq_id for s in decoding]
        self._tracked.update(seq_ids)
        lengths = self.policy.draft_lengths(seq_ids, [self._room(s) for s in decoding])
        if not any(lengths):
            for seq in decoding:
                seq.spec_token_ids = []
            return
        proposals = self.proposer.propose(seq_ids, [s.token_ids for s in decoding], lengths)
        lengths = self.policy.verify_lengths(seq_ids, [len(p) for p in proposals])
        for seq, proposal, length in zip(decoding, proposals, lengths, strict=True):
            seq.spec_token_ids = proposal[:length]

    def _room(self, seq: EngineSequence) -> int:
        """Tokens ``seq`` may propose: what its ``max_tokens`` and the context length leave after
        the token the step adds anyway; 0 for a request that does not speculate."""
        request = seq.request
        if request.spec_decoding is None:  # first seen: give it its record
            request.spec_decoding = SpecDecodingStats()
            request.spec_disabled_reason = disabled_reason(request)
        if request.spec_disabled_reason is not None:
            return 0
        left = request.params.max_tokens - seq.num_output_tokens - 1
        return max(0, min(left, self.max_model_len - seq.num_tokens - 1))

    def observe(self, seq: EngineSequence, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record one verified draft of ``seq`` with the policy, the request and the totals."""
        self.policy.observe(seq.seq_id, num_draft_tokens, num_accepted_tokens)
        self.totals.observe_draft(num_draft_tokens, num_accepted_tokens)
        record = seq.request.spec_decoding
        if record is not None:
            record.observe_draft(num_draft_tokens, num_accepted_tokens)

    def forget_gone(self, running: list[EngineSequence]) -> None:
        """Release what the proposer and the policy hold for sequences no longer running
        (finished, aborted or preempted: a preempted one starts afresh when it runs again); the
        engine calls it after every step."""
        if not self._tracked:
            return
        gone = self._tracked - {s.seq_id for s in running}
        for seq_id in gone:
            self.proposer.release(seq_id)
            self.policy.release(seq_id)
        self._tracked -= gone
