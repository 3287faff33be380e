"""vLLM's ``cache_salt``: requests share cached KV blocks only under the same salt.

The salt enters the hash of a request's first block, so a salted prompt never hits blocks that
another salt (or no salt) computed -- in the pool, and in a disk tier after a restart -- while
requests of one salt share as before. Greedy tokens are the same whatever the salt: only where
the keys and values come from changes.
"""

import random
import re

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine import BeamSearchParams, InvalidRequestError
from pagedkv.memory import block_hash, salted_root
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BLOCK = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("salt"), "llama")


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)]


def _run(llm: LLM, prompt: list[int], salt: str | None):
    entry = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
    (out,) = llm.generate([entry], GREEDY, use_tqdm=False)
    return out


def test_a_salt_enters_the_first_block_hash_and_so_every_hash_of_the_chain():
    tokens = [1, 2, 3, 4]
    plain, a, b = (
        block_hash(None, tokens),
        block_hash(salted_root("a"), tokens),
        block_hash(salted_root("b"), tokens),
    )
    assert len({plain, a, b}) == 3 and min(plain, a, b) >= 0
    assert block_hash(a, tokens) != block_hash(plain, tokens)  # the second block differs too
    assert block_hash(salted_root("a"), tokens) == a  # and is the same on every run
    assert salted_root(None) is None and salted_root("a") < -1  # a root never names a block


def test_salts_keep_prefix_caches_apart_and_share_within_one(model_path):
    prompt = _prompt(41, 1)
    with LLM(str(model_path), dtype="float32", block_size=BLOCK, num_kv_blocks=128) as llm:
        runs = [_run(llm, prompt, salt) for salt in ("tenant-a", "tenant-b", "tenant-a", None, None)]
        assert [out.num_cached_tokens for out in runs] == [0, 0, 40, 0, 40]
        assert llm.kv_stats()["prefix_cache_hits_tokens"] == 80
        assert len({tuple(out.outputs[0].token_ids) for out in runs}) == 1  # the same tokens


def test_beam_and_sampled_requests_cache_under_their_salt(model_path):
    prompt = _prompt(30, 2)
    options = dict(dtype="float32", block_size=BLOCK, num_kv_blocks=256)
    with LLM(str(model_path), **options) as llm:
        llm.beam_search(
            [{"prompt_token_ids": prompt, "cache_salt": "a"}], BeamSearchParams(beam_width=2, max_tokens=9)
        )
        sampled = SamplingParams(n=3, max_tokens=9, temperature=1.0, seed=3, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": "b"}], sampled, use_tqdm=False)
        # the prompt's blocks, cached by the request that forked, are found under its salt only
        longer = prompt + [5] * 12
        assert _run(llm, longer, "c").num_cached_tokens == 0
        assert _run(llm, longer, None).num_cached_tokens == 0
        assert _run(llm, longer, "a").num_cached_tokens == 28
        assert _run(llm, longer, "b").num_cached_tokens == 28


@pytest.mark.parametrize("salt", ["", 5, "bad \ud800"])
def test_a_salt_must_be_non_empty_text(model_path, salt):
    with LLM(str(model_path), dtype="float32", num_kv_blocks=64) as llm:
        with pytest.raises(InvalidRequestError) as err:
            llm.engine.add_request("r", [5, 6, 7], GREEDY, cache_salt=salt)
        assert err.value.param == "cache_salt"
        assert not llm.engine.has_unfinished_requests()


def test_a_salted_disk_block_is_not_found_unsalted_after_a_restart(model_path, tmp_path):
    """The tier's files are named by hash: a restart indexes them by hash, so an unsalted
    request never loads what a salted one wrote, and the same salt does."""
    prompts = [_prompt(41, seed) for seed in range(6)]
    options = dict(
        dtype="float32", block_size=BLOCK, num_kv_blocks=16, watermark=0.0, decode_headroom=0.0,
        kv_offload="disk", kv_offload_memory="2MiB", kv_offload_dir=tmp_path / "kv",
    )  # fmt: skip
    salted = [{"prompt_token_ids": p, "cache_salt": "tenant-a"} for p in prompts]
    with LLM(str(model_path), **options) as first:
        expected = [o.outputs[0].token_ids for o in first.generate(salted, GREEDY, use_tqdm=False)]
        assert first.kv_stats()["tier_blocks_stored"] > 0
    with LLM(str(model_path), **options) as restarted:
        assert restarted.kv_stats()["tier_blocks_cached"] > 0
        plain = restarted.generate(prompts[:1], GREEDY, use_tqdm=False)
        stats = restarted.kv_stats()
        assert stats["tier_hits_tokens"] == 0 and stats["prefix_cache_hits_tokens"] == 0
        assert plain[0].num_cached_tokens == 0
        assert plain[0].outputs[0].token_ids == expected[0]
        again = restarted.generate(salted[:1], GREEDY, use_tqdm=False)
        assert restarted.kv_stats()["tier_hits_tokens"] > 0 and again[0].num_cached_tokens > 0
        assert again[0].outputs[0].token_ids == expected[0]


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ({"prompt": "hi", "prompt_token_ids": [5]}, "exactly one of"),
        ({"cache_salt": "a"}, "exactly one of"),
        ({"prompt": [5, 6]}, "'prompt' is text"),
        ({"prompt": "hi", "multi_modal_data": {}}, "unsupported keys ['multi_modal_data']"),
    ],
)
def test_a_malformed_prompt_dict_is_refused_before_anything_is_queued(model_path, prompt, says):
    with LLM(str(model_path), dtype="float32", num_kv_blocks=64) as llm:
        with pytest.raises(ValueError, match=re.escape(says)):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}, prompt], GREEDY, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
