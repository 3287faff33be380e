"""transformers' own answers for the exactness tests of the families and RoPE scalings.

A dynamic-NTK model in transformers recomputes its frequencies for the longest sequence it has
seen; pagedkv computes them once for the whole stretched context (:mod:`pagedkv.models.rope`).
``warmup`` runs one forward of the full context first, after which transformers keeps those
frequencies for every sequence longer than the pretraining length: the condition under which
both must agree.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import transformers

from tests.checkpoints import TEST_VOCAB_SIZE


def hf_model(path: Path, warmup: int = 0) -> transformers.PreTrainedModel:
    """The float32 eager transformers model of ``path``, after a forward of ``warmup`` tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if warmup:
        with torch.no_grad():
            model(torch.arange(warmup)[None] % TEST_VOCAB_SIZE)
    return model


def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len, vocab]`` of one sequence run alone."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(model: transformers.PreTrainedModel, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, ``max_new`` tokens, no stop token."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones_like(ids)
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


def long_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts longer than 16 tokens (the tests' pretraining length), two sharing a 40-token
    prefix so the prefix cache hits."""
    rng = random.Random(seed)
    shared = [rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(40)]
    prompts = [[rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)] for n in (17, 21, 33, 40)]
    return [*prompts, shared + [5, 6, 7], shared + [9]]
