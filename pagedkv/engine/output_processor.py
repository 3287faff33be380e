"""The last stage of a step: sampled tokens in, ``RequestOutput``s out.

Appends each sampled token to its sequence, streams its text through the sequence's
detokenizer, applies the stop conditions (EOS, stop tokens, stop strings, ``max_tokens``, the
context length), advances beam searches, frees the blocks of whatever finished and builds the
outputs of every request that moved (vLLM's output processor, nano-vllm's ``postprocess``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.engine.beam_search import advance_beams
from pagedkv.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedkv.engine.sequence import Request, Sequence
from pagedkv.models import Tokenizer

if TYPE_CHECKING:
    from pagedkv.engine.scheduler import Scheduler


@dataclass
class SampledStep:
    """What the sample stage hands over: one token per sampled sequence, and the beam searches
    whose beams got their log-probabilities this step."""

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    beam_requests: list[Request]
    #: Prompt tokens of the sequences whose prompt finished computing this step.
    prompt_tokens: int


@dataclass
class ProcessedStep:
    outputs: list[RequestOutput]
    #: Tokens appended to sequences this step (samples and beams).
    generated_tokens: int


class OutputProcessor:
    """Turns sampled tokens into text, finish reasons and :class:`RequestOutput` objects."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def process(self, sampled: SampledStep, scheduler: Scheduler, now: float) -> ProcessedStep:
        """Append, detokenize and stop; advance beams; finish what ended; build the outputs."""
        touched: dict[str, Request] = {}
        for seq, token, logprobs in zip(sampled.seqs, sampled.token_ids, sampled.logprobs, strict=True):
            self.append_token(seq, token, logprobs)
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
            touched[seq.request.request_id] = seq.request
        generated = len(sampled.seqs)
        for request in sampled.beam_requests:
            appended = advance_beams(request, scheduler, self.max_model_len)
            if appended is None:
                continue  # a beam is still catching up
            generated += appended
            if request.first_token_time is None:
                request.first_token_time = now
            if request.is_finished:  # beams stream nothing before the search is over
                touched[request.request_id] = request
        for seq in sampled.seqs:
            if seq.finish_reason is not None:
                scheduler.finish(seq)
        return ProcessedStep([self.make_output(r) for r in touched.values()], generated)

    def append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> None:
        params = seq.request.params
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs.logprob
        seq.text += seq.detokenizer.push(token)
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif params.stop and self._truncate_at_stop(seq):
            return
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.text += seq.detokenizer.flush()
            if params.stop:
                self._truncate_at_stop(seq)

    @staticmethod
    def _truncate_at_stop(seq: Sequence) -> bool:
        """End ``seq`` at the first stop string in its text, cutting the text before it."""
        hits = [(seq.text.find(stop), stop) for stop in seq.request.params.stop]
        hits = [(at, stop) for at, stop in hits if at >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        seq.text = seq.text[:at]
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    def make_output(self, request: Request) -> RequestOutput:
        if request.beam is not None:
            completions = self._beam_completions(request)
        else:
            completions = self._completions(request)
        metrics = {"arrival_time": request.arrival_time}
        if request.first_token_time is not None:
            metrics["time_to_first_token"] = request.first_token_time - request.arrival_time
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.is_finished,
            num_cached_tokens=request.num_cached_tokens,
            metrics=metrics,
        )

    def _beam_completions(self, request: Request) -> list[CompletionOutput]:
        """Beams best first (only once the search is over; nothing streams before)."""
        return [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(h.token_ids),
                token_ids=list(h.token_ids),
                cumulative_logprob=h.cumulative_logprob,
                finish_reason="stop" if h.ended_with_eos else "length",
            )
            for i, h in enumerate(request.beam.results)
        ]

    @staticmethod
    def _completions(request: Request) -> list[CompletionOutput]:
        params = request.params
        return [
            CompletionOutput(
                index=seq.index,
                text=seq.text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
                logprobs=list(seq.logprobs) if params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in request.seqs
        ]
