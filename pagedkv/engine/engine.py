"""LLMEngine: requests in, tokens out, one scheduler step at a time.

``step()`` is a few calls, each stage in its own module:

1. schedule -- :mod:`pagedkv.engine.core.scheduler` picks the slices to compute and allocates their blocks;
2. execute -- an executor (:mod:`pagedkv.engine.worker.executor`) runs the model over the step's plan
   and returns the logits of the slices that end a sequence (and of every prompt row whose
   prompt logprobs were asked for: :mod:`pagedkv.engine.sample.prompt_logprobs` records those); a
   second KV tier settles its moves (:mod:`pagedkv.engine.core.kv_tier`: a failed load leaves the step);
3. sample -- :mod:`pagedkv.engine.sample.sample_stage` has :mod:`pagedkv.engine.sample.sampler` draw one
   token per sequence (a finished prompt first forks into its ``n`` samples) and verifies proposed
   tokens; beams keep their log-probabilities. Through :mod:`pagedkv.engine.sample.fault_isolation`: a
   request whose sampling raises fails alone;
4. process outputs -- :mod:`pagedkv.engine.output_processor` appends, detokenizes, checks the
   stops, ranks beam searches and names failed requests;
5. commit -- :func:`pagedkv.engine.core.commit.update_from_output` applies what stages 2-4 decided
   (progress, forks, rollbacks, prefix-cache inserts, frees), the one writer of them after the
   forward pass;
6. outputs -- the ``RequestOutput`` of every request that moved.

After each step the engine publishes a :class:`~pagedkv.engine.stats.StepStats`. The offline
``LLM`` and the HTTP server both drive it.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.core.adapter_admission import adapters_in_use
from pagedkv.engine.core.commit import StepDecisions, finish, update_from_output
from pagedkv.engine.core.kv_tier import make_kv_manager
from pagedkv.engine.core.plan import ShippedTables, StepPlan
from pagedkv.engine.core.scheduler import Scheduler, SchedulerOutput
from pagedkv.engine.core.sequence import BeamState, Request, Sequence
from pagedkv.engine.kv_snapshot import KVSnapshot
from pagedkv.engine.lora_registry import LoRARegistry
from pagedkv.engine.lora_request import LoRARequest
from pagedkv.engine.output_processor import OutputProcessor, ProcessedStep, SampledStep
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sample.prompt_logprobs import take_prompt_logprobs
from pagedkv.engine.sample.sample_stage import sample_step
from pagedkv.engine.sample.sampler import Sampler, make_generator
from pagedkv.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedkv.engine.spec.factory import make_verifier
from pagedkv.engine.stats import EngineStats, StatsCollector, StepStats
from pagedkv.engine.structured.manager import StructuredOutputManager
from pagedkv.engine.validation import InvalidRequestError, RequestValidator, check_cache_salt
from pagedkv.engine.worker.executor import Executor
from pagedkv.engine.worker.executor.factory import make_executor
from pagedkv.memory.prefix_cache import root_of
from pagedkv.models import ModelConfig
from pagedkv.models.generation_config import default_sampling_params
from pagedkv.models.hub import resolve_model
from pagedkv.tokenizer import engine_tokenizer
from pagedkv.tokenizer.gguf_file import release_readers

if TYPE_CHECKING:
    import torch

    from pagedkv.engine.structured.xgrammar_backend import CompiledGrammar

__all__ = ["EngineConfig", "InvalidRequestError", "LLMEngine"]

logger = logging.getLogger("pagedkv.engine")


class LLMEngine:
    """Requests in, tokens out: the loop that the offline ``LLM`` and the HTTP server drive.

    ``add_request`` validates and queues; each ``step()`` runs one scheduler step over every
    live request and returns the outputs that moved. Not thread-safe: one thread owns it.
    """

    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig(**overrides)
        #: The user's flat options, and the typed parts they resolve to (what the engine reads).
        self.config = config
        self.settings = settings = config.resolve()
        self.kv_policy = settings.kv_policy
        #: The model's folder, and the Hub id it came from (``pagedkv.models.hub``).
        model = settings.model
        self.model_source = resolve_model(
            model.model, model.revision, model.download_dir, weights=model.loads_weights
        )
        path = self.model_source.folder
        self.model_path = path
        self.is_builtin = model.model is None
        self.model_config = ModelConfig.from_pretrained(path)
        self.default_sampling_params = self._model_sampling_defaults()
        limit = self.model_config.max_position_embeddings
        if model.max_model_len is not None and model.max_model_len > limit:
            raise ValueError(f"max_model_len {model.max_model_len} exceeds the model's {limit} positions")
        self.max_model_len = model.max_model_len or limit
        tokenizer = path if model.tokenizer is None else self._tokenizer_folder(model.tokenizer)
        self.tokenizer = engine_tokenizer(tokenizer, model.skip_tokenizer_init)
        self.executor: Executor = make_executor(settings, path, self.model_config)
        release_readers()  # a GGUF model's weights are loaded: its files' mappings can go
        num_blocks = self.executor.num_kv_blocks
        #: How the pool was sized; ``describe()`` is the line the CLI prints at start-up.
        self.kv_sizing = self.executor.kv_sizing
        logger.info("%s", self.kv_sizing.describe())
        self.kv_manager, self.kv_tier = make_kv_manager(settings, self.executor)
        #: the block tables the executor's runners hold, as the plans sent them
        self.shipped_tables = ShippedTables()
        self.scheduler = Scheduler.from_config(settings, self.kv_manager, self.max_model_len)
        pool_tokens = num_blocks * settings.cache.block_size
        self.validator = RequestValidator(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            kv_policy=self.kv_policy,
            block_size=settings.cache.block_size,
            num_blocks=num_blocks,
            usable_blocks=self.kv_manager.usage().total_blocks - self.kv_manager.watermark_blocks,
            peak_blocks=self.kv_manager.peak_blocks,
            limits=settings.limits.resolved(pool_tokens, settings.scheduler.max_num_seqs, self.max_model_len),
        )
        eos = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.sampler = Sampler(sorted(eos))
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, eos, settings.structured_outputs
        )
        #: Speculative decoding's proposer, policy and verifier (None: off).
        vocab = self.model_config.vocab_size
        self.verifier = make_verifier(settings, self.max_model_len, vocab, sorted(eos), num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.stats_collector = StatsCollector(self.scheduler, self.kv_tier, self.verifier is not None)
        self.requests: dict[str, Request] = {}
        #: The LoRA adapters requests may name (checked when added); refuses all without LoRA.
        self.loras = LoRARegistry(settings.lora, self.model_config)
        #: Prefix-cache root -> the adapter whose requests' blocks hash under it (read by KV
        #: events, which name a block's adapter); one entry per adapter and cache salt.
        self.lora_roots: dict[int, LoRARequest] = {}

    def _tokenizer_folder(self, tokenizer: str | Path) -> Path:
        """The folder (or GGUF file) of a ``tokenizer`` given apart from the model: a local path,
        or a Hub id whose tokenizer files are fetched without its weights."""
        options = self.settings.model
        return resolve_model(tokenizer, None, options.download_dir, weights=False).folder

    def _model_sampling_defaults(self) -> dict[str, Any]:
        """generation_config.json's sampling fields (per ``settings.model.generation_config``), checked
        once here: a bad value stops the start instead of failing every request."""
        defaults = default_sampling_params(self.model_path, self.settings.model.generation_config)
        try:
            SamplingParams(**defaults)
        except (TypeError, ValueError) as err:
            raise ValueError(f"the model's generation_config.json sets a bad default: {err}") from None
        if defaults:
            logger.warning(
                "Default sampling parameters have been overridden by the model's Hugging Face generation "
                "config: %s (--generation-config vllm ignores them)",
                defaults,
            )
        return defaults

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without sampling parameters runs with (vLLM's name): the model's
        defaults (:attr:`default_sampling_params`), else ``SamplingParams()``."""
        return SamplingParams(**self.default_sampling_params)

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        client_request_id: str | None = None,
        grammar: CompiledGrammar | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validate and queue a request; raises :class:`InvalidRequestError` with the reason.

        ``priority``: lower runs first, under the ``priority`` scheduling policy (vLLM's); requests
        that share a ``client_request_id`` share one fair share of the engine (``engine/core/fairness.py``).
        ``grammar``: ``params.structured_outputs`` compiled ahead (the server's way), else here.
        Without ``params``: :meth:`get_default_sampling_params`. ``cache_salt`` (vLLM's): a
        non-empty string; the request reuses cached KV blocks only of requests with the same salt,
        so one tenant cannot time another's prompts. ``lora_request``: the adapter the request runs
        with (added by :meth:`add_lora` if it is new); None: the base model.
        """
        self.scheduler.check_priority(priority)
        params = params or self.get_default_sampling_params()
        request = self._make_request(
            request_id, prompt, params, cache_salt, grammar=grammar, lora=lora_request
        )
        request.priority, request.client_request_id = priority, client_request_id
        return self._queue(request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check a LoRA adapter against the model and make it known (vLLM's); False if it was
        known already. Raises :class:`InvalidRequestError` naming what is wrong with it."""
        added = self.loras.add(lora_request)
        paged = self.scheduler.paged_adapters
        if added and paged is not None:
            kv = self.settings.cache.block_size, self.model_config.num_kv_heads, self.model_config.head_dim
            paged.register(lora_request.lora_int_id, self.loras.paged_file(lora_request.lora_int_id, *kv))
        return added

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter and free its slot; False if it is unknown. Refused
        (:class:`InvalidRequestError`) while a request runs or waits with it."""
        if any(r.lora_int_id == lora_int_id for r in self.requests.values()):
            raise InvalidRequestError(f"LoRA adapter {lora_int_id} is in use by a request", "lora_int_id")
        if self.scheduler.adapters is not None:
            self.scheduler.adapters.forget(lora_int_id, adapters_in_use(self.scheduler.running))
        if self.scheduler.paged_adapters is not None:
            self.scheduler.paged_adapters.forget(lora_int_id)  # its pages back to the pool
        for root in [root for root, lora in self.lora_roots.items() if lora.lora_int_id == lora_int_id]:
            del self.lora_roots[root]  # in place: KV events read this dict
        return self.loras.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters requests may name, in the order they were added."""
        return self.loras.list()

    def add_beam_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: BeamSearchParams,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Queue a beam search; its result arrives as one RequestOutput, beams best first."""
        sampling = params.sampling_params()
        request = self._make_request(request_id, prompt, sampling, cache_salt, beam=params, lora=lora_request)
        request.beam = BeamState(params, self.eos_token_ids)
        return self._queue(request)

    def _make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None,
        beam: BeamSearchParams | None = None,
        grammar: CompiledGrammar | None = None,
        lora: LoRARequest | None = None,
    ) -> Request:
        """The checked request with its first sequence, not queued yet: the caller sets what
        only its kind of request has, then :meth:`_queue` makes it visible to the scheduler."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        check_cache_salt(cache_salt)
        if lora is not None:
            self.add_lora(lora)
        samples = self.validator.check_before_encoding(prompt, params, beam)
        if not self.tokenizer.has_text and (isinstance(prompt, str) or params.stop):
            raise InvalidRequestError(f"{self.tokenizer.reason}: send token ids, no stop strings", "prompt")
        if not self.tokenizer.has_text and params.bad_words:
            raise InvalidRequestError(f"{self.tokenizer.reason}: bad_words cannot be tokenized", "bad_words")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if params.bad_words:  # a copy: the caller's params may serve other prompts, other models
            params = copy.copy(params)
            params.update_from_tokenizer(self.tokenizer)
        self.validator.check(token_ids, params, samples)
        matcher = self.structured_outputs.matcher(params, grammar)  # the last check: may compile
        now = time.monotonic()
        request = Request(request_id, text, token_ids, params, now, cache_salt=cache_salt, lora_request=lora)
        if lora is not None:
            self.lora_roots[root_of(request.prefix_salt)] = lora
        seq = Sequence(request, 0, list(token_ids), make_generator(params.seed, 0))
        seq.detokenizer = self.tokenizer.detokenizer(
            token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        seq.grammar = matcher
        request.seqs.append(seq)
        return request

    def _queue(self, request: Request) -> Request:
        """Register ``request`` and hand its first sequence to the scheduler's waiting queue."""
        self.requests[request.request_id] = request
        self.scheduler.add(request.seqs[0])
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (queued or running); its blocks return at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                finish(self.scheduler, seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One forward pass; the outputs of every request that produced a token or finished (with
        ``finished_only``, of those that finished: all the offline ``LLM`` reads, and cheaper)."""
        started = time.perf_counter()
        self.kv_tier.settle_moves()  # a disk tier's files written meanwhile are readable now
        if self.verifier is not None:
            self.verifier.speculator.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self.scheduler.has_work and not self.kv_tier.poll():  # (not while the tier moves)
                raise RuntimeError("scheduler made no progress with requests waiting (a bug)")
            return []
        plan = scheduled.plan(self.kv_manager, self.shipped_tables)
        plan, logits, reverted = self.kv_tier.settle(scheduled, plan, self._execute(plan))
        computed_at = time.monotonic()  # when this step's tokens exist: their requests' clocks
        decisions = StepDecisions.after(scheduled, reverted)
        logits = take_prompt_logprobs(scheduled.scheduled, plan.slices, logits, decisions)
        sampled = sample_step(scheduled, logits, self.sampler, self.tokenizer, decisions, self.verifier)
        processed = self.output_processor.process(sampled, decisions, computed_at)
        update_from_output(self.scheduler, decisions)
        outputs = self.output_processor.outputs(processed, finished_only)
        self._publish(scheduled, sampled, processed, outputs, started)
        return outputs

    def _execute(self, plan: StepPlan) -> torch.Tensor:
        """The executor's step; if it fails, the adapters it was to load are not resident."""
        try:
            return self.executor.execute(plan)
        except Exception:
            if plan.lora_loads and self.scheduler.adapters is not None:
                self.scheduler.adapters.undo(plan.lora_loads)
            if plan.lora_page_writes and self.scheduler.paged_adapters is not None:
                self.scheduler.paged_adapters.retry(plan.lora_page_writes)
            raise

    def _publish(
        self,
        scheduled: SchedulerOutput,
        sampled: SampledStep,
        processed: ProcessedStep,
        outputs: list[RequestOutput],
        started: float,
    ) -> None:
        """Forget the finished requests and record the step's statistics."""
        finished = [output.request_id for output in outputs if output.finished]
        for request_id in finished:
            self.requests.pop(request_id, None)
        if self.verifier is not None:
            self.verifier.speculator.forget_gone(self.scheduler.running)
        elapsed, generated = time.perf_counter() - started, processed.generated_tokens
        self.stats_collector.record_step(
            scheduled, sampled.prompt_tokens, generated, len(finished), elapsed, sampled.spec_decoding
        )

    # -- what the engine publishes ----------------------------------------------------------
    @property
    def last_step(self) -> StepStats | None:
        """The record of the latest step (None before the first)."""
        return self.stats_collector.last_step

    def stats(self) -> EngineStats:
        """Counters since the engine started, and the KV pool and queues now."""
        return self.stats_collector.engine_stats()

    def kv_stats(self) -> dict[str, float | int | str]:
        """Blocks total / used / cached, utilization, preemptions, prefix-cache hits, and what the
        cache costs on each rank: its ``kv_cache_dtype``, bytes per token (scales included) and in
        all, and how many ranks (``tensor_parallel_size``) hold such a cache."""
        return self.stats().kv_stats() | self.executor.kv_memory.stats()

    def kv_snapshot(self) -> KVSnapshot:
        """The block map: every physical block's refcount, cache state and owners."""
        return self.stats_collector.kv_snapshot()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (e.g. after the weights change); returns how many."""
        return self.kv_manager.reset_prefix_cache()

    def describe(self) -> str:
        """One line for logs and the CLI: the model, its dtype and the kernels it runs on."""
        model = "built-in model" if self.is_builtin else self.model_source.repo_id or str(self.model_path)
        return f"{model}: " + ", ".join(f"{key} {value}" for key, value in self.executor.runtime.items())

    def check_health(self) -> None:
        """Raise :class:`~pagedkv.engine.worker.executor.ExecutorError` if steps can no longer run."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Release the model and the KV cache (and any worker rank) now; idempotent. Dropping the
        engine releases them too; steps afterwards raise ``ExecutorError``."""
        self.structured_outputs.close()
        if self.scheduler.paged_adapters is not None:
            self.scheduler.paged_adapters.spill_resident()  # a disk tier keeps them too
        self.kv_tier.flush()  # a disk tier keeps the prefix cache for the next start
        self.executor.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
