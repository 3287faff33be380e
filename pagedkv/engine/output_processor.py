"""The last stage of a step: sampled tokens in, stop decisions and ``RequestOutput``s out.

:meth:`OutputProcessor.process` appends each sampled token to its sequence (and advances its
grammar, under structured output), streams its text through the sequence's detokenizer, checks
the stop conditions (EOS, stop tokens, stop strings, a complete grammar, ``max_tokens``, the
context length), ranks beam searches and names the failed requests -- deciding, in the step's
:class:`~pagedkv.engine.core.commit.StepDecisions`, which sequences finish and why, which beams fork
and which requests end with an error. It frees nothing: the commit point does
(:func:`~pagedkv.engine.core.commit.update_from_output`). :meth:`OutputProcessor.outputs` then builds
the outputs of every request that moved (vLLM's output processor, nano-vllm's ``postprocess``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.engine.core.commit import Finish
from pagedkv.engine.core.sequence import Request, Sequence
from pagedkv.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedkv.engine.sample.beam_search import advance_beams
from pagedkv.engine.sample.fault_isolation import error_message
from pagedkv.engine.spec.metrics import SpecDecodingStats
from pagedkv.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagedkv.engine.core.commit import StepDecisions


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
    #: The requests that moved this step, in the order they did (their outputs wait for the commit).
    requests: list[Request]
    #: Tokens appended to sequences this step (samples and beams).
    generated_tokens: int


class OutputProcessor:
    """Turns sampled tokens into text, finish decisions and :class:`RequestOutput` objects."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def process(self, sampled: SampledStep, decisions: StepDecisions, now: float) -> ProcessedStep:
        """Append, detokenize and check the stops; rank beams; name failed requests (their
        messages set here, their ends in ``decisions`` with the rest)."""
        touched: dict[str, Request] = {}
        generated = self._append_samples(sampled, now, touched, decisions)
        for request in sampled.beam_requests:
            appended = advance_beams(request, decisions, self.max_model_len)
            if appended is None:
                continue  # a beam is still catching up
            generated += appended
            if request.first_token_time is None:
                request.first_token_time = now
            touched[request.request_id] = request
        for request_id, error in sampled.failures.items():
            request = touched[request_id]
            request.error = error_message(request, error)
            decisions.failed.append(request)
        return ProcessedStep(list(touched.values()), generated)

    def outputs(self, processed: ProcessedStep, finished_only: bool = False) -> list[RequestOutput]:
        """The outputs of the requests that moved, once the step is committed: a beam search's
        only when it is over (beams stream nothing before), and with ``finished_only`` only
        those of the requests that finished."""
        shown = (r for r in processed.requests if r.is_finished or not (finished_only or r.beam is not None))
        return [self.make_output(r) for r in shown]

    def _append_samples(
        self, sampled: SampledStep, now: float, touched: dict[str, Request], decisions: StepDecisions
    ) -> int:
        """Append each sampled token (a failed request's rows have none); note every request
        that moved in ``touched``, every stop met in ``decisions``. Returns the tokens appended."""
        generated = 0
        stopped: set[Sequence] = set()
        for seq, token, logprobs in zip(sampled.seqs, sampled.token_ids, sampled.logprobs, strict=True):
            touched[seq.request.request_id] = seq.request
            if token is None:  # its request failed: ended at the commit
                continue
            if seq in stopped:  # a verified token after one that stopped it
                continue
            if seq.grammar is not None and not seq.grammar.accept_token(token):
                # The mask allows only what the grammar accepts: a bug, ended like one in sampling.
                error = RuntimeError(f"the grammar of the request refused token {token}, which it allowed")
                sampled.failures.setdefault(seq.request.request_id, error)
                continue
            end = self.append_token(seq, token, logprobs)
            generated += 1
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
            if end is not None:
                stopped.add(seq)
                decisions.finishes.append(end)
        return generated

    def append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> Finish | None:
        """Append ``token`` to ``seq`` with its logprobs and text; returns the finish it meets, if
        any (the commit point applies it)."""
        params = seq.request.params
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs.logprob
        ends_at_eos = token in self.eos_token_ids and not params.ignore_eos
        if not ends_at_eos:  # the EOS that ends a sample has no text, even with special tokens shown
            seq.text += seq.detokenizer.push(token)
        reason: str | None = None
        stop: int | str | None = None
        if ends_at_eos:
            reason = "stop"
        elif token in seq.request.stop_token_ids:
            reason, stop = "stop", token
        elif (found := self._truncate_at_stop(seq)) is not None:
            return Finish(seq, "stop", found)
        elif seq.grammar is not None and seq.grammar.is_terminated():  # its stop token, under ignore_eos
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            return None
        seq.text += seq.detokenizer.flush()
        if (found := self._truncate_at_stop(seq)) is not None:
            reason, stop = "stop", found
        return Finish(seq, reason, stop)

    @staticmethod
    def _truncate_at_stop(seq: Sequence) -> str | None:
        """The earliest stop string in ``seq``'s text, if any, cutting the text before it (after
        it under ``include_stop_str_in_output``).

        Only the characters added since the last call are read (see
        :mod:`pagedkv.engine.stop_strings`): the cost per token does not grow with the stop list.
        """
        if seq.stop_scan is None:
            return None
        match = seq.stop_scan.find(seq.text)
        if match is None:
            return None
        kept = len(match.stop) if seq.request.params.include_stop_str_in_output else 0
        seq.text = seq.text[: match.start + kept]
        return match.stop

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
