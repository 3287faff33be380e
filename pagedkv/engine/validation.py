"""Checks a request must pass before it takes any engine state, and the limits a deployer sets.

``SamplingParams`` checks each field on its own. What is checked here needs the model or the
deployment: text against unpaired surrogates, token ids against the vocabulary, the context
length, the KV pool under the KV policy, and :class:`RequestLimits`, which bound what one request
may ask for. A request that could never run is refused at ``add_request`` with the numbers,
instead of waiting forever or failing inside a batched step where it would take other requests
down with it; without the limits one request could ask for a million samples (the process grows
until the kernel kills it). A refusal is an :class:`InvalidRequestError` that names the field
(``param``) and, for a limit, its value.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from pagedkv.config.checks import positive_int
from pagedkv.engine.core.kv_policy import KVPolicy
from pagedkv.engine.sampling_params import BeamSearchParams, SamplingParams, unpaired_surrogate_at
from pagedkv.memory import blocks_for


class InvalidRequestError(ValueError):
    """A request that can never be served as asked; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestLimits:
    """The most one request may ask for; the defaults keep one request from exhausting a host.

    ``max_request_tokens`` bounds samples x (prompt + ``max_tokens``) of one engine request (the
    server also applies it to the sum over a batch of prompts): the tokens a request may make the
    engine hold and compute, whatever ``n`` and the lengths are. Unset, the engine derives it
    from its KV pool (:meth:`resolved`).
    """

    #: Most parallel samples (``n``) per prompt; OpenAI's own API caps ``n`` at 128.
    max_n: int = 128
    #: Most beams of a beam search.
    max_beam_width: int = 32
    #: Most tokens one request may ask for: samples x (prompt + max_tokens), over its prompts;
    #: None: derived from the engine's KV pool (:meth:`resolved`).
    max_request_tokens: int | None = None
    #: Most stop strings (OpenAI allows 4, vLLM's ``VLLM_MAX_STOP_STRINGS`` defaults to 4): room for
    #: role markers, code fences and tag sets many times over.
    max_stop_strings: int = 128
    #: Most characters over all stop strings: the size of the request's stop automaton and the
    #: most text a stream holds back (the longest string less one); 64 characters each for a full list.
    max_stop_chars: int = 8192
    #: Most ``stop_token_ids``: every special token of a large vocabulary fits.
    max_stop_token_ids: int = 1024

    def __post_init__(self) -> None:
        for name in (
            "max_n",
            "max_beam_width",
            "max_request_tokens",
            "max_stop_strings",
            "max_stop_chars",
            "max_stop_token_ids",
        ):
            value = getattr(self, name)
            if value is None and name == "max_request_tokens":
                continue
            positive_int(f"RequestLimits.{name}", value)

    def resolved(self, pool_tokens: int, max_num_seqs: int, max_model_len: int) -> RequestLimits:
        """These limits with the token budget set: the deployer's, else the most tokens the engine
        can hold at once -- the KV pool's ``pool_tokens``, or ``max_num_seqs`` sequences of
        ``max_model_len`` if that is less.

        Why that much: a request within it can have every sample resident at once, so it runs
        in one pass over the pool; one asking for more could only run in waves, its samples
        evicting each other by preemption, and would hold the engine for several times the work
        the pool is sized for. Every single-sample request that fits the pool and the context is
        within it, so only ``n``, beams and batches of prompts can reach it.
        """
        if self.max_request_tokens is not None:
            return self
        return replace(self, max_request_tokens=min(pool_tokens, max_num_seqs * max_model_len))

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise InvalidRequestError(f"n = {n} is over the limit max_n = {self.max_n} (--max-n)", param="n")

    def check_beam_width(self, beam_width: int) -> None:
        if beam_width > self.max_beam_width:
            raise InvalidRequestError(
                f"beam_width = {beam_width} is over the limit max_beam_width = {self.max_beam_width} "
                "(--max-beam-width)",
                param="beam_width",
            )

    def check_stops(self, params: SamplingParams) -> None:
        """The stop lists' sizes: they bound the automaton built for the request and the work
        of checking its token ids."""
        if len(params.stop) > self.max_stop_strings:
            raise InvalidRequestError(
                f"stop holds {len(params.stop)} strings, over the limit max_stop_strings = "
                f"{self.max_stop_strings} (--max-stop-strings)",
                param="stop",
            )
        chars = sum(map(len, params.stop))
        if chars > self.max_stop_chars:
            raise InvalidRequestError(
                f"the stop strings hold {chars} characters in all, over the limit max_stop_chars = "
                f"{self.max_stop_chars} (--max-stop-chars)",
                param="stop",
            )
        if len(params.stop_token_ids) > self.max_stop_token_ids:
            raise InvalidRequestError(
                f"stop_token_ids holds {len(params.stop_token_ids)} ids, over the limit "
                f"max_stop_token_ids = {self.max_stop_token_ids} (--max-stop-token-ids)",
                param="stop_token_ids",
            )

    def check_tokens(self, requested: int, detail: str) -> None:
        """``requested``: samples x (prompt + max_tokens), summed over prompts; ``detail`` says how.
        An unresolved budget (None) checks nothing: the engine resolves it from its pool."""
        if self.max_request_tokens is not None and requested > self.max_request_tokens:
            raise InvalidRequestError(
                f"the request asks for up to {requested} tokens ({detail}), over the limit "
                f"max_request_tokens = {self.max_request_tokens} (--max-request-tokens)",
                param="max_tokens",
            )


def check_text(text: str, param: str) -> None:
    """Refuse text the tokenizer cannot take: an unpaired surrogate is not a character."""
    at = unpaired_surrogate_at(text)
    if at is not None:
        raise InvalidRequestError(
            f"{param} holds an unpaired UTF-16 surrogate {text[at]!a} at character {at}: it is not "
            "valid Unicode text",
            param=param,
        )


def check_cache_salt(cache_salt: object) -> None:
    """vLLM's ``cache_salt``: None, or a non-empty string of valid text (it is hashed as UTF-8)
    without a NUL character (which marks an adapter's salt: ``Request.prefix_salt``)."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidRequestError(
            f"cache_salt must be a non-empty string, got {cache_salt!r:.40}", param="cache_salt"
        )
    check_text(cache_salt, "cache_salt")
    if "\x00" in cache_salt:
        raise InvalidRequestError("cache_salt must not contain a NUL character", param="cache_salt")


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Every id must index a row of the model's logits: ``0 <= id < vocab_size``."""
    bad = [
        t
        for t in token_ids
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size
    ]
    if bad:
        raise InvalidRequestError(
            f"{param} holds {bad[:5]!r}, which are not token ids of the vocabulary [0, {vocab_size})",
            param=param,
        )


def check_context(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """Prompt and output must fit in the model's context; ``param`` says which one is too long."""
    if prompt_len == 0:
        raise InvalidRequestError("the prompt is empty: at least one token is needed", param="prompt")
    total = prompt_len + max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens, but the request asks for "
            f"{total} ({prompt_len} in the prompt + {max_tokens} max_tokens)",
            param="prompt" if prompt_len >= max_model_len else "max_tokens",
        )


@dataclass(frozen=True)
class RequestValidator:
    """The engine's checks, with the numbers they need: the model's vocabulary and context, the
    KV pool and policy, and the deployer's limits."""

    vocab_size: int
    max_model_len: int
    kv_policy: KVPolicy
    block_size: int
    num_blocks: int
    #: Blocks a single request may take: the pool minus the admission watermark.
    usable_blocks: int
    limits: RequestLimits = field(default_factory=RequestLimits)
    #: The most blocks a request takes at once, from the tokens its admission allocates and the
    #: tokens it ends with (the KV manager's ``peak_blocks``: with KV groups, a prompt is
    #: allocated in every group); None: the final tokens' blocks.
    peak_blocks: Callable[[int, int], int] | None = None

    @property
    def max_kv_tokens(self) -> int:
        """The most tokens one request may hold in the KV cache."""
        return self.usable_blocks * self.block_size

    def check_before_encoding(
        self, prompt: str | list[int], params: SamplingParams, beam: BeamSearchParams | None = None
    ) -> int:
        """The checks that need no token ids (cheap, so they come first): the sample or beam
        count and the stop lists against their limits, text against surrogates. Returns the
        number of samples."""
        if beam is not None:
            self.limits.check_beam_width(beam.beam_width)
        else:
            self.limits.check_n(params.n)
        self.limits.check_stops(params)
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
        return params.n if beam is None else beam.beam_width

    def check(self, token_ids: list[int], params: SamplingParams, samples: int = 1) -> None:
        """Raise :class:`InvalidRequestError` naming what is wrong, or return. ``samples``:
        the sequences the request will run (``n``, or the beam width)."""
        check_token_ids(token_ids, self.vocab_size, "prompt")
        check_token_ids(params.stop_token_ids, self.vocab_size, "stop_token_ids")
        if params.logit_bias:
            check_token_ids(list(params.logit_bias), self.vocab_size, "logit_bias")
        if params.allowed_token_ids:
            check_token_ids(params.allowed_token_ids, self.vocab_size, "allowed_token_ids")
        if params.bad_words_token_ids:
            ids = [t for word in params.bad_words_token_ids for t in word]
            check_token_ids(ids, self.vocab_size, "bad_words")
        check_context(len(token_ids), params.max_tokens, self.max_model_len)
        reserved = self.kv_policy.peak_tokens(len(token_ids), params.max_tokens, self.max_model_len)
        if self.peak_blocks is None:
            needed = blocks_for(reserved, self.block_size)
        else:
            admitted = len(token_ids) if self.kv_policy.grows_on_demand else reserved
            needed = self.peak_blocks(admitted, reserved)
        if needed > self.usable_blocks:
            raise InvalidRequestError(
                f"the request can never fit in the KV cache: {reserved} tokens need {needed} blocks of "
                f"{self.block_size} tokens, but only {self.usable_blocks} of {self.num_blocks} blocks "
                "are usable",
                param="max_tokens",
            )
        total = len(token_ids) + params.max_tokens
        self.limits.check_tokens(
            samples * total, f"{samples} x ({len(token_ids)} prompt + {params.max_tokens} max_tokens)"
        )
