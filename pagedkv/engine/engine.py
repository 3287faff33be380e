"""LLMEngine: requests in, tokens out, one scheduler step at a time.

The engine owns the model, the paged KV cache and the scheduler. ``step()`` schedules, runs the
model once over every scheduled token, samples, detokenizes, applies stop conditions and frees
the blocks of whatever finished. The offline ``LLM`` and the HTTP server both drive it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedkv.attention import KVCache
from pagedkv.engine.beam_search import (
    BeamSearchParams,
    BeamState,
    Candidate,
    Hypothesis,
    best_hypotheses,
    rank_candidates,
)
from pagedkv.engine.fault_isolation import error_message, sample_rows
from pagedkv.engine.model_runner import ModelRunner
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampler import Sampler, make_generator
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import Request, Sequence
from pagedkv.engine.validation import (
    InvalidRequestError,
    RequestLimits,
    check_context,
    check_fits_cache,
    check_text,
    check_token_ids,
)
from pagedkv.memory import KVCacheManager, parse_bytes
from pagedkv.models import ModelConfig, builtin_model_path, load_model, load_tokenizer


@dataclass
class EngineConfig:
    """Everything that sizes the engine. ``model=None`` means the built-in random-weight Llama."""

    model: str | Path | None = None
    dtype: str | torch.dtype | None = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: str | int = "256MiB"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    attention_backend: str | None = None
    #: "paged", or "contiguous" / "contiguous-oracle" to measure the reservation it replaces.
    kv_policy: str = "paged"
    #: The most one request may ask for (samples, beams, tokens).
    limits: RequestLimits = field(default_factory=RequestLimits)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        path = Path(config.model) if config.model is not None else builtin_model_path()
        self.model_path = path
        self.is_builtin = config.model is None
        self.model_config = ModelConfig.from_pretrained(path)
        self.tokenizer = load_tokenizer(path)
        self.model = load_model(path, config.dtype, config.device, config.attention_backend)
        dtype = next(self.model.parameters()).dtype
        spec = self.model_config.kv_spec()
        if config.num_kv_blocks is not None:
            self.kv_cache = KVCache(spec, config.num_kv_blocks, config.block_size, dtype, config.device)
        else:
            memory = parse_bytes(config.kv_cache_memory)
            self.kv_cache = KVCache.from_memory(spec, memory, config.block_size, dtype, config.device)
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {limit} positions")
        self.max_model_len = config.max_model_len or limit
        # A contiguous reservation never shares, so it never reuses a cached prefix either.
        caching = config.enable_prefix_caching and config.kv_policy == "paged"
        self.kv = KVCacheManager(self.kv_cache.num_blocks, config.block_size, caching, config.watermark)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.kv_policy,
            self.max_model_len,
        )
        eos = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.sampler = Sampler(sorted(eos))
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv)
        self.requests: dict[str, Request] = {}
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Request:
        """Validate and queue a request; raises :class:`InvalidRequestError` with the reason."""
        params = params or SamplingParams()
        self.config.limits.check_n(params.n)
        return self._queue(request_id, prompt, params, params.n)

    def _queue(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, samples: int
    ) -> Request:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self._validate(token_ids, params, samples)
        request = Request(request_id, text, token_ids, params, arrival_time=time.monotonic())
        seq = Sequence(request, 0, list(token_ids), make_generator(params.seed, 0))
        seq.detokenizer = self.tokenizer.detokenizer(token_ids)
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request

    def _validate(self, token_ids: list[int], params: SamplingParams, samples: int) -> None:
        vocab = self.model_config.vocab_size
        check_token_ids(token_ids, vocab, "prompt")
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        check_context(len(token_ids), params.max_tokens, self.max_model_len)
        total = len(token_ids) + params.max_tokens
        self.config.limits.check_tokens(
            samples * total, f"{samples} x ({len(token_ids)} prompt + {params.max_tokens} max_tokens)"
        )
        reserved = self.max_model_len if self.scheduler.kv_policy == "contiguous" else total
        check_fits_cache(reserved, self.kv.block_size, self.kv.num_blocks, self.kv.watermark_blocks)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (queued or running); its blocks return at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass; the outputs of every request that produced a token or finished."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self.scheduler.has_work:
                raise RuntimeError("scheduler made no progress with requests waiting (a bug)")
            return []
        logits = self.runner.run(plan)
        now = time.monotonic()
        rows: list[Sequence] = []  # sequences to sample, forked samples included
        row_logits: list[int] = []  # the logits row each of them samples from
        num_sampled = 0
        beam_requests: dict[str, Request] = {}
        for item in plan.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.end
            if item.samples:
                if seq.num_output_tokens == 0:
                    self.num_prompt_tokens += seq.num_tokens
                if seq.request.beam is not None:
                    seq.pending_logprobs = logits[num_sampled].log_softmax(dim=-1)
                    beam_requests[seq.request.request_id] = seq.request
                    num_sampled += 1
                    continue
                group = self._fork(seq) if seq.request.needs_fork else [seq]
                row_logits.extend([num_sampled] * len(group))
                rows.extend(group)
                num_sampled += 1
        touched: dict[str, Request] = {}
        failures: dict[str, BaseException] = {}
        if rows:
            sampled = sample_rows(self.sampler, logits[row_logits], rows)
            failures = sampled.failures
            for seq, token, logprobs in zip(rows, sampled.token_ids, sampled.logprobs, strict=True):
                if token is None:  # its request failed: finished below
                    continue
                self._append_token(seq, token, logprobs)
                if seq.request.first_token_time is None:
                    seq.request.first_token_time = now
                touched[seq.request.request_id] = seq.request
        for seq in {item.seq for item in plan.scheduled} | set(rows):
            self.kv.cache_computed_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        for request in beam_requests.values():
            if self._advance_beams(request, now):
                touched[request.request_id] = request
        for seq in rows:
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
        for request_id, error in failures.items():
            touched[request_id] = self._fail(self.requests[request_id], error)
        outputs = [self._output(request) for request in touched.values()]
        for request in touched.values():
            if request.is_finished:
                self.requests.pop(request.request_id, None)
        return outputs

    def _fail(self, request: Request, error: BaseException) -> Request:
        """End every sequence of ``request`` with ``finish_reason="error"``; its blocks return now."""
        request.error = error_message(request, error)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "error"
        return request

    def add_beam_request(self, request_id: str, prompt: str | list[int], params: BeamSearchParams) -> Request:
        """Queue a beam search; its result arrives as one RequestOutput, beams best first."""
        self.config.limits.check_beam_width(params.beam_width)
        sampling = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=params.ignore_eos)
        request = self._queue(request_id, prompt, sampling, params.beam_width)
        request.beam = BeamState(params, self.eos_token_ids)
        return request

    def _advance_beams(self, request: Request, now: float) -> bool:
        """Rank the candidates once every live beam has its log-probs; True when it finished."""
        beams = [s for s in request.seqs if not s.is_finished]
        if not all(s.pending_logprobs is not None and s.num_computed_tokens == s.num_tokens for s in beams):
            return False
        state = request.beam
        survivors, ended = rank_candidates(
            [s.pending_logprobs for s in beams], [s.cumulative_logprob for s in beams], state
        )
        for c in ended:
            tokens = beams[c.parent].output_token_ids + [c.token]
            state.finished.append(Hypothesis(tokens, c.score, ended_with_eos=True))
        if request.first_token_time is None:
            request.first_token_time = now
        children: dict[int, list[Candidate]] = {}
        for c in survivors:
            children.setdefault(c.parent, []).append(c)
        next_beams: list[Sequence] = []
        for index, parent in enumerate(beams):
            parent.pending_logprobs = None
            chosen = children.get(index, [])
            if not chosen:
                self.scheduler.finish(parent)  # a dropped beam frees its private blocks now
                continue
            for c in chosen[1:]:
                child = Sequence(request, 0, list(parent.token_ids), None)
                child.num_computed_tokens = parent.num_computed_tokens
                copies = self.kv.fork(parent.seq_id, child.seq_id, share=self.scheduler.shares_blocks)
                self.scheduler.pending_copies.extend(copies)
                self.scheduler.add_running(child)
                self._extend_beam(child, c)
                next_beams.append(child)
            self._extend_beam(parent, chosen[0])
            next_beams.append(parent)
        request.seqs = next_beams
        done = not next_beams or next_beams[0].num_output_tokens >= state.params.max_tokens
        done = done or next_beams[0].num_tokens >= self.max_model_len
        if done:
            live = [Hypothesis(s.output_token_ids, s.cumulative_logprob) for s in next_beams]
            for seq in next_beams:
                self.scheduler.finish(seq)
            state.results = best_hypotheses(state, live)
        return done

    def _extend_beam(self, seq: Sequence, candidate: Candidate) -> None:
        seq.token_ids.append(candidate.token)
        seq.cumulative_logprob = candidate.score
        self.num_generated_tokens += 1

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Turn a just-computed prompt into ``n`` samples sharing its blocks (copy-on-write)."""
        request = parent.request
        group = [parent]
        for index in range(len(request.seqs), request.params.n):
            child = Sequence(
                request, index, list(parent.token_ids), make_generator(request.params.seed, index)
            )
            child.num_computed_tokens = parent.num_computed_tokens
            child.detokenizer = self.tokenizer.detokenizer(request.prompt_token_ids)
            copies = self.kv.fork(parent.seq_id, child.seq_id, share=self.scheduler.shares_blocks)
            self.scheduler.pending_copies.extend(copies)
            self.scheduler.add_running(child)
            request.seqs.append(child)
            group.append(child)
        return group

    def _append_token(self, seq: Sequence, token: int, logprobs) -> None:
        params = seq.request.params
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
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

    def _output(self, request: Request) -> RequestOutput:
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
            error=request.error,
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

    def _completions(self, request: Request) -> list[CompletionOutput]:
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

    # -- statistics -------------------------------------------------------------------------
    def kv_stats(self) -> dict[str, float | int]:
        """Blocks total / used / cached, utilization, preemptions and prefix-cache hits."""
        usage = self.kv.usage()
        queries, hits = self.kv.prefix_query_tokens, self.kv.prefix_hit_tokens
        return {
            "block_size": usage.block_size,
            "blocks_total": usage.total_blocks,
            "blocks_used": usage.used_blocks,
            "blocks_free": usage.free_blocks,
            "blocks_cached": usage.cached_blocks,
            "utilization": usage.utilization,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries_tokens": queries,
            "prefix_cache_hits_tokens": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }
