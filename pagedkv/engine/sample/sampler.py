"""Turn one step's logits into one token per sequence, each row by its own request's rules.

Processing order (vLLM v1 / transformers): a constrained row's grammar mask (structured
output: the tokens its grammar forbids get -inf), the request's token-id edits
(``allowed_token_ids``, ``bad_words``, ``logit_bias``: :mod:`pagedkv.engine.sample.token_constraints`),
repetition penalty (prompt and output tokens), frequency and presence penalties (output
tokens), the ``min_tokens`` ban on stop tokens; then a greedy row takes the argmax, and any
other row is divided by its temperature, filtered by ``min_p``, ``top_k`` and ``top_p``, and
drawn from the softmax of what is left.

The grammar mask comes first, written into the constrained rows of the logits given (only
those rows: every other row keeps its exact bits, so an unconstrained request samples as it
would alone). A -inf logit stays -inf through every later stage, so masking first draws the
same tokens as masking last; it also makes a constrained row's logprobs those of the tokens
its grammar allows, as in vLLM. Masking twice changes nothing more, so a row-by-row retry
(:mod:`pagedkv.engine.sample.fault_isolation`) may run on logits masked once already. Once a row's
grammar is complete it allows only the stop tokens, and then it wins over ``min_tokens``.

Reproducibility: a seeded row draws with its own ``torch.Generator`` and nothing else, by
inverse transform sampling (one uniform number from that generator against the running
probability mass, which picks token i with probability p_i). The draw consumes the same amount
of the generator every step,
so a request's tokens depend on its seed and its logits only, never on its row index or on
which other requests share the batch. Unseeded rows share one draw from the global RNG.

Logprobs are those of the raw model output, ``log_softmax(logits)`` before any token-id edit
(``logit_bias`` included), penalty, temperature or filter (after a grammar's mask): vLLM v1's
default (``logprobs_mode="raw_logprobs"``), and the only choice under which a greedy row
(temperature 0) still has a distribution to report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence, Sized
from dataclasses import dataclass

import torch

from pagedkv.engine.outputs import TokenLogprobs
from pagedkv.engine.sample.token_constraints import apply_token_constraints
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.structured.bitmask import allows_only, apply_grammars
from pagedkv.engine.structured.matcher import GrammarMatcher


def make_generator(
    seed: int | None, sample_index: int = 0, device: str | torch.device = "cpu"
) -> torch.Generator | None:
    """The private RNG of one sequence: None (use the global RNG) when ``seed`` is None.

    Sample ``i`` of an ``n > 1`` request uses ``seed + i`` (vLLM's convention), so the samples
    differ from each other and each stays reproducible. Make it on the logits' device.
    """
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed((seed + sample_index) % 2**64)


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row, and its logprobs for the rows whose request asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``, by ``index_select``: one contiguous gather, where indexing with a list
    takes torch's general advanced-indexing path. All the rows in order: ``logits`` itself, no
    copy."""
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits
    return logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the lowest index of the row's maximum, a NaN counting as the maximum.

    On CPU through NumPy, whose argmax is vectorised where torch's CPU argmax is not, and which
    picks the same index, ties and NaN included (tests/engine/sample/test_sampler.py holds them equal).
    """
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
) -> torch.Tensor:
    """Repetition (HF), then frequency and presence (OpenAI) penalties.

    Repetition: a logit of a token seen in the prompt or output is divided by the penalty
    when positive and multiplied by it when negative. Frequency and presence: ``logit -=
    frequency * count + presence * (count > 0)`` over the output tokens. Only rows with a
    penalty are touched, so the [rows, V] count tensors stay as small as the need.

    Returns a new tensor, or ``logits`` itself when no row has a penalty: the common case
    copies nothing, and the caller's logits stay intact for a row-by-row retry.
    """
    rows = [i for i, p in enumerate(params) if _has_penalty(p)]
    if not rows:
        return logits
    device = logits.device
    sub = take_rows(logits, rows)
    counts = torch.zeros_like(sub)
    out_r, out_t = _flatten([output_token_ids[i] for i in rows], device)
    counts.index_put_((out_r, out_t), torch.ones_like(out_t, dtype=sub.dtype), accumulate=True)
    seen = counts > 0
    prompt_r, prompt_t = _flatten([prompt_token_ids[i] for i in rows], device)
    seen[prompt_r, prompt_t] = True

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(params[i], name) for i in rows], dtype=sub.dtype, device=device)[:, None]

    rep = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= column("frequency_penalty") * counts + column("presence_penalty") * (counts > 0)
    return logits.index_copy(0, torch.tensor(rows, device=device), sub)


def ban_stop_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: tuple[int, ...],
    must_end: Callable[[int, set[int]], bool] | None = None,
) -> torch.Tensor:
    """Below ``min_tokens`` generated, EOS (unless ignored) and stop tokens get -inf: a new
    tensor, or ``logits`` itself when no row bans anything (see :func:`apply_penalties`).

    ``must_end(i, banned)``: row ``i``'s grammar allows nothing but ``banned`` (it is complete).
    The grammar wins there and nothing is banned: a row with every token at -inf has no token
    to give."""
    rows: list[int] = []
    tokens: list[int] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            if must_end is not None and must_end(i, banned):
                continue
            rows += [i] * len(banned)
            tokens += sorted(banned)
    if not rows:
        return logits
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
    return logits.index_put(index, torch.tensor(-torch.inf, dtype=logits.dtype, device=device))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the row's most likely token."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, -torch.inf)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the ``top_k`` most likely tokens, then the smallest prefix of mass >= ``top_p``.

    ``top_k`` holds the vocabulary size for rows without a limit. One stable descending sort
    serves both filters; on ties the lower id ranks first, so ``top_k=1`` and a tiny ``top_p``
    both keep exactly the token greedy decoding would pick.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(logits.shape[-1], device=logits.device)
    drop = positions[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows at top_p = 1 keep everything: rounding can bring the running mass to 1 early.
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def inverse_cdf_draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row: the first token at which the row's running probability mass
    passes ``u * total``, with ``u ~ U[0, 1)`` from the row's generator (token i wins with
    probability p_i).

    One uniform number per row, where an exponential race (``argmax(p / E)``) draws and takes the
    log of one per token: a running sum costs one pass over the row, no transcendental per
    token. The sum is in float64 so that rounding cannot move mass between tokens visibly;
    scaling ``u`` by the row's own total absorbs the softmax's rounding, and a token of
    probability 0 (filtered out) never wins, since the mass does not grow there.
    Rows without a generator share one draw from the global RNG; a seeded row takes exactly one
    number from its generator per step.
    """
    device = probs.device
    uniform = torch.empty(probs.shape[0], dtype=torch.float64, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            uniform[i : i + 1] = torch.rand(1, generator=g, dtype=torch.float64, device=g.device).to(device)
    return inverse_cdf(probs, uniform)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row ``r``'s first token whose running mass passes ``uniforms[r]`` times the row's total,
    in float64 (:func:`inverse_cdf_draw` with the uniform numbers given)."""
    mass = probs.to(torch.float64).cumsum(dim=-1)
    targets = (uniforms.to(mass.device) * mass[:, -1])[:, None]
    return torch.searchsorted(mass, targets, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What non-greedy rows are drawn from: temperature, ``min_p``, ``top_k``, ``top_p``, then
    softmax. One function for the sampler and speculative verification, so a verified token is
    drawn from the same numbers, row by row, as a sampled one."""
    device, vocab = logits.device, logits.shape[-1]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device)

    logits = logits / column([p.temperature for p in params])[:, None]
    if any(p.min_p > 0 for p in params):
        logits = apply_min_p(logits, column([p.min_p for p in params]))
    # The sort behind top_k / top_p is the costliest step: only the rows that filter pay it.
    filtered = [j for j, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1]
    if filtered:
        ks = [params[j].top_k if 0 < params[j].top_k < vocab else vocab for j in filtered]
        top_k = torch.tensor(ks, device=device)
        top_p = column([params[j].top_p for j in filtered])
        logits[filtered] = apply_top_k_top_p(take_rows(logits, filtered), top_k, top_p)
    return logits.softmax(dim=-1)


class SamplerBase:
    """What the plain and the rejection sampler share: the model's end-of-sequence tokens, and the
    check of a call's inputs."""

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        #: Banned (with the request's stop tokens) until a request reaches its ``min_tokens``.
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    def _check_logits(self, logits: torch.Tensor) -> None:
        if logits.dim() != 2:
            raise ValueError(
                f"{type(self).__name__} expects logits of shape [rows, vocab], got {tuple(logits.shape)}"
            )

    def _check_lengths(self, count: int, counted: str, per: str, **inputs: Sized) -> None:
        """Raise ValueError unless each per-``per`` input has ``count`` entries (``counted`` says
        what ``count`` counts, for the message)."""
        wrong = {key: len(values) for key, values in inputs.items() if len(values) != count}
        if wrong:
            raise ValueError(f"{type(self).__name__} got {counted} but per-{per} inputs of lengths {wrong}")


class Sampler(SamplerBase):
    """The sampling step of the engine: logits [B, V] in, one token per row out."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        grammars: Sequence[GrammarMatcher | None] | None = None,
    ) -> SamplerOutput:
        """Sample row i of ``logits`` by ``params[i]`` with ``generators[i]``, within what
        ``grammars[i]`` allows next when it is set; see the module doc."""
        self._check_logits(logits)
        self._check_lengths(
            logits.shape[0],
            f"logits for {logits.shape[0]} rows",
            "row",
            params=params,
            generators=generators,
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_token_ids,
        )
        logits = logits.to(torch.float32)  # no copy: only the grammars write into it
        bitmask = apply_grammars(logits, grammars) if grammars is not None else None
        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = take_rows(logits, want_logprobs).log_softmax(dim=-1) if want_logprobs else None

        logits = apply_token_constraints(logits, params, output_token_ids)
        logits = apply_penalties(logits, params, output_token_ids, prompt_token_ids)
        must_end = None
        if bitmask is not None:
            vocab = logits.shape[-1]
            must_end = lambda i, banned: grammars[i] is not None and allows_only(bitmask, i, banned, vocab)
        logits = ban_stop_tokens(logits, params, output_token_ids, self.eos_token_ids, must_end)

        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if not drawn:
            tokens = greedy_tokens(logits)
        else:
            tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
            greedy = [i for i, p in enumerate(params) if p.greedy]
            if greedy:
                tokens[greedy] = greedy_tokens(take_rows(logits, greedy))
            tokens[drawn] = self._draw(
                take_rows(logits, drawn), [params[i] for i in drawn], [generators[i] for i in drawn]
            )

        token_ids = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        if raw_logprobs is not None:
            chosen = [token_ids[i] for i in want_logprobs]
            entries = token_logprobs(raw_logprobs, chosen, [params[i].logprobs for i in want_logprobs])
            for i, entry in zip(want_logprobs, entries, strict=True):
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def _draw(
        logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """Temperature, min_p, top_k, top_p, then the draw, for the non-greedy rows."""
        return inverse_cdf_draw(filtered_probs(logits, params), generators)


def token_logprobs(raw_logprobs: torch.Tensor, chosen: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Row ``j``'s logprob and rank of token ``chosen[j]`` and its ``ks[j]`` most likely tokens,
    with one ``tolist``: for sampled tokens here and for prompt tokens
    (:mod:`pagedkv.engine.sample.prompt_logprobs`)."""
    chosen_t = torch.tensor(chosen, device=raw_logprobs.device)[:, None]
    chosen_lp = raw_logprobs.gather(-1, chosen_t)
    ranks = (raw_logprobs > chosen_lp).sum(dim=-1) + 1
    top_lp, top_ids = raw_logprobs.topk(max(ks), dim=-1)
    chosen_lp, ranks, top_lp, top_ids = (t.tolist() for t in (chosen_lp, ranks, top_lp, top_ids))
    return [
        TokenLogprobs(
            token_id=chosen[j],
            logprob=chosen_lp[j][0],
            rank=ranks[j],
            top=list(zip(top_ids[j][:k], top_lp[j][:k], strict=True)),
        )
        for j, k in enumerate(ks)
    ]


def _flatten(token_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of ragged token lists, for one vectorised ``index_put_``."""
    rows = [r for r, tokens in enumerate(token_lists) for _ in tokens]
    tokens = [t for ts in token_lists for t in ts]
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(tokens, dtype=torch.long, device=device),
    )
