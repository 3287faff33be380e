"""LLM: the offline API -- many prompts in, finished outputs out, in the order given."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tqdm.auto import tqdm

from pagedkv.engine import BeamSearchParams, EngineConfig, LLMEngine, RequestOutput, SamplingParams


class LLM:
    """Load a model once and generate for batches of prompts with continuous batching.

    ``LLM(model=None)`` loads the built-in tiny Llama trained on Python source (shipped, no download).
    Keyword arguments are :class:`EngineConfig` fields. :meth:`shutdown` (or leaving a ``with
    LLM(...) as llm:`` block, or dropping the last reference) releases the model, the KV cache
    and any tensor-parallel ranks, so another engine can start in the same process.
    """

    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def __repr__(self) -> str:
        return f"LLM({self.engine.describe()}; {self.engine.kv_sizing.describe()})"

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Release the model, the KV cache and the worker ranks now; idempotent. Generating
        afterwards raises ``ExecutorError``."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion; outputs in input order.

        ``priority``: one per prompt, lower first (vLLM's); needs ``scheduling_policy="priority"``.
        """
        prompts = self._as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        ids = self._submit(
            [
                lambda rid, p=p, sp=sp, pr=pr: self.engine.add_request(rid, p, sp, priority=pr)
                for p, sp, pr in zip(prompts, params, priorities, strict=True)
            ]
        )
        return self._run(ids, use_tqdm)

    @staticmethod
    def _as_prompt_list(prompts) -> list[str | list[int]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return [p if isinstance(p, str) else list(p) for p in prompts]

    def _submit(self, adds: list[Callable[[str], object]]) -> list[str]:
        """Queue every request or none: if one is rejected, the ones queued before it are aborted."""
        ids: list[str] = []
        try:
            for add in adds:
                request_id = str(self._next_id)
                self._next_id += 1
                add(request_id)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step(finished_only=True):
                    finished[output.request_id] = output
                    if use_tqdm:
                        bar.update(1)
                        stats = self.engine.kv_stats()
                        bar.set_postfix(kv=f"{stats['utilization']:.0%}", running=stats["running"])
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [finished[request_id] for request_id in ids]

    def beam_search(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: BeamSearchParams,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Beam search for each prompt; each output's completions are its beams, best first.

        Beams are forked block tables: they share every block they have in common.
        """
        prompts = self._as_prompt_list(prompts)
        ids = self._submit([lambda rid, p=p: self.engine.add_beam_request(rid, p, params) for p in prompts])
        return self._run(ids, use_tqdm)

    def kv_stats(self) -> dict[str, float | int | str]:
        """The KV pool now (blocks, utilization, prefix-cache hits, preemptions) and its cost on
        each rank: ``kv_cache_dtype``, ``bytes_per_token`` (scales included), ``kv_cache_bytes``;
        ``tensor_parallel_size`` ranks hold such a cache each."""
        return self.engine.kv_stats()

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()
