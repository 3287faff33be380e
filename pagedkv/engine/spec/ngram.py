"""Prompt lookup: propose the tokens that followed the latest earlier match of the text's end.

For a sequence (prompt and output so far) and ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, the last ``n`` tokens are looked up among the sequence's earlier
``n``-grams; the first ``n`` that matches wins (the longest match), and of its occurrences the
latest (the most recent context, e.g. the line of code just written). The proposal is the
tokens that followed it. When they run into the sequence's end before ``k`` tokens, the
proposal continues with itself, as a repeat would: proposal token ``i`` is token
``start + n + i`` of the sequence extended by the proposal, so a match always yields ``k``.

Cost: one vectorised pass over the sequence per step (:func:`propose_from`): the positions
where the last token recurs, narrowed one token further back at a time while any remain, so
the work past the first comparison is proportional to the matches, not to the length. The
first comparison is linear in the context, as the step's attention over that context is, and
runs in C; nothing is kept but the tokens as a NumPy array (:class:`TokenArray`, four bytes a
token, grown by the new tokens each step). A per-sequence dict of every n-gram would make the
lookup constant-time, but costs tens of bytes per token and per ``n`` and a build in Python
when a sequence first speculates; ``tools/spec_ngram_cost.py`` compares the two.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def propose_from(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens to follow ``tokens`` (see the module docstring); [] when no suffix of
    ``min_n`` tokens or more occurred before, or ``k`` is 0."""
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    #: positions before the last where a match of the last n tokens ends, n = 1, 2, ...
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    best: tuple[int, int] | None = None
    for n in range(1, max_n + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if not len(ends):
            break
        if n >= min_n:
            best = (n, int(ends[-1]) - n + 1)
    if best is None:
        return []
    n, start = best
    out: list[int] = []
    for position in range(start + n, start + n + k):
        out.append(int(tokens[position]) if position < length else out[position - length])
    return out


class TokenArray:
    """A sequence's tokens as a NumPy array, following its token list as the list grows."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.int32)
        self._length = 0

    def sync(self, tokens: Sequence[int]) -> np.ndarray:
        """The tokens of ``tokens`` as an array view; copies only those added since the last
        call (all of them when the list is shorter than before: not the same list)."""
        length = len(tokens)
        if length < self._length:
            self._length = 0
        if length > len(self._buffer):
            grown = np.empty(max(length, 2 * len(self._buffer), 64), dtype=np.int32)
            grown[: self._length] = self._buffer[: self._length]
            self._buffer = grown
        if length > self._length:
            self._buffer[self._length : length] = tokens[self._length : length]
            self._length = length
        return self._buffer[:length]


class NgramProposer:
    """Prompt lookup for a batch of sequences, each with its own ``k``."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min} and {prompt_lookup_max}"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._arrays: dict[Hashable, TokenArray] = {}

    def propose(
        self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]], num_tokens: Sequence[int]
    ) -> list[list[int]]:
        """Sequence ``i`` (``seq_ids[i]``, whose tokens are ``token_ids[i]``) gets up to
        ``num_tokens[i]`` proposed tokens (0: none, and nothing is kept for it).

        Invariant the caller keeps: a sequence's token list only grows by appending (proposals
        are appended only once verified), so the array of a sequence never goes stale."""
        if not len(seq_ids) == len(token_ids) == len(num_tokens):
            raise ValueError(
                f"NgramProposer.propose got {len(seq_ids)} sequence ids, {len(token_ids)} token "
                f"lists and {len(num_tokens)} draft lengths"
            )
        proposals = []
        for seq_id, tokens, k in zip(seq_ids, token_ids, num_tokens, strict=True):
            if k <= 0:
                proposals.append([])
                continue
            array = self._arrays.get(seq_id)
            if array is None:
                array = self._arrays[seq_id] = TokenArray()
            proposals.append(
                propose_from(array.sync(tokens), self.prompt_lookup_min, self.prompt_lookup_max, k)
            )
        return proposals

    def release(self, seq_id: Hashable) -> None:
        """Forget a finished sequence's tokens (idempotent)."""
        self._arrays.pop(seq_id, None)

    @property
    def num_tracked_sequences(self) -> int:
        return len(self._arrays)
