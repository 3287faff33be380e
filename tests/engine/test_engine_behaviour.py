"""Engine behaviour beyond greedy exactness: seeds, parallel samples, stops, rejections, aborts."""

import random

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine import InvalidRequestError
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("behaviour"), "llama")


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)]


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_seeded_sampling_is_identical_across_runs_and_batch_compositions(model_path):
    target = _prompt(21, 1)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = LLM(str(model_path), dtype="float32", num_kv_blocks=256).generate(
        [target], params, use_tqdm=False
    )
    noisy = SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True)
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=256, block_size=4)
    crowd = llm.generate([_prompt(5, 2), target, _prompt(40, 3)], [noisy, params, noisy], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    again = llm.generate([target, _prompt(3, 4)], [params, noisy], use_tqdm=False)
    assert again[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_parallel_samples_fork_and_equal_independent_requests(model_path):
    """Sample i of an n-request uses seed + i: it must equal a lone request with that seed.

    The samples share the prompt's blocks and copy the partial last block on their first
    write; a missed or misdirected copy would change some sample's tokens.
    """
    prompt = _prompt(19, 5)  # 19 tokens: the last of 5 blocks of 4 is partial and shared
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=256, block_size=4)
    both = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    forked = llm.generate([prompt], SamplingParams(n=3, seed=7, **both), use_tqdm=False)[0]
    assert [c.index for c in forked.outputs] == [0, 1, 2]
    singles = llm.generate(
        [prompt] * 3, [SamplingParams(seed=7 + i, **both) for i in range(3)], use_tqdm=False
    )
    assert [c.token_ids for c in forked.outputs] == [o.outputs[0].token_ids for o in singles]
    assert len({tuple(c.token_ids) for c in forked.outputs}) == 3
    assert llm.kv_stats()["blocks_used"] == 0


def test_parallel_samples_hold_the_prompt_once(model_path):
    prompt = _prompt(64, 6)
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=256, block_size=16, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request(
        "r", prompt, SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=0, ignore_eos=True)
    )
    engine.step()  # the prompt
    engine.step()  # every sample writes its first token into a new block
    # 4 prompt blocks shared + one private block per sample, not 4 x 5.
    assert engine.kv_manager.usage().used_blocks == 4 + 4
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_manager.usage().used_blocks == 0


def test_stop_strings_token_ids_and_length(model_path):
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=256)
    prompt = _prompt(10, 8)
    free = llm.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False
    )
    tokens, text = free[0].outputs[0].token_ids, free[0].outputs[0].text
    assert free[0].outputs[0].finish_reason == "length" and len(tokens) == 20

    stop_id = tokens[5]
    by_id = llm.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id]), use_tqdm=False
    )
    out = by_id[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == tokens[: tokens.index(stop_id) + 1]

    stop_text = text[len(text) // 2 : len(text) // 2 + 2]
    by_text = llm.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, stop=[stop_text]), use_tqdm=False
    )
    out = by_text[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_text
    assert out.text == text[: text.index(stop_text)]


def test_text_prompts_and_detokenized_output(model_path):
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=256)
    out = llm.generate(
        "Hello paged world", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.prompt == "Hello paged world"
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello paged world")
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_logprobs_are_returned_for_each_token(model_path):
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=256)
    out = llm.generate(
        [_prompt(7, 9)],
        SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )
    c = out[0].outputs[0]
    assert len(c.logprobs) == 5
    for token, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert lp.token_id == token and lp.rank == 1 and len(lp.top) == 3
        assert lp.top[0][0] == token  # greedy picks the most likely token
    assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs))


def test_impossible_requests_are_rejected_and_leak_nothing(model_path):
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=8, block_size=4, max_model_len=256)
    with pytest.raises(InvalidRequestError, match="maximum context length is 256"):
        llm.generate([_prompt(250, 1)], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="can never fit in the KV cache"):
        llm.generate([_prompt(30, 1)], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="not token ids of the vocabulary"):
        llm.generate([[TEST_VOCAB_SIZE + 5]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    # A valid request next to an invalid one: nothing of the batch stays queued.
    with pytest.raises(InvalidRequestError):
        llm.generate([_prompt(3, 1), _prompt(300, 1)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.kv_stats()["blocks_used"] == 0


def test_abort_returns_every_block(model_path):
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=64, block_size=4)
    engine = llm.engine
    engine.add_request("running", _prompt(30, 1), SamplingParams(max_tokens=50, n=2, seed=1, ignore_eos=True))
    engine.add_request("queued", _prompt(30, 2), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_manager.usage().used_blocks > 0
    assert engine.abort("running") and engine.abort("queued")
    assert not engine.abort("unknown")
    assert engine.kv_manager.usage().used_blocks == 0
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_work


def test_finished_only_steps_return_exactly_the_finished_outputs(model_path):
    """``step(finished_only=True)`` (what ``LLM.generate`` drives) skips the outputs of running
    requests; the finished ones are those a plain ``step()`` returns, at the same step."""
    requests = [
        (_prompt(7, 20), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)),
        (_prompt(12, 21), SamplingParams(max_tokens=11, temperature=0.8, seed=3, n=2, logprobs=1)),
        (_prompt(3, 22), SamplingParams(max_tokens=8, temperature=1.0, seed=4, stop_token_ids=[9])),
    ]

    def run(finished_only: bool) -> list[tuple[int, str, bool, list]]:
        engine = LLM(str(model_path), dtype="float32", num_kv_blocks=256, block_size=4).engine
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(str(i), prompt, params)
        seen, step = [], 0
        while engine.has_unfinished_requests():
            step += 1
            seen += [(step, o.request_id, o.finished, o.outputs) for o in engine.step(finished_only)]
        assert engine.stats().kv.used_blocks == 0
        return seen

    every, finished = run(False), run(True)
    assert any(not done for _, _, done, _ in every)  # plain steps stream the running requests
    assert len(finished) == len(requests)
    assert finished == [record for record in every if record[2]]


def test_skip_special_tokens_keeps_or_drops_their_text_and_an_ending_eos_has_none(model_path):
    """The same seeded tokens decode with or without the special tokens' text; a sample that
    ends at EOS shows no EOS text either way (vLLM's rule)."""
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=256)
    special = {i for i, token in llm.tokenizer.backend.get_added_tokens_decoder().items() if token.special}
    drawn = dict(n=8, max_tokens=48, temperature=1.5, seed=3)
    shown, hidden = (
        llm.generate(
            [_prompt(6, 10)],
            SamplingParams(**drawn, ignore_eos=True, skip_special_tokens=keep),
            use_tqdm=False,
        )[0]
        for keep in (False, True)
    )
    assert any(special & set(c.token_ids) for c in shown.outputs)
    for with_text, without in zip(shown.outputs, hidden.outputs, strict=True):
        assert with_text.token_ids == without.token_ids
        assert with_text.text == llm.tokenizer.decode(with_text.token_ids, skip_special_tokens=False)
        assert without.text == llm.tokenizer.decode(without.token_ids, skip_special_tokens=True)
    ended = llm.generate([_prompt(6, 10)], SamplingParams(**drawn, skip_special_tokens=False), use_tqdm=False)
    at_eos = [c for c in ended[0].outputs if c.token_ids[-1] in llm.engine.eos_token_ids]
    assert at_eos
    for c in at_eos:
        assert c.text == llm.tokenizer.decode(c.token_ids[:-1], skip_special_tokens=False)
