"""Speculative decoding under tensor parallelism: the proposals travel in the step's plan to
both ranks, which compute the logits of every proposed token on their halves of the heads (a
draft model proposes on rank 0 alone), so greedy verification keeps the tokens two ranks give
without speculation (kept apart from ``test_tensor_parallel``: one tensor-parallel engine per
process)."""

import pytest

from pagedkv import LLM, SamplingParams
from tests.engine.spec.test_engine_spec import NGRAM, PYTHON_PROMPTS
from tests.engine.worker.test_tensor_parallel import _tokens

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
#: The built-in model (it writes repetitive code, so drafts are accepted), split over two ranks,
#: with a token budget that chunks the prompts: verification shares steps with prompt chunks.
OPTIONS = dict(dtype="float32", block_size=4, max_num_batched_tokens=20, tensor_parallel_size=2)
DRAFT = {"model": "stdlib-llama-draft", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def expected() -> list[list[list[int]]]:
    with LLM(**OPTIONS) as plain:
        return _tokens(plain.generate(PYTHON_PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("speculative_config", [NGRAM, DRAFT], ids=["ngram", "draft-model"])
def test_two_ranks_keep_the_greedy_tokens_of_two_ranks_without_speculation(expected, speculative_config):
    with LLM(speculative_config=speculative_config, **OPTIONS) as speculating:
        assert _tokens(speculating.generate(PYTHON_PROMPTS, GREEDY, use_tqdm=False)) == expected
        # drafts were verified, some accepted and some rolled back, and every block came back
        totals = speculating.engine.verifier.speculator.totals
        assert totals.num_drafts > 0 and 0 < totals.num_accepted_tokens < totals.num_draft_tokens
        assert speculating.kv_stats()["blocks_used"] == 0
