"""Prompt logprobs: every prompt token's logprob through the paged path equals transformers'.

The reference is transformers' ``log_softmax`` of one forward pass over the whole prompt, on the
trained built-in model in float32. The engine computes the same numbers chunk by chunk (small
token budgets cut prompts into many steps, mixed with other requests' decodes), past prefix-cache
hits (which a prompt-logprobs request must not use), and through preemption and recomputation.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine import RequestLimits
from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.core.sequence import Request
from pagedkv.engine.sample.prompt_logprobs import score
from pagedkv.models import builtin_model_path
from tests.engine.plans import Piece, plan_of

CODE = (
    "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() "
    "for line in f]\n\n\nclass Counter:\n    def __init__(self):\n        self.count = 0\n\n    def "
    "add(self, n=1):\n        self.count += n\n        return self.count\n"
)
TOP = 3


@pytest.fixture(scope="module")
def reference():
    """transformers' float32 log-softmax over a whole prompt, per prompt (cached by ids)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(builtin_model_path(), dtype=torch.float32)
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logprobs(ids: list[int]) -> torch.Tensor:
        if tuple(ids) not in cache:
            with torch.no_grad():
                cache[tuple(ids)] = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        return cache[tuple(ids)]

    return logprobs


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts of 1, 2, 23 and ~70 tokens cut from one piece of Python source."""
    ids = LLM(dtype="float32", num_kv_blocks=8).tokenizer.encode(CODE)
    return [ids[:1], ids[:2], ids[:23], ids]


def _check_against(reference, output, k: int) -> None:
    ids = output.prompt_token_ids
    entries = output.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    expected = reference(ids)
    for position in range(1, len(ids)):
        row, entry = expected[position - 1], entries[position]
        assert entry.token_id == ids[position]
        assert entry.logprob == pytest.approx(row[ids[position]].item(), abs=1e-4)
        assert entry.rank == 1 + int((row > row[ids[position]] + 1e-4).sum())
        top_lp, top_ids = row.topk(k)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top_lp.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [5, 2048])
def test_prompt_logprobs_equal_transformers_through_chunked_prefill(reference, prompts, budget):
    llm = LLM(dtype="float32", max_num_batched_tokens=budget, num_kv_blocks=64, block_size=4)
    params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=TOP, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        _check_against(reference, out, TOP)
        assert len(out.outputs[0].token_ids) == 6
    assert llm.kv_stats()["blocks_used"] == 0


def test_without_prompt_logprobs_there_are_none_and_zero_asks_for_the_token_only(reference, prompts):
    llm = LLM(dtype="float32", num_kv_blocks=64)
    plain, zero = llm.generate(
        [prompts[2], prompts[2]],
        [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, prompt_logprobs=0)],
        use_tqdm=False,
    )
    assert plain.prompt_logprobs is None
    assert all(entry.top == [] for entry in zero.prompt_logprobs[1:])
    _check_against(reference, zero, 0)


def test_a_prompt_logprobs_request_skips_prefix_cache_hits_and_others_still_use_them(reference, prompts):
    llm = LLM(dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    prompt = prompts[3]
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=1)
    warm = llm.generate([prompt], plain, use_tqdm=False)[0]
    after = llm.generate([prompt], scored, use_tqdm=False)[0]
    again = llm.generate([prompt], plain, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0  # the cached blocks hold no logits to score them with
    _check_against(reference, after, 1)
    assert again.num_cached_tokens > 0  # the cache itself is untouched
    assert warm.outputs[0].token_ids == after.outputs[0].token_ids == again.outputs[0].token_ids
    assert llm.kv_stats()["blocks_used"] == 0


def test_prompt_logprobs_survive_preemption_and_parallel_samples(reference, prompts):
    # 20 blocks of 4 tokens for four requests growing to ~100 tokens: preemption must happen (the
    # budget is set above the pool, which holds less than the three samples' worth).
    llm = LLM(
        dtype="float32",
        num_kv_blocks=20,
        block_size=4,
        max_num_batched_tokens=8,
        watermark=0.0,
        decode_headroom=0.0,
        limits=RequestLimits(max_request_tokens=4096),
    )
    long = prompts[3][:40]
    params = [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=8, n=3, seed=1, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
    ]
    outs = llm.generate([long, prompts[2], prompts[2], long], params, use_tqdm=False)
    assert llm.kv_stats()["preemptions"] > 0
    for out in outs[:3]:
        _check_against(reference, out, 2)
    assert outs[3].prompt_logprobs is None and len(outs[2].outputs) == 3
    assert llm.kv_stats()["blocks_used"] == 0


def test_a_recomputed_chunk_is_recorded_once(reference, prompts):
    """After a preemption mid-prompt the rows come again from position 0: nothing is duplicated."""
    ids = prompts[2]
    request = Request("r", None, ids, SamplingParams(prompt_logprobs=1), arrival_time=0.0)
    logits = reference(ids)  # log-softmax is idempotent: fine as logits
    for start, stop in [(0, 10), (0, 15), (15, len(ids))]:  # recomputed from the start, one chunk further
        request.prompt_logprobs.extend(score(request, start, logits[start:stop]))
    assert [e.token_id for e in request.prompt_logprobs[1:]] == ids[1:]
    with pytest.raises(RuntimeError, match="before those of position"):
        score(Request("s", None, ids, SamplingParams(prompt_logprobs=1), 0.0), 4, logits[4:])


def test_a_prompt_logits_slice_returns_every_row_and_survives_json():
    plan = plan_of(
        [Piece([5, 6, 7], 0, [3], True, prompt_logits=True), Piece([8, 9], 0, [2], False, True)]
        + [Piece([4], 7, [1, 2], True)]
    )
    assert StepPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert [list(s.logits_rows()) for s in plan.slices] == [[0, 1, 2], [0, 1], [0]]
    assert plan.num_logits == 6
    llm = LLM(dtype="float32", num_kv_blocks=8, block_size=4)
    runner = llm.engine.executor.runner
    inputs = runner.prepare(plan)
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3, 4, 5]
