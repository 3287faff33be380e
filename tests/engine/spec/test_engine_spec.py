"""Speculative decoding in the live engine: the same tokens as without it, and the pool intact.

Greedy verification keeps exactly the tokens plain greedy decoding picks, and seeded sampling
draws the same tokens with speculation on or off (the rejection sampler's point-mass draw uses
the uniform number plain sampling would have used). Every case checks that speculation really
ran (drafts were verified and some accepted) and that every block came back.
"""

from __future__ import annotations

import pytest

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.engine.spec.metrics import SpecDecodingStats
from tests.checkpoints import make_checkpoint
from tests.engine.test_engine_exactness import CASES, _prompts

#: Prompt lookup that proposes on any repeated token, so random-weight models speculate often.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]


def _assert_speculated_and_clean(llm: LLM, rejected: bool = True) -> None:
    """Drafts were verified and some accepted (and, with ``rejected``, some rolled back), and
    every block is back in the pool."""
    totals = llm.engine.verifier.speculator.totals
    assert totals.num_drafts > 0 and totals.num_accepted_tokens > 0
    assert totals.num_accepted_tokens < totals.num_draft_tokens or not rejected
    assert llm.kv_stats()["blocks_used"] == 0


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_are_those_of_plain_greedy(tmp_path, case):
    arch, overrides = CASES[case]
    path = str(make_checkpoint(tmp_path, arch, **overrides))
    # a small budget chunks the longer prompts, so verification shares steps with prompt chunks
    options = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 512, "max_num_batched_tokens": 24}
    expected = _tokens(LLM(path, **options), _prompts(), GREEDY)
    llm = LLM(path, speculative_config=NGRAM, **options)
    assert _tokens(llm, _prompts(), GREEDY) == expected
    assert llm.kv_stats()["prefix_cache_hits_tokens"] > 0
    _assert_speculated_and_clean(llm, rejected=False)  # a model that repeats one token accepts all


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return str(make_checkpoint(tmp_path_factory.mktemp("spec-llama"), "llama"))


def test_preemption_changes_no_token(llama):
    tiny = {
        "dtype": "float32",
        "block_size": 4,
        "num_kv_blocks": 20,
        "watermark": 0.0,
        "decode_headroom": 0.0,
    }
    expected = _tokens(LLM(llama, dtype="float32"), _prompts(), GREEDY)
    llm = LLM(llama, speculative_config=NGRAM, **tiny)
    assert _tokens(llm, _prompts(), GREEDY) == expected
    assert llm.kv_stats()["preemptions"] > 0
    _assert_speculated_and_clean(llm)


#: Python for the built-in model, which writes repetitive code: prompt lookup finds matches
#: even while sampling.
PYTHON_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
]


def test_seeded_samples_are_the_same_with_speculation():
    """n = 2 samples fork from one prompt (copy-on-write), each drawing from its own seed."""
    params = SamplingParams(max_tokens=48, temperature=0.5, top_p=0.95, seed=7, n=2, ignore_eos=True)
    expected = _tokens(LLM(dtype="float32"), PYTHON_PROMPTS, params)
    llm = LLM(dtype="float32", block_size=4, speculative_config=NGRAM)
    assert _tokens(llm, PYTHON_PROMPTS, params) == expected
    _assert_speculated_and_clean(llm)


def test_stop_conditions_cut_inside_an_accepted_draft(llama):
    """A stop token or max_tokens inside the verified tokens ends the sequence there."""
    plain = LLM(llama, dtype="float32")
    first = plain.generate(_prompts()[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[first[10]], ignore_eos=True)
    params = [stop, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)]
    prompts = _prompts()[:1] * 2
    expected = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(llama, dtype="float32", speculative_config=NGRAM)
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in expected]
    assert len(got[1].token_ids) == 7 and got[0].token_ids[-1] == first[10]
    assert llm.kv_stats()["blocks_used"] == 0


def test_beam_search_does_not_speculate_and_says_why(llama):
    llm = LLM(llama, dtype="float32", speculative_config=NGRAM)
    beams = llm.beam_search(_prompts()[:1], BeamSearchParams(beam_width=2, max_tokens=6), use_tqdm=False)
    plain = LLM(llama, dtype="float32").beam_search(
        _prompts()[:1], BeamSearchParams(beam_width=2, max_tokens=6), use_tqdm=False
    )
    assert [c.token_ids for c in beams[0].outputs] == [c.token_ids for c in plain[0].outputs]
    assert beams[0].metrics["spec_decode_disabled_reason"] == "beam search"
    assert llm.engine.verifier.speculator.totals.num_drafts == 0


def test_request_metrics_count_drafts(llama):
    llm = LLM(llama, dtype="float32", speculative_config=NGRAM)
    out = llm.generate(_prompts()[:1], GREEDY, use_tqdm=False)[0]
    drafted, accepted = (
        out.metrics["spec_decode_num_draft_tokens"],
        out.metrics["spec_decode_num_accepted_tokens"],
    )
    assert 0 < accepted <= drafted
    assert out.metrics["spec_decode_num_drafts"] <= drafted
    assert "spec_decode_disabled_reason" not in out.metrics


def test_the_shipped_draft_model_keeps_greedy_tokens_and_frees_its_pool():
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = _tokens(LLM(dtype="float32"), PYTHON_PROMPTS, params)
    draft = {"model": "stdlib-llama-draft", "num_speculative_tokens": 3}
    llm = LLM(dtype="float32", block_size=4, speculative_config=draft)
    assert _tokens(llm, PYTHON_PROMPTS, params) == expected
    _assert_speculated_and_clean(llm)
    assert llm.engine.verifier.speculator.proposer.kv.usage().used_blocks == 0


def test_a_draft_model_of_another_vocabulary_or_name_is_refused(llama):
    with pytest.raises(ValueError, match="speculative_config.model 'stdlib-llama-draft' has a vocabulary"):
        LLM(llama, speculative_config={"model": "stdlib-llama-draft", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="neither a model folder nor a shipped model"):
        LLM(speculative_config={"model": "no-such-draft", "num_speculative_tokens": 2})


def test_step_stats_add_up_to_the_engine_totals_and_the_requests_metrics(llama):
    """Each step's drafts (``StepStats.spec_decoding``) sum to the engine's totals, which equal
    what the requests' metrics count; an engine without speculation publishes None."""
    llm = LLM(llama, dtype="float32", speculative_config=NGRAM)
    engine = llm.engine
    for i, prompt in enumerate(_prompts()[:3]):
        engine.add_request(str(i), prompt, GREEDY)
    steps, outputs = [], {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
        steps.append(engine.last_step.spec_decoding)
    totals = engine.stats().spec_decoding
    assert totals.num_drafts > 0 and 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    summed = SpecDecodingStats()
    for step in steps:
        if step is not None:
            summed.merge(step)
    assert summed == totals == engine.verifier.speculator.totals
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert sum(o.metrics[f"spec_decode_{name}"] for o in outputs.values()) == getattr(totals, name)
    per_pos = totals.num_accepted_tokens_per_pos
    assert sum(per_pos) == totals.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    plain = LLM(llama, dtype="float32").engine
    plain.add_request("0", _prompts()[0], GREEDY)
    plain.step()
    assert plain.last_step.spec_decoding is None and plain.stats().spec_decoding is None
