"""Beam search on forked block tables.

All live beams of a request advance together: each step every beam computes its next-token
log-probabilities; once all of them have (a beam that was preempted catches up first), the
request's candidates are ranked. A beam chosen more than once forks -- its block table is
shared and only its partial last block is copied on the next write -- and a beam not chosen is
finished at once, so its private blocks go back to the pool in this step's commit
(:mod:`pagedkv.engine.core.commit`: ranking decides the forks and frees, the commit point applies
them).

Ranking follows vLLM's ``LLM.beam_search``: each beam proposes its ``2 * beam_width`` most
likely tokens; proposals ending in EOS become finished hypotheses (unless ``ignore_eos``), the
rest are ranked by cumulative log-probability and the best ``beam_width`` survive. At the end,
finished hypotheses and surviving beams are ranked by ``cumulative_logprob / length **
length_penalty``, where ``length`` counts generated tokens, a final EOS excluded.

Under structured output every beam holds its own grammar state (forked with the beam): a
beam's log-probabilities are those of the tokens its grammar allows, a forbidden token is
never proposed (fewer than ``2 * beam_width`` proposals when fewer tokens are allowed), and
EOS is proposed only once the beam's grammar is complete.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedkv.engine.core.commit import Finish, Fork
from pagedkv.engine.core.sequence import BeamState, Hypothesis, Request, Sequence
from pagedkv.engine.structured.bitmask import apply_grammars
from pagedkv.engine.structured.matcher import GrammarMatcher

if TYPE_CHECKING:
    from pagedkv.engine.core.commit import StepDecisions

__all__ = [
    "BeamState",
    "Candidate",
    "Hypothesis",
    "advance_beams",
    "best_hypotheses",
    "next_token_logprobs",
    "rank_candidates",
]


@dataclass(frozen=True)
class Candidate:
    score: float
    parent: int  # index into the live beams
    token: int


def next_token_logprobs(logits: torch.Tensor, grammar: GrammarMatcher | None) -> torch.Tensor:
    """A beam's [vocab] log-probabilities from its [1, vocab] logits row: over the tokens its
    grammar allows next when it has one (the row is masked in place)."""
    logits = logits.to(torch.float32)
    if grammar is not None:
        apply_grammars(logits, [grammar])
    return logits[0].log_softmax(dim=-1)


def rank_candidates(
    logprobs: list[torch.Tensor], cumulative: list[float], state: BeamState
) -> tuple[list[Candidate], list[Candidate]]:
    """(survivors, ended-with-EOS) among the candidates that every live beam proposes."""
    width = state.params.beam_width
    proposals: list[Candidate] = []
    for parent, (row, base) in enumerate(zip(logprobs, cumulative, strict=True)):
        top = torch.topk(row, min(2 * width, row.shape[-1]))
        for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            if value != float("-inf"):  # a token the beam's grammar forbids
                proposals.append(Candidate(base + value, parent, token))
    ended = [c for c in proposals if c.token in state.eos_token_ids and not state.params.ignore_eos]
    alive = [c for c in proposals if c.token not in state.eos_token_ids or state.params.ignore_eos]
    alive.sort(key=lambda c: c.score, reverse=True)
    return alive[:width], ended


def best_hypotheses(state: BeamState, live: list[Hypothesis]) -> list[Hypothesis]:
    penalty = state.params.length_penalty
    ranked = sorted(state.finished + live, key=lambda h: h.score(penalty), reverse=True)
    return ranked[: state.params.beam_width]


def advance_beams(request: Request, decisions: StepDecisions, max_model_len: int) -> int | None:
    """Rank the candidates once every live beam has its log-probs (and, after this step, all its
    tokens computed); extend the chosen beams, and decide in ``decisions`` their forks and the
    frees of the others (of every beam once the search is over). Returns the tokens appended, or
    None while a beam is still catching up (nothing ranked)."""
    beams = [s for s in request.seqs if not s.is_finished]
    ready = (s.pending_logprobs is not None and decisions.computed_tokens(s) == s.num_tokens for s in beams)
    if not all(ready):
        return None
    state = request.beam
    survivors, ended = rank_candidates(
        [s.pending_logprobs for s in beams], [s.cumulative_logprob for s in beams], state
    )
    for c in ended:
        tokens = beams[c.parent].output_token_ids + [c.token]
        state.finished.append(Hypothesis(tokens, c.score, ended_with_eos=True))
    children: dict[int, list[Candidate]] = {}
    for c in survivors:
        children.setdefault(c.parent, []).append(c)
    next_beams: list[Sequence] = []
    for index, parent in enumerate(beams):
        parent.pending_logprobs = None
        chosen = children.get(index, [])
        if not chosen:
            decisions.beam_moves.append(Finish(parent))  # a dropped beam frees its private blocks
            continue
        for c in chosen[1:]:
            child = parent.fork(index=0, generator=None)
            decisions.beam_moves.append(Fork(parent, child))
            next_beams.append(_extend(child, c))
        next_beams.append(_extend(parent, chosen[0]))
    request.seqs = next_beams
    done = not next_beams or next_beams[0].num_output_tokens >= state.params.max_tokens
    if done or next_beams[0].num_tokens >= max_model_len:
        live = [Hypothesis(s.output_token_ids, s.cumulative_logprob) for s in next_beams]
        decisions.beam_moves.extend(Finish(seq) for seq in next_beams)
        state.results = best_hypotheses(state, live)
    return len(next_beams)


def _extend(beam: Sequence, candidate: Candidate) -> Sequence:
    if beam.grammar is not None and not beam.grammar.accept_token(candidate.token):
        raise RuntimeError(f"a beam's grammar refused token {candidate.token}, which it allowed")
    beam.token_ids.append(candidate.token)
    beam.cumulative_logprob = candidate.score
    return beam
