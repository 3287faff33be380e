"""What the engine hands back: vLLM-style ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    """The logprob of a sampled token and, when asked for, the top of the distribution."""

    token_id: int
    logprob: float
    #: 1 + the number of tokens strictly more likely than the sampled one.
    rank: int
    #: ``(token_id, logprob)`` of the most likely tokens, most likely first.
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    """One generated sequence (of ``n``): its text, tokens and why it stopped."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step (streaming) or at the end (``LLM.generate``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    #: Timings (``arrival_time``, ``time_to_first_token``) and, with speculative decoding, the
    #: request's drafts (``spec_decode_num_drafts``, ``..._num_draft_tokens``,
    #: ``..._num_accepted_tokens``) or why it did not speculate (``spec_decode_disabled_reason``).
    metrics: dict[str, float | str] = field(default_factory=dict)
    #: Set when the request failed inside the engine (its outputs end with ``finish_reason="error"``).
    error: str | None = None
    #: With ``SamplingParams.prompt_logprobs``: one entry per prompt token, None for the first
    #: (nothing predicts it); each entry is the prompt token's logprob and the top of the
    #: distribution it was drawn from. None when not asked for.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
