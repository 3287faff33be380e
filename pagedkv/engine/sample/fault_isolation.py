"""Keep one request's failure inside a step from ending the others.

The sampler works on the whole batch at once, so an exception in it -- a bug, or a value that no
check foresaw -- would otherwise fail every request in the step. When the batched call raises,
every row is sampled again on its own to find the request(s) at fault: those finish with
``finish_reason="error"`` and an error message; every other row gets the token the batched call
would have given it. A seeded row's generator is rewound to its state before the failed call
first, so its draw is the same as if nothing had failed (saving the states is a small copy per
seeded row, taken before every batched call).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedkv.engine.core.sequence import Request, Sequence
from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.engine.sample.sampler import Sampler

logger = logging.getLogger("pagedkv.engine")


@dataclass
class RowSamples:
    """One token per row, or None for the rows of a request that failed."""

    token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None]
    #: The requests whose sampling raised, with what they raised.
    failures: dict[str, BaseException]


def _sample(sampler: Sampler, logits: torch.Tensor, rows: list[Sequence]):
    return sampler(
        logits,
        [s.request.params for s in rows],
        [s.generator for s in rows],
        [s.output_token_ids for s in rows],
        [s.request.prompt_token_ids for s in rows],
        [s.grammar for s in rows],
    )


def sample_rows(sampler: Sampler, logits: torch.Tensor, rows: list[Sequence]) -> RowSamples:
    """Sample ``rows`` (row i from ``logits[i]``) in one batch; on failure, row by row."""
    if not rows:
        return RowSamples([], [], {})
    saved = [(s.generator, s.generator.get_state()) for s in rows if s.generator is not None]
    try:
        out = _sample(sampler, logits, rows)
        return RowSamples(out.token_ids, out.logprobs, {})
    except Exception as err:
        logger.warning("sampling a batch of %d rows failed (%r); sampling row by row", len(rows), err)
    for generator, state in saved:
        generator.set_state(state)
    token_ids: list[int | None] = [None] * len(rows)
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    failures: dict[str, BaseException] = {}
    for i, seq in enumerate(rows):
        request_id = seq.request.request_id
        if request_id in failures:
            continue
        try:
            out = _sample(sampler, logits[i : i + 1], [seq])
        except Exception as err:
            logger.exception("sampling failed for request %s; it ends with an error", request_id)
            failures[request_id] = err
            continue
        token_ids[i], logprobs[i] = out.token_ids[0], out.logprobs[0]
    for i, seq in enumerate(rows):  # a failed request's other samples end with it
        if seq.request.request_id in failures:
            token_ids[i] = logprobs[i] = None
    return RowSamples(token_ids, logprobs, failures)


def error_message(request: Request, error: BaseException) -> str:
    """What a failed request's output says (offline users see it; the server logs it)."""
    return f"request {request.request_id} failed inside the engine step: {error!r}"
