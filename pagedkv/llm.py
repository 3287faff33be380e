"""LLM: the offline API -- many prompts in, finished outputs out, in the order given."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedkv.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams


class LLM:
    """Load a model once and generate for batches of prompts with continuous batching.

    ``LLM(model=None)`` loads the built-in tiny Llama with random weights (no download).
    Keyword arguments are :class:`EngineConfig` fields.
    """

    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion; outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id = str(self._next_id)
                self._next_id += 1
                self.engine.add_request(
                    request_id, list(prompt) if not isinstance(prompt, str) else prompt, p
                )
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
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

    def kv_stats(self) -> dict[str, float | int]:
        return self.engine.kv_stats()

    def reset_prefix_cache(self) -> int:
        return self.engine.kv.reset_prefix_cache()
