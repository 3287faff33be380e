"""The last stage of a step: sampled tokens in, ``RequestOutput``s out.

Appends each sampled token to its sequence (and advances its grammar, under structured
output), streams its text through the sequence's detokenizer, applies the stop conditions (EOS,
stop tokens, stop strings, a complete grammar, ``max_tokens``, the context length), advances
beam searches, frees the blocks of whatever finished and builds the
outputs of every request that moved (vLLM's output processor, nano-vllm's ``postprocess``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.engine.beam_search import advance_beams
from pagedkv.engine.fault_isolation import error_message
from pagedkv.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedkv.engine.sequence import Request, Sequence
from pagedkv.engine.spec.metrics import SpecDecodingStats
from pagedkv.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagedkv.engine.scheduler import Scheduler


@dataclass
class SampledStep:
    """What the sample stage hands over: one token per sampled sequence (None for the
    sequences of a request whose sampling failed), and the beam searches whose beams got their
    log-probabilities this step."""

    seqs: list[Sequence]
    token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None]
    beam_requests: list[Request]
    #: Prompt tokens of the sequences whose prompt finished computing this step.
    prompt_tokens: int
    #: The requests whose sampling raised (by request id), with what they raised.
    failures: dict[str, BaseException] = field(default_factory=dict)
    #: The drafts this step verified (speculative decoding; None when it verified none). A
    #: speculating sequence appears in ``seqs`` once per token it keeps, in order.
    spec_decoding: SpecDecodingStats | None = None


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

    def process(
        self, sampled: SampledStep, scheduler: Scheduler, now: float, finished_only: bool = False
    ) -> ProcessedStep:
        """Append, detokenize and stop; advance beams; end failed requests; finish what ended;
        build the outputs (with ``finished_only``, only those of the requests that finished)."""
        touched: dict[str, Request] = {}
        generated = self._append_samples(sampled, now, touched)
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
        for request_id, error in sampled.failures.items():
            self._fail(touched[request_id], error, scheduler)
        moved = (r for r in touched.values() if r.is_finished) if finished_only else touched.values()
        return ProcessedStep([self.make_output(r) for r in moved], generated)

    def _append_samples(self, sampled: SampledStep, now: float, touched: dict[str, Request]) -> int:
        """Append each sampled token (a failed request's rows have none); note every request
        that moved in ``touched``. Returns the tokens appended."""
        generated = 0
        for seq, token, logprobs in zip(sampled.seqs, sampled.token_ids, sampled.logprobs, strict=True):
            touched[seq.request.request_id] = seq.request
            if token is None:  # its request failed: ended in process()
                continue
            if seq.finish_reason is not None:  # a verified token after one that stopped it
                continue
            if seq.grammar is not None and not seq.grammar.accept_token(token):
                # The mask allows only what the grammar accepts: a bug, ended like one in sampling.
                error = RuntimeError(f"the grammar of the request refused token {token}, which it allowed")
                sampled.failures.setdefault(seq.request.request_id, error)
                continue
            self.append_token(seq, token, logprobs)
            generated += 1
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
        return generated

    @staticmethod
    def _fail(request: Request, error: BaseException, scheduler: Scheduler) -> None:
        """End every sequence of ``request`` with ``finish_reason="error"``; its blocks return now."""
        request.error = error_message(request, error)
        for seq in request.seqs:
            if not seq.is_finished:
                scheduler.finish(seq)
                seq.finish_reason = "error"

    def append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> None:
        params = seq.request.params
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs.logprob
        ends_at_eos = token in self.eos_token_ids and not params.ignore_eos
        if not ends_at_eos:  # the EOS that ends a sample has no text, even with special tokens shown
            seq.text += seq.detokenizer.push(token)
        if ends_at_eos:
            seq.finish_reason = "stop"
        elif token in seq.request.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif self._truncate_at_stop(seq):
            return
        elif seq.grammar is not None and seq.grammar.is_terminated():  # its stop token, under ignore_eos
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.text += seq.detokenizer.flush()
            self._truncate_at_stop(seq)

    @staticmethod
    def _truncate_at_stop(seq: Sequence) -> bool:
        """End ``seq`` at the earliest stop string in its text, cutting the text before it (after
        it under ``include_stop_str_in_output``).

        Only the characters added since the last call are read (see
        :mod:`pagedkv.engine.stop_strings`): the cost per token does not grow with the stop list.
        """
        if seq.stop_scan is None:
            return False
        match = seq.stop_scan.find(seq.text)
        if match is None:
            return False
        kept = len(match.stop) if seq.request.params.include_stop_str_in_output else 0
        seq.text = seq.text[: match.start + kept]
        seq.finish_reason, seq.stop_reason = "stop", match.stop
        return True

    def make_output(self, request: Request) -> RequestOutput:
        if request.beam is not None:
            completions = self._beam_completions(request)
        else:
            completions = self._completions(request)
        metrics = {"arrival_time": request.arrival_time}
        if request.first_token_time is not None:
            metrics["time_to_first_token"] = request.first_token_time - request.arrival_time
        if request.spec_decoding is not None:
            metrics |= request.spec_decoding.request_metrics(request.spec_disabled_reason)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.is_finished,
            num_cached_tokens=request.num_cached_tokens,
            metrics=metrics,
            error=request.error,
            prompt_logprobs=request.prompt_logprobs,
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
                token_ids=seq.output_token_ids,  # a fresh list: the sequence moves on
                cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
                logprobs=list(seq.logprobs) if params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in request.seqs
        ]
