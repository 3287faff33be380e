"""Keeps constrained text valid UTF-8, whatever the grammar allows.

xgrammar matches a grammar against the UTF-8 bytes of the tokens, but its wide character
classes (a JSON string's ``[^"\\]``, a regex's ``.``) accept byte sequences no decoder does:
UTF-16 surrogates (``ED A0..BF``) and overlong forms (``E0 80..9F``, ``F0 80..8F``), among
others. A byte-level vocabulary can walk such a grammar to text that decodes to replacement
characters -- a string longer than its ``maxLength``, JSON its own schema refuses. The guard
removes from every mask the tokens whose own bytes are not valid UTF-8 (leading continuation
bytes aside: they finish the sequence before them), and, after a token that ends in one of the
lead bytes that restrict the byte after them (``E0 ED F0 F4``), the tokens that start with a
byte that lead does not allow.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

import numpy as np

#: The lead bytes that narrow the range of the next byte (RFC 3629 section 4), and that range.
NARROW_LEADS: dict[int, range] = {
    0xE0: range(0xA0, 0xC0),  # below is an overlong three-byte form
    0xED: range(0x80, 0xA0),  # above is a UTF-16 surrogate
    0xF0: range(0x90, 0xC0),  # below is an overlong four-byte form
    0xF4: range(0x80, 0x90),  # above is past U+10FFFF
}


def is_continuation(byte: int) -> bool:
    return 0x80 <= byte < 0xC0


def valid_inside(data: bytes) -> bool:
    """``data``, after its leading continuation bytes, is valid UTF-8 that may end mid-character."""
    start = 0
    while start < len(data) and start < 3 and is_continuation(data[start]):
        start += 1
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data[start:], final=False)
    except UnicodeDecodeError:
        return False
    return True


def bitmask_of(allowed: np.ndarray) -> np.ndarray:
    """One bitmask row (int32 words) with the bit of token ``t`` set exactly when ``allowed[t]``."""
    bits = np.zeros((len(allowed) + 31) // 32 * 32, dtype=bool)
    bits[: len(allowed)] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


class Utf8Guard:
    """The UTF-8 rule for one vocabulary; shared, read-only, by every matcher built on it."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int) -> None:
        """``token_bytes[t]`` is token ``t``'s bytes; ids from ``len(token_bytes)`` up to
        ``vocab_size`` (padding of the model's logits) have none and are never forbidden here."""
        anywhere = np.ones(vocab_size, dtype=bool)
        first = np.full(vocab_size, -1)
        self._lead_of: dict[int, int] = {}  # token -> the narrowing lead byte it ends with
        for token, data in enumerate(token_bytes[:vocab_size]):
            anywhere[token] = valid_inside(data)
            if data:
                first[token] = data[0]
                if data[-1] in NARROW_LEADS:
                    self._lead_of[token] = data[-1]
        self._anywhere = bitmask_of(anywhere)
        self._forbidden = frozenset(np.flatnonzero(~anywhere).tolist())
        self._after: dict[int, np.ndarray] = {}
        self._forbidden_after: dict[int, frozenset[int]] = {}
        for lead, allowed_next in NARROW_LEADS.items():
            wrong = np.isin(first, [b for b in range(0x80, 0xC0) if b not in allowed_next])
            self._after[lead] = bitmask_of(anywhere & ~wrong)
            self._forbidden_after[lead] = frozenset(np.flatnonzero(wrong).tolist())

    def allows(self, previous: int | None, token: int) -> bool:
        """``token`` may follow ``previous`` (None at the start) and keep the text valid UTF-8."""
        if token in self._forbidden:
            return False
        lead = self._lead_of.get(previous)
        return lead is None or token not in self._forbidden_after[lead]

    def mask_after(self, previous: int | None) -> np.ndarray:
        """The bitmask row (int32 words) of the tokens :meth:`allows` after ``previous``: AND it
        into a grammar's row."""
        lead = self._lead_of.get(previous)
        return self._anywhere if lead is None else self._after[lead]
