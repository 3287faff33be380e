"""Perplexity of token sequences, computed by the engine's own paged path (prompt logprobs).

A text longer than the context is cut into windows, each sent as one prompt with
``prompt_logprobs=0``; the scored tokens' logprobs come back from the same paged attention,
chunked prefill and KV cache that serve requests, so the figure measures what serving computes
(a quantized KV cache included).

Windows (:func:`sliding_windows`) follow transformers' perplexity guide: windows of ``window``
tokens start every ``stride`` tokens, and each scores only the tokens no earlier window scored,
so every token is scored once, with at least ``window - stride`` tokens of context once the
first window is past. ``stride == window`` (the default) cuts the text into consecutive,
non-overlapping windows, each scored on all its tokens but the first: the training script's
held-out perplexity (:mod:`pagedkv.models.builtin.train.windows`). A smaller stride costs
``window / stride`` times the compute and gives every token more context.

:func:`llamacpp_chunks` are llama.cpp's ``llama-perplexity`` windows instead (consecutive chunks,
each scoring its second half), so a figure can be set beside llama.cpp's on the same file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine

#: Windows in flight at once: bounds the prompt logprobs held before they are summed.
WINDOWS_PER_BATCH = 64


@dataclass(frozen=True)
class Window:
    """One prompt of a perplexity run: its tokens ``token_ids[scored_from:]`` are scored."""

    token_ids: list[int]
    scored_from: int

    @property
    def num_scored(self) -> int:
        return len(self.token_ids) - self.scored_from


@dataclass(frozen=True)
class Perplexity:
    """Summed negative log-likelihood (nats) of the scored tokens, and how many there were."""

    nll: float
    num_tokens: int
    num_windows: int

    @classmethod
    def of(cls, window_scores: Sequence[Sequence[float]]) -> Perplexity:
        """From each window's scored-token logprobs (:func:`window_logprobs`)."""
        nll = -sum(math.fsum(scores) for scores in window_scores)
        return cls(nll=nll, num_tokens=sum(map(len, window_scores)), num_windows=len(window_scores))

    @property
    def perplexity(self) -> float:
        """exp of the mean negative log-likelihood per scored token."""
        return math.exp(self.nll / self.num_tokens)


def sliding_windows(token_ids: Sequence[int], window: int, stride: int | None = None) -> list[Window]:
    """``token_ids`` as windows of at most ``window`` tokens every ``stride`` (default: ``window``),
    each scoring the tokens after the last one scored before it (see the module docstring). The
    first token is never scored: nothing precedes it. Windows with nothing to score are left out."""
    stride = window if stride is None else stride
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"a perplexity window holds at least 2 tokens, got {window!r}")
    if not isinstance(stride, int) or not 1 <= stride <= window:
        raise ValueError(f"stride must be an integer in [1, window = {window}], got {stride!r}")
    windows = []
    scored_until = 0  # the tokens before this position are scored
    for begin in range(0, max(len(token_ids) - 1, 1), stride):
        end = min(begin + window, len(token_ids))
        first = max(scored_until, begin + 1)  # a window's first token has no context in it
        if end > first:
            windows.append(Window(list(token_ids[begin:end]), first - begin))
        scored_until = end
        if end == len(token_ids):
            break
    return windows


def llamacpp_chunks(token_ids: Sequence[int], n_ctx: int, bos_token_id: int | None = None) -> list[Window]:
    """The windows of llama.cpp's ``llama-perplexity -c n_ctx`` (without ``--ppl-stride``).

    The text's tokens are cut into ``len(token_ids) // n_ctx`` consecutive chunks of ``n_ctx``
    (a shorter tail is left out); in each, the logits from position ``n_ctx // 2`` on score the
    tokens after them, so every scored token saw at least half a chunk, and the first half of
    each chunk is context only. For a model that adds BOS (``bos_token_id`` given), each chunk's
    first token is replaced by BOS, as llama-perplexity does. Like llama-perplexity, it wants
    two chunks at least.
    """
    if not isinstance(n_ctx, int) or n_ctx < 4:
        raise ValueError(f"a llama-perplexity chunk holds at least 4 tokens, got {n_ctx!r}")
    if len(token_ids) < 2 * n_ctx:
        raise ValueError(
            f"the text has {len(token_ids)} tokens: llama-perplexity's chunks of {n_ctx} need {2 * n_ctx}"
        )
    windows = []
    for begin in range(0, len(token_ids) - n_ctx + 1, n_ctx):
        chunk = list(token_ids[begin : begin + n_ctx])
        if bos_token_id is not None:
            chunk[0] = bos_token_id
        windows.append(Window(chunk, n_ctx // 2 + 1))
    return windows


def window_logprobs(engine: LLMEngine, windows: Sequence[Window]) -> list[list[float]]:
    """The logprob of each scored token of each window, computed by ``engine`` as prompt logprobs.

    The engine must be idle (:func:`run_to_completion`); at most :data:`WINDOWS_PER_BATCH`
    windows are in flight at once, batched by its scheduler like any requests.
    """
    longest = engine.max_model_len - 1  # each window is a prompt that generates one token
    too_long = [len(w.token_ids) for w in windows if len(w.token_ids) > longest]
    if too_long:
        raise ValueError(
            f"a window of {too_long[0]} tokens does not fit: the engine's max_model_len "
            f"{engine.max_model_len} allows prompts of {longest} tokens plus the one generated"
        )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    scored: list[list[float]] = []
    for first in range(0, len(windows), WINDOWS_PER_BATCH):
        batch = windows[first : first + WINDOWS_PER_BATCH]
        outputs = run_to_completion(engine, [w.token_ids for w in batch], params)
        for out, window in zip(outputs, batch, strict=True):
            scored.append([entry.logprob for entry in out.prompt_logprobs[window.scored_from :]])
    return scored


def run_to_completion(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], params: SamplingParams
) -> list[RequestOutput]:
    """Run ``prompts`` through an idle ``engine`` to the end; their final outputs, in order.

    It drives the engine's steps itself, so another caller's requests would be stepped too and
    their outputs lost: an engine with requests is refused.
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("this drives the engine's steps: it needs an engine with no requests")
    ids = [f"run-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, list(prompt), params)
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step(finished_only=True))
    return [finished[request_id] for request_id in ids]


def perplexity(
    engine: LLMEngine, documents: Iterable[Sequence[int]], window: int, stride: int | None = None
) -> Perplexity:
    """Perplexity of ``documents`` (token ids each; windows never cross documents) by ``engine``'s
    prompt logprobs, in windows of ``window`` tokens every ``stride`` (default ``window``)."""
    windows = [w for ids in documents for w in sliding_windows(ids, window, stride)]
    return Perplexity.of(window_logprobs(engine, windows))
