"""Keeps constrained text valid UTF-8: no token may spell a UTF-16 surrogate.

xgrammar matches a grammar against the UTF-8 bytes of the tokens, and its wide character
classes (a JSON string's ``[^"\\]``, a regex's ``.``) span U+D800..U+DFFF. Those code points
have a UTF-8 spelling (``ED A0..BF xx``) that no decoder accepts, so a byte-level vocabulary
could walk a grammar to text that decodes to replacement characters -- a string longer than its
``maxLength``, JSON its own schema refuses. The guard removes from every mask, whatever the
grammar, the tokens that would complete such a spelling: those holding ``ED A0..BF`` anywhere,
and, after a token that ends in the lead byte ``ED``, those that start with ``A0..BF``. Every
other UTF-8 rule xgrammar already keeps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SURROGATE_LEAD = 0xED
SURROGATE_SECOND = range(0xA0, 0xC0)


def bitmask_of(allowed: np.ndarray) -> np.ndarray:
    """One bitmask row (int32 words) with the bit of token ``t`` set exactly when ``allowed[t]``."""
    bits = np.zeros((len(allowed) + 31) // 32 * 32, dtype=bool)
    bits[: len(allowed)] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


def spells_surrogate(data: bytes) -> bool:
    """``data`` holds a lead byte ``ED`` followed by ``A0..BF``: the start of a surrogate."""
    return any(data[i] == SURROGATE_LEAD and data[i + 1] in SURROGATE_SECOND for i in range(len(data) - 1))


class Utf8Guard:
    """The surrogate rule for one vocabulary; shared, read-only, by every matcher built on it."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int) -> None:
        """``token_bytes[t]`` is token ``t``'s UTF-8 bytes; ids from ``len(token_bytes)`` up to
        ``vocab_size`` (padding of the model's logits) have none and are never forbidden here."""
        anywhere = np.ones(vocab_size, dtype=bool)
        after_lead = np.ones(vocab_size, dtype=bool)
        ends_with_lead = set()
        for token, data in enumerate(token_bytes[:vocab_size]):
            anywhere[token] = not spells_surrogate(data)
            after_lead[token] = not (data and data[0] in SURROGATE_SECOND)
            if data.endswith(bytes([SURROGATE_LEAD])):
                ends_with_lead.add(token)
        self._anywhere = bitmask_of(anywhere)
        self._after_lead = bitmask_of(anywhere & after_lead)
        self._forbidden_after_lead = frozenset(np.flatnonzero(~after_lead).tolist())
        self._forbidden = frozenset(np.flatnonzero(~anywhere).tolist())
        self._ends_with_lead = frozenset(ends_with_lead)

    def allows(self, previous: int | None, token: int) -> bool:
        """``token`` may follow ``previous`` (None at the start) without spelling a surrogate."""
        if token in self._forbidden:
            return False
        return previous not in self._ends_with_lead or token not in self._forbidden_after_lead

    def restrict(self, bitmask, row: int, previous: int | None) -> None:
        """Clear in ``bitmask[row]`` (a CPU tensor, changed in place) the tokens :meth:`allows`
        refuses after ``previous``."""
        mask = self._after_lead if previous in self._ends_with_lead else self._anywhere
        words = bitmask[row].numpy()  # shares the tensor's memory
        words &= mask
