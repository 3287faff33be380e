"""Verification in the sample stage: a speculating sequence's ``k + 1`` logits rows in, the tokens
it keeps out, and the decision to roll its KV table back to them.

Row ``j`` of a sequence that proposed ``x_1..x_k`` scores the token after its last token and
``x_1..x_j``; :class:`~pagedkv.engine.spec.rejection.RejectionSampler` keeps the longest
accepted prefix plus one token of the target's, exactly as plain decoding would draw them
(greedy: the same tokens; seeded sampling: the same draws). The step computed keys and values
for the last token and all ``k`` proposals; the sequence keeps ``start + 1 + accepted`` of them
(a rollback the commit point applies, :mod:`pagedkv.engine.core.commit`, before the prefix cache is
offered any block), so a block holding a rejected token is never registered (and the accepted
ones join the sequence's tokens only when the output processor appends them, after which the
next step's registration may take their block).

A batch whose verification raises is verified again sequence by sequence, as
:mod:`pagedkv.engine.sample.fault_isolation` samples row by row: the request at fault fails alone (its
sequence keeps no proposed token), the others keep what the batched call would have given them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pagedkv.engine.core.scheduler_output import ScheduledSeq
from pagedkv.engine.core.sequence import Sequence
from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.engine.sample.sampler import take_rows
from pagedkv.engine.spec.metrics import SpecDecodingStats
from pagedkv.engine.spec.rejection import RejectionSampler, VerifiedTokens
from pagedkv.engine.spec.speculator import Speculator

logger = logging.getLogger("pagedkv.engine")


@dataclass
class VerifiedStep:
    """The tokens verification emitted, one entry per token in order (a sequence appears once
    per token it keeps; None for a failed request's sequence), and this step's drafts."""

    seqs: list[Sequence] = field(default_factory=list)
    token_ids: list[int | None] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    #: The requests whose verification raised (by request id), with what they raised.
    failures: dict[str, BaseException] = field(default_factory=dict)
    stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    #: Each verified sequence and the computed tokens it keeps (the commit point's rollbacks).
    rollbacks: list[tuple[Sequence, int]] = field(default_factory=list)


class Verifier:
    """Verifies a step's speculating sequences and records what they kept (see the module
    docstring)."""

    def __init__(self, speculator: Speculator, eos_token_ids: Iterable[int]) -> None:
        self.speculator = speculator
        self.sampler = RejectionSampler(eos_token_ids)

    def verify(self, items: list[tuple[ScheduledSeq, int]], logits: torch.Tensor) -> VerifiedStep:
        """Verify each scheduled slice whose first logits row is given beside it; decide what
        every sequence keeps."""
        step = VerifiedStep()
        if not items:
            return step
        rows = [r for item, first in items for r in range(first, first + 1 + item.num_spec_tokens)]
        verified, failures = self._verify_rows(take_rows(logits, rows), [item for item, _ in items])
        step.failures = failures
        for index, (item, _) in enumerate(items):
            seq, drafted = item.seq, item.num_spec_tokens
            failed = seq.request.request_id in failures
            accepted = 0 if failed else verified.num_accepted[index]
            step.rollbacks.append((seq, item.end - drafted + accepted))
            if failed:
                step.seqs.append(seq)
                step.token_ids.append(None)
                step.logprobs.append(None)
                continue
            step.stats.observe_draft(drafted, accepted)
            self.speculator.observe(seq, drafted, accepted)
            tokens, logprobs = verified.token_ids[index], verified.logprobs[index]
            step.seqs.extend([seq] * len(tokens))
            step.token_ids.extend(tokens)
            step.logprobs.extend(logprobs if logprobs is not None else [None] * len(tokens))
        return step

    def _run(self, logits: torch.Tensor, items: list[ScheduledSeq]) -> VerifiedTokens:
        seqs = [item.seq for item in items]
        return self.sampler(
            logits,
            [list(item.spec_token_ids) for item in items],
            [s.request.params for s in seqs],
            [s.generator for s in seqs],
            [s.output_token_ids for s in seqs],
            [s.request.prompt_token_ids for s in seqs],
        )

    def _verify_rows(
        self, logits: torch.Tensor, items: list[ScheduledSeq]
    ) -> tuple[VerifiedTokens, dict[str, BaseException]]:
        """Verify ``items`` in one batch; on failure, sequence by sequence (a failed one keeps
        nothing, and its request is named in the failures)."""
        saved = [(s.generator, s.generator.get_state()) for s in (i.seq for i in items) if s.generator]
        try:
            return self._run(logits, items), {}
        except Exception as err:
            logger.warning("verifying %d drafts failed (%r); verifying one by one", len(items), err)
        for generator, state in saved:
            generator.set_state(state)
        merged = VerifiedTokens([], [], [])
        failures: dict[str, BaseException] = {}
        first = 0
        for item in items:
            count, request_id = 1 + item.num_spec_tokens, item.seq.request.request_id
            one = None
            if request_id not in failures:
                try:
                    one = self._run(logits[first : first + count], [item])
                except Exception as err:
                    logger.exception("verification failed for request %s; it ends with an error", request_id)
                    failures[request_id] = err
            first += count
            merged.token_ids.append(one.token_ids[0] if one else [])
            merged.num_accepted.append(one.num_accepted[0] if one else 0)
            merged.logprobs.append(one.logprobs[0] if one else None)
        return merged, failures
