"""Token bitmasks: one row per sampled row of a step, one bit per vocabulary token.

The only module of the package that uses torch. A step allocates one bitmask for its batch
(:func:`allocate_token_bitmask`, every token allowed), each constrained row's matcher writes its
row (:func:`fill_token_bitmask`), and :func:`apply_token_bitmask` sets the logits of the tokens
a row's grammar forbids to ``-inf`` -- in the constrained rows only: every other row is left
untouched, bit for bit, so unconstrained requests sample exactly as they would alone.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from pagedkv.engine.structured.matcher import GrammarMatcher


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row: one bit per token."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A [num_rows, ceil(vocab_size / 32)] int32 CPU tensor with every bit set (all allowed)."""
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def fill_token_bitmask(bitmask: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> list[int]:
    """Row ``i`` of ``bitmask`` gets the tokens ``matchers[i]`` allows next; rows whose matcher
    is None (unconstrained) are not written. Returns the constrained rows, in order.

    Every row in one library call on the calling thread (a row is mostly a copy from the
    grammar's precomputed mask cache, too little work to hand to other threads; one call saves
    the per-row crossings into the library), then the UTF-8 guards' rows in one AND per mask.
    Raises ValueError for a terminated matcher, as :meth:`GrammarMatcher.fill_bitmask` does.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return rows
    try:
        _batch_matcher().batch_fill_next_token_bitmask(
            [matchers[row].library_matcher for row in rows], bitmask, rows
        )
    except RuntimeError:
        for row in rows:  # the library's reason is a C++ check; say which row and why
            matchers[row].fill_bitmask(bitmask, row)
        raise
    by_mask: dict[int, tuple[np.ndarray, list[int]]] = {}  # a guard has two masks, shared by rows
    for row in rows:
        mask = matchers[row].utf8_mask()
        if mask is not None:
            by_mask.setdefault(id(mask), (mask, []))[1].append(row)
    if by_mask:
        words = bitmask.numpy()
        for mask, guarded in by_mask.values():
            words[guarded] &= mask
    return rows


@functools.cache
def _batch_matcher():
    """xgrammar's batch filler, one thread: the engine's threads are busy with the model."""
    # Deferred: only a step with a constrained row gets here, once xgrammar has compiled its
    # grammar; importing it at engine start would cost every engine seconds.
    import xgrammar

    return xgrammar.BatchGrammarMatcher(max_threads=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place, for each row ``r`` in ``rows``: ``logits[r, t] = -inf`` for every token ``t``
    whose bit is clear in ``bitmask[r]``. Other rows, and the allowed tokens' logits, keep their
    exact values. ``logits`` is [batch, vocab] float32 on CPU (or a float tensor on CUDA: the
    bitmask moves there, and xgrammar's kernel runs); ``bitmask`` is [>= batch, ceil(vocab / 32)]
    int32 on CPU.
    """
    if not rows:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[-1] != bitmask_width(logits.shape[-1]):
        raise ValueError(
            f"a bitmask of shape {tuple(bitmask.shape)} does not cover logits of shape {tuple(logits.shape)}"
        )
    if min(rows) < 0 or max(rows) >= min(logits.shape[0], bitmask.shape[0]):
        raise ValueError(f"rows {list(rows)} are not all rows of logits {tuple(logits.shape)} and bitmask")
    if logits.device.type == "cpu":
        _apply_on_cpu(logits, bitmask, list(rows))
        return
    padding = logits.shape[-1] % 32
    if padding:
        # xgrammar's kernel can visit the clear bits past the vocabulary in a row's last
        # word, and write -inf there: into the next row, or past the tensor. Set them.
        bitmask = bitmask.clone()
        bitmask[:, -1] |= -(1 << padding)
    # Deferred: only a step with a constrained row gets here, once xgrammar has compiled its
    # grammar; importing it at engine start would cost every engine seconds.
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), indices=list(rows)
    )


def _apply_on_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """One vectorised fill over the batch: the bits unpacked to one byte per token (little-endian
    words, so bit ``t % 32`` of word ``t // 32`` is byte ``t``), then one ``masked_fill_``.
    Cheaper on CPU than xgrammar's row-by-row kernel."""
    batch, vocab = logits.shape
    allowed = np.unpackbits(bitmask.numpy()[rows].view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    if rows == list(range(batch)):
        forbidden = allowed == 0
    else:
        forbidden = np.zeros((batch, vocab), dtype=bool)
        forbidden[rows] = allowed == 0
    with torch.inference_mode():  # the model's logits are inference tensors
        logits.masked_fill_(torch.from_numpy(forbidden), float("-inf"))


def apply_grammars(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor | None:
    """Row ``i`` of ``logits`` keeps only the tokens ``matchers[i]`` allows next (in place; rows
    without a matcher untouched); returns the step's bitmask, or None when no row is constrained
    (then nothing was allocated or written)."""
    if all(m is None for m in matchers):
        return None
    bitmask = allocate_token_bitmask(len(matchers), logits.shape[-1])
    apply_token_bitmask(logits, bitmask, fill_token_bitmask(bitmask, matchers))
    return bitmask


def allows_only(bitmask: torch.Tensor, row: int, tokens: Iterable[int], vocab_size: int) -> bool:
    """Whether ``bitmask[row]`` allows no token of the vocabulary outside ``tokens`` (e.g. a
    complete grammar, which allows only the stop tokens)."""
    words = bitmask[row].numpy().view(np.uint32).copy()
    for token in tokens:
        if 0 <= token < vocab_size:
            words[token // 32] &= ~np.uint32(1 << (token % 32))
    if vocab_size % 32:  # bits past the vocabulary mean nothing
        words[-1] &= np.uint32((1 << (vocab_size % 32)) - 1)
    return not words.any()
