"""Prompt lookup: propose the tokens that followed the latest earlier match of the text's end.

For a sequence (prompt and output so far) and ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, the last ``n`` tokens are looked up among the sequence's earlier
``n``-grams; the first ``n`` that matches wins (the longest match), and of its occurrences the
latest (the most recent context, e.g. the line of code just written). The proposal is the
tokens that followed it. When they run into the sequence's end before ``k`` tokens, the
proposal continues with itself, as a repeat would: proposal token ``i`` is token
``start + n + i`` of the sequence extended by the proposal, so a match always yields ``k``.

Cost: each sequence keeps an index (:class:`NgramIndex`), a dict from every ``n``-gram but the
last to its latest start, updated as tokens arrive: ``prompt_lookup_max - prompt_lookup_min + 1``
dict writes per new token and as many reads per proposal, however long the context. A scan of
the whole sequence per step (vLLM's KMP) grows with the context instead. The price is memory:
about 150 bytes per token per ``n`` while the sequence lives.

Invariant the caller keeps: a sequence's token list only grows by appending (proposals are
never appended before they are verified), so the index never has to forget anything.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class NgramIndex:
    """The latest start of every ``n``-gram (``min_n <= n <= max_n``) of one token list, except
    the n-grams that end at its last token (the text's end is what is looked up)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram bounds must satisfy 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        #: n-gram (a tuple of n token ids) -> the start of its latest indexed occurrence
        self._latest: dict[tuple[int, ...], int] = {}
        #: n-grams ending at positions ``0 .. end - 1`` are indexed
        self._end = 0

    def _sync(self, tokens: Sequence[int]) -> None:
        """Index the n-grams ending at every position before the last token."""
        if len(tokens) < self._end + 1:  # the list shrank: not the list this index was built on
            self._latest.clear()
            self._end = 0
        latest, min_n, max_n = self._latest, self.min_n, self.max_n
        for end in range(self._end, len(tokens) - 1):
            for n in range(min_n, min(max_n, end + 1) + 1):
                latest[tuple(tokens[end - n + 1 : end + 1])] = end - n + 1
        self._end = max(self._end, len(tokens) - 1)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens`` (see the module docstring); [] when no suffix
        of ``min_n`` tokens or more occurred before, or ``k`` is 0."""
        if k <= 0:
            return []
        self._sync(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._latest.get(tuple(tokens[length - n :]))
            if start is not None:
                return _continuation(tokens, start + n, k)
        return []


def _continuation(tokens: Sequence[int], first: int, k: int) -> list[int]:
    """``k`` tokens from position ``first`` of ``tokens`` extended by the result itself."""
    length = len(tokens)
    out: list[int] = []
    for position in range(first, first + k):
        out.append(tokens[position] if position < length else out[position - length])
    return out


class NgramProposer:
    """Prompt lookup for a batch of sequences, each with its own index and its own ``k``."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        NgramIndex(prompt_lookup_min, prompt_lookup_max)  # validates the bounds
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._indexes: dict[Hashable, NgramIndex] = {}

    def propose(
        self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]], num_tokens: Sequence[int]
    ) -> list[list[int]]:
        """Sequence ``i`` (``seq_ids[i]``, whose tokens are ``token_ids[i]``) gets up to
        ``num_tokens[i]`` proposed tokens (0: none, and no index is built for it)."""
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
            index = self._indexes.get(seq_id)
            if index is None:
                index = self._indexes[seq_id] = NgramIndex(self.prompt_lookup_min, self.prompt_lookup_max)
            proposals.append(index.propose(tokens, k))
        return proposals

    def release(self, seq_id: Hashable) -> None:
        """Forget a finished sequence's index (idempotent)."""
        self._indexes.pop(seq_id, None)

    @property
    def num_indexed_sequences(self) -> int:
        return len(self._indexes)
