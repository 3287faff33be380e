"""Prompts to token ids for the handlers, handing a large prompt's tokenizer memory back.

Tokenizing text allocates far more than the ids it returns: for a 1 MiB prompt (~750k tokens of
the built-in model) the ``tokenizers`` Encoding -- ids, type ids, token strings, offsets, masks --
peaks near 140 MiB. glibc keeps what is freed in the arena of the thread that allocated it, and
that transient fragments the arena instead of shrinking it: a server refusing ~1 MiB prompts with
400 grew from 330 MiB to 1.6 GiB of RSS while no Python object stayed alive (tracemalloc's total
stayed flat, and ``malloc_trim`` brought it back to 370 MiB). So after a large prompt the handler
asks glibc to return its free pages (``malloc_trim``): tens of milliseconds against the seconds
that tokenizing such a prompt takes, and nothing at all for ordinary prompts.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

from pagedkv.models import Tokenizer

#: Prompts of at least this many tokens give their transient memory back after tokenizing.
RELEASE_AFTER_TOKENS = 1 << 14


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> bool:
    """Return the C heap's free pages to the OS; False where that is not possible."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _released_after(ids: list[int]) -> list[int]:
    if len(ids) >= RELEASE_AFTER_TOKENS:
        release_free_memory()
    return ids


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[int]) -> list[int]:
    """Text is tokenized (special tokens added, as ``LLM.generate`` does); ids pass through."""
    if isinstance(prompt, str):
        return _released_after(tokenizer.encode(prompt))
    return list(prompt)


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """The conversation through the model's chat template, then tokenized."""
    return _released_after(tokenizer.encode_chat(messages))
