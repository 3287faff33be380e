"""The sample stage of a step: one token per sequence whose slice ended at its last token.

A request's first sample decides its ``n - 1`` siblings here (forks the commit point applies:
they share the prompt's blocks, copy-on-write); beams only keep their log-probabilities, ranked
once all of a request's beams have them. Sampling itself goes through
:mod:`pagedkv.engine.sample.fault_isolation`, so a request whose sampling raises fails alone. A slice
that ends with proposed tokens (speculative decoding) has ``1 + k`` logits rows and is verified
instead (:mod:`pagedkv.engine.spec.verify`): its sequence keeps the accepted tokens and one
more, and its KV table is to be rolled back to them. The stage writes no progress, queue or
block table: it records its forks and rollbacks in the step's
:class:`~pagedkv.engine.core.commit.StepDecisions`.
"""

from __future__ import annotations

import torch

from pagedkv.engine.core.commit import Fork, StepDecisions
from pagedkv.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from pagedkv.engine.core.sequence import Request, Sequence
from pagedkv.engine.output_processor import SampledStep
from pagedkv.engine.sample.beam_search import next_token_logprobs
from pagedkv.engine.sample.fault_isolation import sample_rows
from pagedkv.engine.sample.sampler import Sampler, make_generator, take_rows
from pagedkv.engine.spec.verify import VerifiedStep, Verifier
from pagedkv.tokenizer import NoTokenizer, Tokenizer


def sample_step(
    scheduled: SchedulerOutput,
    logits: torch.Tensor,
    sampler: Sampler,
    tokenizer: Tokenizer | NoTokenizer,
    decisions: StepDecisions,
    verifier: Verifier | None = None,
) -> SampledStep:
    """Sample the step's sequences: ``logits`` holds, in step order, one row per slice that
    needs logits, ``1 + k`` for a slice ending with ``k`` proposed tokens. The samples forked
    and the rollbacks verification decided go to ``decisions``."""
    seqs: list[Sequence] = []  # sequences to sample, forked samples included
    rows: list[int] = []  # the logits row each of them samples from
    verifying: list[tuple[ScheduledSeq, int]] = []  # speculating slices and their first row
    beams: dict[str, Request] = {}
    prompt_tokens = row = 0
    for item in (item for item in scheduled.scheduled if item.needs_logits):
        seq, first = item.seq, row
        row += 1 + item.num_spec_tokens
        if item.num_spec_tokens:
            verifying.append((item, first))
            continue
        if seq.num_output_tokens == 0:
            prompt_tokens += seq.num_tokens
        if seq.request.beam is not None:
            seq.pending_logprobs = next_token_logprobs(logits[first : first + 1], seq.grammar)
            beams[seq.request.request_id] = seq.request
            continue
        group = fork_samples(seq, tokenizer, decisions) if seq.request.needs_fork else [seq]
        rows.extend([first] * len(group))
        seqs.extend(group)
    result = sample_rows(sampler, take_rows(logits, rows) if rows else logits[:0], seqs)
    verified = verifier.verify(verifying, logits) if verifier is not None else VerifiedStep()
    decisions.rollbacks.extend(verified.rollbacks)
    return SampledStep(
        seqs + verified.seqs,
        result.token_ids + verified.token_ids,
        result.logprobs + verified.logprobs,
        list(beams.values()),
        prompt_tokens,
        result.failures | verified.failures,
        verified.stats if verifying else None,
    )


def fork_samples(
    parent: Sequence, tokenizer: Tokenizer | NoTokenizer, decisions: StepDecisions
) -> list[Sequence]:
    """Turn a just-computed prompt into ``n`` samples; each new one joins its request and is
    a fork in ``decisions`` (it shares the prompt's blocks, copy-on-write, once committed)."""
    request, params = parent.request, parent.request.params
    group = [parent]
    for index in range(len(request.seqs), params.n):
        child = parent.fork(index, make_generator(params.seed, index))
        child.detokenizer = tokenizer.detokenizer(
            request.prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        decisions.forks.append(Fork(parent, child))
        request.seqs.append(child)
        group.append(child)
    return group
