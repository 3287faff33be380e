"""Request prompts to token ids: the cheap checks first, the tokenizing off the event loop.

Tokenizing is the costliest thing a request that will be refused can make the server do: its
time grows with the body, to seconds of a core for a body of a few MiB. So a request's prompts
pass three stages, cheapest first, and the first prompt over a limit ends the work:

1. a lower bound on each text prompt's tokens from its length, without the tokenizer: a prompt
   whose bound plus ``max_tokens`` exceeds the context, or a batch whose bounds exceed
   ``max_request_tokens``, is refused before anything is tokenized;
2. the prompts tokenized one at a time, each checked against the context as soon as it has its
   ids, the batch against its token budget with the bounds of the prompts still to come;
3. (the caller) the ids against the engine's own checks: vocabulary, KV pool.

The bound: for a BPE tokenizer that never merges unknown input into one token, no token covers
more characters than the longest string in its vocabulary, so a text of C characters (after the
tokenizer's normalizer) has at least C / longest tokens. For other tokenizers the bound is 0
and stage 2 does the work.

Stages 1 and 2 run on one tokenizer thread (:meth:`PromptEncoder.run`), never on the event loop:
the ``tokenizers`` call used, ``encode_batch`` of one text, releases the GIL while it works, so
``/health``, streams and other requests are served meanwhile. One thread, as vLLM's tokenizer
executor: tokenizing takes at most one core from the engine, and bodies are tokenized in turn.

Memory: tokenizing a large prompt allocates transient ``Encoding`` data (ids, type ids, token
strings, offsets, masks) many times the prompt's size. glibc keeps what is freed in the arena of
the thread that allocated it, and that transient fragments the arena instead of shrinking it: a
server refusing large prompts would grow its RSS several-fold while no Python object stays alive
(tests/server/test_fuzz.py holds it within 1.5x). So after a large prompt the thread asks glibc
to return its free pages (``malloc_trim``): far less than the tokenizing it follows, and nothing
at all for ordinary prompts.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from tokenizers.models import BPE

from pagedkv.engine import InvalidRequestError
from pagedkv.engine.validation import check_context
from pagedkv.tokenizer import Tokenizer

#: Prompts of at least this many tokens give their transient memory back after tokenizing.
RELEASE_AFTER_TOKENS = 1 << 14

_T = TypeVar("_T")


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


def _chars_per_token(tokenizer: Tokenizer) -> int | None:
    """The most characters one token can cover, or None where no such bound holds."""
    model = tokenizer.backend.model
    if not isinstance(model, BPE):
        return None
    if model.unk_token is not None and model.fuse_unk and not model.byte_fallback:
        return None  # a run of unknown characters becomes one token
    return max(len(token) for token in tokenizer.backend.get_vocab(with_added_tokens=True))


def _prefixed(err: InvalidRequestError, index: int | None) -> InvalidRequestError:
    """The error of prompt ``index`` of a batch (None: the request has one prompt)."""
    if index is None:
        return err
    return InvalidRequestError(f"prompt {index}: {err}", err.param)


@dataclass(frozen=True)
class PromptLimits:
    """What the prompts of one request may take, and how they are tokenized.

    Each prompt plus ``max_tokens`` fits in ``max_model_len``; ``n`` x (prompt + ``max_tokens``)
    summed over the prompts stays within ``max_request_tokens``.
    """

    max_model_len: int
    max_tokens: int
    n: int
    max_request_tokens: int
    #: Keep only each prompt's last this many tokens (vLLM's ``truncate_prompt_tokens``).
    truncate_to: int | None = None
    add_special_tokens: bool = True

    def check_prompt(self, index: int | None, num_tokens: int) -> None:
        try:
            check_context(num_tokens, self.max_tokens, self.max_model_len)
        except InvalidRequestError as err:
            raise _prefixed(err, index) from None

    def check_bound(self, index: int | None, at_least: int, chars: int, chars_per_token: int) -> None:
        """Refuse a text prompt whose lower bound alone, plus ``max_tokens``, exceeds the context."""
        total = at_least + self.max_tokens
        if total <= self.max_model_len:
            return
        err = InvalidRequestError(
            f"this model's maximum context length is {self.max_model_len} tokens, but the request asks "
            f"for at least {total} (at least {at_least} in the prompt of {chars} characters, as no token "
            f"covers more than {chars_per_token}, + {self.max_tokens} max_tokens)",
            param="prompt" if at_least >= self.max_model_len else "max_tokens",
        )
        raise _prefixed(err, index)

    def check_batch(self, num_prompts: int, prompt_tokens: int, at_least: bool = False) -> None:
        """``prompt_tokens``: the batch's prompt tokens, or (``at_least``) a lower bound on them.
        One sequence is left to the engine, which says first whether it can fit at all."""
        requested = self.n * (prompt_tokens + num_prompts * self.max_tokens)
        if requested <= self.max_request_tokens or num_prompts * self.n == 1:
            return
        bound = "at least " if at_least else ""
        raise InvalidRequestError(
            f"the request asks for {bound or 'up to '}{requested} tokens (n = {self.n} x ({bound}"
            f"{prompt_tokens} prompt tokens + {num_prompts} x {self.max_tokens} max_tokens)), over the "
            f"limit max_request_tokens = {self.max_request_tokens} (--max-request-tokens)",
            param="max_tokens",
        )

    def truncated(self, ids: list[int]) -> list[int]:
        if self.truncate_to is not None and len(ids) > self.truncate_to:
            return ids[-self.truncate_to :]
        return ids


class PromptEncoder:
    """Token ids of request prompts, on the encoder's own thread; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chars_per_token = _chars_per_token(tokenizer)
        # Its thread ends once the encoder is garbage (the executor's own weakref callback).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-tokenizer")

    async def run(self, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(*args)`` on the tokenizer thread; the event loop serves other requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(fn, *args))

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of ``text`` (0 when the tokenizer allows none)."""
        if self.chars_per_token is None:
            return 0
        normalizer = self.tokenizer.backend.normalizer
        length = len(normalizer.normalize_str(text)) if normalizer is not None else len(text)
        return -(-length // self.chars_per_token)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids, the GIL released while the tokenizer works (a batch call of one)."""
        (encoding,) = self.tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        ids = encoding.ids
        del encoding
        if len(ids) >= RELEASE_AFTER_TOKENS:
            release_free_memory()
        return ids

    def encode_prompts(self, prompts: Sequence[str | list[int]], limits: PromptLimits) -> list[list[int]]:
        """Every prompt's ids (truncated as asked), or :class:`InvalidRequestError` for the first
        prompt over a limit, named by its index in a batch. Stages 1 and 2; blocking: call it on
        the tokenizer thread (:meth:`run`)."""
        indices: list[int | None] = list(range(len(prompts))) if len(prompts) > 1 else [None]
        bounds = [self._bound(index, prompt, limits) for index, prompt in zip(indices, prompts, strict=True)]
        limits.check_batch(len(prompts), sum(bounds), at_least=True)
        encoded: list[list[int]] = []
        counted, still_bounded = 0, sum(bounds)
        for index, prompt, bound in zip(indices, prompts, bounds, strict=True):
            ids = self.encode_text(prompt, limits.add_special_tokens) if isinstance(prompt, str) else prompt
            ids = limits.truncated(list(ids))
            limits.check_prompt(index, len(ids))
            encoded.append(ids)
            counted, still_bounded = counted + len(ids), still_bounded - bound
            limits.check_batch(len(prompts), counted + still_bounded, at_least=len(encoded) < len(prompts))
        return encoded

    def _bound(self, index: int | None, prompt: str | list[int], limits: PromptLimits) -> int:
        """Stage 1 for one prompt: its token count (ids) or lower bound (text), checked."""
        if not isinstance(prompt, str):
            num_tokens = len(prompt) if limits.truncate_to is None else min(len(prompt), limits.truncate_to)
            limits.check_prompt(index, num_tokens)
            return num_tokens
        at_least = self.min_tokens(prompt)
        if limits.truncate_to is not None:
            return min(at_least, limits.truncate_to)
        if self.chars_per_token is not None:
            limits.check_bound(index, at_least, len(prompt), self.chars_per_token)
        return at_least
