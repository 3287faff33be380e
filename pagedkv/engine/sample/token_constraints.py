"""The logits edits a request asks for by token id: ``allowed_token_ids``, ``bad_words``, ``logit_bias``.

vLLM v1 applies them in this order, before the penalties and the draw: every token outside
``allowed_token_ids`` gets -inf; the last token of a bad word gets -inf where the output so far
ends with the word's other tokens (a one-token word always); then each ``logit_bias`` value is
added to its token's logit (a banned token stays -inf). They change what is sampled, not the
reported logprobs, which are the model's own (vLLM v1's default ``raw_logprobs``; see
:mod:`pagedkv.engine.sample.sampler`).

Only the rows of requests that ask are touched, in one gather and one scatter for the batch:
a batch without them gets its own ``logits`` back, no copy, so every other request samples
exactly as it would alone. The result is a new tensor, so a row-by-row retry
(:mod:`pagedkv.engine.sample.fault_isolation`) starts again from the logits it was given.
"""

from __future__ import annotations

import torch

from pagedkv.engine.sampling_params import SamplingParams


def banned_bad_word_tokens(bad_words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output (vLLM's rule: a word
    longer than the output plus one token cannot complete yet)."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or output_token_ids[-prefix:] == word[:-1]:
            banned.append(word[-1])
    return banned


def apply_token_constraints(
    logits: torch.Tensor, params: list[SamplingParams], output_token_ids: list[list[int]]
) -> torch.Tensor:
    """``logits`` [B, V] with each row's ``allowed_token_ids``, ``bad_words`` and ``logit_bias``
    applied (see the module docstring); ``logits`` itself when no row has any."""
    rows = [i for i, p in enumerate(params) if p.constrains_tokens]
    if not rows:
        return logits
    device = logits.device
    sub = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=device))
    allowed = [(j, params[i].allowed_token_ids) for j, i in enumerate(rows) if params[i].allowed_token_ids]
    if allowed:
        masked = torch.ones(len(allowed), sub.shape[1], dtype=torch.bool, device=device)
        keep_r = [r for r, (_, ids) in enumerate(allowed) for _ in ids]
        keep_t = [t for _, ids in allowed for t in ids]
        masked[keep_r, keep_t] = False
        which = torch.tensor([j for j, _ in allowed], dtype=torch.long, device=device)
        sub[which] = sub[which].masked_fill(masked, -torch.inf)
    ban_r, ban_t = [], []
    for j, i in enumerate(rows):
        if params[i].bad_words_token_ids:
            banned = banned_bad_word_tokens(params[i].bad_words_token_ids, output_token_ids[i])
            ban_r += [j] * len(banned)
            ban_t += banned
    if ban_r:
        sub[ban_r, ban_t] = -torch.inf
    bias_r = [j for j, i in enumerate(rows) if params[i].logit_bias for _ in params[i].logit_bias]
    if bias_r:
        bias_t = [t for i in rows if params[i].logit_bias for t in params[i].logit_bias]
        values = [v for i in rows if params[i].logit_bias for v in params[i].logit_bias.values()]
        index = (torch.tensor(bias_r, device=device), torch.tensor(bias_t, device=device))
        sub.index_put_(index, torch.tensor(values, dtype=sub.dtype, device=device), accumulate=True)
    return logits.index_copy(0, torch.tensor(rows, dtype=torch.long, device=device), sub)
