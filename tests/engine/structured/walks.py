"""Random walks through a grammar: at each step one token drawn uniformly among those allowed."""

from __future__ import annotations

import numpy as np

from pagedkv.engine.structured.bitmask import allocate_token_bitmask, fill_token_bitmask
from pagedkv.engine.structured.matcher import GrammarMatcher


def allowed_tokens(bitmask_row, vocab_size: int) -> list[int]:
    """The token ids whose bit is set in one bitmask row (int32 words, little-endian bits)."""
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).tolist()


def next_allowed(matcher: GrammarMatcher, vocab_size: int) -> list[int]:
    bitmask = allocate_token_bitmask(1, vocab_size)
    fill_token_bitmask(bitmask, [matcher])
    return allowed_tokens(bitmask[0], vocab_size)


def random_walk(matcher: GrammarMatcher, vocab_size: int, seed: int, max_steps: int = 5000) -> list[int]:
    """Walk until the matcher terminates (it accepted a stop token); the tokens accepted."""
    rng = np.random.default_rng(seed)
    for _ in range(max_steps):
        if matcher.is_terminated():
            return list(matcher.accepted_tokens)
        allowed = next_allowed(matcher, vocab_size)
        assert allowed, "a live grammar matcher allowed no token at all"
        assert matcher.accept_token(int(rng.choice(allowed)))
    raise AssertionError(f"no termination in {max_steps} steps: {matcher.accepted_tokens}")
