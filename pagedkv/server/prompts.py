"""Prompts to token ids for the handlers, handing a large prompt's tokenizer memory back.

Tokenizing text allocates far more than the ids it returns: for a 1 MiB prompt (~750k tokens of
the built-in model) the ``tokenizers`` Encoding -- ids, type ids, token strings, offsets, masks --
peaks near 140 MiB. glibc keeps what is freed in the arena of the thread that allocated it, and
that transient fragments the arena instead of shrinking it: a server refusing ~1 MiB prompts with
400 grew from 330 MiB to 1.6 GiB of RSS while no Python object stayed alive (tracemalloc's total
stayed flat, and ``malloc_trim`` brought it back to 370 MiB). So after a large prompt the handler
asks glibc to return its free pages (``malloc_trim``): tens of milliseconds against the seconds
that tokenizing such a prompt takes, and nothing at all for ordinary prompts.

Better still is not to tokenize text that cannot fit. For a BPE tokenizer that never merges
unknown input into one token, no token covers more characters than the longest string in its
vocabulary (17 for the built-in model), so a text of C characters (after the tokenizer's
normalizer) has at least C / longest tokens: a 1 MiB prompt to a 4,096-token model is refused
in microseconds, where tokenizing it took ~2 s of the event loop and ~140 MiB. For other
tokenizers the bound is not sound and the text is tokenized as before.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

from tokenizers.models import BPE

from pagedkv.engine import InvalidRequestError
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


def _chars_per_token(tokenizer: Tokenizer) -> int | None:
    """The most characters one token can cover, or None where no such bound holds."""
    model = tokenizer.backend.model
    if not isinstance(model, BPE):
        return None
    if model.unk_token is not None and model.fuse_unk and not model.byte_fallback:
        return None  # a run of unknown characters becomes one token
    return max(len(token) for token in tokenizer.backend.get_vocab(with_added_tokens=True))


class PromptEncoder:
    """Token ids of request prompts: text that provably cannot fit is refused untokenized."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chars_per_token = _chars_per_token(tokenizer)

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of ``text`` (0 when the tokenizer allows none)."""
        if self.chars_per_token is None:
            return 0
        normalizer = self.tokenizer.backend.normalizer
        length = len(normalizer.normalize_str(text)) if normalizer is not None else len(text)
        return -(-length // self.chars_per_token)

    def _refuse_hopeless(self, text: str) -> None:
        """Refuse a text whose tokens alone fill the context (the rest is checked on its ids)."""
        if self.chars_per_token is None or len(text) < self.max_model_len * self.chars_per_token:
            return  # no bound to apply, or the text may fit (a normalizer that grew it: tokenized)
        at_least = self.min_tokens(text)
        if at_least >= self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"alone has at least {at_least} ({len(text)} characters; no token of this tokenizer "
                f"covers more than {self.chars_per_token})",
                param="prompt",
            )

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Text is tokenized (special tokens added, as ``LLM.generate`` does); ids pass through."""
        if isinstance(prompt, str):
            self._refuse_hopeless(prompt)
            return _released_after(self.tokenizer.encode(prompt))
        return list(prompt)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The conversation through the model's chat template, then tokenized."""
        text = self.tokenizer.apply_chat_template(messages)
        self._refuse_hopeless(text)
        return _released_after(self.tokenizer.encode(text, add_special_tokens=False))
