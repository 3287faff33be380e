"""Verify proposed tokens against the target model's logits, keeping its distribution exact.

A sequence that proposed ``k`` tokens ``x_1..x_k`` gets ``k + 1`` rows of target logits: row
``j`` scores the token after the sequence and ``x_1..x_j``. The target distribution ``p_j`` of
row ``j`` is exactly what :class:`~pagedkv.engine.sample.sampler.Sampler` would draw from there:
the token-id edits (``bad_words`` over the output *including* ``x_1..x_j``), penalties and the
``min_tokens`` ban over that output, then
temperature, ``min_p``, ``top_k``, ``top_p``. Standard rejection sampling: accept ``x_j`` with
probability ``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection emit a token drawn from the
residual ``norm(max(0, p_j - q_j))`` and stop; if all ``k`` are accepted, emit a bonus token
drawn from ``p_{k+1}``. Each emitted token is then distributed exactly as plain sampling would
have drawn it. Special cases:

- **greedy** rows (temperature 0) keep the proposed tokens while they equal the row's argmax
  and emit the argmax at the first difference (or the bonus row's): plain greedy decoding;
- **point-mass proposals** (``draft_probs=None``: n-gram lookup, a greedily drafting model):
  ``q_j(x_j) = 1``, so ``x_j`` is accepted with probability ``p_j(x_j)`` and the residual is
  ``p_j`` without ``x_j``. This is done by drawing ``y_j`` from ``p_j`` with the row's one uniform
  number (the sampler's inverse CDF) and accepting ``x_j`` iff ``y_j == x_j``, else emitting
  ``y_j``: the same law, and each emitted token uses exactly the uniform number plain sampling
  would have used for it, so a seeded request samples the same tokens with speculation on or
  off (given the same logits).

Reproducibility: a seeded sequence draws only from its own generator, and consumes exactly one
uniform number per emitted token for point-mass proposals (accepted tests plus one more with
``q``): its ``k + 1`` numbers are drawn at once and the generator is rewound to what was used.
Unseeded sequences share one draw from the global RNG.

Rows are ragged: sequence ``i`` owns ``num_draft_tokens[i] + 1`` consecutive rows starting at
:func:`row_offsets` ``[i]`` (and ``num_draft_tokens[i]`` rows of ``draft_probs``); ``k = 0`` is a
plain sample, so non-speculating sequences share the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.engine.sample.sampler import (
    SamplerBase,
    apply_penalties,
    ban_stop_tokens,
    filtered_probs,
    greedy_tokens,
    inverse_cdf,
    take_rows,
    token_logprobs,
)
from pagedkv.engine.sample.token_constraints import apply_token_constraints
from pagedkv.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class VerifiedTokens:
    """Per sequence: the tokens to append (the accepted proposal, then one token from the
    target), how many proposed tokens were accepted, and the emitted tokens' logprobs when the
    request asked for them (raw ``log_softmax`` of their rows, as the sampler reports)."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[TokenLogprobs] | None]


def row_offsets(num_draft_tokens: Sequence[int]) -> list[int]:
    """First logits row of each sequence, then the total: sequence ``i`` owns rows
    ``offsets[i] .. offsets[i + 1] - 1`` (``num_draft_tokens[i] + 1`` of them)."""
    offsets = [0]
    for k in num_draft_tokens:
        offsets.append(offsets[-1] + k + 1)
    return offsets


class RejectionSampler(SamplerBase):
    """Speculative verification for a batch of sequences (see the module docstring)."""

    def __call__(
        self,
        logits: torch.Tensor,
        draft_token_ids: list[list[int]],
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        draft_probs: torch.Tensor | None = None,
    ) -> VerifiedTokens:
        """Verify sequence ``i``'s ``draft_token_ids[i]`` with its rows of ``logits``
        (``[sum(k_i + 1), V]``) and, for a drafting model that samples, its rows of
        ``draft_probs`` (``[sum(k_i), V]``, each the distribution its token was drawn from)."""
        offsets = row_offsets([len(d) for d in draft_token_ids])
        self._check_logits(logits)
        self._check_lengths(
            len(draft_token_ids),
            f"{len(draft_token_ids)} drafts",
            "sequence",
            params=params,
            generators=generators,
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_token_ids,
        )
        _check_rows(logits, draft_token_ids)
        _check_draft_probs(logits, draft_probs, offsets[-1] - len(offsets) + 1)
        logits = logits.to(torch.float32)
        processed = self._penalize(logits, draft_token_ids, params, output_token_ids, prompt_token_ids)

        tokens: list[list[int]] = [[] for _ in params]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            flat = [r for i in greedy for r in range(offsets[i], offsets[i + 1])]
            argmax = greedy_tokens(take_rows(processed, flat)).tolist()
            per_seq = _split(argmax, [len(draft_token_ids[i]) + 1 for i in greedy])
            for i, targets in zip(greedy, per_seq, strict=True):
                tokens[i] = _keep_matching(draft_token_ids[i], targets)
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if drawn:
            batch = _Drawn(processed, draft_token_ids, params, generators, offsets, drawn)
            verified = batch.point_mass() if draft_probs is None else batch.with_draft_probs(draft_probs)
            for i, emitted in zip(drawn, verified, strict=True):
                tokens[i] = emitted
        accepted = [len(t) - 1 for t in tokens]
        return VerifiedTokens(tokens, accepted, _logprobs(logits, tokens, params, offsets))

    def _penalize(
        self,
        logits: torch.Tensor,
        drafts: list[list[int]],
        params: list[SamplingParams],
        outputs: list[list[int]],
        prompts: list[list[int]],
    ) -> torch.Tensor:
        """Token-id edits, penalties and the ``min_tokens`` ban, row by row (``logits`` itself
        when no sequence has any: the common case builds no per-row lists)."""
        edited = (
            _reads_output(p, len(out)) or p.constrains_tokens for p, out in zip(params, outputs, strict=True)
        )
        if not any(edited):
            return logits
        rows = _expand_rows(drafts, params, outputs, prompts)
        processed = apply_token_constraints(logits, rows.params, rows.outputs)
        processed = apply_penalties(processed, rows.params, rows.outputs, rows.prompts)
        return ban_stop_tokens(processed, rows.params, rows.outputs, self.eos_token_ids)


@dataclass
class _Rows:
    """Per-row inputs of the penalties and the ``min_tokens`` ban (row ``j`` of a sequence sees
    its output extended by the first ``j`` proposed tokens)."""

    params: list[SamplingParams]
    outputs: list[list[int]]
    prompts: list[list[int]]


def _reads_output(p: SamplingParams, num_output: int) -> bool:
    """Whether the row's processing depends on the output tokens (penalties, a live
    ``min_tokens``, bad words)."""
    penalized = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    return penalized or p.min_tokens > num_output or bool(p.bad_words_token_ids)


def _expand_rows(
    drafts: list[list[int]], params: list[SamplingParams], outputs: list[list[int]], prompts: list[list[int]]
) -> _Rows:
    rows = _Rows([], [], [])
    for draft, p, output, prompt in zip(drafts, params, outputs, prompts, strict=True):
        extend = _reads_output(p, len(output))
        for j in range(len(draft) + 1):
            rows.params.append(p)
            rows.outputs.append(output + draft[:j] if extend and j else output)
            rows.prompts.append(prompt)
    return rows


def _split(values: list, lengths: list[int]) -> list[list]:
    out, start = [], 0
    for n in lengths:
        out.append(values[start : start + n])
        start += n
    return out


def _keep_matching(draft: list[int], targets: list[int]) -> list[int]:
    """The proposed tokens while they equal the targets, then the target at the first
    difference (or the last target, the bonus, when all match)."""
    for j, token in enumerate(draft):
        if token != targets[j]:
            return [*draft[:j], targets[j]]
    return [*draft, targets[len(draft)]]


class _Uniforms:
    """``k + 1`` uniform numbers per sequence, drawn up front; :meth:`rewind` leaves a seeded
    generator as if only the numbers used had been drawn, one at a time."""

    def __init__(self, counts: list[int], generators: list[torch.Generator | None], device: torch.device):
        unseeded = sum(n for n, g in zip(counts, generators, strict=True) if g is None)
        shared = torch.rand(unseeded, dtype=torch.float64, device=device).tolist() if unseeded else []
        self.values: list[list[float]] = []
        self.states: list[torch.Tensor | None] = []
        for n, g in zip(counts, generators, strict=True):
            if g is None:
                self.values.append(shared[:n])
                shared = shared[n:]
                self.states.append(None)
            else:
                self.states.append(g.get_state())
                self.values.append(torch.rand(n, generator=g, dtype=torch.float64, device=g.device).tolist())
        self.generators = generators

    def rewind(self, index: int, used: int) -> None:
        g, state = self.generators[index], self.states[index]
        if g is not None and state is not None and used < len(self.values[index]):
            g.set_state(state)
            torch.rand(used, generator=g, dtype=torch.float64, device=g.device)


class _Drawn:
    """The non-greedy sequences of a batch: their target distributions (one row per proposed
    token, then the bonus row) and their uniform numbers."""

    def __init__(
        self,
        logits: torch.Tensor,
        drafts: list[list[int]],
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        offsets: list[int],
        seqs: list[int],
    ) -> None:
        self.drafts = [drafts[i] for i in seqs]
        counts = [len(d) + 1 for d in self.drafts]
        #: Row of each sequence's first proposed token in ``probs`` (and in the draft's rows).
        self.starts = row_offsets([n - 1 for n in counts])[:-1]
        self.draft_starts = [offsets[i] - i for i in seqs]
        flat = [r for i in seqs for r in range(offsets[i], offsets[i + 1])]
        row_params = [params[i] for i, n in zip(seqs, counts, strict=True) for _ in range(n)]
        self.probs = filtered_probs(take_rows(logits, flat), row_params)
        self.uniforms = _Uniforms(counts, [generators[i] for i in seqs], logits.device)

    def point_mass(self) -> list[list[int]]:
        """Draw ``y_j`` for every row at once; keep the proposal while ``x_j == y_j``."""
        values = self.uniforms.values
        flat_uniforms = torch.tensor([u for row in values for u in row], dtype=torch.float64)
        drawn = _split(inverse_cdf(self.probs, flat_uniforms).tolist(), [len(row) for row in values])
        emitted = []
        for position, (draft, targets) in enumerate(zip(self.drafts, drawn, strict=True)):
            tokens = _keep_matching(draft, targets)
            self.uniforms.rewind(position, len(tokens))
            emitted.append(tokens)
        return emitted

    def with_draft_probs(self, draft_probs: torch.Tensor) -> list[list[int]]:
        """Accept ``x_j`` when ``u_j * q_j(x_j) < p_j(x_j)``; at the first rejection draw from the
        residual with the next uniform number; after all ``k``, draw the bonus with ``u_k``."""
        draft_probs = draft_probs.to(torch.float32)
        p_rows = [s + j for s, d in zip(self.starts, self.drafts, strict=True) for j in range(len(d))]
        q_rows = [s + j for s, d in zip(self.draft_starts, self.drafts, strict=True) for j in range(len(d))]
        ids = torch.tensor([t for d in self.drafts for t in d], dtype=torch.long, device=self.probs.device)
        p_at = _split(self.probs[p_rows, ids].tolist(), [len(d) for d in self.drafts])
        q_at = _split(draft_probs[q_rows, ids].tolist(), [len(d) for d in self.drafts])
        emitted = []
        for position, draft in enumerate(self.drafts):
            values = self.uniforms.values[position]
            j = _first_rejected(p_at[position], q_at[position], values)
            row = self.probs[self.starts[position] + j]
            if j < len(draft):
                residual = (row - draft_probs[self.draft_starts[position] + j]).clamp_(min=0)
                row = residual if residual.sum() > 0 else row
            token = inverse_cdf(row[None], torch.tensor(values[j + int(j < len(draft))])[None])
            emitted.append([*draft[:j], int(token)])
            self.uniforms.rewind(position, min(j + 2, len(values)))
        return emitted


def _first_rejected(p_at: list[float], q_at: list[float], uniforms: list[float]) -> int:
    """Position of the first proposed token rejected (``len(p_at)`` when none is): ``x_j`` is
    accepted with probability ``min(1, p / q)``, i.e. when ``u * q < p``."""
    for j, (p, q) in enumerate(zip(p_at, q_at, strict=True)):
        if not uniforms[j] * q < p:
            return j
    return len(p_at)


def _logprobs(
    logits: torch.Tensor, tokens: list[list[int]], params: list[SamplingParams], offsets: list[int]
) -> list[list[TokenLogprobs] | None]:
    """Raw logprobs of each emitted token, from the row it was emitted at."""
    out: list[list[TokenLogprobs] | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not wanted:
        return out
    rows = [offsets[i] + j for i in wanted for j in range(len(tokens[i]))]
    chosen = [t for i in wanted for t in tokens[i]]
    ks = [params[i].logprobs for i in wanted for _ in tokens[i]]
    entries = token_logprobs(take_rows(logits, rows).log_softmax(dim=-1), chosen, ks)
    for i, per_seq in zip(wanted, _split(entries, [len(tokens[i]) for i in wanted]), strict=True):
        out[i] = per_seq
    return out


def _check_rows(logits: torch.Tensor, drafts: list[list[int]]) -> None:
    """Raise ValueError unless ``logits`` has one row per proposed token plus one per sequence, and
    every proposed token is in its vocabulary."""
    rows = sum(len(d) + 1 for d in drafts)
    if logits.shape[0] != rows:
        raise ValueError(
            f"RejectionSampler got {logits.shape[0]} logits rows for drafts that need {rows} "
            "(each sequence's proposed tokens plus one)"
        )
    vocab = logits.shape[1]
    bad = next((t for d in drafts for t in d if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"a proposed token id {bad} is outside the vocabulary of {vocab}")


def _check_draft_probs(logits: torch.Tensor, draft_probs: torch.Tensor | None, num_draft_tokens: int) -> None:
    if draft_probs is not None and tuple(draft_probs.shape) != (num_draft_tokens, logits.shape[1]):
        raise ValueError(
            f"draft_probs must hold one row per proposed token ({num_draft_tokens}, {logits.shape[1]}), "
            f"got {tuple(draft_probs.shape)}"
        )
