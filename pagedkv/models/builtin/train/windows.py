"""Token windows of the built-in model's text, for training and for perplexity.

A source file becomes one document: its ids as the tokenizer encodes it (BOS first), then EOS,
so the model learns where files start and end. Perplexity is measured on each held-out document
cut into consecutive, non-overlapping windows of ``context`` tokens; every window is scored on
all its tokens but the first (which has nothing before it in that window), exactly what an
engine's prompt logprobs give for a prompt of that window's ids. Windows never cross documents.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer

from pagedkv.tokenizer.bpe import EOS_ID


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Each text's ids, BOS first (the tokenizer's post-processor) and EOS last."""
    return [encoding.ids + [EOS_ID] for encoding in tokenizer.encode_batch(list(texts))]


def document_windows(documents: Iterable[Sequence[int]], context: int) -> list[list[int]]:
    """Every document cut into windows of at most ``context`` tokens; a last piece of one token
    (nothing in it to score) is dropped."""
    windows = []
    for ids in documents:
        for start in range(0, len(ids), context):
            window = list(ids[start : start + context])
            if len(window) >= 2:
                windows.append(window)
    return windows


def scored_tokens(windows: Iterable[Sequence[int]]) -> int:
    """How many tokens a perplexity over ``windows`` scores (all but each window's first)."""
    return sum(len(w) - 1 for w in windows)


def perplexity(total_nll: float, num_tokens: int) -> float:
    """exp of the mean negative log-likelihood (natural log) per scored token."""
    return math.exp(total_nll / num_tokens)
