"""Beam search on forked block tables.

All live beams of a request advance together: each step every beam computes its next-token
log-probabilities; once all of them have (a beam that was preempted catches up first), the
request's candidates are ranked. A beam chosen more than once forks -- its block table is
shared and only its partial last block is copied on the next write -- and a beam not chosen is
finished at once, so its private blocks go back to the pool immediately.

Ranking follows vLLM's ``LLM.beam_search``: each beam proposes its ``2 * beam_width`` most
likely tokens; proposals ending in EOS become finished hypotheses (unless ``ignore_eos``), the
rest are ranked by cumulative log-probability and the best ``beam_width`` survive. At the end,
finished hypotheses and surviving beams are ranked by ``cumulative_logprob / length **
length_penalty``, where ``length`` counts generated tokens, a final EOS excluded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.engine.sampling_params import BeamSearchParams


@dataclass
class Hypothesis:
    """A finished or surviving beam: its generated tokens and their summed log-probability."""

    token_ids: list[int]
    cumulative_logprob: float
    ended_with_eos: bool = False

    def score(self, length_penalty: float) -> float:
        length = len(self.token_ids) - int(self.ended_with_eos)
        return self.cumulative_logprob / max(length, 1) ** length_penalty


@dataclass
class BeamState:
    """Per-request beam search bookkeeping; the live beams are the request's sequences."""

    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    finished: list[Hypothesis] = field(default_factory=list)
    #: The best ``beam_width`` hypotheses, set when the search ends.
    results: list[Hypothesis] = field(default_factory=list)


@dataclass(frozen=True)
class Candidate:
    score: float
    parent: int  # index into the live beams
    token: int


def rank_candidates(
    logprobs: list[torch.Tensor], cumulative: list[float], state: BeamState
) -> tuple[list[Candidate], list[Candidate]]:
    """(survivors, ended-with-EOS) among the candidates that every live beam proposes."""
    width = state.params.beam_width
    proposals: list[Candidate] = []
    for parent, (row, base) in enumerate(zip(logprobs, cumulative, strict=True)):
        top = torch.topk(row, min(2 * width, row.shape[-1]))
        for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            proposals.append(Candidate(base + value, parent, token))
    ended = [c for c in proposals if c.token in state.eos_token_ids and not state.params.ignore_eos]
    alive = [c for c in proposals if c.token not in state.eos_token_ids or state.params.ignore_eos]
    alive.sort(key=lambda c: c.score, reverse=True)
    return alive[:width], ended


def best_hypotheses(state: BeamState, live: list[Hypothesis]) -> list[Hypothesis]:
    penalty = state.params.length_penalty
    ranked = sorted(state.finished + live, key=lambda h: h.score(penalty), reverse=True)
    return ranked[: state.params.beam_width]
