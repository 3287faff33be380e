"""Checks a request must pass before it is queued: it can be served as asked, or it fails now.

A request that could never run -- an empty prompt, token ids outside the vocabulary, more tokens
than the context holds, more KV than the whole pool under the KV policy -- is refused at
``add_request`` with the numbers, instead of waiting forever or failing inside a step where
other requests would share its fate.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.engine.kv_policy import KVPolicy
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.memory import blocks_for


class InvalidRequestError(ValueError):
    """A request that can never be served as asked (too long, too big for the cache, ...)."""


@dataclass(frozen=True)
class RequestValidator:
    vocab_size: int
    max_model_len: int
    kv_policy: KVPolicy
    block_size: int
    num_blocks: int
    #: Blocks a single request may take: the pool minus the admission watermark.
    usable_blocks: int

    @property
    def max_kv_tokens(self) -> int:
        """The most tokens one request may hold in the KV cache."""
        return self.usable_blocks * self.block_size

    def check(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`InvalidRequestError` naming what is wrong, or return."""
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: at least one token is needed")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"asks for {total} ({len(token_ids)} in the prompt + {params.max_tokens} max_tokens)"
            )
        reserved = self.kv_policy.peak_tokens(len(token_ids), params.max_tokens, self.max_model_len)
        needed = blocks_for(reserved, self.block_size)
        if needed > self.usable_blocks:
            raise InvalidRequestError(
                f"the request can never fit in the KV cache: {reserved} tokens need {needed} blocks of "
                f"{self.block_size} tokens, but only {self.usable_blocks} of {self.num_blocks} blocks "
                "are usable"
            )
