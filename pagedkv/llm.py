"""LLM: the offline API -- many prompts in, finished outputs out, in the order given."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedkv.engine import (
    BeamSearchParams,
    EngineConfig,
    LLMEngine,
    LoRARequest,
    RequestOutput,
    SamplingParams,
)

#: A prompt as vLLM's ``LLM`` takes it: text, token ids, or a ``TextPrompt`` / ``TokensPrompt``
#: dict (``{"prompt": ...}`` or ``{"prompt_token_ids": [...]}``, with an optional ``cache_salt``).
PromptType = str | Sequence[int] | Mapping[str, object]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


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
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt (text, token ids, or a prompt dict) to completion; outputs in input order.

        Without ``sampling_params``: :meth:`get_default_sampling_params` (the model's defaults).
        ``priority``: one per prompt, lower first (vLLM's); needs ``scheduling_policy="priority"``.
        A prompt dict's ``cache_salt`` (vLLM's) keeps its prefix cache apart from other salts'.
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); needs ``enable_lora=True``.
        """
        prompts = self._as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        ids = self._submit(
            [
                lambda rid, p=p, sp=sp, pr=pr, lo=lo: self.engine.add_request(
                    rid, p[0], sp, priority=pr, cache_salt=p[1], lora_request=lo
                )
                for p, sp, pr, lo in zip(prompts, params, priorities, loras, strict=True)
            ]
        )
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` dicts) or a list of them;
        outputs in input order, as :meth:`generate` gives them (vLLM's ``LLM.chat``).

        Each conversation is rendered by the model's chat template (or ``chat_template``, Jinja
        source), which also sees ``tools`` and the ``chat_template_kwargs`` as variables, then
        tokenized without special tokens: the template places any BOS itself. The output's
        ``prompt`` is the rendered text. ``add_generation_prompt`` opens the assistant's turn;
        ``continue_final_message`` instead leaves the last message open for the model to go on.
        ``lora_request``: as :meth:`generate` takes it.
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        conversations = [messages] if not messages or isinstance(messages[0], dict) else list(messages)
        variables = {**({"tools": tools} if tools is not None else {}), **(chat_template_kwargs or {})}
        texts = [
            self.tokenizer.apply_chat_template(
                list(conversation),
                add_generation_prompt,
                continue_final_message,
                chat_template=chat_template,
                **variables,
            )
            for conversation in conversations
        ]
        prompts = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
        return outputs

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters ``generate`` uses when given none (vLLM's name): the sampling
        fields of the model's generation_config.json (``generation_config="auto"``, the default;
        "vllm" ignores them; a folder reads the file there), else ``SamplingParams()``."""
        return self.engine.get_default_sampling_params()

    @staticmethod
    def _as_prompt_list(prompts) -> list[tuple[str | list[int], str | None]]:
        """Each prompt as (text or token ids, cache salt)."""
        if isinstance(prompts, str | Mapping) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return [_parse_prompt(p) for p in prompts]

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
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Beam search for each prompt; each output's completions are its beams, best first.

        Beams are forked block tables: they share every block they have in common.
        ``lora_request``: the adapter every prompt runs with (None: the base model).
        """
        prompts = self._as_prompt_list(prompts)
        ids = self._submit(
            [
                lambda rid, p=p: self.engine.add_beam_request(rid, p[0], params, p[1], lora_request)
                for p in prompts
            ]
        )
        return self._run(ids, use_tqdm)

    def kv_stats(self) -> dict[str, float | int | str]:
        """The KV pool now (blocks, utilization, prefix-cache hits, preemptions) and its cost on
        each rank: ``kv_cache_dtype``, ``bytes_per_token`` (scales included), ``kv_cache_bytes``;
        ``tensor_parallel_size`` ranks hold such a cache each."""
        return self.engine.kv_stats()

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()


def _parse_prompt(prompt: PromptType) -> tuple[str | list[int], str | None]:
    """(text or token ids, cache salt) of one prompt; a dict holds exactly one of ``prompt`` and
    ``prompt_token_ids``."""
    if isinstance(prompt, str):
        return prompt, None
    if not isinstance(prompt, Mapping):
        return list(prompt), None
    unknown = set(prompt) - _PROMPT_KEYS
    if unknown:
        allowed = sorted(_PROMPT_KEYS)
        raise ValueError(f"prompt dict has unsupported keys {sorted(unknown)}; allowed: {allowed}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict holds exactly one of 'prompt' and 'prompt_token_ids'")
    if "prompt" in prompt:
        body = prompt["prompt"]
        if not isinstance(body, str):
            raise ValueError(f"a prompt dict's 'prompt' is text, got {type(body).__name__}")
    else:
        body = list(prompt["prompt_token_ids"])  # type: ignore[call-overload]
    return body, prompt.get("cache_salt")  # type: ignore[return-value]
