"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): how the model scores each prompt token.

The logits computed at prompt position ``p`` score prompt token ``p + 1``; the first token has
no score (nothing precedes it). A request that asks for them gets the logits of every row of its
prompt slices from the executor (``SeqSlice.prompt_logits``), chunk after chunk of a chunked
prefill, and this module turns each chunk's rows into logprobs as the step returns them, so no
more than one chunk's logits are ever held. The step's commit point appends them to the request
(:mod:`pagedkv.engine.core.commit`): how many are recorded is what the scheduler reads to know
whether the prompt still needs its logits.

Such a request skips the prefix cache at admission (vLLM v1's rule): a cached block holds its
tokens' keys and values, but their logits were never kept, so the request computes its whole
prompt. Its blocks are still offered to the cache afterwards for the requests that follow.

The values are the raw model's ``log_softmax``, before penalties or temperature, like the
sampled tokens' logprobs (:mod:`pagedkv.engine.sample.sampler`); an entry holds the prompt token's
logprob and rank and the ``prompt_logprobs`` most likely tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedkv.engine.core.plan import SeqSlice
from pagedkv.engine.core.sequence import Request
from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.engine.sample.sampler import token_logprobs

if TYPE_CHECKING:
    from pagedkv.engine.core.commit import StepDecisions
    from pagedkv.engine.core.scheduler_output import ScheduledSeq


def take_prompt_logprobs(
    items: list[ScheduledSeq], slices: list[SeqSlice], logits: torch.Tensor, decisions: StepDecisions
) -> torch.Tensor:
    """Score the prompt tokens in this step's logits (the logprobs go to ``decisions``); return
    the rows to sample from.

    ``logits`` holds each slice's :meth:`SeqSlice.logits_rows` in plan order (``slices[i]`` is
    the plan of ``items[i]``); the result holds one row per slice that ends its sequence -- the
    last of its rows -- as the sample stage expects.
    """
    if not any(piece.prompt_logits for piece in slices):
        return logits  # every row is a sampled one
    sampled_rows: list[int] = []
    offset = 0
    for item, piece in zip(items, slices, strict=True):
        count = len(piece.logits_rows())
        if piece.prompt_logits:
            request = item.seq.request
            scored = score(request, piece.start, logits[offset : offset + count])
            decisions.prompt_logprobs.append((request, scored))
        if piece.needs_logits:
            sampled_rows.extend(range(offset + count - 1 - piece.num_spec_tokens, offset + count))
        offset += count
    return logits[sampled_rows]


def score(request: Request, start: int, rows: torch.Tensor) -> list[TokenLogprobs]:
    """The logprobs that ``rows`` -- the logits at positions ``start, start + 1, ...`` -- give the
    prompt tokens not yet recorded, in order. A recomputation after preemption repeats rows
    already recorded: they are skipped, never scored twice."""
    recorded = request.prompt_logprobs
    prompt = request.prompt_token_ids
    first = len(recorded) - 1 - start  # the row scoring the first token not yet recorded
    stop = min(len(rows), len(prompt) - 1 - start)  # rows past it score generated tokens
    if first < 0:
        raise RuntimeError(
            f"request {request.request_id}: prompt logits from position {start} arrived before those "
            f"of position {len(recorded) - 1} (were cached tokens skipped?)"
        )
    if first >= stop:
        return []
    raw = rows[first:stop].float().log_softmax(dim=-1)
    targets = prompt[start + first + 1 : start + stop + 1]
    return token_logprobs(raw, targets, [request.params.prompt_logprobs] * len(targets))
