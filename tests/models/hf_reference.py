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

from pagedkv import LLM, SamplingParams
from pagedkv.models import load_model
from tests.checkpoints import TEST_VOCAB_SIZE
from tests.devices import TEST_DEVICE

from .paging import PagedBatch

#: largest absolute logit difference to transformers, in float32
TOL = 1e-4
MAX_NEW = 10


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


def assert_packed_logits_match(path: Path, hf: transformers.PreTrainedModel, backend: str) -> None:
    """Four long prompts prefilled packed in one step, then one packed decode step, over a
    paged cache on ``backend``: every row's logits are transformers' for that sequence alone."""
    model = load_model(path, dtype=torch.float32, attention_backend=backend)
    seqs = long_prompts()[:4]
    batch = PagedBatch(model, max_len=max(map(len, seqs)) + 1, num_seqs=len(seqs))
    ours = batch.step(seqs)
    for seq, got in zip(seqs, ours, strict=True):
        assert (got - hf_logits(hf, seq)).abs().max().item() < TOL
    nxt = [[int(logits[-1].argmax())] for logits in ours]
    for seq, tok, got in zip(seqs, nxt, batch.step(nxt), strict=True):
        assert (got - hf_logits(hf, seq + tok)[-1:]).abs().max().item() < TOL


def assert_greedy_tokens_match(path: Path, hf: transformers.PreTrainedModel, block_size: int) -> None:
    """``LLM``'s greedy tokens for :func:`long_prompts` are transformers': prefill chunked
    among decodes by a small token budget, the shared prefix served from the prefix cache."""
    llm = LLM(
        str(path),
        dtype="float32",
        device=TEST_DEVICE,
        block_size=block_size,
        num_kv_blocks=2048 // block_size,
        max_num_batched_tokens=20,
    )
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(long_prompts(), greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, long_prompts(), MAX_NEW)
    assert llm.kv_stats()["prefix_cache_hits_tokens"] > 0
